"""LayerNorm over the last axis: y = w * (x - mean) / sqrt(var + eps) + b.

Shapes: x (..., C), w and b (C,). The variance is biased (divides by C), eps = 1e-5 (SPEC 1).
The forward caches x and the per-row statistics mean and rstd = 1 / sqrt(var + eps), as llm.c
does, not the normalised tensor: backward recomputes xhat from them. Rows are split over the
CPU threads on NumPy (minitensor.parallel).
"""

import numpy as np

from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.parallel import parallel_for


class LayerNorm(Layer):
    def __init__(self, w, dw, b, db, eps=1e-5):
        self.w, self.dw, self.b, self.db, self.eps = w, dw, b, db, eps

    def forward(self, x):
        xp = array_module(x)
        C = x.shape[-1]
        x2 = x.reshape(-1, C)                                # (N, C)
        N = x2.shape[0]
        y = xp.empty_like(x2)
        mean = xp.empty((N, 1), dtype=x.dtype)
        rstd = xp.empty((N, 1), dtype=x.dtype)

        def rows(s, e):
            xs, ys = x2[s:e], y[s:e]
            mean[s:e] = xs.mean(axis=-1, keepdims=True)
            xp.subtract(xs, mean[s:e], out=ys)               # xc
            var = xp.einsum("ij,ij->i", ys, ys)[:, None] / C if xp is np else (ys * ys).mean(-1, keepdims=True)
            rstd[s:e] = 1.0 / xp.sqrt(var + self.eps)
            ys *= rstd[s:e]                                  # xhat
            ys *= self.w
            ys += self.b

        _over_rows(xp, N, C, rows)
        self._save(x2, mean, rstd, x.shape)
        return y.reshape(x.shape)

    def backward(self, dy, residual=None):
        """dx; plus residual (an array of x's shape) if given, added in the same pass: the gradient
        that reaches x around this layer through a skip connection."""
        x2, mean, rstd, shape = self._pop()
        xp = array_module(dy)
        N, C = x2.shape
        dy2 = dy.reshape(N, C)
        dx = xp.empty_like(x2)
        r2 = None if residual is None else residual.reshape(N, C)
        parts = []

        def rows(s, e):
            xhat = x2[s:e] - mean[s:e]                       # forward was: xhat = (x - mean) * rstd
            xhat *= rstd[s:e]
            g = dy2[s:e]
            # forward was: y = w * xhat + b; the parameter gradients sum over rows
            dw = xp.einsum("ij,ij->j", g, xhat) if xp is np else (g * xhat).sum(0)
            parts.append((s, dw, g.sum(axis=0)))
            dxhat = xp.multiply(g, self.w, out=dx[s:e])
            # xhat depends on x directly and through mean and rstd; with g = dxhat, summing the
            # three paths gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
            proj = (xp.einsum("ij,ij->i", dxhat, xhat) if xp is np else (dxhat * xhat).sum(-1))[:, None] / C
            dxhat -= dxhat.mean(axis=-1, keepdims=True)
            xhat *= proj
            dxhat -= xhat
            dxhat *= rstd[s:e]
            if r2 is not None:
                dxhat += r2[s:e]

        _over_rows(xp, N, C, rows)
        for _, dw, db in sorted(parts, key=lambda p: p[0]):  # a fixed order: bit-reproducible sums
            self.dw += dw
            self.db += db
        return dx.reshape(shape)


def _over_rows(xp, N, C, fn):
    if xp is np:
        parallel_for(N, fn, cost_per_item=C)
    else:
        fn(0, N)
