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
b_attn is added by the copies that make each head's q, k, v contiguous, and a block's residual
(`forward(x, residual=r)`) in c_proj's epilogue, so neither costs a pass of its own.
On CuPy, when the probabilities of all heads fit a budget of GPU memory (`dense_max_bytes`,
a 64th of the device's memory per layer: 2.2 GB on an H200, where ANDREA-120M at 8 x 1024 needs
384 MiB), the core is instead one batched GEMM per product over the contiguous (B*nh, T, hs)
operands, with no loop over query blocks and the probabilities kept for backward; every
(T, T) operand is used as stored (backward computes dv^T = dy^T p and dk^T = q^T ds, so only the
small (T, hs) operands are transposed), and the causal softmax is the fused kernel pair
'causal_softmax_fwd'/'_bwd' when the piece `causal_softmax` is in use (minitensor.cuda).
`forward_kv` is the inference path for sampling: it appends to a key/value cache so each new
token costs one row of attention instead of re-running the whole sequence.

On NumPy each thread takes one head at a time through all its query blocks, so the block of
scores a GEMM writes is still in that core's cache when the softmax and the next GEMM read it;
the head's q, k, v copies and its share of c_attn's gradient are made in the same thread. With
numba (minitensor.cpu) and SciPy, a head's whole core is one compiled call,
`attention_forward_cpu` / `attention_backward_cpu` below: the same blocks, the GEMMs through
np.dot (BLAS), the softmax rows in between, no Python and no GIL from a head's first block to
its last. With numba alone, the Python block loop runs, and the row-wise work between its GEMMs
runs in `block_exp_cpu` (each row's maximum, exp, sum and scaling, with the causal mask as the
loop's bound), `block_probs_again_cpu` and `block_softmax_backward_cpu`.
"""

import math

import numpy as np

from minitensor import cpu, cuda
from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.linear import Linear
from minitensor.parallel import blas_single_threaded, parallel_for
from minitensor.softmax import exp_rows

_mask_cache = {}


def causal_mask(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above; cached per size and dtype."""
    key = (xp.__name__, T, np.dtype(dtype).str)
    if key not in _mask_cache:
        _mask_cache[key] = xp.asarray(np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1))
    return _mask_cache[key]


def block_exp(s, i0, lse):
    """In place over scores s (..., bq, i1) of query rows i0..i1 against keys 0..i1.

    Masks the diagonal block (the last bq columns), replaces each row by exp(row - max), writes
    its log-sum-exp into lse (..., bq, 1) and returns the row sums (..., bq, 1) (exp_rows): the
    probabilities are s / sums. Every row keeps its diagonal entry, so its maximum is finite and
    exp(-inf - max) is exactly 0.
    """
    if _fast(s, lse):
        total = np.empty(lse.shape, s.dtype)
        block_exp_cpu(s, i0, lse[:, :, 0], total[:, :, 0], False)
        return total
    xp = array_module(s)
    s[..., i0:] += causal_mask(xp, s.shape[-2], s.dtype)
    total, row_lse = exp_rows(s)
    lse[...] = row_lse
    return total


def block_softmax(s, i0, lse):
    """In place: block_exp, then each row divided by its sum; returns the probabilities s."""
    if _fast(s, lse):
        block_exp_cpu(s, i0, lse[:, :, 0], np.empty(lse.shape[:2], s.dtype), True)
        return s
    s /= block_exp(s, i0, lse)
    return s


def block_probs_again(s, i0, lse):
    """In place: the probabilities block_softmax gave, from the same scores and its log-sum-exp."""
    if _fast(s, lse):
        block_probs_again_cpu(s, i0, lse[:, :, 0])
        return s
    xp = array_module(s)
    s[..., i0:] += causal_mask(xp, s.shape[-2], s.dtype)
    s -= lse
    xp.exp(s, out=s)
    return s


def block_softmax_backward(dp, p, D):
    """In place: dp <- p * (dp - D), D = rowsum(dP * P) given per row (..., bq, 1)."""
    if _fast(dp, p, D) and dp.shape == p.shape:
        block_softmax_backward_cpu(dp, p, D[:, :, 0])
        return dp
    dp -= D
    dp *= p
    return dp


