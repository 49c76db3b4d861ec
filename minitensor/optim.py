"""AdamW over the flat parameter and gradient buffers (minitensor.flat).

    m = b1 m + (1 - b1) g                      g = the gradient times grad_scale (clipping)
    v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd [decayed]) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Decoupled weight decay (Loshchilov & Hutter) applied before the Adam step, as PyTorch's AdamW
does, and only to the tensors `decays` selects (by default those of 2+ dimensions: matmul
weights and embeddings), given to the backend as a 0/1 mask over the buffer (`Ops.decay_mask`: in
the parameters' dtype, or uint8 on NumPy, whose step reads only where it changes). The update is
`Ops.adamw_step` of the parameters' backend (minitensor.backends.ops), this formula as written; under a
mixed precision (Params.mixed: float32 masters, bfloat16 weights for the layers) the same step also
writes the shard's range of the bfloat16 copy (`copy=`, Params.compute), so no second pass refreshes it.
Gradient clipping is the backend's too (`ops.global_norm`, `ops.clip_scale`): on a GPU the norm
stays on the device and the step takes the scale as a 0-d array, so nothing is read back.

The optimizer owns its state, and says what it is: `STATE` names its flat tensors (m, v), each one
element per parameter of the range of the flat buffer this rank updates (`shard`, start and stop:
the whole buffer in a replicated run, one rank's part where the state is sharded, as ZeRO-1 does);
`named_state()` gives them by name, `state_dict()` / `load_state_dict()` with the step count t.
Checkpoints, the start-up broadcast and the scripts go through these and nothing else
(tests/rules/test_state_by_name.py), so a new state tensor is one name in `STATE`.
"""

import math


class AdamW:
    # the flat state tensors, each over the rank's shard of the buffer, zero at the start
    STATE = ("m", "v")

    def __init__(self, params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decays=None, shard=None):
        """params: a minitensor Params, or what holds one as `.params` (a model: AdamW(model));
        decays(name, shape) -> bool says which tensors are decayed (default: those of 2+ dimensions);
        shard: (start, stop), the range of the flat buffer this optimizer updates and keeps state for
        (default: all of it)."""
        params = getattr(params, "params", params)
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        start, stop = shard if shard is not None else (0, params.size)
        if not 0 <= start <= stop <= params.size:
            raise ValueError(f"AdamW shard [{start}, {stop}) is not a range of the flat buffer of {params.size}")
        self.params = params
        self.ops = params.ops
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.shard = (int(start), int(stop))
        self.decays = decays or (lambda name, shape: len(shape) >= 2)
        self.decayed = self._owned(self.ops.decay_mask(params, self.decays), copy=True)  # 1 where decayed
        self._state = {name: params.xp.zeros(stop - start, dtype=params.dtype) for name in self.STATE}
        self.t = 0

    def _owned(self, flat, copy=False):
        """The shard's range of a flat buffer: the buffer itself when the shard is all of it."""
        start, stop = self.shard
        if (start, stop) == (0, self.params.size):
            return flat
        return flat[start:stop].copy() if copy else flat[start:stop]

    def step(self, lr=None, grad_scale=1.0):
        """One update of the shard from params.grads (times grad_scale); lr overrides the default for
        this step.

        grad_scale may be a 0-d array on the parameters' device (the clipping scale computed
        there), so a GPU step needs no host read."""
        self.t += 1
        b1, b2 = self.betas
        copy = {"copy": self._owned(self.params.compute)} if self.params.mixed else {}
        self.ops.adamw_step(self._owned(self.params.data), self._owned(self.params.grads), self._state["m"],
                            self._state["v"], self.decayed, self.lr if lr is None else lr, b1, b2, self.eps,
                            self.weight_decay, self.t, grad_scale, **copy)

    def named_state(self):
        """{name: flat state tensor over the shard} in STATE's order: the optimizer's own arrays, so a
        broadcast into them or a checkpoint read of them needs no copy."""
        return dict(self._state)

    def state_dict(self):
        return {**self._state, "t": self.t}

    def load_state_dict(self, state):
        """state: each name of STATE over the flat buffer's span (a checkpoint's: without the padding a
        sharded run adds at the end, so the same for any number of ranks), and t; the shard's range of
        each is kept."""
        span, xp = self.params.span, self.params.xp
        for name in self._state:
            if name not in state:
                raise ValueError(f"optimizer state has no {name!r} (it holds {sorted(state)})")
            if tuple(state[name].shape) != (span,):
                raise ValueError(f"optimizer state {name!r} of size {tuple(state[name].shape)} does not fit the "
                                 f"flat buffer of {span}")
        start, stop = self.shard
        held = max(min(stop, span) - start, 0)  # of the shard, what lies within the span
        for name, mine in self._state.items():
            mine[:held] = xp.asarray(state[name])[start:start + held]
            mine[held:] = 0  # the padding past the span: its state is zero
        self.t = int(state["t"])


def cosine_lr(step, max_lr, min_lr, warmup_steps, total_steps):
    """Linear warmup from max_lr / warmup_steps to max_lr, then cosine decay to min_lr at total_steps.

    step counts from 0; past total_steps the rate stays at min_lr.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
