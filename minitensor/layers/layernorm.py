"""LayerNorm over the last axis: y = w * (x - mean) / sqrt(var + eps) + b.

Shapes: x (..., C), w and b (C,). The variance is biased (divides by C), as GPT-2's and
PyTorch's, with eps = 1e-5. The forward keeps x and the per-row statistics mean and
rstd = 1 / sqrt(var + eps), not the normalised tensor (as llm.c does).

    forward:   xhat = (x - mean) rstd,   y = w xhat + b
    backward:  dw += sum over rows of dy xhat,   db += sum over rows of dy
               g = w dy;  xhat depends on x directly and through mean and rstd, and summing the
               three paths gives  dx = rstd (g - mean(g) - xhat mean(g xhat))

The arithmetic is `Ops.layernorm_forward` / `layernorm_backward` (minitensor.backends.ops).
"""

from typing import NamedTuple

from minitensor.layers.layer import Norm


class LayerNormCache(NamedTuple):
    x: object          # (N, C), the input as rows
    mean: object       # (N, 1)
    rstd: object       # (N, 1)
    shape: tuple


class LayerNorm(Norm):
    params = ("weight", "bias")
    stats = ("mean", "rstd")

    def __init__(self, w, dw, b, db, eps=1e-5, ops=None):
        super().__init__(ops)
        self.w, self.dw, self.b, self.db, self.eps = w, dw, b, db, eps

    def forward(self, x):
        self._take_ops(x)
        x2 = self.ops.xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))  # (N, C)
        y, mean, rstd = self.ops.layernorm_forward(x2, self.w, self.b, self.eps)
        self._save(LayerNormCache(x2, mean, rstd, x.shape))
        return y.reshape(x.shape)

    def forward_joined(self, x, bias, residual):
        """forward of x += bias + residual, the join made in place in x (Norm) by joined_layernorm_forward,
        in the pass that normalises it. x must be contiguous."""
        self._take_ops(x)
        x2 = x.reshape(-1, x.shape[-1])                      # a view: the join lands in x
        y, mean, rstd = self.ops.joined_layernorm_forward(x2, bias, residual.reshape(x2.shape), self.w, self.b,
                                                          self.eps)
        self._save(LayerNormCache(x2, mean, rstd, x.shape))
        return y.reshape(x.shape)

    def infer_stats(self, x):
        """infer(x) and the statistics it normalised by: (y, {"mean": (..., 1), "rstd": (..., 1)})."""
        x2 = self.ops.xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        y, mean, rstd = self.ops.layernorm_forward(x2, self.w, self.b, self.eps)
        rows = (*x.shape[:-1], 1)
        return y.reshape(x.shape), {"mean": mean.reshape(rows), "rstd": rstd.reshape(rows)}

    def backward(self, dy, skip=None):
        """dx; plus skip (x's shape), if given, in the same pass: the gradient that reaches x
        around this layer (the residual path of a pre-norm block)."""
        return self.backward_and_sum_skip(dy, skip, None)

    def backward_and_sum_skip(self, dy, skip, linear):
        """backward(dy, skip), skip's column sums added into linear.db (Norm) by layernorm_backward, in the
        pass that reads skip (linear None: none)."""
        x2, mean, rstd, shape = self._pop()
        dy2 = self.ops.xp.ascontiguousarray(dy.reshape(x2.shape))
        dres = None if skip is None else skip.reshape(x2.shape)
        if linear is None:
            dx = self.ops.layernorm_backward(dy2, x2, mean, rstd, self.w, self.dw, self.db, dres)
        else:
            dx = self.ops.layernorm_backward(dy2, x2, mean, rstd, self.w, self.dw, self.db, dres, linear.db)
        return dx.reshape(shape)
