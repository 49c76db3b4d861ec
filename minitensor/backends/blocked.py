"""The attention core over blocks of query rows, for the backends whose memory or caches the dense
(B, nh, T, T) probabilities of `Ops.attention_forward` do not suit (NumpyOps; CupyOps past its
memory budget). `BlockedAttention` is a mixin placed before Ops: `class NumpyOps(BlockedAttention, Ops)`.

Query rows i0..i1 see keys 0..i1 only, so the scores above the diagonal are never computed and no
(T, T) matrix is materialised. The forward keeps each row's log-sum-exp; backward recomputes the
probabilities from it (or reads them when they were kept: up to keep_probs_max_bytes in all), and
uses rowsum(dP * P) = rowsum(dY * Y) (since Y = P V and dP = dY V^T), which costs hs per row
instead of T. The work goes head by head through `over_heads`, which a backend spreads over threads.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor.backends.ops import Ops
from minitensor.backends.softmax import exp_rows
from minitensor.precision import is_float


class BlockedAttentionCache(NamedTuple):
    """q (scaled by 1/sqrt(hs)), k, v: (B*n_head, T, hs) contiguous; y4: the output as a
    (B, n_head, T, hs) view; lse: each query row's log-sum-exp (B*n_head, T, 1); probs: one
    (B*n_head, i1 - i0, i1) array per query block when the forward kept them, else None."""
    q: object
    k: object
    v: object
    y4: object
    lse: object
    probs: object
    block: int


class BlockedAttention:
    def over_heads(self, B, n_head, fn):
        """fn(start, stop) over the B * n_head heads (flat index b * n_head + h), each call within one b."""
        for b in range(B):
            fn(b * n_head, (b + 1) * n_head)

    def split_heads(self, qkv4, b, q, k, v, s=None, e=None):
        """Heads s..e (all by default) of q, k, v (contiguous (B*n_head, T, hs)) from the three
        (B, n_head, T, hs) views qkv4 of c_attn's output: each copy adds c_attn's bias b (3C,)
        (so it costs no pass of its own), and q is scaled by 1/sqrt(hs) (T*hs work, rather
        than the scores' T*T)."""
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        C = nh * hs
        for i, (src, dst) in enumerate(zip(qkv4, (q, k, v))):
            bias = None if b is None else b[i * C:(i + 1) * C].reshape(nh, 1, hs)
            if s is None:                                    # all heads, as (B, nh, T, hs)
                dst = dst.reshape(B, nh, T, hs)
            else:
                h0 = s % nh
                bias = None if bias is None else bias[h0:h0 + e - s]
                src, dst = heads_of(src, s, e), dst[s:e]
            if bias is not None:
                xp.add(src, bias, out=dst)
            else:
                dst[...] = src
            if i == 0:
                dst *= 1.0 / math.sqrt(hs)

    @staticmethod
    def attention_blocks(T, block):
        """The query blocks (i0, i1) of block rows each."""
        return [(i0, min(i0 + block, T)) for i0 in range(0, T, block)]

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """Ops.attention_forward over query blocks of `block` rows (dense=True: Ops' dense core).
        Probabilities up to keep_probs_max_bytes in all are kept from forward to backward; larger
        ones are recomputed there from q, k and the row log-sum-exp (one more q k^T GEMM per block).
        bfloat16 heads take Ops' dense core, which sums in float32 (these blocks compute in y4's dtype)."""
        if dense or not is_float(y4.dtype):
            return self.attention_forward_dense(qkv4, b, y4)
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        BH = B * nh
        q, k, v = (xp.empty((BH, T, hs), dtype=y4.dtype) for _ in range(3))
        lse = xp.empty((BH, T, 1), dtype=y4.dtype)           # each row's log-sum-exp
        blocks = self.attention_blocks(T, block)
        kept_bytes = y4.itemsize * BH * sum((i1 - i0) * i1 for i0, i1 in blocks)
        kept = [xp.empty((BH, i1 - i0, i1), dtype=y4.dtype) for i0, i1 in blocks] \
            if kept_bytes <= keep_probs_max_bytes else None

        def heads(s, e):                                     # heads s..e, all query blocks
            self.split_heads(qkv4, b, q, k, v, s, e)
            yh = heads_of(y4, s, e)
            work = xp.empty((e - s) * block * T, dtype=y4.dtype) if kept is None else None
            for n, (i0, i1) in enumerate(blocks):
                shape = (e - s, i1 - i0, i1)
                sc = kept[n][s:e] if kept is not None else work[:math.prod(shape)].reshape(shape)
                xp.matmul(q[s:e, i0:i1], k[s:e, :i1].transpose(0, 2, 1), out=sc)  # keys 0..i1 only
                yb = yh[:, i0:i1]
                if kept is not None:
                    xp.matmul(self.block_softmax(sc, i0, lse[s:e, i0:i1]), v[s:e, :i1], out=yb)
                else:  # nothing keeps the probabilities: normalise the (bq, hs) output, not the (bq, i1) scores
                    total = self.block_exp(sc, i0, lse[s:e, i0:i1])
                    xp.matmul(sc, v[s:e, :i1], out=yb)
                    yb /= total

        self.over_heads(B, nh, heads)
        return BlockedAttentionCache(q, k, v, y4, lse, kept, block)

    def attention_forward_dense(self, qkv4, b, y4):
        """The dense core: Ops' own (a backend overrides it with a fused one)."""
        return Ops.attention_forward(self, qkv4, b, y4)

    def attention_backward(self, dy4, saved, dqkv4):
        if not isinstance(saved, BlockedAttentionCache):
            return super().attention_backward(dy4, saved, dqkv4)
        xp = self.xp
        q, k, v, y4, lse, kept, block = saved
        BH, T, hs = q.shape
        blocks = self.attention_blocks(T, block)

        def heads(s, e):                                     # heads s..e, all query blocks
            dy = heads_of(dy4, s, e)
            dq, dk, dv = xp.empty_like(q[s:e]), xp.zeros_like(k[s:e]), xp.zeros_like(v[s:e])
            work_p = xp.empty((e - s) * block * T, dtype=q.dtype) if kept is None else None
            work_dp = xp.empty((e - s) * block * T, dtype=q.dtype)
            work_kv = xp.empty((e - s) * T * hs, dtype=q.dtype)
            D = (dy * heads_of(y4, s, e)).sum(axis=-1, keepdims=True)  # rowsum(dY * Y) = rowsum(dP * P)
            for n, (i0, i1) in enumerate(blocks):
                shape = (e - s, i1 - i0, i1)
                if kept is not None:
                    p = kept[n][s:e]
                else:                                        # recompute: p = softmax(q k^T + mask)
                    p = work_p[:math.prod(shape)].reshape(shape)
                    xp.matmul(q[s:e, i0:i1], k[s:e, :i1].transpose(0, 2, 1), out=p)
                    self.block_probs_again(p, i0, lse[s:e, i0:i1])
                dyb = dy[:, i0:i1]
                part = work_kv[:(e - s) * i1 * hs].reshape(e - s, i1, hs)  # this block's share of dk, dv
                # forward was: y = p @ v
                dv[:, :i1] += xp.matmul(p.transpose(0, 2, 1), dyb, out=part)
                dp = xp.matmul(dyb, v[s:e, :i1].transpose(0, 2, 1), out=work_dp[:math.prod(shape)].reshape(shape))
                # forward was: p = softmax(s) per row, so ds = p * (dp - D)
                ds = self.block_softmax_backward(dp, p, D[:, i0:i1])
                # forward was: s = (q / sqrt(hs)) @ k^T, with q already scaled in the cache
                xp.matmul(ds, k[s:e, :i1], out=dq[:, i0:i1])
                dk[:, :i1] += xp.matmul(ds.transpose(0, 2, 1), q[s:e, i0:i1], out=part)
            dq *= 1.0 / math.sqrt(hs)                        # d(q) from d(scaled q)
            for g, d in zip(dqkv4, (dq, dk, dv)):
                heads_of(g, s, e)[...] = d

        self.over_heads(dy4.shape[0], dy4.shape[1], heads)

    # The causal row softmax over a block of scores s (..., bq, i1): query rows i0..i0+bq against
    # keys 0..i1. Row r sees keys 0..i0+r; the rest of the row (in the diagonal block) is masked
    # with -inf. Every row keeps its diagonal entry, so its maximum is finite.

    def block_exp(self, s, i0, lse):
        """In place: each row becomes exp(row - max), masked; writes its log-sum-exp into lse
        (..., bq, 1) and returns the row sums (..., bq, 1): the probabilities are s / sums."""
        s[..., i0:] += square_mask(self.xp, s.shape[-2], s.dtype)
        total, row_lse = exp_rows(s)
        lse[...] = row_lse
        return total

    def block_softmax(self, s, i0, lse):
        """In place: block_exp, then each row divided by its sum; returns the probabilities s."""
        s /= self.block_exp(s, i0, lse)
        return s

    def block_probs_again(self, s, i0, lse):
        """In place: the probabilities block_softmax gave, from the same scores and its lse."""
        s[..., i0:] += square_mask(self.xp, s.shape[-2], s.dtype)
        s -= lse
        self.xp.exp(s, out=s)
        return s

    def block_softmax_backward(self, dp, p, D):
        """In place: dp <- p * (dp - D), D = rowsum(dP * P) per row (..., bq, 1)."""
        dp -= D
        dp *= p
        return dp


class BlockedOps(BlockedAttention, Ops):
    """Ops with the blocked attention core, against any xp (the GPU check's and the tests' reference
    for the block softmax)."""


def heads_of(a4, s, e):
    """The (e - s, T, hs) view of heads s..e (flat index b * nh + h, all within one b) of a
    (B, nh, T, hs) array or view."""
    nh = a4.shape[1]
    b = s // nh
    return a4[b, s - b * nh:e - b * nh]


_mask_cache = {}


def square_mask(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above; cached per size and dtype."""
    key = (xp.__name__, T, np.dtype(dtype).str)
    if key not in _mask_cache:
        _mask_cache[key] = xp.asarray(np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1))
    return _mask_cache[key]
