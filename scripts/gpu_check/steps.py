"""Training steps as the phases run them: a few AdamW steps returning losses and gradients (train),
and the benchmark's steps with their memory peak and forward / backward / optimizer split (TrainingSteps)."""

import time

import numpy as np


def train(cfg, device, dtype, data, kernels=None):
    """Per-step losses, the step-0 gradients {name: float64 NumPy array} (clipping at norm 1) and
    the line that says which kernels ran."""
    from andrea.model.transformer import ANDREA
    from minitensor.device import to_numpy
    from minitensor.optim import AdamW

    model = ANDREA(cfg, device=device, dtype=dtype, seed=0, kernels=kernels)
    ops = model.ops
    opt = AdamW(model, lr=1e-3)
    losses, grads = [], None
    for x in data:
        losses.append(float(model.loss(x[:, :-1], x[:, 1:])))
        model.zero_grad()
        model.backward()
        if grads is None:
            grads = {name: to_numpy(g).astype(np.float64) for name, g in model.named_grads()}
        opt.step(grad_scale=ops.clip_scale(ops.global_norm(model.params.grads), 1.0, 0.0)[0])
    return losses, grads, ops.kernels_line


class TrainingSteps:
    """Training steps of `model` as the training loop runs them, on two batches of B x T random ids,
    recording the memory pool's peak use (after forward and backward) and, when asked, one step's
    forward / backward / optimizer split."""

    def __init__(self, model, opt, B, T):
        self.model, self.opt, self.xp, self.B, self.T = model, opt, model.xp, B, T
        rng = np.random.default_rng(0)
        # token ids stay on the host, as the training loader's do: the model checks them there and
        # copies them over; ids on the device would be read back, two host reads a step
        self.batches = [rng.integers(0, model.cfg.vocab_size, (B, T + 1)) for _ in range(2)]
        self.pool = None if self.xp is np else self.xp.get_default_memory_pool()
        self.used = 0  # the pool's peak use, in bytes
        self.split = {"forward": [], "backward": [], "optimizer": []}

    def step(self, i, timed_split=False):
        model, x = self.model, self.batches[i % 2]
        marks = [time.perf_counter()]
        loss = model.loss(x[:, :-1], x[:, 1:])
        self._phase_done(marks, timed_split, memory=True)
        model.zero_grad()
        model.backward()
        self._phase_done(marks, timed_split, memory=True)
        scale, finite = model.ops.clip_scale(model.ops.global_norm(model.params.grads), 1.0, loss)
        if bool(finite):  # the one host read of a training step
            self.opt.step(grad_scale=scale)
        self._phase_done(marks, timed_split)
        if timed_split:
            for key, a, b in zip(self.split, marks, marks[1:]):
                self.split[key].append(b - a)
        return loss

    def _phase_done(self, marks, timed_split, memory=False):
        from andrea.run.perf import synchronize

        if memory and self.pool is not None:
            self.used = max(self.used, self.pool.used_bytes())
        if timed_split:
            synchronize(self.xp)
            marks.append(time.perf_counter())

