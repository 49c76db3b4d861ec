"""cupy.cuda.device (stand-in): Device 0 and its cuBLAS handle."""

from cupy.cuda import runtime

CUBLAS_HANDLE = 1


class Device:
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        runtime._check(self.id)

    def use(self):
        runtime.setDevice(self.id)

    def synchronize(self):
        pass

    @property
    def mem_info(self):
        return runtime.memGetInfo()

    @property
    def compute_capability(self):
        return "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)


def get_device_id():
    return 0


def get_cublas_handle():
    return CUBLAS_HANDLE
