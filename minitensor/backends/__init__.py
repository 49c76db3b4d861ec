"""The compute backends, built once per choice: `get_ops(xp, kernels)`.

    ops = get_ops(numpy)                  # NumpyOps (numpy_ops.py), numba kernels if installed
    ops = get_ops(cupy, "auto")           # CupyOps (cupy_ops.py) with the self-checked kernels

    ops.py            Ops: every piece in its plainest form, the reference the others are checked against
    softmax.py        the row softmax every softmax runs
    numpy_ops.py      NumpyOps: the CPU, work over threads; cpu/ each piece's NumPy code and compiled
                      kernels, numba_jit.py how they compile (or not, without numba)
    cupy_ops.py       CupyOps: the GPU, CUDA kernels chosen by the start-up self-check and timing
                      (selection.py); cuda.py their registry and launches,
                      kernels/ each kernel's CUDA source (.cu) beside its spec, wrapper and record (.py)
    all_kernels()     every CUDA kernel (name -> spec) and fused_pieces() every fused piece's record
                      (name -> cuda.FusedPiece), from every module of kernels/ (kernels.load)
    selection.py      which fused pieces a CupyOps runs: each self-checked against Ops, timed at the
                      run's sizes (train.kernels: auto), or all, or none

The model builds its backend here from the device's array module (minitensor.device) and its
kernels setting, and hands it to every layer; a layer built without one takes its arrays'. The
imports are in the function: importing a backend module (minitensor.backends.ops) runs this file,
and must not load numba, CuPy's kernels or the kernel selection.
"""

import numpy as np

_ops = {}


def get_ops(xp=np, kernels=None, sizes=None):
    """The backend for arrays of xp, built once per choice and logged by its `kernels_line`.

    On NumPy: NumpyOps with the numba kernels unless kernels (or, when it is None or one of the
    GPU's choices below, ANDREA_CPU_KERNELS) says 'numpy' or numba is not installed
    (minitensor.backends.numba_jit.mode). On CuPy: CupyOps with the fused kernels kernels says, 'auto' (the
    default: those that pass the start-up self-check, run here once), 'fused' (all, unchecked)
    or 'generic' (none; minitensor.backends.selection); with the run's sizes (minitensor.backends.cuda.Sizes),
    'auto' also times each piece against the generic code there and keeps the faster. A
    selection.Choice (rank 0's, on every rank of a data-parallel run) is used as it is, unchecked here."""
    from minitensor.backends import numba_jit, selection

    if xp is np:
        gpu_choice = kernels in selection.MODES or isinstance(kernels, selection.Choice)
        key = ("numpy", numba_jit.mode(None if gpu_choice else kernels))
        if key not in _ops:
            from minitensor.backends.numpy_ops import NumpyOps

            _ops[key] = NumpyOps(numba=key[1] == "numba")
        return _ops[key]
    key = ("cupy", xp, kernels or "auto", sizes if (kernels or "auto") == "auto" else None)
    if key not in _ops:
        from minitensor.backends.cupy_ops import CupyOps

        if isinstance(key[2], selection.Choice):
            fused, line = key[2].fused, key[2].line
        else:
            fused, line = selection.select_kernels(key[2], xp, sizes=key[3])
        _ops[key] = CupyOps(xp, fused, line)
    return _ops[key]


def all_kernels():
    """Every CUDA kernel (name -> spec): minitensor.backends.kernels.all_kernels."""
    from minitensor.backends import kernels

    return kernels.all_kernels()


def fused_pieces():
    """Every fused piece's record (name -> cuda.FusedPiece), by name: minitensor.backends.kernels.fused_pieces."""
    from minitensor.backends import kernels

    return kernels.fused_pieces()