def _fast(s, *others):
    """The numba kernels take s (n, bq, i1) C-contiguous (each row one contiguous run) and the
    per-row arrays (n, bq, 1) in any layout."""
    return (cpu.enabled(s, *others) and s.ndim == 3 and s.flags.c_contiguous
            and all(o.ndim == 3 and o.shape[-1] == 1 for o in others))


@cpu.kernel()
def block_exp_cpu(s, i0, lse, total, normalise):
    """s (n, bq, i1) scores of query rows i0..i0+bq against keys 0..i1, in place; lse, total (n, bq).

    Row r sees keys 0..i0+r: over those, exp(row - max) (with normalise, divided by their sum);
    the masked rest becomes 0. lse = max + log(sum), total = sum. The row's maximum, its exp
    and its scaling are passes over a row in L1; the mask is the loop bound."""
    n, bq, i1 = s.shape
    for h in range(n):
        for r in range(bq):
            m, acc = cpu.causal_exp_row(s[h, r], min(i0 + r + 1, i1), normalise)
            lse[h, r] = m + np.log(acc)
            total[h, r] = acc


@cpu.kernel()
def block_probs_again_cpu(s, i0, lse):
    """s (n, bq, i1) the same scores as block_exp_cpu saw, lse (n, bq) its log-sum-exp: in place,
    the probabilities exp(s - lse) (0 where masked)."""
    t = s.dtype.type
    n, bq, i1 = s.shape
    for h in range(n):
        for r in range(bq):
            last = i0 + r + 1
            m = lse[h, r]
            for j in range(last):
                s[h, r, j] = cpu.exp(s[h, r, j] - m)
            for j in range(last, i1):
                s[h, r, j] = t(0)


@cpu.kernel()
def block_softmax_backward_cpu(dp, p, D):
    """dp, p (n, bq, i1), D (n, bq): dp <- p * (dp - D) in place."""
    n, bq, i1 = dp.shape
    for h in range(n):
        for r in range(bq):
            d = D[h, r]
            for j in range(i1):
                dp[h, r, j] = p[h, r, j] * (dp[h, r, j] - d)


def _fused(x):
    """Whether the core runs as the fused kernels below: numba with BLAS reachable from it."""
    return cpu.enabled(x) and cpu.blas_in_kernels()


@cpu.kernel()
def attention_forward_cpu(q, k, v, y, lse, probs, block):
    """One head's causal attention, all query blocks: q (scaled), k, v (T, hs) C-contiguous;
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
            m, acc = cpu.causal_exp_row(p[r], i0 + r + 1, keep)  # normalised only if kept: backward reads p
            inv[r] = t(1) / acc
            lse[i0 + r] = m + np.log(acc)
        np.dot(p, v[:i1], yb[:bq])
        for r in range(bq):
            w = t(1) if keep else inv[r]                     # else normalise the (bq, hs) output instead
            for c in range(hs):
                y[i0 + r, c] = yb[r, c] * w


@cpu.kernel()
def attention_backward_cpu(q, k, v, y, dy, lse, probs, block, dq, dk, dv, scale):
    """The backward of attention_forward_cpu for one head: from dy (T, hs) (any layout) and the
    forward's q (scaled), k, v, y, lse and probs, writes dq, dk, dv (T, hs) (any layout); dq is
    scaled by `scale` (1/sqrt(hs): the cached q was scaled). Per block, as _backward_blocks:
    p again (kept, or q_b k^T then exp(s - lse)), dv += p^T dy_b, dp = dy_b v^T,
    ds = p (dp - D), dq_b = ds k, dk += ds^T q_b, with D = rowsum(dy y) = rowsum(dp p)."""
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
                    row[j] = cpu.exp(row[j] - m)
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


def _over_heads(xp, B, nh, fn):
    """fn(start, stop) over the B * nh heads (flat index b * nh + h), each call within one b: on
    NumPy one head at a time, the heads split over minitensor's threads, each running its small
    GEMMs on one BLAS thread (so a head's (bq, i1) block of scores stays in its core's cache from
    the GEMM that writes it to the ones that read it); on CuPy all of a sequence's heads at once."""
    if xp is not np:
        for b in range(B):
            fn(b * nh, (b + 1) * nh)
        return

    def each(start, stop):
        for h in range(start, stop):
            fn(h, h + 1)

    with blas_single_threaded():
        parallel_for(B * nh, each, min_work=0)


