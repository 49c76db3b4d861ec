"""The CPU backend: NumPy work split over threads, and numba kernels for the hot pieces.

`NumpyOps` overrides pieces of `minitensor.ops.Ops` and falls back to it (`super()`) for what a
kernel does not take (a dtype, a layout). Two levels, chosen once when a model is built:

    NumpyOps(numba=False)   ANDREA_CPU_KERNELS=numpy, or numba not installed: the Ops maths,
                            its rows, heads and chunks spread over minitensor's threads
    NumpyOps(numba=True)    the default with numba: compiled kernels (below) for LayerNorm,
                            GELU, the attention core, the cross-entropy, the embedding's
                            scatter-add and AdamW

Why each piece is faster here:
- NumPy runs a ufunc on one core; large ufunc calls release the GIL, so rows (LayerNorm,
  cross-entropy) and chunks (GELU, AdamW) go to a few threads (minitensor.parallel).
- A compiled kernel makes one pass over memory where NumPy makes one per operation, with the
  arithmetic in registers (minitensor.cpu: the decorator, a vectorisable float32 exp).
- Attention runs head by head, each head's blocks on one core with single-threaded BLAS, so the
  block of scores a GEMM writes is still in cache when the softmax and the next GEMM read it;
  with SciPy's BLAS reachable from numba, a head's whole core is one compiled call.

Each override is checked against the Ops method it replaces (tests/test_cpu_kernels.py). Kernels
run in the arrays' dtype: a Python constant would promote a float32 loop to float64, so every
constant is written t(c) with t = x.dtype.type. Every reduction stays within one row or one
fixed block of rows on one thread: results are bit-reproducible at a fixed thread count.
"""

import math

import numpy as np

from minitensor import cpu
from minitensor.ops import GELU_A, GELU_C, AttentionCache, Ops, heads_of
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


