"""Two checks of a data-parallel run's gradient transport: `python -m andrea.run.allreduce`.

    python -m andrea.run.allreduce --nccl-self-test                  # NCCL at one rank on this GPU
    mpiexec -n 2 python -m andrea.run.allreduce --bench 92331264     # MPI's all-reduce of 92M float32
    python -m andrea.run.allreduce --bench 92331264 --gpu            # NCCL's (one rank: its local pass)

The self-test loads the library, exchanges the id, runs each collective (all-reduce, broadcast,
reduce-scatter, all-gather) over 4 MiB on the reducer's stream and checks the result (NCCL refuses
two ranks on one GPU, so one lent GPU checks one rank). `--bench` times the in-place all-reduce of
that many float32 values on this world, the median of 5 after a warm-up, and prints it as JSON on
rank 0: what andrea.bench reports as the gradient all-reduce.
"""

from __future__ import annotations

import json
import time

import numpy as np

from andrea.errors import UserError
from andrea.run.distributed import init, use_local_gpu
from andrea.run.nccl import NcclReducer, load_nccl
from andrea.run.reducer import Shards


def nccl_self_test() -> int:
    """One-rank NCCL on this GPU: library, id exchange, sum, broadcast; prints one line, returns 0."""
    nccl, cupy = load_nccl()
    world = init()
    if world.size != 1:
        raise UserError("run the NCCL self-test as one process (NCCL refuses two ranks on one GPU)")
    reducer = NcclReducer(world, nccl, cupy)
    buf = cupy.arange(1 << 20, dtype=cupy.float32)
    expected = buf.copy()
    shards = Shards(buf.size, 1)
    reducer.all_reduce(buf)
    reducer.broadcast(buf)
    reducer.reduce_scatter(buf, shards)
    reducer.all_gather(buf, shards, wait=False).wait()
    cupy.cuda.get_current_stream().synchronize()
    if not bool((buf == expected).all()):
        raise RuntimeError("NCCL's collectives at one rank changed the buffer")
    version = nccl.get_version() if hasattr(nccl, "get_version") else "?"
    print(f"NCCL self-test: ok (version {version}, 1 rank, {buf.nbytes >> 20} MiB all-reduce, broadcast, "
          "reduce-scatter and all-gather on the NCCL stream)")
    return 0


def time_allreduce(reducer, buf, repeats=5, sync=None) -> float:
    """Median seconds of one in-place all-reduce of `buf` (after one warm-up), all ranks together."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        reducer.all_reduce(buf)
        if sync is not None:
            sync()
        if i:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_allreduce(elements: int, gpu: bool) -> dict | None:
    """The gradient all-reduce of a model with `elements` float32 parameters, timed on this world.

    On the CPU it is MPI's in-place Allreduce between the launched processes; with `gpu` it is
    NCCL's on this rank's GPU (one rank without mpiexec: NCCL's local pass, no transfer).
    Returns the measurement on rank 0, None elsewhere.
    """
    world = init()
    if gpu:
        nccl, cupy = load_nccl()
        use_local_gpu(world)
        reducer, buf = NcclReducer(world, nccl, cupy), cupy.ones(elements, dtype=cupy.float32)
        sync = cupy.cuda.get_current_stream().synchronize
    else:
        reducer, buf, sync = world.reducer_for(np), np.ones(elements, dtype=np.float32), None
    seconds = time_allreduce(reducer, buf, sync=sync)
    if not world.is_main:
        return None
    return {"transport": reducer.name, "processes": world.size, "bytes": int(buf.nbytes), "seconds": seconds}


def main(argv=None):
    from andrea.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m andrea.run.allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--nccl-self-test", action="store_true", help="check NCCL at one rank on this GPU")
    ap.add_argument("--bench", type=int, metavar="ELEMENTS",
                    help="time the in-place all-reduce of this many float32 values; prints JSON on rank 0")
    ap.add_argument("--gpu", action="store_true", help="with --bench: NCCL on GPUs instead of MPI")
    args = ap.parse_args(argv)
    if args.nccl_self_test:
        return nccl_self_test()
    if args.bench:
        result = bench_allreduce(args.bench, args.gpu)
        if result is not None:
            print(json.dumps(result))
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    from andrea.cli import run_cli

    run_cli(main)