def _heads_of(a4, s, e):
    """The (e - s, T, hs) view of heads s..e (flat index b * nh + h, all within one b) of a
    (B, nh, T, hs) array or view."""
    nh = a4.shape[1]
    b = s // nh
    return a4[b, s - b * nh:e - b * nh]


class CausalSelfAttention(Layer):
    block = 128                      # query rows per block
    # Probabilities up to this many bytes in all are kept from forward to backward; larger ones
    # are recomputed there from q, k and the row log-sum-exp (one more q k^T GEMM per block).
    keep_probs_max_bytes = 16 << 20
    # The dense core: None chooses it on CuPy within dense_max_bytes (None: a 64th of the GPU's
    # memory); True or False forces it either way (the tests run it on NumPy in float64).
    dense = None
    dense_max_bytes = None

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

    def _split(self, qkv4, qkv, s=None, e=None):
        """Heads s..e (all heads by default) of q, k, v (contiguous (BH, T, hs) arrays) from the
        (B, nh, T, hs) views of c_attn's output: each copy adds c_attn's bias (so it costs no pass
        of its own), and q is scaled by 1/sqrt(hs) (T*hs work, rather than the scores' T*T).
        All heads are one operation per array (one launch each on CuPy)."""
        xp = array_module(qkv[0])
        b, C = self.c_attn.b, self.c_proj.W.shape[0]
        nh = self.n_head
        B, _, T, hs = qkv4[0].shape
        for i, (src, dst) in enumerate(zip(qkv4, qkv)):
            bias = None if b is None else b[i * C:(i + 1) * C].reshape(nh, 1, hs)
            if s is None:                                    # all heads, as (B, nh, T, hs)
                dst = dst.reshape(B, nh, T, hs)
            else:
                h0 = s % nh
                bias = None if bias is None else bias[h0:h0 + e - s]
                src, dst = _heads_of(src, s, e), dst[s:e]
            if bias is not None:
                xp.add(src, bias, out=dst)
            else:
                dst[...] = src
            if i == 0:
                dst *= 1.0 / math.sqrt(hs)

    def forward(self, x, residual=None):
        """out = c_proj(attention(c_attn(x))) (+ residual, added in c_proj's epilogue, if given)."""
        xp = array_module(x)
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        BH = B * nh
        qkv4 = self._heads(self.c_attn.forward(x, bias=False), B, T)  # its bias is added in _split
        q, k, v = (xp.empty((BH, T, hs), dtype=x.dtype) for _ in range(3))
        if self._use_dense(xp, BH * T * T * x.itemsize):
            self._split(qkv4, (q, k, v))
            return self._forward_dense(q, k, v, B, residual)
        if _fused(x):
            return self._forward_fused(qkv4, q, k, v, B, residual)
        # y is written with the heads already in (B, T, C) order, ready for c_proj
        y = xp.empty((B, T, C), dtype=x.dtype)
        y4 = y.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
        lse = xp.empty((BH, T, 1), dtype=x.dtype)            # each row's log-sum-exp
        blocks = self._blocks(T)
        kept_bytes = x.itemsize * BH * sum((i1 - i0) * i1 for i0, i1 in blocks)
        kept = [xp.empty((BH, i1 - i0, i1), dtype=x.dtype) for i0, i1 in blocks] \
            if kept_bytes <= self.keep_probs_max_bytes else None

        def heads(s, e):                                     # heads s..e, all query blocks
            self._split(qkv4, (q, k, v), s, e)
            yh = _heads_of(y4, s, e)
            work = xp.empty((e - s) * self.block * T, dtype=x.dtype) if kept is None else None
            for n, (i0, i1) in enumerate(blocks):
                shape = (e - s, i1 - i0, i1)
                sc = kept[n][s:e] if kept is not None else work[:math.prod(shape)].reshape(shape)
                xp.matmul(q[s:e, i0:i1], k[s:e, :i1].transpose(0, 2, 1), out=sc)  # keys 0..i1 only
                yb = yh[:, i0:i1]
                if kept is not None:
                    xp.matmul(block_softmax(sc, i0, lse[s:e, i0:i1]), v[s:e, :i1], out=yb)
                else:  # nothing keeps the probabilities: normalise the (bq, hs) output, not the (bq, i1) scores
                    total = block_exp(sc, i0, lse[s:e, i0:i1])
                    xp.matmul(sc, v[s:e, :i1], out=yb)
                    yb /= total

        _over_heads(xp, B, nh, heads)
        self._save("blocks", q, k, v, y4, lse, kept, B)
        return self.c_proj.forward(y, residual=residual)

    def backward(self, dout):
        xp = array_module(dout)
        core, q, k, v, y4, lse, kept, B = self._pop()
        BH, T, hs = q.shape
        nh = BH // B
        dy = self.c_proj.backward(dout)                      # (B, T, C)
        dy4 = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) view
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dout.dtype)
        grads4 = [dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]  # views, in c_attn's layout
        if core == "fused":
            self._backward_fused(dy4, q, k, v, y4, lse, kept, grads4)
        elif core == "dense":                                # kept = p (BH, T, T)
            dy = xp.ascontiguousarray(dy4).reshape(BH, T, hs)
            dq, dk, dv = self._backward_dense(dy, q, k, v, y4.reshape(BH, T, hs), kept)
            dq *= 1.0 / math.sqrt(hs)                        # d(q) from d(scaled q)
            for g, d in zip(grads4, (dq, dk, dv)):
                g[...] = d.reshape(B, nh, T, hs)
        else:
            self._backward_blocks(dy4, q, k, v, y4, lse, kept, grads4)
        return self.c_attn.backward(dqkv.reshape(B, T, 3 * nh * hs))

    def _backward_blocks(self, dy4, q, k, v, y4, lse, kept, grads4):
        """Into grads4 (three (B, nh, T, hs) views of c_attn's gradient): d(q), d(k), d(v)."""
        xp = array_module(q)
        BH, T, hs = q.shape
        blocks = self._blocks(T)

        def heads(s, e):                                     # heads s..e, all query blocks
            dy = _heads_of(dy4, s, e)
            dq, dk, dv = xp.empty_like(q[s:e]), xp.zeros_like(k[s:e]), xp.zeros_like(v[s:e])
            work_p = xp.empty((e - s) * self.block * T, dtype=q.dtype) if kept is None else None
            work_dp = xp.empty((e - s) * self.block * T, dtype=q.dtype)
            work_kv = xp.empty((e - s) * T * hs, dtype=q.dtype)
            # softmax backward needs D = rowsum(dP * P) per row; rowsum(dP * P) = rowsum(dY * Y)
            # since Y = P V and dP = dY V^T, which costs hs per row instead of T
            D = (dy * _heads_of(y4, s, e)).sum(axis=-1, keepdims=True)
            for n, (i0, i1) in enumerate(blocks):
                shape = (e - s, i1 - i0, i1)
                if kept is not None:
                    p = kept[n][s:e]
                else:                                        # recompute: p = softmax(q k^T + mask)
                    p = work_p[:math.prod(shape)].reshape(shape)
                    xp.matmul(q[s:e, i0:i1], k[s:e, :i1].transpose(0, 2, 1), out=p)
                    block_probs_again(p, i0, lse[s:e, i0:i1])
                dyb = dy[:, i0:i1]
                part = work_kv[:(e - s) * i1 * hs].reshape(e - s, i1, hs)  # this block's share of dk, dv
                # forward was: y = p @ v
                dv[:, :i1] += xp.matmul(p.transpose(0, 2, 1), dyb, out=part)
                dp = xp.matmul(dyb, v[s:e, :i1].transpose(0, 2, 1), out=work_dp[:math.prod(shape)].reshape(shape))
                # forward was: p = softmax(s) per row, so ds = p * (dp - D)
                ds = block_softmax_backward(dp, p, D[:, i0:i1])
                # forward was: s = (q * scale) @ k^T, with q already scaled in the cache
                xp.matmul(ds, k[s:e, :i1], out=dq[:, i0:i1])
                dk[:, :i1] += xp.matmul(ds.transpose(0, 2, 1), q[s:e, i0:i1], out=part)
            dq *= 1.0 / math.sqrt(hs)                        # d(q) from d(scaled q)
            for g, d in zip(grads4, (dq, dk, dv)):
                _heads_of(g, s, e)[...] = d

        _over_heads(xp, BH // self.n_head, self.n_head, heads)

    # --- the fused core (NumPy with numba and SciPy: minitensor.cpu) ---

    def _forward_fused(self, qkv4, q, k, v, B, residual):
        """attention_forward_cpu head by head: each head's blocks, GEMMs included, in one call."""
        BH, T, hs = q.shape
        nh = self.n_head
        y = np.empty((B, T, nh * hs), dtype=q.dtype)
        y4 = y.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
        lse = np.empty((BH, T), dtype=q.dtype)
        size = sum((i1 - i0) * i1 for i0, i1 in self._blocks(T))
        kept = np.empty((BH, size), dtype=q.dtype) if q.itemsize * BH * size <= self.keep_probs_max_bytes else None

        def heads(s, e):
            self._split(qkv4, (q, k, v), s, e)
            for h in range(s, e):
                attention_forward_cpu(q[h], k[h], v[h], _heads_of(y4, h, h + 1)[0], lse[h],
                                      np.empty(0, q.dtype) if kept is None else kept[h], self.block)

        _over_heads(np, B, nh, heads)
        self._save("fused", q, k, v, y4, lse, kept, B)
        return self.c_proj.forward(y, residual=residual)

    def _backward_fused(self, dy4, q, k, v, y4, lse, kept, grads4):
        BH, T, hs = q.shape
        scale = q.dtype.type(1.0 / math.sqrt(hs))

        def heads(s, e):
            for h in range(s, e):
                dq, dk, dv = (_heads_of(g, h, h + 1)[0] for g in grads4)
                attention_backward_cpu(q[h], k[h], v[h], _heads_of(y4, h, h + 1)[0], _heads_of(dy4, h, h + 1)[0],
                                       lse[h], np.empty(0, q.dtype) if kept is None else kept[h], self.block,
                                       dq, dk, dv, scale)

        _over_heads(np, BH // self.n_head, self.n_head, heads)

    # --- the dense core (CuPy within the budget) ---

    def _use_dense(self, xp, probs_bytes):
        if self.dense is not None:
            return self.dense
        return xp is not np and probs_bytes <= (self.dense_max_bytes or _gpu_memory(xp) // 64)

    def _forward_dense(self, q, k, v, B, residual):
        """q (scaled), k, v (BH, T, hs) contiguous: all heads in one GEMM per product."""
        xp = array_module(q)
        BH, T, hs = q.shape
        s = xp.matmul(q, k.transpose(0, 2, 1))              # (BH, T, T) scores
        if cuda.uses("causal_softmax", s):
            p = causal_softmax_forward_gpu(s, out=s)
        else:
            p = block_softmax(s, 0, xp.empty((BH, T, 1), dtype=q.dtype))
        y = xp.matmul(p, v)                                  # (BH, T, hs)
        nh = BH // B
        self._save("dense", q, k, v, y.reshape(B, nh, T, hs), None, p, B)
        y = y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B, T, nh * hs)  # heads back in order
        return self.c_proj.forward(y, residual=residual)

    def _backward_dense(self, dy, q, k, v, y, p):
        """(dq, dk, dv) of the dense core; dk and dv as transposed views of (BH, hs, T) products."""
        xp = array_module(dy)
        # forward was: y = p @ v, so dv = p^T dy, computed as dv^T = dy^T p with p read as stored
        dvT = xp.matmul(dy.transpose(0, 2, 1), p)            # (BH, hs, T)
        dp = xp.matmul(dy, v.transpose(0, 2, 1))             # (BH, T, T)
        # forward was: p = softmax(s) per row, so ds = p * (dp - D), D = rowsum(dp p) = rowsum(dy y)
        if cuda.uses("causal_softmax", dp):
            ds = causal_softmax_backward_gpu(dp, p, out=dp)
        else:
            ds = block_softmax_backward(dp, p, (dy * y).sum(axis=-1, keepdims=True))
        # forward was: s = (q * scale) @ k^T, with q already scaled in the cache
        dq = xp.matmul(ds, k)                                # (BH, T, hs)
        dkT = xp.matmul(q.transpose(0, 2, 1), ds)            # (BH, hs, T)
        return dq, dkT.transpose(0, 2, 1), dvT.transpose(0, 2, 1)

    def forward_kv(self, x, cache, pos, residual=None):
        """Inference: x (B, T_new, C) at positions pos.., with cache = (k, v) arrays (B, nh, T_max, hs).

        Writes the new keys and values into the cache and attends over positions [0, pos + T_new),
        with the training forward's layers and softmax (c_attn, c_proj through `infer`); keeps
        nothing for backward. residual as in forward.
        """
        xp = array_module(x)
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self._heads(self.c_attn.infer(x), B, T)
        k_cache, v_cache = cache
        k_cache[:, :, pos:pos + T] = k
        v_cache[:, :, pos:pos + T] = v
        end = pos + T
        att = xp.matmul(q * (1.0 / math.sqrt(hs)), k_cache[:, :, :end].transpose(0, 1, 3, 2))  # (B, nh, T, end)
        # new row i sits at position pos + i: the block of query rows pos..end against keys 0..end
        block_softmax(att, pos, xp.empty((*att.shape[:-1], 1), dtype=att.dtype))
        y = xp.matmul(att, v_cache[:, :, :end]).transpose(0, 2, 1, 3).reshape(B, T, C)
        return self.c_proj.infer(y, residual=residual)


# ---------------------------------------------------------------------------------------------
# CUDA: the causal softmax over (..., T, T) attention scores, forward, backward, recomputed


# One block per row; row r of a matrix attends to columns 0..r only (r = the row's index mod T).
# The masked columns are never read and are written as exact zeros; p may be s itself.
CAUSAL_SOFTMAX_FWD = cuda.register(cuda.RawSpec("causal_softmax_fwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void causal_softmax_fwd(const T *s, T *p, T *lse, const int n_ctx, const T scale,
                                              const int write_lse) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const int last = row % n_ctx;
  const T *sr = s + row * n_ctx;
  T *pr = p + row * n_ctx;
  T top = lowest_of(scale);
  for (int j = threadIdx.x; j <= last; j += blockDim.x) {
    const T z = scale * sr[j];
    top = z > top ? z : top;
  }
  top = block_max(top, buf);  /* finite: every row keeps its diagonal entry */
  T total = 0;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) total += exp_of(scale * sr[j] - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) pr[j] = j <= last ? exp_of(scale * sr[j] - top) / total : (T)0;
  if (write_lse && threadIdx.x == 0) lse[row] = top + log_of(total);
}
"""))

# forward was: p = softmax(z) by rows, z = scale s + mask. ds may be dp itself.
CAUSAL_SOFTMAX_BWD = cuda.register(cuda.RawSpec("causal_softmax_bwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void causal_softmax_bwd(const T *dp, const T *p, T *ds, const int n_ctx, const T scale) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const int last = row % n_ctx;
  const T *dpr = dp + row * n_ctx;
  const T *pr = p + row * n_ctx;
  T *dsr = ds + row * n_ctx;
  T dot = 0;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) dot += dpr[j] * pr[j];
  dot = block_sum(dot, buf);
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) dsr[j] = j <= last ? scale * (pr[j] * (dpr[j] - dot)) : (T)0;
}
"""))

