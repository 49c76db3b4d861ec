"""The CPU backend: NumPy work split over threads, and numba kernels for the hot pieces.

`NumpyOps` overrides pieces of `minitensor.backends.ops.Ops` (the textbook) with the same maths in
forms that run fast here, and takes the attention core over query blocks from
minitensor.backends.blocked. Two levels, chosen once when a model is built:

    NumpyOps(numba=False)   ANDREA_CPU_KERNELS=numpy, or numba not installed: the maths in NumPy,
                            in place where it can be, its rows, heads and chunks spread over
                            minitensor's threads; GELU in its sigmoid form (one exp, no tanh)
    NumpyOps(numba=True)    the default with numba: compiled kernels (below) for LayerNorm,
                            GELU, the attention core, the cross-entropy, the embedding's
                            scatter-add and AdamW

Why each piece is faster here:
- NumPy runs a ufunc on one core; large ufunc calls release the GIL, so rows (LayerNorm,
  cross-entropy) and chunks (GELU, AdamW) go to a few threads (minitensor.parallel).
- A compiled kernel makes one pass over memory where NumPy makes one per operation, with the
  arithmetic in registers (minitensor.backends.numba_jit: the decorator, a vectorisable float32 exp).
- Attention runs head by head, each head's blocks on one core with single-threaded BLAS, so the
  block of scores a GEMM writes is still in cache when the softmax and the next GEMM read it;
  with SciPy's BLAS reachable from numba, a head's whole core is one compiled call.

Each override is checked against the Ops method it replaces (tests/engine/test_cpu_kernels.py). Kernels
run in the arrays' dtype: a Python constant would promote a float32 loop to float64, so every
constant is written t(c) with t = x.dtype.type. Every reduction stays within one row or one
fixed block of rows on one thread: results are bit-reproducible at a fixed thread count.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.blocked import BlockedAttention, heads_of
from minitensor.backends.numba_kernels import (
    adamw_cpu,
    attention_backward_cpu,
    attention_forward_cpu,
    block_exp_cpu,
    block_probs_again_cpu,
    block_softmax_backward_cpu,
    gelu_backward_cpu,
    gelu_forward_cpu,
    layernorm_backward_cpu,
    layernorm_forward_cpu,
    scatter_add_rows_cpu,
    softmax_rows_cpu,
)
from minitensor.backends.ops import Ops
from minitensor.backends.softmax import exp_rows
from minitensor.backends.tricks import GELU_AC, GELU_AC3, GELU_C, FreshGrads, adamw_scalars, adamw_update
from minitensor.parallel import blas_single_threaded, parallel_for

EPILOGUE_BLOCK = 1 << 15  # elements of y per row block of a Linear's epilogue (128 KiB of float32)
CHUNK = 1 << 16           # elements per elementwise chunk (GELU, AdamW): its operands stay in cache
ROWS_IN_CACHE = 1 << 18   # elements per block of the cross-entropy's rows (1 MiB of float32)
LN_ROW_BLOCK = 32         # rows per partial sum of LayerNorm's dw and db in the kernel
# Below this many elements the LayerNorm kernels run on the calling thread. At 1024 x 768 (120m)
# two threads beat one, with the input in the cores' caches as it is between the layers of a step
# (BENCHMARKS.md, "The CPU kernels").
LN_MIN_WORK = 1 << 16


def _floats(*arrays):
    """The kernels take C-contiguous float32/float64 NumPy arrays of one dtype."""
    return all(isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64) and a.flags.c_contiguous
               and a.dtype == arrays[0].dtype for a in arrays)


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


class NumpyOps(BlockedAttention, Ops):
    def __init__(self, numba=True):
        super().__init__(np)
        self._fresh = FreshGrads()        # the gradient views a GEMM may write (linear_weight_grads)
        self._pieces = (None, None)       # AdamW's decay mask and its pieces (adamw_step)
        self.mask_dtype = np.uint8        # that mask: adamw_step reads only where it changes (92 MB at 120m, not 369)
        self.numba = bool(numba) and numba_jit.numba is not None
        self.name = "numba" if self.numba else "numpy"
        self.kernels_line = ("kernels: numba-compiled CPU kernels (ANDREA_CPU_KERNELS=numpy for NumPy alone)"
                             if self.numba else
                             "kernels: NumPy (pip install -e '.[fast]' adds numba's compiled CPU kernels)")

    # --- threads ---

    def over_rows(self, n, fn, cost_per_item=1):
        parallel_for(n, fn, cost_per_item=cost_per_item)

    def over_heads(self, B, n_head, fn):
        """One head at a time, the heads split over the threads, each running its small GEMMs on
        one BLAS thread (two small GEMMs on a core each beat one on two cores woken per call)."""
        def each(start, stop):
            for h in range(start, stop):
                fn(h, h + 1)

        with blas_single_threaded():
            parallel_for(B * n_head, each, min_work=0)

    def row_dot(self, a, b):
        """sum(a * b) over the last axis, (N, C) -> (N,)."""
        return np.einsum("ij,ij->i", a, b)

    def col_dot(self, a, b):
        """sum(a * b) over the rows, (N, C) -> (C,)."""
        return np.einsum("ij,ij->j", a, b)

    def fill_zero(self, a):
        # one thread's memset cannot fill the memory bandwidth (BENCHMARKS.md, "The CPU kernels")
        parallel_for(a.size, lambda s, e: a.reshape(-1)[s:e].fill(0), min_work=1 << 20)
        self._fresh.zeroed(a)

    # --- Linear ---

    def add_epilogue(self, y, b=None, r=None):
        """In cache-sized row blocks over the threads: 2-5x NumPy's one-thread broadcast add."""
        if b is None and r is None:
            return
        rows = max(1, EPILOGUE_BLOCK // max(1, y.shape[1]))

        def blocks(s, e):
            for i in range(s, e, rows):
                yb = y[i:min(i + rows, e)]
                if b is not None:
                    yb += b
                if r is not None:
                    yb += r[i:min(i + rows, e)]

        parallel_for(y.shape[0], blocks, cost_per_item=y.shape[1])

    def linear_weight_grads(self, x, dy, dW, db):
        """dW += x^T dy, db += sum_n dy; the first time after fill_zero (FreshGrads), the GEMM writes
        dW itself instead of a temporary that is then added."""
        write = self._fresh.take(dW)
        if write:
            np.matmul(x.T, dy, out=dW)
        else:
            dW += x.T @ dy
        if db is not None:
            if write:
                db[...] = self.bias_grad(dy)
            else:
                db += self.bias_grad(dy)

    def bias_grad(self, dy):
        """A GEMV (ones @ dy): multi-threaded BLAS, 2-5x NumPy's axis-0 sum at these sizes."""
        return np.ones(dy.shape[0], dtype=dy.dtype) @ dy

    # --- LayerNorm ---

    def layernorm_forward(self, x, w, b, eps):
        if not (self.numba and _floats(x, w, b)):
            return self._layernorm_forward_rows(x, w, b, eps)
        N, C = x.shape
        y = np.empty_like(x)
        mean = np.empty((N, 1), dtype=x.dtype)
        rstd = np.empty((N, 1), dtype=x.dtype)
        e = x.dtype.type(eps)
        parallel_for(N, lambda s, f: layernorm_forward_cpu(x[s:f], w, b, e, y[s:f], mean[s:f], rstd[s:f]),
                     cost_per_item=C, min_work=LN_MIN_WORK)
        return y, mean, rstd

    def layernorm_backward(self, dy, x, mean, rstd, w, dw, db, dres=None):
        if not (self.numba and _floats(x, dy, w) and (dres is None or _floats(x, dres))):
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

    # --- GELU ---
    #
    # Written through 0.5 (1 + tanh u) = sigmoid(2u), one exp instead of a tanh:
    #   sig = 1 / (1 + exp(-2u)),  y = x sig
    #   dy/dx = sig + x sig (1 - sig) 2 du/dx = sig (1 + (1 - sig) 2 x du/dx),
    #   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    # For x below about -10, exp(-2u) overflows to inf: y = x / inf = -0 and dx = 0, as they should.

    @staticmethod
    def _gelu_sigmoid(x):
        with np.errstate(over="ignore"):
            e = np.exp(x * (x * x * (-2.0 * GELU_AC) - 2.0 * GELU_C))   # exp(-2u)
        return x / (1.0 + e)

    @staticmethod
    def _gelu_backward_sigmoid(x, dy):
        x2 = x * x
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + np.exp(x * (x2 * (-2.0 * GELU_AC) - 2.0 * GELU_C)))
        two_x_du = x * (x2 * (2.0 * GELU_AC3) + 2.0 * GELU_C)                # 2 x du/dx
        return ((1.0 - sig) * two_x_du + 1.0) * sig * dy

    def gelu_forward(self, x):
        if self.numba and _floats(x) and x.ndim >= 1 and x.size:
            return self._gelu_forward_cpu(x, None)
        y = np.empty_like(x)
        self._chunks(lambda xs, ys: np.copyto(ys, self._gelu_sigmoid(xs)), x, y)
        return y

    def bias_gelu_forward(self, x, b):
        if self.numba and _floats(x, b) and x.ndim >= 1 and x.size and b.shape == x.shape[-1:]:
            return self._gelu_forward_cpu(x, b)
        x += b                                               # x becomes h = x + b (bias_gelu_backward)
        return self.gelu_forward(x)

    def bias_gelu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b, which bias_gelu_forward left in x."""
        return self.gelu_backward(x, dy, recompute_output)

    def gelu_backward(self, x, dy, recompute_output=False):
        if self.numba and _floats(x, dy) and x.ndim >= 1 and x.size and dy.shape == x.shape:
            dx = np.empty_like(x)
            C = x.shape[-1]
            x2, dy2, dx2 = x.reshape(-1, C), dy.reshape(-1, C), dx.reshape(-1, C)
            parallel_for(x2.shape[0], lambda s, e: gelu_backward_cpu(x2[s:e], dy2[s:e], dx2[s:e], recompute_output),
                         cost_per_item=C)
            return (dx, x) if recompute_output else dx   # with recompute_output, x now holds GELU(x)
        dx = np.empty_like(x)
        self._chunks(lambda xs, dys, dxs: np.copyto(dxs, self._gelu_backward_sigmoid(xs, dys)), x, dy, dx)
        return (dx, self.gelu_forward(x)) if recompute_output else dx

    def _gelu_forward_cpu(self, x, b):
        """GELU(x), or x += b then GELU(x), one pass over rows of C."""
        y = np.empty_like(x)
        C = x.shape[-1]
        bias = b if b is not None else np.zeros(C, x.dtype)
        x2, y2 = x.reshape(-1, C), y.reshape(-1, C)
        parallel_for(x2.shape[0], lambda s, e: gelu_forward_cpu(x2[s:e], bias, b is not None, y2[s:e]),
                     cost_per_item=C)
        return y

    def _chunks(self, fn, *arrays):
        """fn over matching CHUNK-element pieces of same-shape arrays (whose temporaries then stay
        in cache: BENCHMARKS.md, "The CPU kernels"), spread over the threads; whole arrays when they are
        not all C-contiguous."""
        size = arrays[0].size
        if size <= CHUNK or not all(a.flags.c_contiguous for a in arrays):
            fn(*arrays)
            return
        flat = [a.reshape(-1) for a in arrays]

        def run(first, last):
            for start in range(first * CHUNK, min(last * CHUNK, size), CHUNK):
                fn(*[f[start:start + CHUNK] for f in flat])

        parallel_for(-(-size // CHUNK), run, min_work=0)

    # --- the attention core ---

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """With numba and SciPy's BLAS reachable from it, each head's whole core (its blocks,
        GEMMs included) is one compiled call, attention_forward_cpu."""
        if dense or not (self.numba and y4.dtype in (np.float32, np.float64) and numba_jit.blas_in_kernels()):
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
        return (self.numba and _floats(s) and s.ndim == 3
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

    # --- softmax cross-entropy ---

    def softmax_xent_forward(self, z, t, inplace=False):
        """(loss, softmax(z) / N): the probabilities kept already divided by N (backward's scale),
        over z with inplace. With numba, each row's exp, sum and scaling in one kernel while its V
        values sit in cache; the row maxima from NumPy's SIMD max (a compiled max loop is one
        compare per cycle). Without, blocks of rows that stay in cache for all passes."""
        if not (self.numba and _floats(z) and z.dtype.kind == "f"):
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

    # --- embedding ---

    def scatter_add_rows(self, dW, idx, rows):
        """numba: the rows added one by one in token order, the columns split over the threads (each
        element's sum in the same order whatever the thread count). NumPy: sort the ids, sum each
        run of equal ids with one reduceat, add the sums to distinct rows (much faster than add.at)."""
        if self.numba and _floats(dW, rows) and dW.ndim == 2:
            ids = idx.astype(np.int64, copy=False)
            # 1024 rows of 768 take less than a thread's hand-off (BENCHMARKS.md): split only well above that
            parallel_for(dW.shape[1], lambda s, e: scatter_add_rows_cpu(dW, ids, rows, s, e),
                         cost_per_item=ids.shape[0], min_work=1 << 21)
            return
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_idx[1:] != sorted_idx[:-1])))
        sums = np.add.reduceat(rows[order], starts, axis=0)
        dW[sorted_idx[starts]] += sums

    # --- gradient clipping ---

    def global_norm(self, grads):
        """A float: the squares accumulated in float64 a million at a time, so a float32 buffer's
        norm loses nothing to its length, and no float64 copy of it is made."""
        total = 0.0
        for start in range(0, grads.size, 1 << 20):
            g = grads[start:start + (1 << 20)]
            total += float(np.dot(g, g))
        return math.sqrt(total)

    # --- AdamW ---

    def _adamw_pieces(self, decayed):
        """(starts, stops, flags) of pieces of at most CHUNK elements over the runs of equal values of
        the 0/1 decay mask: a scalar decay factor per piece instead of the mask. Kept for the last mask."""
        if self._pieces[0] is not decayed:
            flags = np.asarray(decayed) != 0
            edges = np.concatenate(([0], np.flatnonzero(flags[1:] != flags[:-1]) + 1, [flags.size]))
            pieces = [(s, min(s + CHUNK, e), bool(flags[a])) for a, e in zip(edges[:-1].tolist(), edges[1:].tolist())
                      for s in range(a, e, CHUNK)]
            self._pieces = (decayed, tuple(np.array(col, dtype=np.int64) for col in zip(*pieces)) if pieces else
                            tuple(np.empty(0, np.int64) for _ in range(3)))
        return self._pieces[1]

    def adamw_step(self, p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale=1.0):
        """numba: one pass reading g, m, v, p once and writing m, v, p once per element; NumPy: the
        update over the cache-sized pieces, spread over the threads. Both in the folded form
        (minitensor.backends.tricks.adamw_update)."""
        starts, stops, flags = self._adamw_pieces(decayed)
        step_size, eps_hat = adamw_scalars(lr, b1, b2, eps, t)
        decay = lr * weight_decay
        if self.numba and _floats(p, g, m, v):
            f = p.dtype.type                                 # Python floats would make the kernel float64
            scalars = (f(b1), f(b2), f(grad_scale), f(step_size), f(eps_hat), f(decay))
            parallel_for(len(starts), lambda s, e: adamw_cpu(p, g, m, v, starts[s:e], stops[s:e], flags[s:e],
                                                             *scalars), min_work=0)
            return
        args = (b1, b2, float(grad_scale), step_size, eps_hat)

        def run(first, last):
            w = np.empty(CHUNK, p.dtype)
            for s, e, d in zip(starts[first:last].tolist(), stops[first:last].tolist(), flags[first:last].tolist()):
                adamw_update(np, p[s:e], g[s:e], m[s:e], v[s:e], w[:e - s], *args, 1.0 - decay if d else 1.0)

        parallel_for(len(starts), run, min_work=0)
