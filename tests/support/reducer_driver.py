"""Every collective of the MPI reducer on each rank, for tests/e2e/test_reducer.py.

    mpiexec -n N python -m mpi4py tests/support/reducer_driver.py OUT          # each rank writes OUT/rank<r>.json
    mpiexec -n N python -m mpi4py tests/support/reducer_driver.py OUT --plant  # with the order check on, rank 1
                                                                               # issues another collective

Rank r's buffer holds r + 1 + i / 8 at element i (exact in float32). Each collective runs blocking
and started-then-waited, in float32 and float64, over a buffer of 37 elements cut into N ranges
(padded to Shards.padded: the last ranges hold the padding); the reduce-scatter also over a span of the
buffer alone (a bucket, as the overlapped reduction starts them).
"""

import json
import sys
from pathlib import Path

import numpy as np

from andrea.cli import run_cli
from andrea.run import distributed as dist
from andrea.run.reducer import Shards

SIZE = 37


def filled(rank, n, dtype):
    return (rank + 1 + np.arange(n) / 8).astype(dtype)


def span(shards):
    """A bucket that starts inside the first rank's range and ends inside the last's."""
    return 5, shards.padded - 7


def collectives(world, reducer, out):
    results = {}
    shards = Shards(SIZE, world.size)
    for dtype in ("float32", "float64"):
        for wait in (True, False):
            for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce_scatter_span"):
                buf = filled(world.rank, shards.padded, dtype)
                args = (buf, shards) if kind in ("reduce_scatter", "all_gather") else (buf,)
                if kind == "reduce_scatter_span":  # one bucket of the buffer, cut across the ranks' ranges
                    pending = reducer.reduce_scatter(buf, shards, wait=wait, span=span(shards))
                else:
                    pending = getattr(reducer, kind)(*args, wait=wait)
                if not wait:
                    pending.wait()
                results[f"{kind} {dtype} {'blocking' if wait else 'started'}"] = buf.tolist()
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(results))


def planted(world, reducer):
    buf = np.ones(64, np.float32)
    reducer.all_reduce(buf)
    world.sum_scalars([1.0])
    if world.rank == 1:  # the mismatch: a collective under a test of the rank
        reducer.broadcast(np.ones(48, np.float32))
    reducer.all_reduce(buf)
    world.log("not reached")


def main(argv):
    world = dist.init()
    with dist.guard(world):
        if "--plant" in argv:
            world.check_collectives()  # before the reducer is made, which takes the world's check
            planted(world, world.reducer_for(np))
        else:
            collectives(world, world.reducer_for(np), argv[0])
    return 0


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