# Elementwise: flat index i is row i / n_ctx (over all matrices), column i % n_ctx.
CAUSAL_SOFTMAX_RECOMPUTE = cuda.register(cuda.ElementwiseSpec(
    "causal_softmax_recompute", "T s, raw T lse, int32 n_ctx, T scale", "T p",
    "const unsigned int row = (unsigned int)i / (unsigned int)n_ctx;\n"
    "const unsigned int col = (unsigned int)i - row * (unsigned int)n_ctx;\n"
    "p = col <= row % (unsigned int)n_ctx ? exp(scale * s - lse[row]) : (T)0;",
    reference=lambda s, lse, n_ctx, scale: _recompute_flat(s, lse, int(n_ctx), scale),
    scalars=(("n_ctx", 6), ("scale", 0.35)),
))


def _recompute_flat(s, lse, n_ctx, scale):
    i = np.arange(s.size)
    row, col = i // n_ctx, i % n_ctx
    return np.where(col <= row % n_ctx, np.exp(scale * s - lse[row]), 0.0)


def causal_softmax_forward_gpu(s, scale=1.0, lse=None, out=None):
    """Causal row softmax of scale * s for s (..., T, T) (CuPy, contiguous), into `out` (which may
    be s) or a new array; returns p. With `lse` (T values per matrix, e.g. (..., T, 1)), each row's
    log-sum-exp is written there, for causal_softmax_recompute_gpu."""
    fn = "causal_softmax_forward_gpu"
    rows, T = cuda.square_rows(fn, s)
    p = cuda.out_like(fn, s, out)
    if lse is not None:
        cuda.row_values(fn, "lse", lse, s, rows)
    if rows:
        cuda.launch(CAUSAL_SOFTMAX_FWD, s.dtype, (rows,), (cuda.threads(T, 128),),
                (s, p, p if lse is None else lse, np.int32(T), s.dtype.type(scale), np.int32(lse is not None)))
    return p


