"""AdamW over the flat parameter and gradient buffers (minitensor.flat).

    m = b1 m + (1 - b1) g                      g = the gradient times grad_scale (clipping)
    v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd [decayed]) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Decoupled weight decay (Loshchilov & Hutter) applied before the Adam step, as PyTorch's AdamW
does, and only to the tensors `decays` selects (by default those of 2+ dimensions: matmul
weights and embeddings), given to the backend as a 0/1 mask over the buffer (`Ops.decay_mask`: in
the parameters' dtype, or uint8 on NumPy, whose step reads only where it changes). The update is
`Ops.adamw_step` of the parameters' backend (minitensor.backends.ops), this formula as written.
Gradient clipping is the backend's too (`ops.global_norm`, `ops.clip_scale`): on a GPU the norm
stays on the device and the step takes the scale as a 0-d array, so nothing is read back.
"""

import math


class AdamW:
    def __init__(self, params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decays=None):
        """params: a minitensor Params, or what holds one as `.params` (a model: AdamW(model));
        decays(name, shape) -> bool says which tensors are decayed (default: those of 2+ dimensions)."""
        params = getattr(params, "params", params)
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.params = params
        self.ops = params.ops
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.m = params.xp.zeros_like(params.data)
        self.v = params.xp.zeros_like(params.data)
        self.decays = decays or (lambda name, shape: len(shape) >= 2)
        self.decayed = self.ops.decay_mask(params, self.decays)  # 1 over the decayed tensors, 0 elsewhere
        self.t = 0

    def step(self, lr=None, grad_scale=1.0):
        """One update from params.grads (times grad_scale); lr overrides the default for this step.

        grad_scale may be a 0-d array on the parameters' device (the clipping scale computed
        there), so a GPU step needs no host read."""
        self.t += 1
        b1, b2 = self.betas
        self.ops.adamw_step(self.params.data, self.params.grads, self.m, self.v, self.decayed,
                            self.lr if lr is None else lr, b1, b2, self.eps, self.weight_decay, self.t, grad_scale)

    def state_dict(self):
        return {"m": self.m, "v": self.v, "t": self.t}

    def load_state_dict(self, state):
        if state["m"].shape != self.m.shape or state["v"].shape != self.v.shape:
            raise ValueError(f"optimizer state of size {state['m'].shape} does not fit {self.m.shape}")
        self.m[...] = self.params.xp.asarray(state["m"])
        self.v[...] = self.params.xp.asarray(state["v"])
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
