"""NumpyOps' attention core: with numba and SciPy's BLAS reachable from it, each head's whole core (its
query blocks, GEMMs included) is one compiled call; with numba alone, the row-wise work between the
blocked core's GEMMs (minitensor.backends.blocked) is; without numba, the blocked core as it is.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor import precision
from minitensor.backends import numba_jit
from minitensor.backends.blocked import heads_of


class KernelAttentionCache(NamedTuple):
    """What attention_forward_cpu keeps: q (scaled by 1/sqrt(hs)), k, v (B*n_head, T, hs); y4 the
    output's (B, n_head, T, hs) view; lse (B*n_head, T); probs: each head's blocks of probabilities
    one after the other (B*n_head, sum of (i1 - i0) i1), or None (recomputed in backward).

    The fields of blocked.BlockedAttentionCache, laid out otherwise (lse without its trailing axis,
    probs one flat run per head rather than a list per query block, as the compiled kernels read
    them): its own type, which sends the backward to attention_backward_cpu."""
    q: object
    k: object
    v: object
    y4: object
    lse: object
    probs: object
    block: int


class AttentionCPU:
    """Ops.attention_forward / _backward and the blocked core's row pieces on the CPU (a mixin of NumpyOps,
    placed before BlockedAttention)."""

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """With numba and SciPy's BLAS reachable from it, each head's whole core (its blocks,
        GEMMs included) is one compiled call, attention_forward_cpu."""
        if dense or not (self.numba and precision.is_float(y4.dtype) and numba_jit.blas_in_kernels()):
            return super().attention_forward(qkv4, b, y4, block, keep_probs_max_bytes, dense)
        B, nh, T, hs = qkv4[0].shape
        BH = B * nh
        q, k, v = (np.empty((BH, T, hs), dtype=y4.dtype) for _ in range(3))
        lse = np.empty((BH, T), dtype=y4.dtype)
        size = sum((i1 - i0) * i1 for i0, i1 in self.attention_blocks(T, block))
        kept = np.empty((BH, size), dtype=y4.dtype) if y4.itemsize * BH * size <= keep_probs_max_bytes else None
        no_probs = np.empty(0, y4.dtype)

        def heads(s, e):
            self.split_heads(qkv4, b, q, k, v, s, e)
            for h in range(s, e):
                attention_forward_cpu(q[h], k[h], v[h], heads_of(y4, h, h + 1)[0], lse[h],
                                      no_probs if kept is None else kept[h], block)

        self.over_heads(B, nh, heads)
        return KernelAttentionCache(q, k, v, y4, lse, kept, block)

    def attention_backward(self, dy4, saved, dqkv4):
        if not isinstance(saved, KernelAttentionCache):
            return super().attention_backward(dy4, saved, dqkv4)
        q, k, v, y4, lse, kept, block = saved
        BH, T, hs = q.shape
        scale = q.dtype.type(1.0 / math.sqrt(hs))
        no_probs = np.empty(0, q.dtype)

        def heads(s, e):
            for h in range(s, e):
                dq, dk, dv = (heads_of(g, h, h + 1)[0] for g in dqkv4)
                attention_backward_cpu(q[h], k[h], v[h], heads_of(y4, h, h + 1)[0], heads_of(dy4, h, h + 1)[0],
                                       lse[h], no_probs if kept is None else kept[h], block,
                                       dq, dk, dv, scale)

        self.over_heads(dy4.shape[0], dy4.shape[1], heads)

    # The row-wise work between the block core's GEMMs (numba without SciPy's BLAS): s (n, bq, i1)
    # C-contiguous, each row one contiguous run; the per-row arrays (n, bq, 1) in any layout.

    def _rows_fit(self, s, *others):
        return (self.numba and numba_jit.takes(s) and s.ndim == 3
                and all(o.ndim == 3 and o.shape[-1] == 1 and o.dtype == s.dtype for o in others))

    def block_exp(self, s, i0, lse):
        if not self._rows_fit(s, lse):
            return super().block_exp(s, i0, lse)
        total = np.empty(lse.shape, s.dtype)
        block_exp_cpu(s, i0, lse[:, :, 0], total[:, :, 0], False)
        return total

    def block_softmax(self, s, i0, lse):
        if not self._rows_fit(s, lse):
            return super().block_softmax(s, i0, lse)
        block_exp_cpu(s, i0, lse[:, :, 0], np.empty(lse.shape[:2], s.dtype), True)
        return s

    def block_probs_again(self, s, i0, lse):
        if not self._rows_fit(s, lse):
            return super().block_probs_again(s, i0, lse)
        block_probs_again_cpu(s, i0, lse[:, :, 0])
        return s

    def block_softmax_backward(self, dp, p, D):
        if not (self._rows_fit(dp, D) and isinstance(p, np.ndarray) and p.shape == dp.shape and p.dtype == dp.dtype):
            return super().block_softmax_backward(dp, p, D)
        block_softmax_backward_cpu(dp, p, D[:, :, 0])
        return dp


@numba_jit.kernel()
def block_exp_cpu(s, i0, lse, total, normalise):
    """Ops.block_exp (block_softmax with normalise): s (n, bq, i1) in place; lse, total (n, bq).
    The row's maximum, its exp and its scaling are passes over a row in L1; the mask is the loop bound."""
    n, bq, i1 = s.shape
    for h in range(n):
        for r in range(bq):
            m, acc = numba_jit.causal_exp_row(s[h, r], min(i0 + r + 1, i1), normalise)
            lse[h, r] = m + np.log(acc)
            total[h, r] = acc


