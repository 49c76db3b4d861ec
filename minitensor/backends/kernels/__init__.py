"""The GPU's kernels, each piece in two files side by side: NAME.cu (the CUDA source, one section
`// @kernel KERNEL` per kernel, read at its first use by minitensor.backends.cuda.cu_code) and NAME.py
(its specs, the wrappers that check and launch it, and, for a fused piece, its record
`cuda.fused_piece(...)`: the Ops methods it replaces, each with the function that runs it, the
self-check's sample, gpu_check's cases). rows.cuh and flash.cuh are headers a section may `#include`.

`load()` imports every NAME.py of this folder, in the order of their names: importing one registers
its kernels (cuda.KERNELS) and its record (cuda.PIECES). CupyOps, the kernel selection, the checks
without a GPU (`python -m minitensor.checks`), gpu_check and the tests read them from there
(all_kernels, fused_pieces below, which minitensor.backends hands out too), so a new piece is its
two files and nothing else: no list of the pieces is kept anywhere.
"""

import functools
import importlib
import pathlib


@functools.cache
def load():
    """The names of the modules of this folder, each imported (its kernels and record registered), in
    the order of their names."""
    names = tuple(sorted(p.stem for p in pathlib.Path(__file__).parent.glob("*.py") if p.stem != "__init__"))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


def all_kernels():
    """minitensor.backends.cuda.KERNELS (name -> spec) with every kernel in it: every module of this
    folder imported (load)."""
    from minitensor.backends import cuda

    load()
    return cuda.KERNELS


def fused_pieces():
    """Every fused piece's record (name -> cuda.FusedPiece), every module of this folder imported
    (load), in the order of their names: what CupyOps(fused=...) and train.kernels choose from, and
    the order of the kernels line."""
    from minitensor.backends import cuda

    load()
    return dict(sorted(cuda.PIECES.items()))
