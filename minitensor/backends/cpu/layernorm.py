"""NumpyOps' LayerNorm: with numba, one compiled pass per row block (forward) and the parameter sums
per fixed block of rows (backward); without, Ops' formulas over the threads' rows, in place where
they can be. Both equal Ops.layernorm_forward / _backward (tests/engine/test_cpu_kernels.py).
"""

import numpy as np

from minitensor.backends import numba_jit
from minitensor.parallel import parallel_for

LN_ROW_BLOCK = 32         # rows per partial sum of LayerNorm's dw and db in the kernel
# Below this many elements the LayerNorm kernels run on the calling thread. At 1024 x 768 (120m)
# two threads beat one, with the input in the cores' caches as it is between the layers of a step
# (BENCHMARKS.md, "The CPU kernels").
LN_MIN_WORK = 1 << 16


class LayerNormCPU:
    """Ops.layernorm_forward / _backward on the CPU (a mixin of NumpyOps)."""

    def layernorm_forward(self, x, w, b, eps):
        if not (self.numba and numba_jit.takes(x, w, b)):
            return self._layernorm_forward_rows(x, w, b, eps)
        N, C = x.shape
        y = np.empty_like(x)
        mean = np.empty((N, 1), dtype=x.dtype)
        rstd = np.empty((N, 1), dtype=x.dtype)
        e = x.dtype.type(eps)
        parallel_for(N, lambda s, f: layernorm_forward_cpu(x[s:f], w, b, e, y[s:f], mean[s:f], rstd[s:f]),
                     cost_per_item=C, min_work=LN_MIN_WORK)
        return y, mean, rstd

    def layernorm_backward(self, dy, x, mean, rstd, w, dw, db, dres=None, dres_db=None):
        if dres_db is not None:
            self.add_bias_grad(dres, dres_db)
        if not (self.numba and numba_jit.takes(x, dy, w) and (dres is None or numba_jit.takes(x, dres))):
            return self._layernorm_backward_rows(dy, x, mean, rstd, w, dw, db, dres)
        N, C = x.shape
        dx = np.empty_like(x)
        n_blocks = -(-N // LN_ROW_BLOCK)
        dw_parts = np.empty((n_blocks, C), x.dtype)      # one partial sum per fixed block of rows
        db_parts = np.empty((n_blocks, C), x.dtype)
        res = dres if dres is not None else np.empty((0, C), x.dtype)

        def blocks(first, last):
            s, e = first * LN_ROW_BLOCK, min(last * LN_ROW_BLOCK, N)
            layernorm_backward_cpu(x[s:e], mean[s:e], rstd[s:e], dy[s:e], w,
                                   res[s:e] if dres is not None else res, dres is not None,
                                   dx[s:e], dw_parts[first:last], db_parts[first:last], LN_ROW_BLOCK)

        parallel_for(n_blocks, blocks, cost_per_item=LN_ROW_BLOCK * C, min_work=LN_MIN_WORK)
        dw += dw_parts.sum(axis=0)                       # over axis 0 NumPy adds the rows in order
        db += db_parts.sum(axis=0)
        return dx

    def _layernorm_forward_rows(self, x, w, b, eps):
        """Ops.layernorm_forward over the threads' rows, in place where it can be."""
        N, C = x.shape
        y = np.empty_like(x)
        mean = np.empty((N, 1), dtype=x.dtype)
        rstd = np.empty((N, 1), dtype=x.dtype)

        def rows(s, e):
            xs, ys = x[s:e], y[s:e]
            mean[s:e] = xs.mean(axis=-1, keepdims=True)
            np.subtract(xs, mean[s:e], out=ys)               # x - mean: centred first, no cancellation
            var = self.row_dot(ys, ys)[:, None] / C
            rstd[s:e] = 1.0 / np.sqrt(var + eps)
            ys *= rstd[s:e]                                  # xhat
            ys *= w
            ys += b

        self.over_rows(N, rows, cost_per_item=C)
        return y, mean, rstd

    def _layernorm_backward_rows(self, dy, x, mean, rstd, w, dw, db, dres=None):
        """Ops.layernorm_backward over the threads' rows; their dw, db parts summed in row order."""
        N, C = x.shape
        dx = np.empty_like(x)
        parts = []

        def rows(s, e):
            xhat = x[s:e] - mean[s:e]                        # forward was: xhat = (x - mean) * rstd
            xhat *= rstd[s:e]
            g = dy[s:e]
            parts.append((s, self.col_dot(g, xhat), g.sum(axis=0)))
            dxhat = np.multiply(g, w, out=dx[s:e])
            # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dxhat (Ops.layernorm_backward)
            proj = self.row_dot(dxhat, xhat)[:, None] / C
            dxhat -= dxhat.mean(axis=-1, keepdims=True)
            xhat *= proj
            dxhat -= xhat
            dxhat *= rstd[s:e]
            if dres is not None:
                dxhat += dres[s:e]

        self.over_rows(N, rows, cost_per_item=C)
        for _, dw_part, db_part in sorted(parts, key=lambda p: p[0]):  # a fixed order: reproducible sums
            dw += dw_part
            db += db_part
        return dx


@numba_jit.kernel()
def layernorm_forward_cpu(x, w, b, eps, y, mean, rstd):
    """Ops.layernorm_forward: x, y (N, C); w, b (C,); mean, rstd (N, 1) written."""
    t = x.dtype.type
    N, C = x.shape
    inv_c = t(1) / t(C)                                      # an integer C would promote the row to float64
    for i in range(N):
        m = t(0)
        for j in range(C):
            m += x[i, j]
        m *= inv_c
        var = t(0)
        for j in range(C):
            d = x[i, j] - m
            var += d * d
        r = t(1) / np.sqrt(var * inv_c + eps)
        mean[i, 0] = m
        rstd[i, 0] = r
        for j in range(C):
            y[i, j] = (x[i, j] - m) * r * w[j] + b[j]


# no FMA: with C = 1, or any row of equal values, w * dy - mean(w * dy) must be exactly 0, and an
# FMA of the unrounded product against the rounded mean leaves its rounding error times rstd
@numba_jit.kernel(contract=False)
def layernorm_backward_cpu(x, mean, rstd, dy, w, res, add_res, dx, dw, db, block):
    """Ops.layernorm_backward: x, dy, dx, res (N, C) (res added if add_res); mean, rstd (N, 1);
    w (C,); dw, db (n_blocks, C): row n set to the sums over rows n*block..(n+1)*block."""
    t = x.dtype.type
    N, C = x.shape
    inv_c = t(1) / t(C)
    for n in range(dw.shape[0]):
        for j in range(C):
            dw[n, j] = t(0)
            db[n, j] = t(0)
        for i in range(n * block, min((n + 1) * block, N)):
            m, r = mean[i, 0], rstd[i, 0]
            # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = w * dy
            sum_g = t(0)
            sum_gx = t(0)
            for j in range(C):
                xhat = (x[i, j] - m) * r
                g = w[j] * dy[i, j]
                sum_g += g
                sum_gx += g * xhat
                dw[n, j] += dy[i, j] * xhat
                db[n, j] += dy[i, j]
            mg, mgx = sum_g * inv_c, sum_gx * inv_c
            for j in range(C):
                xhat = (x[i, j] - m) * r
                d = r * (w[j] * dy[i, j] - mg - xhat * mgx)
                if add_res:
                    d += res[i, j]
                dx[i, j] = d
