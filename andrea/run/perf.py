"""Measurements shared by training and the benchmark: matmul peak, MFU, peak memory, a clock.

MFU (model FLOPs utilisation) = achieved training FLOP/s / the float32 matmul peak of the same
device, measured in the same process (a peak from a datasheet would flatter or shame a VM
whose cores it does not describe): on the CPU the best of a few 4096^3 float32
matmuls through NumPy's BLAS; on a GPU loops of 8192^3 products through cuBLAS timed with CUDA
events, in the GEMM mode of the run (TF32 or not), and for a bf16 run (train.precision=bf16) on
bfloat16 products through the cuBLAS GEMM its layers call. The MFU lines name the peak they divide by.
A measurement taken while other work loads the machine comes out low, and MFU against it above
100% (as it did on a shared VM): training measures the peak again (`fresh`) when
its steps beat it, and divides by the highest measurement or rate achieved (andrea.run.throughput.Throughput).
"""

import resource
import sys
import time

import numpy as np

from minitensor import precision

_peaks = {}


def synchronize(xp):
    if xp is not np:
        xp.cuda.Device().synchronize()


def matmul_peak_flops(xp=np, n=None, repeats=3, dtype="float32", fresh=False, loops=10):
    """Best FLOP/s of n x n x n matmuls (after one warm-up), cached per module, size and dtype
    unless fresh. NumPy (n = 4096 by default): the best of `repeats` single products, each timed
    on the host. CuPy (n = 8192 by default, and at least that: a smaller product is over in
    microseconds and its launch overhead would understate the peak, overstating MFU): the best of
    `repeats` loops of `loops` products each, timed with CUDA events around the loop. The GPU's
    GEMM mode (TF32 or not, minitensor.device.set_tf32) is whatever it is when this first runs.
    dtype "bfloat16" (a GPU only): the GEMM a bf16 run's layers call, cuBLAS's gemmEx with float32 sums
    (minitensor.backends.cublas), never CuPy's matmul."""
    gpu = xp is not np
    n = max(8192, n or 8192) if gpu else n or 4096
    key = (xp.__name__, n, dtype)
    if fresh or key not in _peaks:
        dt = precision.dtype_of(dtype)
        matmul = _gemm_of(xp, dt)
        a = xp.ones((n, n), dtype=dt)
        b = xp.ones((n, n), dtype=dt)
        c = xp.empty((n, n), dtype=dt)
        matmul(a, b, out=c)
        synchronize(xp)
        best = float("inf")
        for _ in range(repeats):
            if gpu:
                start, end = xp.cuda.Event(), xp.cuda.Event()
                start.record()
                for _ in range(loops):
                    matmul(a, b, out=c)
                end.record()
                end.synchronize()
                best = min(best, xp.cuda.get_elapsed_time(start, end) / 1e3 / loops)
            else:
                t = time.perf_counter()
                matmul(a, b, out=c)
                best = min(best, time.perf_counter() - t)
        _peaks[key] = 2 * n ** 3 / best
    return _peaks[key]


def _gemm_of(xp, dtype):
    """The product matmul_peak_flops times: xp.matmul, or for bfloat16 the project's cuBLAS GEMM."""
    if precision.name_of(dtype) != precision.BF16:
        return xp.matmul
    if xp is np:
        raise ValueError("a bfloat16 GEMM peak needs a GPU (CuPy): NumPy has no bfloat16 arithmetic")
    from minitensor.backends import cublas

    return cublas.matmul


def peak_dtype(policy):
    """The dtype whose GEMM peak a run of that train.precision is measured against: its compute dtype
    where that is bfloat16 (its GEMMs' operands), else float32 (as a float64 check run's too)."""
    compute = precision.get(policy).compute
    return compute if compute == precision.BF16 else "float32"


def peak_label(xp, tf32=False, dtype="float32"):
    """What matmul_peak_flops measured, in words, for the MFU line."""
    if xp is np:
        return "CPU float32 GEMM peak (NumPy BLAS)"
    if dtype == precision.BF16:
        return "GPU bf16 GEMM peak (cuBLAS gemmEx, float32 sums, 8192^3, CUDA events)"
    return f"GPU float32 GEMM peak ({'TF32 tensor cores' if tf32 else 'no TF32'}, 8192^3, CUDA events)"


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
