"""LayerNorm over the last axis: y = w * (x - mean) / sqrt(var + eps) + b.

Shapes: x (..., C), w and b (C,). The variance is biased (divides by C), eps = 1e-5 (SPEC 1).
The forward caches x and the per-row statistics mean and rstd = 1 / sqrt(var + eps), as llm.c
does, not the normalised tensor: backward recomputes xhat from them. Rows are split over the
CPU threads on NumPy (minitensor.parallel).

On the CPU with numba (minitensor.cpu), `layernorm_forward_cpu` and `layernorm_backward_cpu`
below do each row in one kernel, its C values in cache for all the row's passes. Backward's
dw and db sum over rows in fixed blocks of ROW_BLOCK rows, one partial per block added in
block order: the same sums whatever the thread count.
"""

import numpy as np

from minitensor import cpu
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
        if _fast(x2, self.w, self.b):
            eps = x.dtype.type(self.eps)
            parallel_for(N, lambda s, e: layernorm_forward_cpu(x2[s:e], self.w, self.b, eps, y[s:e], mean[s:e],
                                                               rstd[s:e]), cost_per_item=C)
            self._save(x2, mean, rstd, x.shape)
            return y.reshape(x.shape)

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
        if _fast(x2, dy2, self.w) and (r2 is None or _fast(r2)) and dy2.dtype == x2.dtype:
            self._backward_cpu(x2, mean, rstd, dy2, r2, dx)
            return dx.reshape(shape)
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


    def _backward_cpu(self, x2, mean, rstd, dy2, r2, dx):
        N, C = x2.shape
        n_blocks = -(-N // ROW_BLOCK)
        dw_parts = np.empty((n_blocks, C), x2.dtype)
        db_parts = np.empty((n_blocks, C), x2.dtype)
        res = r2 if r2 is not None else np.empty((0, C), x2.dtype)

        def blocks(first, last):
            for n in range(first, last):
                s, e = n * ROW_BLOCK, min((n + 1) * ROW_BLOCK, N)
                layernorm_backward_cpu(x2[s:e], mean[s:e], rstd[s:e], dy2[s:e], self.w,
                                       res[s:e] if r2 is not None else res, r2 is not None,
                                       dx[s:e], dw_parts[n], db_parts[n])

        parallel_for(n_blocks, blocks, cost_per_item=ROW_BLOCK * C)
        for n in range(n_blocks):                            # block order: bit-reproducible sums
            self.dw += dw_parts[n]
            self.db += db_parts[n]


ROW_BLOCK = 32  # rows per partial sum of dw and db on the numba path


def _fast(*arrays):
    return cpu.enabled(*arrays) and all(a.flags.c_contiguous for a in arrays)


@cpu.kernel()
def layernorm_forward_cpu(x, w, b, eps, y, mean, rstd):
    """x, y (N, C); w, b (C,); mean, rstd (N, 1) written: y = w * (x - mean) * rstd + b per row."""
    t = x.dtype.type
    N, C = x.shape
    for i in range(N):
        m = t(0)
        for j in range(C):
            m += x[i, j]
        m /= C
        var = t(0)
        for j in range(C):
            d = x[i, j] - m
            var += d * d
        r = t(1) / np.sqrt(var / C + eps)
        mean[i, 0] = m
        rstd[i, 0] = r
        for j in range(C):
            y[i, j] = (x[i, j] - m) * r * w[j] + b[j]


@cpu.kernel()
def layernorm_backward_cpu(x, mean, rstd, dy, w, res, add_res, dx, dw, db):
    """One block of rows: x, dy, dx, res (N, C) (res used if add_res); mean, rstd (N, 1); w (C,);
    dw, db (C,) set to this block's sums over its rows, row by row."""
    t = x.dtype.type
    N, C = x.shape
    for j in range(C):
        dw[j] = t(0)
        db[j] = t(0)
    for i in range(N):
        m, r = mean[i, 0], rstd[i, 0]
        # forward was: y = w * xhat + b, xhat = (x - mean) * rstd; with g = w * dy, summing the paths
        # through mean and rstd gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
        sum_g = t(0)
        sum_gx = t(0)
        for j in range(C):
            xhat = (x[i, j] - m) * r
            g = w[j] * dy[i, j]
            sum_g += g
            sum_gx += g * xhat
            dw[j] += dy[i, j] * xhat
            db[j] += dy[i, j]
        mg, mgx = sum_g / C, sum_gx / C
        for j in range(C):
            xhat = (x[i, j] - m) * r
            d = r * (w[j] * dy[i, j] - mg - xhat * mgx)
            if add_res:
                d += res[i, j]
            dx[i, j] = d


def _over_rows(xp, N, C, fn):
    if xp is np:
        parallel_for(N, fn, cost_per_item=C)
    else:
        fn(0, N)
