"""The kernels a run's steps use, one choice on every rank: with several processes on GPUs and
train.kernels 'auto', rank 0 checks and times the fused pieces against the generic code at the run's
sizes (minitensor.backends.selection) and broadcasts what it chose (andrea.run.distributed.agree), so
that no near tie or failed timing can leave ranks on different kernels (and, through AdamW's, their
weight replicas drifting apart)."""

import numpy as np

from andrea.errors import UserError
from andrea.run import distributed as dist
from andrea.run import preflight
from minitensor.backends import selection
from minitensor.device import GPUUnavailable, get_device


def agreed_kernels(world, train, sizes):
    """The fused GPU kernels every rank of the run uses: with several processes on GPUs and
    train.kernels 'auto', rank 0's start-up self-check and timing at the run's sizes (a
    minitensor.backends.cuda.Sizes), broadcast, as a selection.Choice that each rank builds its backend
    from unchecked and untimed; else train.kernels as it is (one process decides alone; 'fused' and
    'generic' are the same everywhere). A collective: every rank calls it, outside any `together`."""
    if world.size == 1 or train.kernels != "auto":
        return train.kernels
    with world.together():
        try:
            xp = get_device(preflight.train_device(train.device)).xp
        except GPUUnavailable as e:
            raise UserError(str(e)) from e
    if xp is np:
        return train.kernels

    def decide():
        return selection.Choice(*selection.select_kernels("auto", xp, sizes=sizes)).to_json()

    choice = selection.Choice.from_json(dist.agree(world, decide))
    return selection.Choice(choice.fused, f"{choice.line} (rank 0's choice, on all {world.size} processes)")
