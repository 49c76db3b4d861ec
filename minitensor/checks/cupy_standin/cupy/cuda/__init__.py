"""cupy.cuda (stand-in): one device, its runtime queries, streams and events that time on the host."""

import time

from cupy.cuda import device, nccl, runtime  # noqa: F401
from cupy.cuda.device import Device  # noqa: F401


class Stream:
    """A stream: work on the stand-in is done when its call returns, so there is nothing to wait for."""

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else 1

    def synchronize(self):
        pass

    def wait_event(self, event):
        """Later work on this stream waits for the event: here all work is done when its call returns."""

    def use(self):
        global _current
        _current = self
        return self

    def __enter__(self):
        self._previous = _current
        return self.use()

    def __exit__(self, *exc):
        self._previous.use()


Stream.null = Stream(null=True)
_current = Stream.null


def get_current_stream(device_id=None):
    return _current


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.time = None

    def record(self, stream=None):
        self.time = time.perf_counter()

    def synchronize(self):
        pass

    @property
    def done(self):
        return self.time is not None


def get_elapsed_time(start_event, end_event):
    """Milliseconds between two recorded events."""
    if start_event.time is None or end_event.time is None:
        raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: an event was not recorded")
    return 1e3 * (end_event.time - start_event.time)
