"""Causal multi-head self-attention with a fused qkv projection (GPT-2's layout, SPEC 1).

    qkv = x @ W_attn + b_attn                 # (B, T, 3C): q, k, v are consecutive C-wide slices
    head h uses columns h*hs:(h+1)*hs of each, hs = C / n_head
    att = softmax(q k^T / sqrt(hs) + mask)    # (B, nh, T, T), mask = -inf above the diagonal
    y = att v                                 # (B, nh, T, hs), heads concatenated back in order
    out = y @ W_proj + b_proj                 # (B, T, C)

The forward caches q, k, v and the attention probabilities; backward differentiates the softmax
with the probabilities alone (masked entries are exactly 0 there, so they get no gradient).
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
        m = np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1)
        _mask_cache[key] = xp.asarray(m)
    return _mask_cache[key]


def causal_softmax(att, lse=None):
    """Row softmax of (..., T, T) scores with position t attending to positions <= t only.

    In place; if lse (..., T, 1) is given, each row's log-sum-exp is written into it, from which
    `causal_softmax_again` recomputes the same probabilities later. The mask is added (one
    broadcast pass) rather than assigned through a boolean index, which NumPy executes as a slow
    scatter. Every row keeps its diagonal entry, so the row maximum is finite and
    exp(-inf - max) is exactly 0.
    """
    xp = array_module(att)
    mask = causal_mask(xp, att.shape[-1], att.dtype)

    def softmax(a, out_lse):
        a += mask
        top = a.max(axis=-1, keepdims=True)
        a -= top
        xp.exp(a, out=a)
        total = a.sum(axis=-1, keepdims=True)
        a /= total
        if out_lse is not None:
            out_lse[...] = top + xp.log(total)

    _over_matrices(att, lse, softmax)
    return att


def causal_softmax_again(scores, lse):
    """In place: the probabilities causal_softmax gave, from the same scores and its log-sum-exp."""
    xp = array_module(scores)
    mask = causal_mask(xp, scores.shape[-1], scores.dtype)

    def again(s, row_lse):
        s += mask
        s -= row_lse
        xp.exp(s, out=s)

    _over_matrices(scores, lse, again)
    return scores


def _over_matrices(att, lse, fn):
    """fn(att part, lse part) over the (B * nh) matrices, split over threads on NumPy."""
    xp = array_module(att)
    if xp is np and att.flags.c_contiguous:
        mats = att.reshape(-1, *att.shape[-2:])
        rows = None if lse is None else lse.reshape(-1, att.shape[-2], 1)
        parallel_for(mats.shape[0], lambda s, e: fn(mats[s:e], None if rows is None else rows[s:e]),
                     cost_per_item=att.shape[-1] * att.shape[-2])
    else:
        fn(att, lse)


def _softmax_backward(datt, att):
    """In place: datt <- att * (datt - rowsum(datt * att)), split over threads on NumPy."""
    xp = array_module(att)

    def rows(d, a):
        d -= (d * a).sum(axis=-1, keepdims=True)
        d *= a

    if xp is np and datt.flags.c_contiguous and att.flags.c_contiguous:
        T = att.shape[-1]
        d2, a2 = datt.reshape(-1, T), att.reshape(-1, T)
        parallel_for(d2.shape[0], lambda s, e: rows(d2[s:e], a2[s:e]), cost_per_item=T)
    else:
        rows(datt, att)


class CausalSelfAttention(Layer):
    # Probabilities (B, nh, T, T) larger than this are not kept from forward to backward but
    # recomputed there from q, k and each row's log-sum-exp: one more q k^T GEMM instead of
    # 4 B nh T^T bytes per layer (48 MiB a layer for ANDREA-120M at T = 1024).
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

    def forward(self, x):
        xp = array_module(x)
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = self.c_attn.forward(x)                         # (B, T, 3C)
        q, k, v = self._heads(qkv, B, T)                     # (B, nh, T, hs) each
        q = q * (1.0 / math.sqrt(hs))                        # scale q (T*hs work) rather than att (T*T)
        att = xp.matmul(q, k.transpose(0, 1, 3, 2))          # (B, nh, T, T)
        keep = att.nbytes <= self.keep_probs_max_bytes
        lse = None if keep else xp.empty((B, self.n_head, T, 1), dtype=att.dtype)
        causal_softmax(att, lse)
        y = xp.matmul(att, v)                                # (B, nh, T, hs)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)         # heads back in order
        self._save(q, k, v, att if keep else None, lse)
        return self.c_proj.forward(y)

    def backward(self, dout):
        xp = array_module(dout)
        q, k, v, att, lse = self._pop()
        B, nh, T, hs = q.shape
        if att is None:                                      # recompute: att = softmax(q k^T + mask)
            att = causal_softmax_again(xp.matmul(q, k.transpose(0, 1, 3, 2)), lse)
        dy = self.c_proj.backward(dout)                      # (B, T, C)
        dy = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        # forward was: y = att @ v
        datt = xp.matmul(dy, v.transpose(0, 1, 3, 2))        # (B, nh, T, T)
        dv = xp.matmul(att.transpose(0, 1, 3, 2), dy)        # (B, nh, T, hs)
        # forward was: att = softmax(s) per row; ds = att * (datt - sum(datt * att))
        _softmax_backward(datt, att)
        del att
        # forward was: s = (q * scale) @ k^T, with q already scaled in the cache
        dq = xp.matmul(datt, k)                              # d(scaled q)
        dq *= 1.0 / math.sqrt(hs)
        dk = xp.matmul(datt.transpose(0, 1, 3, 2), q)
        del datt
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dout.dtype)
        for i, d in enumerate((dq, dk, dv)):
            dqkv[:, :, i] = d.transpose(0, 2, 1, 3)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * nh * hs))

    def forward_kv(self, x, cache, pos):
        """Inference: x (B, T_new, C) at positions pos.., with cache = (k, v) arrays (B, nh, T_max, hs).

        Writes the new keys and values into the cache and attends over positions [0, pos + T_new).
        Keeps nothing for backward.
        """
        xp = array_module(x)
        B, T, C = x.shape
        hs = C // self.n_head
        W, b = self.c_attn.W, self.c_attn.b
        qkv = x.reshape(-1, C) @ W + b
        q, k, v = self._heads(qkv.reshape(B, T, 3 * C), B, T)
        k_cache, v_cache = cache
        k_cache[:, :, pos:pos + T] = k
        v_cache[:, :, pos:pos + T] = v
        end = pos + T
        att = xp.matmul(q * (1.0 / math.sqrt(hs)), k_cache[:, :, :end].transpose(0, 1, 3, 2))  # (B, nh, T, end)
        if T > 1:  # new row i sits at position pos + i and sees keys 0..pos + i
            hidden = np.arange(end)[None, :] > (pos + np.arange(T))[:, None]
            att[..., xp.asarray(hidden)] = -xp.inf
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        y = xp.matmul(att, v_cache[:, :, :end]).transpose(0, 2, 1, 3).reshape(B, T, C)
        return (y.reshape(-1, C) @ self.c_proj.W + self.c_proj.b).reshape(B, T, C)
