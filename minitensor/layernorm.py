"""LayerNorm over the last axis: y = w * (x - mean) / sqrt(var + eps) + b.

Shapes: x (..., C), w and b (C,). The variance is biased (divides by C), eps = 1e-5 (SPEC 1).
The forward caches x and the per-row statistics mean and rstd = 1 / sqrt(var + eps), as llm.c
does, not the normalised tensor: backward recomputes xhat from them.
"""

from minitensor.backend import array_module
from minitensor.layer import Layer


class LayerNorm(Layer):
    def __init__(self, w, dw, b, db, eps=1e-5):
        self.w, self.dw, self.b, self.db, self.eps = w, dw, b, db, eps

    def forward(self, x):
        xp = array_module(x)
        mean = x.mean(axis=-1, keepdims=True)                # (..., 1)
        xc = x - mean
        var = (xc * xc).mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + self.eps)                 # (..., 1)
        xc *= rstd                                           # xhat, in place
        y = xc
        y *= self.w
        y += self.b
        self._save(x, mean, rstd)
        return y

    def backward(self, dy):
        x, mean, rstd = self._pop()
        C = x.shape[-1]
        xhat = (x - mean) * rstd                             # forward was: xhat = (x - mean) * rstd
        lead = tuple(range(dy.ndim - 1))
        # forward was: y = w * xhat + b
        self.dw += (dy * xhat).sum(axis=lead)
        self.db += dy.sum(axis=lead)
        dxhat = dy * self.w
        # xhat depends on x directly and through mean and rstd; with g = dxhat, summing the three
        # paths gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
        proj = (dxhat * xhat).sum(axis=-1, keepdims=True) / C
        dx = dxhat
        dx -= dxhat.sum(axis=-1, keepdims=True) / C
        xhat *= proj
        dx -= xhat
        dx *= rstd
        return dx
