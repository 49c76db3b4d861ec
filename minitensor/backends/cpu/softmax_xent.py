"""NumpyOps' softmax cross-entropy: the probabilities kept already divided by N (the backward's scale),
with numba each row's exp, sum and scaling in one kernel, without it blocks of rows that stay in
cache for all passes.
"""

import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.softmax import exp_rows
from minitensor.parallel import parallel_for

ROWS_IN_CACHE = 1 << 18   # elements per block of the cross-entropy's rows (1 MiB of float32)


class SoftmaxXentCPU:
    """Ops.softmax_xent_forward / _backward on the CPU (a mixin of NumpyOps)."""

    def softmax_xent_forward(self, z, t, inplace=False):
        """(loss, softmax(z) / N): the probabilities kept already divided by N (backward's scale),
        over z with inplace. With numba, each row's exp, sum and scaling in one kernel while its V
        values sit in cache; the row maxima from NumPy's SIMD max (a compiled max loop is one
        compare per cycle). Without, blocks of rows that stay in cache for all passes."""
        if not (self.numba and numba_jit.takes(z) and z.dtype.kind == "f"):
            return self._softmax_xent_blocks(z, t, inplace)
        N, V = z.shape
        probs = z if inplace else np.empty_like(z)
        logsumexp = np.empty(N, dtype=z.dtype)
        picked = z[np.arange(N), t].astype(z.dtype)          # z[target], before z is overwritten

        def rows(s, e):
            if probs is not z:
                probs[s:e] = z[s:e]
            softmax_rows_cpu(probs[s:e], z[s:e].max(axis=1), N, logsumexp[s:e])

        parallel_for(N, rows, cost_per_item=V)
        return (logsumexp - picked).mean(), probs

    def _softmax_xent_blocks(self, z, t, inplace):
        N, V = z.shape
        probs = z if inplace else np.empty_like(z)
        logsumexp = np.empty(N, dtype=z.dtype)
        picked = z[np.arange(N), t].astype(z.dtype)          # z[target], before z is overwritten
        rows = max(1, ROWS_IN_CACHE // V)

        def blocks(first, last):                             # row blocks that stay in cache for all passes
            for s in range(first * rows, min(last * rows, N), rows):
                pb = probs[s:s + rows]
                total, lse = exp_rows(z[s:s + rows], out=pb)
                np.divide(pb, total * N, out=pb)             # softmax / N: backward's scale, folded in
                logsumexp[s:s + rows] = lse[:, 0]

        self.over_rows(-(-N // rows), blocks, cost_per_item=rows * V)
        return (logsumexp - picked).mean(), probs

    def softmax_xent_backward(self, probs, t, dloss=1.0):
        """dz_n = dloss (softmax(z_n) - onehot(t_n)) / N in place over what the forward kept, softmax / N."""
        N, V = probs.shape
        probs[np.arange(N), t] -= 1.0 / N
        if not (isinstance(dloss, (int, float)) and dloss == 1.0):
            self.over_rows(N, lambda s, e: probs[s:e].__imul__(dloss), cost_per_item=V)
        return probs


@numba_jit.kernel()
def softmax_rows_cpu(p, top, N, logsumexp):
    """Ops.softmax_xent_forward's rows: p (n, V) holding the logits z, top (n,) their row maxima,
    logsumexp (n,): in place, p = softmax(z) / N per row, and logsumexp = log(sum(exp(z - top))) + top."""
    t = p.dtype.type
    n, V = p.shape
    for i in range(n):
        m = top[i]
        total = t(0)
        for j in range(V):
            e = numba_jit.exp(p[i, j] - m)
            p[i, j] = e
            total += e
        scale = t(1) / (total * t(N))                        # softmax / N: backward's scale, folded in
        for j in range(V):
            p[i, j] *= scale
        logsumexp[i] = np.log(total) + m
