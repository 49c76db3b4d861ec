"""A training run: what `python -m andrea.train` (andrea/train.py) is made of.

    launch.py        the run's config from the command's arguments, the same on every rank
    preflight.py     checks made before the first step, so that nothing fails after work is done
    rundata.py       the run's data: prepared if missing, opened, fingerprinted
    trainer.py       the Trainer: model, optimizer, loader, checkpoint state, one step, the loop
    throughput.py    the meter: tokens/s, MFU and the ETA from the time of training steps alone
    stopping.py      the non-finite guard and the stop vote, and their exit codes
    rundir.py        the directories andrea writes into, and who is writing there now
    runlog.py        a run's metrics and last words, written so that a full disk loses nothing
    checkpoint.py    crash-safe checkpoints, one directory per step, published atomically
    distributed.py   data parallelism over MPI (CPU) and NCCL (GPU)
    perf.py          matmul peak, MFU, peak memory, the clock
    gradflow.py      gradient norms through the blocks, recorded while training
    figure.py        the figures' common start: matplotlib (an optional extra) asked for by name
"""
