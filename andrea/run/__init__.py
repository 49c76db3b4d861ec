"""A training run: what `python -m andrea.train` (andrea/train.py) is made of, and the tools around it.

    launch.py        the run's config from the command's arguments, the same on every rank
    preflight.py     checks made before the first step, so that nothing fails after work is done
    paths.py         the checks of a directory or file a command will write
    rundata.py       the run's data: prepared if missing, opened, fingerprinted
    trainer.py       the Trainer: model, optimizer, loader, checkpoint state, one step, the loop
    throughput.py    the meter: tokens/s, MFU and the ETA from the time of training steps alone
    stopping.py      the non-finite guard and the stop vote, and their exit codes
    rundir.py        the directories andrea writes into, and who is writing there now
    runlog.py        a run's metrics and last words, written so that a full disk loses nothing
    checkpoint.py    crash-safe checkpoints, one directory per step, published atomically
    distributed.py   the world of a data-parallel run: MPI start-up, scalars, agreement, CPU gradients
    nccl.py          the GPUs' gradient transport between ranks
    allreduce.py     `python -m andrea.run.allreduce`: the NCCL self-test and the all-reduce timing
    perf.py          matmul peak, MFU, peak memory, the clock
    gradflow.py      gradient norms through the blocks: recorded while training, read and drawn
    figure.py        the figures' common start: matplotlib (an optional extra) asked for by name
    stepmodel.py     a GPU training step recorded launch by launch on the CuPy stand-in, and priced
    pricing.py       an op's time on an H200 from what can be counted (kernel_counts.json)
"""
