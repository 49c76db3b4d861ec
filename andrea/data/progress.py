"""What a preparation says on stderr while it works: lines, and progress redrawn in place.

On a terminal a progress line is redrawn at most 4 times a second; elsewhere (a log file) one
line comes every PROGRESS_SECONDS.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

PROGRESS_SECONDS = 5.0  # a log file gets a progress line at least this often
CLEAR_TO_EOL = "\x1b[K"  # a redrawn progress line may be shorter than the last one


class Log:
    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def every(self, text: Callable[[int], str], seconds: float | None = None) -> Callable[[int], None]:
        """A callback that logs `text(n)` when called, at most once per `seconds` (PROGRESS_SECONDS by
        default; none in the first)."""
        seconds = PROGRESS_SECONDS if seconds is None else seconds
        last = [time.perf_counter()]

        def report(n: int) -> None:
            now = time.perf_counter()
            if now - last[0] >= seconds:
                last[0] = now
                self.line(text(n))

        return report

    def progress(self, label: str, total_items: int, total_bytes: int, unit: str = "files") -> Progress:
        return Progress(self, label, total_items, total_bytes, unit)


class Progress:
    """`label  blocks done/total  MB done/total  MB/s  ETA`: redrawn in place at most 4 times a
    second on a terminal; elsewhere (a log file) one line every PROGRESS_SECONDS."""

    def __init__(self, log: Log, label: str, total_items: int, total_bytes: int, unit: str = "files"):
        self.log, self.label, self.unit = log, label, unit
        self.total_files, self.total_bytes = total_items, max(total_bytes, 1)
        self.tty = log.enabled and log.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.files = self.bytes = 0
        self.resumed = 0  # bytes done before this run (a resumed preparation): not in the rate

    def update(self, files: int, add_bytes: int) -> None:
        self.files, self.bytes = files, self.bytes + add_bytes
        now = time.perf_counter()
        if now - self.last >= (0.25 if self.tty else PROGRESS_SECONDS):
            self.last = now
            if self.tty:
                print("\r" + self._text(now) + CLEAR_TO_EOL, end="", file=self.log.stream, flush=True)
            else:
                self.log.line(self._text(now))

    def done(self) -> None:
        if self.tty:
            print("\r" + self._text(time.perf_counter()) + CLEAR_TO_EOL, file=self.log.stream, flush=True)
        else:
            self.log.line(self._text(time.perf_counter()))

    def _text(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = (self.bytes - self.resumed) / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        # The first second's rate is mostly start-up: no ETA from it.
        eta = "0s" if left == 0 else f"{left / rate:.0f}s" if rate > 0 and elapsed > 1 else "?"
        return (
            f"{self.label} {self.files:>{len(str(self.total_files))}}/{self.total_files} {self.unit}  "
            f"{self.bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB  {rate / 1e6:.1f} MB/s  ETA {eta}"
        )