class NumpyOps(Ops):
    def __init__(self, numba=True):
        super().__init__(np)
        self.numba = bool(numba) and cpu.numba is not None
        self.name = "numba" if self.numba else "numpy"
        if self.numba:
            self.kernels_line = "kernels: numba-compiled CPU kernels (ANDREA_CPU_KERNELS=numpy for NumPy alone)"
        else:
            self.kernels_line = "kernels: NumPy (pip install -e '.[fast]' adds numba's compiled CPU kernels)"

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
        return np.einsum("ij,ij->i", a, b)

    def col_dot(self, a, b):
        return np.einsum("ij,ij->j", a, b)

    def fill_zero(self, a):
        # one thread's memset cannot fill the memory bandwidth (BENCHMARKS.md, "The CPU kernels")
        parallel_for(a.size, lambda s, e: a.reshape(-1)[s:e].fill(0), min_work=1 << 20)

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

    def bias_grad(self, dy):
        """A GEMV (ones @ dy): multi-threaded BLAS, 2-5x NumPy's axis-0 sum at these sizes."""
        return np.ones(dy.shape[0], dtype=dy.dtype) @ dy

    # --- LayerNorm ---

    def layernorm_forward(self, x, w, b, eps):
        if not (self.numba and _floats(x, w, b)):
            return super().layernorm_forward(x, w, b, eps)
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
            return super().layernorm_backward(dy, x, mean, rstd, w, dw, db, dres)
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

    # --- GELU ---

    def gelu_forward(self, x):
        if self.numba and _floats(x) and x.ndim >= 1 and x.size:
            return self._gelu_forward_cpu(x, None)
        y = np.empty_like(x)
        self._chunks(lambda xs, ys: np.copyto(ys, super(NumpyOps, self).gelu_forward(xs)), x, y)
        return y

    def bias_gelu_forward(self, x, b):
        if self.numba and _floats(x, b) and x.ndim >= 1 and x.size and b.shape == x.shape[-1:]:
            return self._gelu_forward_cpu(x, b)
        return super().bias_gelu_forward(x, b)

    def gelu_backward(self, x, dy, recompute_output=False):
        if self.numba and _floats(x, dy) and x.ndim >= 1 and x.size and dy.shape == x.shape:
            dx = np.empty_like(x)
            C = x.shape[-1]
            x2, dy2, dx2 = x.reshape(-1, C), dy.reshape(-1, C), dx.reshape(-1, C)
            parallel_for(x2.shape[0], lambda s, e: gelu_backward_cpu(x2[s:e], dy2[s:e], dx2[s:e], recompute_output),
                         cost_per_item=C)
            return (dx, x) if recompute_output else dx   # with recompute_output, x now holds GELU(x)
        dx = np.empty_like(x)
        self._chunks(lambda xs, dys, dxs: np.copyto(dxs, super(NumpyOps, self).gelu_backward(xs, dys)), x, dy, dx)
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
        if dense or not (self.numba and y4.dtype in (np.float32, np.float64) and cpu.blas_in_kernels()):
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
        return AttentionCache(q, k, v, y4, lse, kept, block, self._attention_backward_cpu)

    def _attention_backward_cpu(self, dy4, cache, grads4):
        q, k, v, y4, lse, kept, block = cache[:7]
        BH, T, hs = q.shape
        scale = q.dtype.type(1.0 / math.sqrt(hs))
        no_probs = np.empty(0, q.dtype)

        def heads(s, e):
            for h in range(s, e):
                dq, dk, dv = (heads_of(g, h, h + 1)[0] for g in grads4)
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

    def softmax_rows_per_block(self, N, V):
        return max(1, ROWS_IN_CACHE // V)

    def softmax_xent_forward(self, z, t, inplace=False):
        """With numba, each row's exp, sum and scaling in one kernel while its V values sit in
        cache; the row maxima from NumPy's SIMD max (a compiled max loop is one compare per cycle)."""
        if not (self.numba and _floats(z) and z.dtype.kind == "f"):
            return super().softmax_xent_forward(z, t, inplace)
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

    def adamw_decay_layout(self, params, decays):
        """(starts, stops, decayed) of pieces of at most CHUNK elements, tensor by tensor: a scalar
        decay factor per piece instead of a buffer-sized mask, and the padding never touched."""
        pieces = []
        for name, shape in params.shapes.items():
            start, size = params.offsets[name], math.prod(shape)
            flag = bool(decays(name, shape))
            pieces += [(s, min(s + CHUNK, start + size), flag) for s in range(start, start + size, CHUNK)]
        return tuple(np.array(col, dtype=np.int64) for col in zip(*pieces)) if pieces else \
            tuple(np.empty(0, np.int64) for _ in range(3))

    def adamw_step(self, p, g, m, v, layout, b1, b2, grad_scale, step_size, eps_hat, decay):
        """numba: one pass reading g, m, v, p once and writing m, v, p once per element; NumPy: the
        Ops update over the cache-sized pieces, spread over the threads."""
        starts, stops, decayed = layout
        if self.numba and _floats(p, g, m, v):
            t = p.dtype.type                                 # Python floats would make the kernel float64
            scalars = (t(b1), t(b2), t(grad_scale), t(step_size), t(eps_hat), t(decay))
            parallel_for(len(starts), lambda s, e: adamw_cpu(p, g, m, v, starts[s:e], stops[s:e], decayed[s:e],
                                                             *scalars), min_work=0)
            return
        args = (b1, b2, float(grad_scale), step_size, eps_hat)

        def run(first, last):
            w = np.empty(CHUNK, p.dtype)
            for s, e, d in zip(starts[first:last].tolist(), stops[first:last].tolist(), decayed[first:last].tolist()):
                self.adamw_update(p[s:e], g[s:e], m[s:e], v[s:e], w[:e - s], *args, 1.0 - decay if d else 1.0)

        parallel_for(len(starts), run, min_work=0)


# ---------------------------------------------------------------------------------------------
# The numba kernels, each the compiled form of the Ops method named in its docstring.


@cpu.kernel()
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
@cpu.kernel(contract=False)
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


@cpu.kernel()
def gelu_forward_cpu(x, b, add_bias, y):
    """Ops.gelu_forward (Ops.bias_gelu_forward if add_bias: x += b in place first); x, y (N, C), b (C,)."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * GELU_C), t(-2 * GELU_A * GELU_C), t(1)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            if add_bias:
                xi += b[j]
                x[i, j] = xi
            y[i, j] = xi / (one + cpu.exp(xi * (m2c + m2ac * xi * xi)))  # x sigmoid(2u); exp = inf gives -0


@cpu.kernel()
def gelu_backward_cpu(x, dy, dx, output):
    """Ops.gelu_backward: x, dy, dx (N, C); sig = sigmoid(2u), GELU'(x) = sig (1 + (1 - sig) 2 x du/dx).
    With output, x is overwritten by GELU(x) = x sig, from the same sig."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * GELU_C), t(-2 * GELU_A * GELU_C), t(1)
    c2, ac6 = t(2 * GELU_C), t(6 * GELU_A * GELU_C)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            sig = one / (one + cpu.exp(xi * (m2c + m2ac * xi * xi)))
            dx[i, j] = dy[i, j] * sig * (one + (one - sig) * xi * (c2 + ac6 * xi * xi))
            if output:
                x[i, j] = xi * sig


@cpu.kernel()
def block_exp_cpu(s, i0, lse, total, normalise):
    """Ops.block_exp (block_softmax with normalise): s (n, bq, i1) in place; lse, total (n, bq).
    The row's maximum, its exp and its scaling are passes over a row in L1; the mask is the loop bound."""
    n, bq, i1 = s.shape
    for h in range(n):
        for r in range(bq):
            m, acc = cpu.causal_exp_row(s[h, r], min(i0 + r + 1, i1), normalise)
            lse[h, r] = m + np.log(acc)
            total[h, r] = acc


@cpu.kernel()
def block_probs_again_cpu(s, i0, lse):
    """Ops.block_probs_again: s (n, bq, i1) in place, lse (n, bq): exp(s - lse), 0 where masked."""
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
    """Ops.block_softmax_backward: dp, p (n, bq, i1), D (n, bq): dp <- p * (dp - D) in place."""
    n, bq, i1 = dp.shape
    for h in range(n):
        for r in range(bq):
            d = D[h, r]
            for j in range(i1):
                dp[h, r, j] = p[h, r, j] * (dp[h, r, j] - d)


@cpu.kernel()
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


@cpu.kernel()
def softmax_rows_cpu(p, top, N, logsumexp):
    """Ops.softmax_xent_forward's rows: p (n, V) holding the logits z, top (n,) their row maxima,
    logsumexp (n,): in place, p = softmax(z) / N per row, and logsumexp = log(sum(exp(z - top))) + top."""
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


@cpu.kernel()
def scatter_add_rows_cpu(dW, idx, rows, c0, c1):
    """Ops.scatter_add_rows over columns c0..c1: dW (V, C), idx (n,), rows (n, C)."""
    for i in range(idx.shape[0]):
        dst, src = dW[idx[i], c0:c1], rows[i, c0:c1]        # views indexed from 0 vectorise
        for j in range(dst.size):
            dst[j] += src[j]


@cpu.kernel()
def adamw_cpu(p, g, m, v, starts, stops, decayed, b1, b2, grad_scale, step_size, eps_hat, decay):
    """Ops.adamw_update over pieces [starts[k], stops[k]) of the flat p, g, m, v (decayed[k] 0 or 1)."""
    t = p.dtype.type
    one = t(1)
    for k in range(starts.size):
        keep = one - decay if decayed[k] else one           # decoupled weight decay
        # views of the piece, indexed from 0: an index numba cannot prove >= 0 costs a
        # wrap-around check per element, which stops LLVM from vectorising the loop
        s, e = starts[k], stops[k]
        pk, gk, mk, vk = p[s:e], g[s:e], m[s:e], v[s:e]
        for i in range(pk.size):
            gi = gk[i] * grad_scale
            mi = b1 * mk[i] + (one - b1) * gi
            vi = b2 * vk[i] + (one - b2) * gi * gi
            mk[i] = mi
            vk[i] = vi
            pk[i] = pk[i] * keep - step_size * mi / (np.sqrt(vi) + eps_hat)