def causal_softmax_backward_gpu(dp, p, scale=1.0, out=None):
    """ds = scale p (dp - rowsum(dp p)) for dp, p (..., T, T) (CuPy, contiguous), into `out`
    (which may be dp) or a new array; returns ds."""
    fn = "causal_softmax_backward_gpu"
    rows, T = cuda.square_rows(fn, p)
    cuda.like(fn, "dp", dp, p)
    ds = cuda.out_like(fn, p, out)
    if rows:
        cuda.launch(CAUSAL_SOFTMAX_BWD, p.dtype, (rows,), (cuda.threads(T, 128),),
                (dp, p, ds, np.int32(T), p.dtype.type(scale)))
    return ds


def causal_softmax_recompute_gpu(s, lse, scale=1.0, out=None):
    """The probabilities causal_softmax_forward_gpu gave, from the same s and its lse, into `out`
    (which may be s) or a new array."""
    fn = "causal_softmax_recompute_gpu"
    rows, T = cuda.square_rows(fn, s)
    cuda.row_values(fn, "lse", lse, s, rows)
    if s.size >= 2**31:
        raise ValueError(f"{fn}: s has {s.size} elements; at most 2**31 - 1 are supported")
    cuda.on_cupy(fn, s, "minitensor.attention.block_probs_again")
    kern = CAUSAL_SOFTMAX_RECOMPUTE.kernel()
    args = (s, lse.reshape(-1), np.int32(T), s.dtype.type(scale))
    return kern(*args) if out is None else kern(*args, cuda.out_like(fn, s, out))


_gpu_memory_bytes = {}


def _gpu_memory(xp):
    """The current GPU's total memory in bytes, asked once per device."""
    device = xp.cuda.Device()
    if device.id not in _gpu_memory_bytes:
        _gpu_memory_bytes[device.id] = device.mem_info[1]
    return _gpu_memory_bytes[device.id]


@cuda.self_check("causal_softmax")
def _self_check(xp, rng):
    """A 4-head attention layer's dense core, forward and backward, over 2 x 40 positions."""
    def draw(*shape, scale=1.0):
        return xp.asarray((scale * rng.standard_normal(shape)).astype(np.float32))

    B, T, C, nh = 2, 40, 48, 4
    grads = [xp.zeros(shape, np.float32) for shape in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    attn = CausalSelfAttention(Linear(draw(C, 3 * C, scale=0.3), grads[0], draw(3 * C), grads[1]),
                               Linear(draw(C, C, scale=0.3), grads[2], draw(C), grads[3]), nh)
    attn.dense = True
    out = attn.forward(draw(B, T, C))
    return (out, attn.backward(draw(B, T, C)), *grads)
