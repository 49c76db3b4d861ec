"""A training run: what surrounds the loop of `python -m andrea.train` (andrea/train.py).

    preflight.py     checks made before the first step, so that nothing fails after work is done
    rundir.py        the directories andrea writes into, and who is writing there now
    runlog.py        a run's metrics and last words, written so that a full disk loses nothing
    checkpoint.py    crash-safe checkpoints, one directory per step, published atomically
    distributed.py   data parallelism over MPI (CPU) and NCCL (GPU)
    perf.py          matmul peak, MFU, peak memory, the clock
    gradflow.py      gradient norms through the blocks, recorded while training
    figure.py        the figures' common start: matplotlib (an optional extra) asked for by name
"""
