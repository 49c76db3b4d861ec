"""Softmax cross-entropy, fused: loss = mean over all N positions of logsumexp(z) - z[target].

Shapes: logits (..., V), targets (...) integer ids in [0, V). backward(dloss=1) returns
dlogits = dloss * (softmax(z) - onehot(target)) / N. The log-sum-exp subtracts the row maximum
first, so large logits cannot overflow. The forward caches the probabilities already divided by
N (one array of the size of the logits; with `inplace=True` written over the logits to save that
memory), so backward only subtracts 1/N at each target and, for dloss != 1, scales.

On the CPU with numba (minitensor.cpu), `softmax_rows_cpu` below makes each row's passes (exp
and sum, scale) in one kernel, in place, while the row's V values sit in cache.
"""

import numpy as np

from minitensor import cpu
from minitensor.backend import array_module
from minitensor.embedding import check_ids
from minitensor.layer import Layer
from minitensor.parallel import parallel_for

ROWS_IN_CACHE = 1 << 18  # elements per block of rows on NumPy (1 MiB of float32)


class SoftmaxCrossEntropy(Layer):
    def __init__(self, check=True):
        """check=False skips the target range check (a host sync on a GPU) for validated targets."""
        self.check = check

    def forward(self, logits, targets, inplace=False):
        xp = array_module(logits)
        V = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets of shape {targets.shape} do not match logits of shape {logits.shape}")
        if self.check:
            check_ids(targets, V, what="target id")
        z = logits.reshape(-1, V)                            # (N, V)
        t = targets.reshape(-1)                              # (N,)
        N = z.shape[0]
        probs = z if inplace else xp.empty_like(z)
        logsumexp = xp.empty(N, dtype=z.dtype)
        picked = z[xp.arange(N), t].astype(z.dtype)          # z[target], before z is overwritten
        rows = max(1, ROWS_IN_CACHE // V) if xp is np else N
        if cpu.enabled(z, probs) and probs.flags.c_contiguous:
            # the row maxima from NumPy's SIMD max (a compiled max loop is one compare per cycle)
            def rows_cpu(s, e):
                if probs is not z:
                    probs[s:e] = z[s:e]
                softmax_rows_cpu(probs[s:e], z[s:e].max(axis=1), N, logsumexp[s:e])

            parallel_for(N, rows_cpu, cost_per_item=V)
            loss = (logsumexp - picked).mean()
            self._save(probs, t, logits.shape)
            return loss

        def blocks(first, last):                             # row blocks that stay in cache for all passes
            for s in range(first * rows, min(last * rows, N), rows):
                zb, pb = z[s:s + rows], probs[s:s + rows]
                zmax = zb.max(axis=1, keepdims=True)
                xp.subtract(zb, zmax, out=pb)
                xp.exp(pb, out=pb)
                sumexp = pb.sum(axis=1, keepdims=True)
                xp.divide(pb, sumexp * N, out=pb)               # softmax / N: backward's scale, folded in
                logsumexp[s:s + rows] = xp.log(sumexp[:, 0]) + zmax[:, 0]

        if xp is np:
            parallel_for(-(-N // rows), blocks, cost_per_item=rows * V)
        else:
            blocks(0, 1)
        loss = (logsumexp - picked).mean()
        self._save(probs, t, logits.shape)
        return loss

    def backward(self, dloss=1.0):
        scaled, t, shape = self._pop()                       # scaled = softmax(z) / N
        xp = array_module(scaled)
        N = scaled.shape[0]
        # forward was: loss = mean_n(logsumexp(z_n) - z_n[t_n]); d/dz_n = (softmax(z_n) - onehot(t_n)) / N
        dz = scaled
        dz[xp.arange(N), t] -= 1.0 / N
        if not (isinstance(dloss, (int, float)) and dloss == 1.0):
            if xp is np:
                parallel_for(N, lambda s, e: dz[s:e].__imul__(dloss), cost_per_item=dz.shape[1])
            else:
                dz *= dloss
        return dz.reshape(shape)


@cpu.kernel()
def softmax_rows_cpu(p, top, N, logsumexp):
    """p (n, V) holding the logits z, top (n,) their row maxima, logsumexp (n,): in place,
    p = softmax(z) / N per row, and logsumexp = log(sum(exp(z - top))) + top (no overflow)."""
    t = p.dtype.type
    n, V = p.shape
    for i in range(n):
        m = top[i]
        total = t(0)
        for j in range(V):
            e = cpu.exp(p[i, j] - m)
            p[i, j] = e
            total += e
        scale = t(1) / (total * t(N))                        # softmax / N: backward's scale, folded in
        for j in range(V):
            p[i, j] *= scale
        logsumexp[i] = np.log(total) + m
