"""RMSNorm over the last axis: y = w * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019).

Shapes: x (..., C), w (C,). LayerNorm without its centring and its bias: a row is scaled by the
reciprocal of its root mean square, rstd = 1 / sqrt(mean(x^2) + eps), and nothing is subtracted,
so the row keeps its mean. The forward keeps x and rstd (N, 1), not the normalised tensor.

    forward:   xhat = x rstd,   y = w xhat
    backward:  dw += sum over rows of dy xhat
               g = w dy, the gradient at xhat; xhat_j = x_j rstd depends on x_k directly and
               through rstd, d rstd / dx_k = -rstd^3 x_k / C = -rstd^2 xhat_k / C, so
               d xhat_j / dx_k = rstd ([j = k] - xhat_j xhat_k / C), and summing over j
               dx = rstd (g - xhat mean(g xhat))

(LayerNorm's dx less its -mean(g) term, the path through the mean it does not subtract.) The
arithmetic is `Ops.rmsnorm_forward` / `rmsnorm_backward` (minitensor.backends.ops); the derivation
step by step is in docs/derivations.md.
"""

from typing import NamedTuple

from minitensor.layers.layer import Norm


class RMSNormCache(NamedTuple):
    x: object          # (N, C), the input as rows
    rstd: object       # (N, 1)
    shape: tuple


class RMSNorm(Norm):
    params = ("weight",)
    stats = ("rstd",)

    def __init__(self, w, dw, eps=1e-5, ops=None):
        super().__init__(ops)
        self.w, self.dw, self.eps = w, dw, eps

    def forward(self, x):
        self._take_ops(x)
        x2 = self.ops.xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))  # (N, C)
        y, rstd = self.ops.rmsnorm_forward(x2, self.w, self.eps)
        self._save(RMSNormCache(x2, rstd, x.shape))
        return y.reshape(x.shape)

    def infer_stats(self, x):
        """infer(x) and the statistic it normalised by: (y, {"rstd": (..., 1)})."""
        x2 = self.ops.xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        y, rstd = self.ops.rmsnorm_forward(x2, self.w, self.eps)
        return y.reshape(x.shape), {"rstd": rstd.reshape(*x.shape[:-1], 1)}

    def backward(self, dy, skip=None):
        """dx; plus skip (x's shape), if given, in the same pass (the Norm contract)."""
        x2, rstd, shape = self._pop()
        dy2 = self.ops.xp.ascontiguousarray(dy.reshape(x2.shape))
        dres = None if skip is None else skip.reshape(x2.shape)
        dx = self.ops.rmsnorm_backward(dy2, x2, rstd, self.w, self.dw, dres)
        return dx.reshape(shape)