@numba_jit.kernel()
def block_probs_again_cpu(s, i0, lse):
    """Ops.block_probs_again: s (n, bq, i1) in place, lse (n, bq): exp(s - lse), 0 where masked."""
    t = s.dtype.type
    n, bq, i1 = s.shape
    for h in range(n):
        for r in range(bq):
            last = i0 + r + 1
            m = lse[h, r]
            for j in range(last):
                s[h, r, j] = numba_jit.exp(s[h, r, j] - m)
            for j in range(last, i1):
                s[h, r, j] = t(0)


@numba_jit.kernel()
def block_softmax_backward_cpu(dp, p, D):
    """Ops.block_softmax_backward: dp, p (n, bq, i1), D (n, bq): dp <- p * (dp - D) in place."""
    n, bq, i1 = dp.shape
    for h in range(n):
        for r in range(bq):
            d = D[h, r]
            for j in range(i1):
                dp[h, r, j] = p[h, r, j] * (dp[h, r, j] - d)


@numba_jit.kernel()
def attention_forward_cpu(q, k, v, y, lse, probs, block):
    """Ops.attention_forward for one head, all query blocks: q (scaled), k, v (T, hs) C-contiguous;
    writes y (T, hs) (any layout) and lse (T,) each row's log-sum-exp.

    probs (sum over blocks of bq * i1,) keeps each block's probabilities, one after another,
    for backward; empty, the blocks share a scratch buffer. Per block: s = q_b k^T (np.dot is
    BLAS's GEMM), each row's exp(s - max) as in block_exp_cpu, y_b = p v; the rows of p are
    divided by their sums when they are kept, else the (bq, hs) rows of y_b are."""
    t = q.dtype.type
    T, hs = q.shape
    keep = probs.size > 0
    work = np.empty(0 if keep else block * T, q.dtype)
    yb = np.empty((block, hs), q.dtype)
    inv = np.empty(block, q.dtype)                           # each row's 1 / sum
    off = 0
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        bq = i1 - i0
        p = (probs[off:off + bq * i1] if keep else work[:bq * i1]).reshape((bq, i1))
        off += bq * i1
        np.dot(q[i0:i1], k[:i1].T, p)                        # keys 0..i1 only
        for r in range(bq):                                  # row i0 + r sees keys 0..i0 + r
            m, acc = numba_jit.causal_exp_row(p[r], i0 + r + 1, keep)  # normalised only if kept: backward reads p
            inv[r] = t(1) / acc
            lse[i0 + r] = m + np.log(acc)
        np.dot(p, v[:i1], yb[:bq])
        for r in range(bq):
            w = t(1) if keep else inv[r]                     # else normalise the (bq, hs) output instead
            for c in range(hs):
                y[i0 + r, c] = yb[r, c] * w


@numba_jit.kernel()
def attention_backward_cpu(q, k, v, y, dy, lse, probs, block, dq, dk, dv, scale):
    """The backward of attention_forward_cpu for one head (Ops._attention_backward_blocks): from
    dy (T, hs) (any layout) and the forward's q (scaled), k, v, y, lse and probs, writes dq, dk,
    dv (T, hs) (any layout); dq is scaled by `scale` (1/sqrt(hs): the cached q was scaled)."""
    t = q.dtype.type
    T, hs = q.shape
    keep = probs.size > 0
    dyc = np.empty((T, hs), q.dtype)                         # dy contiguous, for the GEMMs
    D = np.empty(T, q.dtype)
    for r in range(T):
        acc = t(0)
        for c in range(hs):
            dyc[r, c] = dy[r, c]
            acc += dy[r, c] * y[r, c]
        D[r] = acc
    dqc = np.empty((T, hs), q.dtype)
    dkc = np.zeros((T, hs), q.dtype)
    dvc = np.zeros((T, hs), q.dtype)
    part = np.empty((T, hs), q.dtype)                        # a block's share of dk or dv
    work = np.empty(0 if keep else block * T, q.dtype)
    dpw = np.empty(block * T, q.dtype)
    off = 0
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        bq = i1 - i0
        p = (probs[off:off + bq * i1] if keep else work[:bq * i1]).reshape((bq, i1))
        off += bq * i1
        if not keep:                                         # recompute: p = exp(q_b k^T - lse), masked
            np.dot(q[i0:i1], k[:i1].T, p)
            for r in range(bq):
                row = p[r]
                last = i0 + r + 1
                m = lse[i0 + r]
                for j in range(last):
                    row[j] = numba_jit.exp(row[j] - m)
                for j in range(last, i1):
                    row[j] = t(0)
        dyb = dyc[i0:i1]
        share = part[:i1]
        # forward was: y = p @ v
        np.dot(p.T, dyb, share)
        for r in range(i1):
            for c in range(hs):
                dvc[r, c] += share[r, c]
        ds = dpw[:bq * i1].reshape((bq, i1))
        np.dot(dyb, v[:i1].T, ds)                            # dp
        # forward was: p = softmax(s) per row, so ds = p * (dp - D)
        for r in range(bq):
            d = D[i0 + r]
            for j in range(i1):
                ds[r, j] = p[r, j] * (ds[r, j] - d)
        # forward was: s = (q * scale) @ k^T
        np.dot(ds, k[:i1], dqc[i0:i1])
        np.dot(ds.T, q[i0:i1], share)
        for r in range(i1):
            for c in range(hs):
                dkc[r, c] += share[r, c]
    for r in range(T):
        for c in range(hs):
            dq[r, c] = dqc[r, c] * scale
            dk[r, c] = dkc[r, c]
            dv[r, c] = dvc[r, c]
