"""Causal multi-head self-attention with a fused qkv projection (GPT-2's layout, SPEC 1).

    qkv = x @ W_attn + b_attn                 # (B, T, 3C): q, k, v are consecutive C-wide slices
    head h uses columns h*hs:(h+1)*hs of each, hs = C / n_head
    att = softmax(q k^T / sqrt(hs) + mask)    # (B, nh, T, T), mask = -inf above the diagonal
    y = att v                                 # (B, nh, T, hs), heads concatenated back in order
    out = y @ W_proj + b_proj                 # (B, T, C)

The core runs over blocks of `block` query rows: rows i0..i1 see keys 0..i1 only, so the
scores above the diagonal are never computed (about half of them at long T), and no (T, T)
matrix is ever materialised. The forward keeps each row's log-sum-exp; backward recomputes the
probabilities from it (keeping them instead when they are small, `keep_probs_max_bytes`), and
uses rowsum(dP * P) = rowsum(dY * Y) so the softmax backward needs no extra product over keys.
`forward_kv` is the inference path for sampling: it appends to a key/value cache so each new
token costs one row of attention instead of re-running the whole sequence.
"""

import math

import numpy as np

from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.parallel import parallel_for

_mask_cache = {}


def causal_mask(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above; cached per size and dtype."""
    key = (xp.__name__, T, np.dtype(dtype).str)
    if key not in _mask_cache:
        _mask_cache[key] = xp.asarray(np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1))
    return _mask_cache[key]


def _per_head(fn, *arrays):
    """fn(*parts) over the leading (B * nh) matrices of same-led arrays, split over threads on NumPy."""
    xp = array_module(arrays[0])
    if xp is np and all(a.flags.c_contiguous for a in arrays):
        mats = [a.reshape(-1, *a.shape[2:]) for a in arrays]
        cost = math.prod(arrays[0].shape[2:])
        parallel_for(mats[0].shape[0], lambda s, e: fn(*(m[s:e] for m in mats)), cost_per_item=cost)
    else:
        fn(*arrays)


def block_softmax(s, i0, lse):
    """In place over scores s (B, nh, bq, i1) of query rows i0..i1 against keys 0..i1.

    Masks the diagonal block (the last bq columns), turns each row into probabilities and writes
    its log-sum-exp into lse (B, nh, bq, 1). Every row keeps its diagonal entry, so its maximum is
    finite and exp(-inf - max) is exactly 0.
    """
    xp = array_module(s)
    bq = s.shape[-2]
    mask = causal_mask(xp, bq, s.dtype)

    def rows(a, out_lse):
        a[..., i0:] += mask
        top = a.max(axis=-1, keepdims=True)
        a -= top
        xp.exp(a, out=a)
        total = a.sum(axis=-1, keepdims=True)
        a /= total
        out_lse[...] = top + xp.log(total)

    _per_head(rows, s, lse)
    return s


def block_probs_again(s, i0, lse):
    """In place: the probabilities block_softmax gave, from the same scores and its log-sum-exp."""
    xp = array_module(s)
    mask = causal_mask(xp, s.shape[-2], s.dtype)

    def rows(a, row_lse):
        a[..., i0:] += mask
        a -= row_lse
        xp.exp(a, out=a)

    _per_head(rows, s, lse)
    return s


def block_softmax_backward(dp, p, D):
    """In place: dp <- p * (dp - D), D = rowsum(dP * P) given per row (B, nh, bq, 1)."""
    def rows(d, a, dd):
        d -= dd
        d *= a

    _per_head(rows, dp, p, D)
    return dp


class CausalSelfAttention(Layer):
    block = 128                      # query rows per block
    # Probabilities up to this many bytes in all are kept from forward to backward; larger ones
    # are recomputed there from q, k and the row log-sum-exp (one more q k^T GEMM per block).
    keep_probs_max_bytes = 16 << 20

    def __init__(self, c_attn, c_proj, n_head):
        """c_attn: Linear C -> 3C; c_proj: Linear C -> C; n_head must divide C."""
        C = c_proj.W.shape[0]
        if C % n_head:
            raise ValueError(f"d_model {C} is not divisible by n_head {n_head}")
        self.c_attn, self.c_proj, self.n_head = c_attn, c_proj, n_head

    def _heads(self, qkv, B, T):
        """(B, T, 3C) -> three (B, nh, T, hs) views."""
        C = qkv.shape[-1] // 3
        hs = C // self.n_head
        qkv = qkv.reshape(B, T, 3, self.n_head, hs)
        return [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]

    def _blocks(self, T):
        return [(i0, min(i0 + self.block, T)) for i0 in range(0, T, self.block)]

    def forward(self, x):
        xp = array_module(x)
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        qkv = self.c_attn.forward(x)                         # (B, T, 3C)
        q, k, v = self._heads(qkv, B, T)                     # (B, nh, T, hs) each
        q = q * (1.0 / math.sqrt(hs))                        # scale q (T*hs work) rather than scores (T*T)
        k = xp.ascontiguousarray(k)
        v = xp.ascontiguousarray(v)
        kT = k.transpose(0, 1, 3, 2)
        y = xp.empty((B, nh, T, hs), dtype=x.dtype)
        blocks = self._blocks(T)
        kept_bytes = x.itemsize * B * nh * sum((i1 - i0) * i1 for i0, i1 in blocks)
        kept = [] if kept_bytes <= self.keep_probs_max_bytes else None
        lse = []                                             # per block (B, nh, bq, 1)
        for i0, i1 in blocks:
            p = xp.matmul(q[:, :, i0:i1], kT[:, :, :, :i1])   # (B, nh, bq, i1): keys 0..i1 only
            lse.append(xp.empty((B, nh, i1 - i0, 1), dtype=x.dtype))
            block_softmax(p, i0, lse[-1])
            xp.matmul(p, v[:, :, :i1], out=y[:, :, i0:i1])
            if kept is not None:
                kept.append(p)
        self._save(q, k, v, y, lse, kept)
        return self.c_proj.forward(y.transpose(0, 2, 1, 3).reshape(B, T, C))  # heads back in order

    def backward(self, dout):
        xp = array_module(dout)
        q, k, v, y, lse, kept = self._pop()
        B, nh, T, hs = q.shape
        dy = self.c_proj.backward(dout)                      # (B, T, C)
        dy = xp.ascontiguousarray(dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3))  # (B, nh, T, hs)
        dqkv = xp.zeros((B, T, 3, nh, hs), dtype=dout.dtype)
        dq = dqkv[:, :, 0].transpose(0, 2, 1, 3)             # (B, nh, T, hs) views into dqkv
        dk = dqkv[:, :, 1].transpose(0, 2, 1, 3)
        dv = dqkv[:, :, 2].transpose(0, 2, 1, 3)
        kT = k.transpose(0, 1, 3, 2)
        for n, (i0, i1) in enumerate(self._blocks(T)):
            if kept is not None:
                p = kept[n]
            else:                                            # recompute: p = softmax(q k^T + mask)
                p = block_probs_again(xp.matmul(q[:, :, i0:i1], kT[:, :, :, :i1]), i0, lse[n])
            dyb = dy[:, :, i0:i1]
            # softmax backward needs rowsum(dP * P) = rowsum(dY * Y), since Y = P V and dP = dY V^T
            D = (dyb * y[:, :, i0:i1]).sum(axis=-1, keepdims=True)  # (B, nh, bq, 1)
            # forward was: y = p @ v
            dv[:, :, :i1] += xp.matmul(p.transpose(0, 1, 3, 2), dyb)
            dp = xp.matmul(dyb, v[:, :, :i1].transpose(0, 1, 3, 2))  # (B, nh, bq, i1)
            # forward was: p = softmax(s) per row; ds = p * (dp - rowsum(dp * p))
            ds = block_softmax_backward(dp, p, D)
            # forward was: s = (q * scale) @ k^T, with q already scaled in the cache
            dq[:, :, i0:i1] = xp.matmul(ds, k[:, :, :i1])
            dk[:, :, :i1] += xp.matmul(ds.transpose(0, 1, 3, 2), q[:, :, i0:i1])
        dq *= 1.0 / math.sqrt(hs)                            # d(q) from d(scaled q)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * nh * hs))

    def forward_kv(self, x, cache, pos):
        """Inference: x (B, T_new, C) at positions pos.., with cache = (k, v) arrays (B, nh, T_max, hs).

        Writes the new keys and values into the cache and attends over positions [0, pos + T_new).
        Keeps nothing for backward.
        """
        xp = array_module(x)
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = x.reshape(-1, C) @ self.c_attn.W + self.c_attn.b
        q, k, v = self._heads(qkv.reshape(B, T, 3 * C), B, T)
        k_cache, v_cache = cache
        k_cache[:, :, pos:pos + T] = k
        v_cache[:, :, pos:pos + T] = v
        end = pos + T
        att = xp.matmul(q * (1.0 / math.sqrt(hs)), k_cache[:, :, :end].transpose(0, 1, 3, 2))  # (B, nh, T, end)
        att[..., pos:end] += causal_mask(xp, T, att.dtype)  # new row i sits at position pos + i
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        y = xp.matmul(att, v_cache[:, :, :end]).transpose(0, 2, 1, 3).reshape(B, T, C)
        return (y.reshape(-1, C) @ self.c_proj.W + self.c_proj.b).reshape(B, T, C)
