"""Measurements shared by training and the benchmark: matmul peak, MFU, peak memory, a clock.

MFU (model FLOPs utilisation) = achieved training FLOP/s / the float32 matmul peak of the same
device, measured in the same process (SPEC 1): on the CPU the best of a few 4096^3 float32
matmuls through NumPy's BLAS; on a GPU the same through cuBLAS.
"""

import resource
import sys
import time

import numpy as np

_peaks = {}


def synchronize(xp):
    if xp is not np:
        xp.cuda.Device().synchronize()


def matmul_peak_flops(xp=np, n=4096, repeats=3, dtype="float32", fresh=False):
    """Best FLOP/s of `repeats` n x n x n matmuls (after one warm-up), cached per module and size
    unless fresh."""
    key = (xp.__name__, n, dtype)
    if fresh or key not in _peaks:
        a = xp.ones((n, n), dtype=dtype)
        b = xp.ones((n, n), dtype=dtype)
        c = xp.empty((n, n), dtype=dtype)
        xp.matmul(a, b, out=c)
        synchronize(xp)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            xp.matmul(a, b, out=c)
            synchronize(xp)
            best = min(best, time.perf_counter() - t)
        _peaks[key] = 2 * n ** 3 / best
    return _peaks[key]


def peak_rss_bytes():
    """The process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if sys.platform == "darwin" else ru * 1024


def current_rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def format_duration(seconds):
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
