"""Two checks of a data-parallel run's gradient transport: `python -m andrea.run.allreduce`.

    python -m andrea.run.allreduce --nccl-self-test                  # NCCL at one rank on this GPU
    mpiexec -n 2 python -m andrea.run.allreduce --bench 92331264     # MPI's all-reduce of 92M float32
    python -m andrea.run.allreduce --bench 92331264 --gpu            # NCCL's (one rank: its local pass)
    mpiexec -n 2 python -m andrea.run.allreduce --step-wait tiny --batch 16 --seq 128
                                                   # a step's wait on the reduction, overlap off and on

The self-test loads the library, exchanges the id, runs each collective (all-reduce, broadcast,
reduce-scatter, of the whole buffer and of a bucket, all-gather) over 4 MiB on the reducer's stream
and checks the result (NCCL refuses two ranks on one GPU, so one lent GPU checks one rank). `--bench` times the in-place all-reduce of
that many float32 values on this world, the median of 5 after a warm-up, and prints it as JSON on
rank 0: what andrea.bench reports as the gradient all-reduce. `--step-wait` runs a config's backward
on each process and times how long the step then waits on the gradient reduction (andrea.run.overlap),
with the reduction after the backward and overlapped with it: andrea.bench's "waited" line.
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
    reducer.reduce_scatter(buf, shards, wait=False, span=(1024, buf.size - 1024)).wait()  # a bucket: grouped reduce
    reducer.all_gather(buf, shards, wait=False).wait()
    cupy.cuda.get_current_stream().synchronize()
    if not bool((buf == expected).all()):
        raise RuntimeError("NCCL's collectives at one rank changed the buffer")
    version = nccl.get_version() if hasattr(nccl, "get_version") else "?"
    print(f"NCCL self-test: ok (version {version}, 1 rank, {buf.nbytes >> 20} MiB all-reduce, broadcast, "
          "reduce-scatter (whole and of a bucket) and all-gather on the NCCL stream)")
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


def step_wait(config: str, batch: int, seq: int, steps: int = 3) -> dict | None:
    """How long a step of `config` at batch x seq waits on its gradient reduction past the backward, on
    this world's CPU processes, with the reduction after the backward (overlap off) and overlapped with
    it (on): the median over `steps` steps after a warm-up, with the backward's own median time. Returns
    it on rank 0, None elsewhere."""
    from andrea.config import load_config
    from andrea.model.transformer import ANDREA
    from andrea.run.overlap import GradientReduction

    world = init()
    cfg = load_config(config).model
    model = ANDREA(cfg, seed=0, batch=batch)
    rng = np.random.default_rng(world.rank)
    out = {"config": config, "processes": world.size, "transport": world.reducer_for(np).name}
    for overlap in (False, True):
        reduction = GradientReduction(model, world.reducer_for(np), overlap=overlap)
        waits, backwards = [], []
        for i in range(steps + 1):
            x, y = rng.integers(0, cfg.vocab_size, (2, batch, seq))
            model.zero_grad()
            model.loss(x, y)
            start = time.perf_counter()
            reduction.backward(1.0 / world.size)
            backwards.append(time.perf_counter() - start)
            reduction.finish()
            waits.append(reduction.waited_s)
        out["overlap" if overlap else "after"] = {"waited_s": float(np.median(waits[1:])),
                                                  "backward_s": float(np.median(backwards[1:]))}
    return out if world.is_main else None


def main(argv=None):
    from andrea.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m andrea.run.allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--nccl-self-test", action="store_true", help="check NCCL at one rank on this GPU")
    ap.add_argument("--bench", type=int, metavar="ELEMENTS",
                    help="time the in-place all-reduce of this many float32 values; prints JSON on rank 0")
    ap.add_argument("--gpu", action="store_true", help="with --bench: NCCL on GPUs instead of MPI")
    ap.add_argument("--step-wait", metavar="CONFIG",
                    help="time how long a step of CONFIG waits on its gradient reduction, overlap off and on "
                         "(CPU processes); prints JSON on rank 0")
    ap.add_argument("--batch", type=int, default=1, help="with --step-wait: sequences per step (default 1)")
    ap.add_argument("--seq", type=int, default=64, help="with --step-wait: tokens per sequence (default 64)")
    args = ap.parse_args(argv)
    if args.step_wait:
        if args.batch < 1 or args.seq < 1:
            raise UserError(f"--batch and --seq must be at least 1, got {args.batch} and {args.seq}")
        result = step_wait(args.step_wait, args.batch, args.seq)
        if result is not None:
            print(json.dumps(result))
        return 0
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
