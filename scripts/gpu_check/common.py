"""What every phase of the GPU check shares: its log, the norm-wise comparison, timing, the device.

Lines starting "figure: " are what gpu_check.sh copies into its summary. Everything logged also goes
to gpu_check_results.txt in $OUT (unless gpu_check.sh keeps the transcript itself: GPU_CHECK_TEED).
"""

import os
import sys
import time

import numpy as np

PEAK_FP32 = 67e12  # H200 dense FP32 FLOP/s (NVIDIA's datasheet)
PEAK_TF32 = 495e12  # H200 dense TF32 FLOP/s
KEEP_PROBS = 16 << 20  # CausalSelfAttention.keep_probs_max_bytes as the layer has it


def log(*lines):
    """Each line printed, and appended to $OUT/gpu_check_results.txt where no gpu_check.sh keeps it."""
    for line in lines:
        print(line, flush=True)
        if not os.environ.get("GPU_CHECK_TEED"):
            with open(os.path.join(os.environ.get("OUT") or ".", "gpu_check_results.txt"), "a") as f:
                f.write(line + "\n")


def normwise(got, want):
    """max |got - want| / max |want| in float64, where the arrays are (on the device for CuPy's:
    two scalars come back, not the arrays)."""
    xp = _module_of(got, want)
    got, want = xp.asarray(got).astype(np.float64), xp.asarray(want).astype(np.float64)
    if not want.size:
        return 0.0
    scale, err = float(xp.max(xp.abs(want))), float(xp.max(xp.abs(got - want)))
    return err / scale if scale else err


def _module_of(*arrays):
    """CuPy if any of them is a CuPy array (cupy.get_array_module), else NumPy."""
    cupy = sys.modules.get("cupy")
    return cupy.get_array_module(*arrays) if cupy is not None else np


def verdict(ok):
    return "ok  " if ok else "FAIL"


def gpu_here(dry):
    """Whether the parts run on CuPy: always for the real check, in a dry run only if a GPU works."""
    if not dry:
        return True
    from minitensor.device import gpu_available

    return gpu_available()


def mean_seconds(xp, fn, inputs, reps):
    """The mean seconds of reps calls fn(inputs) after one, the device synchronised around them."""
    from andrea.run.perf import synchronize

    fn(inputs)
    synchronize(xp)
    start = time.perf_counter()
    for _ in range(reps):
        fn(inputs)
    synchronize(xp)
    return (time.perf_counter() - start) / reps


def first_line(e):
    """'Type: the first line of its message', for one line of the log."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def free_pool(xp):
    """CuPy's memory pool emptied between comparisons at model sizes (nothing on NumPy)."""
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()

