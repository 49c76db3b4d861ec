"""Each rank's own kernel choice and the run's agreed one, under mpiexec, for tests/gpu/test_selfcheck.py.

    mpiexec -n 2 python -m mpi4py tests/support/kernels_driver.py OUT [--raise-on RANK]

On the CuPy stand-in, told it is a GPU so that the timing runs. One fused piece (layernorm's record,
its sample and timed run replaced by ones that launch nothing) passes its check on every rank; its
timing disagrees between ranks: on rank 0 the fused piece is faster (1 ms against 2), on the others
slower (2 ms against 1). With --raise-on RANK that rank's timing raises instead, as an out-of-memory
error would. Every rank writes OUT/rank<r>.json: {"own": [pieces, line] of its own select_kernels,
"agreed": [pieces, line] of andrea.run.kernels.agreed_kernels, the choice its backend is built from}.
"""

import argparse
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gpu_standin import standin_cupy

from andrea.run import distributed as dist
from andrea.run.kernels import agreed_kernels
from minitensor.backends import fused_pieces, selection
from minitensor.backends.cuda import Sizes


def sample(ops, rng):
    """Outputs that agree with the piece on and off, launching nothing."""
    return (ops.xp.asarray(rng.standard_normal(8).astype(np.float32)),)


def rank_timer(rank, raise_on):
    """time_piece as this rank measures it: (fused s, generic s)."""
    def time_piece(timed, name, xp, sizes, others=()):
        if rank == raise_on:
            raise MemoryError("Out of memory allocating 1,073,741,824 bytes (injected)")
        return (1e-3, 2e-3) if rank == 0 else (2e-3, 1e-3)
    return time_piece


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--raise-on", type=int, default=None)
    args = ap.parse_args()
    world = dist.init()
    piece = dataclasses.replace(fused_pieces()["layernorm"], sample=sample, timed=lambda ops, sizes: None)
    selection.fused_pieces = lambda: {"layernorm": piece}
    selection.time_piece = rank_timer(world.rank, args.raise_on)
    sizes = Sizes(B=2, T=16, C=32, n_head=2, F=64, V=50, P=300)
    with standin_cupy() as cupy:
        cupy.STANDIN = False  # time, as on a GPU
        own = selection.select_kernels("auto", cupy, sizes=sizes)
        agreed = agreed_kernels(world, SimpleNamespace(kernels="auto", device="gpu"), sizes)
    result = {"own": [list(own[0]), own[1]], "agreed": [list(agreed.fused), agreed.line]}
    Path(args.out, f"rank{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
