"""The compute backends, built once per choice: `get_ops(xp, kernels)`.

    ops = get_ops(numpy)                  # NumpyOps (minitensor/numpy_ops.py), numba kernels if installed
    ops = get_ops(cupy, "auto")           # CupyOps (minitensor/cupy_ops.py) with the self-checked kernels

The model builds its backend here from the device's array module (minitensor.backend) and its
kernels setting, and hands it to every layer; a layer built without one takes the CPU's. This
module sits above both backends and the self-check (minitensor.ops, which they extend, imports
neither of them).
"""

import numpy as np

from minitensor import cpu, selfcheck

_ops = {}


def get_ops(xp=np, kernels=None):
    """The backend for arrays of xp, built once per choice and logged by its `kernels_line`.

    On NumPy: NumpyOps with the numba kernels unless kernels (or, when it is None or one of the
    GPU's choices below, ANDREA_CPU_KERNELS) says 'numpy' or numba is not installed
    (minitensor.cpu.mode). On CuPy: CupyOps with the fused kernels kernels says, 'auto' (the
    default: those that pass the start-up self-check, run here once), 'fused' (all, unchecked)
    or 'generic' (none; minitensor.selfcheck)."""
    if xp is np:
        key = ("numpy", cpu.mode(None if kernels in selfcheck.MODES else kernels))
        if key not in _ops:
            from minitensor.numpy_ops import NumpyOps

            _ops[key] = NumpyOps(numba=key[1] == "numba")
        return _ops[key]
    key = ("cupy", xp, kernels or "auto")
    if key not in _ops:
        from minitensor.cupy_ops import CupyOps

        fused, line = selfcheck.select_kernels(key[2], xp)
        _ops[key] = CupyOps(xp, fused, line)
    return _ops[key]
