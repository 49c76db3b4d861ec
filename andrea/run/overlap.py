"""The step's gradient reduction, overlapped with the last micro-batch's backward or after it.

    reduction = GradientReduction(model, reducer, shards, overlap=True)
    reduction.backward(scale)     # the last micro-batch's backward; with overlap each bucket starts reducing
                                  # as soon as the backward has completed it
    reduction.finish()            # the reduction complete (waits for the started buckets, or runs it all now)
    reduction.waited_s            # seconds the last finish() waited

With overlap (`train.overlap`, on by default when there are several processes), each block's bucket of
the flat gradient buffer (andrea.run.buckets: the top block with ln_f, each block down to block 0, the
embeddings last: the tied wte's gradient is complete only after the embeddings' backward) is started
with `wait=False` as soon as that block's backward ends: an all-reduce of the bucket, or under ZeRO-1
(`shards` given) a reduce-scatter of it, each rank getting the sum of its part. On CPUs these are MPI's
non-blocking collectives (andrea.run.mpi), on GPUs NCCL's on its own stream (andrea.run.nccl), so the
backward of the blocks below runs while a block's bucket reduces. finish() waits for them all, in the
order they started; the optimizer runs after it. Every rank starts the same buckets in the same order
(the backward's), so the collective order is the same on every rank by construction.

Without overlap (one process, or `train.overlap=false`) finish() runs the one collective over the whole
buffer after the backward, as the step always did.

`waited_s` is the host's time in finish(): on CPUs how long the step waited for the reduction past the
backward. MPICH makes no progress on a non-blocking collective outside MPI calls unless asked
(MPIR_CVAR_ASYNC_PROGRESS=1), so after each bucket's start the started ones are tested once, which
lets the library move them on between blocks. On GPUs a wait only orders the streams: the host time is
not the device's.
"""

from __future__ import annotations

import time

from andrea.run.buckets import buckets


class GradientReduction:
    """The reduction of the flat gradient buffer at the end of a step (see the module's docstring)."""

    def __init__(self, model, reducer, shards=None, overlap=False):
        self.model, self.reducer, self.shards, self.overlap = model, reducer, shards, bool(overlap)
        self.bounds = buckets(model.params.offsets, model.params.size, len(model.blocks)) if overlap else None
        self.pending, self.waited_s = [], 0.0

    def backward(self, scale):
        """The last micro-batch's backward (scale as Model.backward's); with overlap each bucket is started
        as the backward completes it, the embeddings' last."""
        if not self.overlap:
            self.model.backward(scale)
            return
        top = len(self.model.blocks) - 1
        self.model.backward(scale, on_block=lambda i: self._start(top - i))
        self._start(len(self.bounds) - 1)

    def _start(self, i):
        start, stop = self.bounds[i]
        grads = self.model.params.grads
        if self.shards is not None:
            pending = self.reducer.reduce_scatter(grads, self.shards, wait=False, span=(start, stop))
        else:
            pending = self.reducer.all_reduce(grads[start:stop], wait=False)
        self.pending.append(pending)
        for p in self.pending:  # a chance for the transport to move the started ones on (MPI: Test)
            p.progress()

    def finish(self):
        """The gradients reduced (all-reduced, or reduce-scattered under ZeRO-1); sets waited_s."""
        began = time.perf_counter()
        if self.overlap:
            for pending in self.pending:
                pending.wait()
            self.pending = []
        elif self.shards is not None:
            self.reducer.reduce_scatter(self.model.params.grads, self.shards)
        else:
            self.reducer.all_reduce(self.model.params.grads)
        self.waited_s = time.perf_counter() - began
