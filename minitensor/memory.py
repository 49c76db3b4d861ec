"""Large temporaries without page faults: glibc's malloc told to reuse freed memory.

By default glibc serves every allocation above its mmap threshold (128 KiB, raised dynamically
to at most 32 MiB) with a fresh mmap and returns it to the kernel on free, and it trims the top
of the heap back to the kernel whenever more than 128 KiB lies free there. A training step makes
hundreds of NumPy temporaries of 0.1-50 MB (attention scores per block, GEMM outputs, GELU
intermediates), so each one's pages are faulted in and zeroed by the kernel again, step after
step (its share of the attention core's time: BENCHMARKS.md, "Process tuning").

keep_freed_memory() raises both thresholds to 1 GiB (mallopt), so freed blocks go back to
malloc's own free lists and the next step's temporaries reuse pages already mapped. The price is
fragmentation: a small run's peak resident memory grows, a large one's hardly (the figures:
BENCHMARKS.md, "Process tuning"). Memory freed
after the peak stays with the process until it exits, as it would under jemalloc or tcmalloc.

It does nothing off glibc, when ANDREA_MALLOC_TUNE=0, or for a threshold already set by the user
through MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES.
"""

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30

_done = None


def keep_freed_memory():
    """Returns the mallopt parameters it set ({} when it set none); does its work once per process."""
    global _done
    if _done is not None:
        return _done
    _done = {}
    if os.environ.get("ANDREA_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return _done
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name, param, env in (("mmap_threshold", M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"),
                             ("trim_threshold", M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_")):
        if env in os.environ or f"glibc.malloc.{name}" in tunables:
            continue
        if mallopt(param, THRESHOLD) == 1:
            _done[name] = THRESHOLD
    return _done
