"""The CPU backend's numba kernels, each the compiled form of the Ops method named in its docstring.

NumpyOps (minitensor/backends/numpy_ops.py) calls them over blocks of rows or heads on minitensor's
threads; minitensor/backends/numba_jit.py compiles them (`@numba_jit.kernel()`), or, without
numba, leaves them plain Python that nothing calls. Each runs in its arrays' dtype: a Python
constant would promote a float32 loop to float64, so every constant is written t(c) with
t = x.dtype.type.
"""


import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.ops import GELU_A, GELU_C


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


@numba_jit.kernel()
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
            y[i, j] = xi / (one + numba_jit.exp(xi * (m2c + m2ac * xi * xi)))  # x sigmoid(2u); exp = inf gives -0


@numba_jit.kernel()
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
            sig = one / (one + numba_jit.exp(xi * (m2c + m2ac * xi * xi)))
            dx[i, j] = dy[i, j] * sig * (one + (one - sig) * xi * (c2 + ac6 * xi * xi))
            if output:
                x[i, j] = xi * sig


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


@numba_jit.kernel()
def scatter_add_rows_cpu(dW, idx, rows, c0, c1):
    """Ops.scatter_add_rows over columns c0..c1: dW (V, C), idx (n,), rows (n, C)."""
    for i in range(idx.shape[0]):
        dst, src = dW[idx[i], c0:c1], rows[i, c0:c1]        # views indexed from 0 vectorise
        for j in range(dst.size):
            dst[j] += src[j]


@numba_jit.kernel()
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
