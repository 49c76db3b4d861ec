"""All parameters in one flat buffer, all gradients in a second buffer of the same layout.

    p = Params({"fc.weight": (3, 4), "fc.bias": (4,)}, xp=numpy, dtype="float32")
    p["fc.weight"]        # (3, 4) view into p.data
    p.grad("fc.weight")   # (3, 4) view into p.grads, same offsets
    p.zero_grad()         # one fill

Layers hold these views and update them in place; nothing may rebind them, because the flat
buffers are the truth that AdamW, gradient clipping and checkpoints work on (as in llm.c).
Each tensor starts at a multiple of 16 elements (64 bytes in float32), so views stay aligned.
`span` is where the last tensor's padding ends; `size`, the buffers' length, is `span` rounded up to
`multiple` (16 unless asked: a run that shards the buffers over N ranks asks for 16 N, so that every
rank's range is as long and aligned).

Under a mixed precision (minitensor.precision, bf16) `data` and `grads` stay float32: the master
weights the optimizer updates and checkpoints hold, and the gradients summed in float32. A third flat
buffer of the same layout, `compute` (bfloat16), holds the weights the layers read:

    p = Params(shapes, xp=cupy, dtype="float32", compute=precision.bfloat16())
    p.compute_view("fc.weight")   # (3, 4) bfloat16 view into p.compute, same offsets
    p.refresh_compute()           # compute = data rounded to nearest even, after data was written

AdamW's update writes `compute` in the same pass (Ops.adamw_step's `copy`); whatever else writes
`data` (the initialisation, a checkpoint, a broadcast) calls refresh_compute after. Without a
compute dtype, `compute` is `data` itself and compute_view(name) is p[name].
"""

import math

import numpy as np

from minitensor.backends import get_ops

ALIGN = 16


class Params:
    """Named views into one parameter buffer (`data`) and one gradient buffer (`grads`)."""

    def __init__(self, shapes, xp=np, dtype="float32", ops=None, multiple=ALIGN, compute=None):
        """compute: the dtype the layers read the weights in, where it differs from dtype (bfloat16
        under precision bf16): a flat copy of that dtype (the module's docstring); None: dtype itself."""
        self.xp = xp
        self.ops = ops or get_ops(xp)
        self.dtype = np.dtype(dtype)
        self.shapes = {name: tuple(int(s) for s in shape) for name, shape in shapes.items()}
        self.offsets = {}
        offset = 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += -(-math.prod(shape) // ALIGN) * ALIGN
        if multiple < 1 or multiple % ALIGN:
            raise ValueError(f"the flat buffers' size must round to a multiple of {ALIGN}, got {multiple}")
        self.span = offset
        self.size = -(-offset // multiple) * multiple
        self.data = xp.zeros(self.size, dtype=self.dtype)
        self.grads = xp.zeros(self.size, dtype=self.dtype)
        self._views = {n: self._view(self.data, n) for n in self.shapes}
        self._grad_views = {n: self._view(self.grads, n) for n in self.shapes}
        self.mixed = compute is not None and np.dtype(compute) != self.dtype
        self.compute = xp.zeros(self.size, dtype=compute) if self.mixed else self.data
        self._compute_views = {n: self._view(self.compute, n) for n in self.shapes} if self.mixed else self._views

    def _view(self, flat, name):
        start = self.offsets[name]
        shape = self.shapes[name]
        return flat[start:start + math.prod(shape)].reshape(shape)

    def __getitem__(self, name):
        return self._views[name]

    def __contains__(self, name):
        return name in self.shapes

    def __len__(self):
        return len(self.shapes)

    def grad(self, name):
        return self._grad_views[name]

    def compute_view(self, name):
        """The view the layers read: of `compute` under a mixed precision, else p[name] itself."""
        return self._compute_views[name]

    def refresh_compute(self):
        """compute = data rounded to compute's dtype (nearest even), after data was written other than by
        the optimizer's step; nothing without a mixed precision."""
        if self.mixed:
            self.compute[...] = self.data.astype(self.compute.dtype)

    def names(self):
        return list(self.shapes)

    def items(self):
        return self._views.items()

    def grad_items(self):
        return self._grad_views.items()

    def zero_grad(self):
        self.ops.fill_zero(self.grads)

    def num_elements(self):
        """Parameters actually held (the padding between tensors is not counted)."""
        return sum(math.prod(s) for s in self.shapes.values())

    def mask(self, predicate, dtype=None):
        """A 0/1 vector over the flat buffer, of `dtype` (default the buffer's): 1 on the tensors where
        predicate(name, shape) holds.

        Padding is 0. Used for example to weight-decay only the matrices.
        """
        m = np.zeros(self.size, dtype=dtype or self.dtype)
        for name, shape in self.shapes.items():
            if predicate(name, shape):
                start = self.offsets[name]
                m[start:start + math.prod(shape)] = 1
        return self.xp.asarray(m)
