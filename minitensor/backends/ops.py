"""The maths of every layer, written once against an array module `xp` (NumPy or CuPy).

    ops = get_ops(xp, kernels)      # minitensor.backends: chosen once, when a model is built
    y, mean, rstd = ops.layernorm_forward(x, w, b, eps)

`Ops` holds each piece in its plainest form, with the derivation beside it: the reference that
every optimised implementation is checked against. A backend subclasses it and overrides only
the pieces it speeds up, falling back to `super()` for what it does not handle (a dtype, a
layout, a size):

    minitensor.backends.numpy_ops.NumpyOps   the CPU: NumPy work split over threads, numba kernels
    minitensor.backends.cupy_ops.CupyOps     the GPU: CUDA kernels accepted by the start-up self-check

Layers hold an `ops` and call it; none of them looks at an array's type. Shapes follow the
layers: N rows of C (or V) values; B sequences of T positions; n_head heads of hs values.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from minitensor.backends.softmax import exp_rows

# GELU, the tanh approximation GPT-2 uses (Hendrycks & Gimpel 2016):
#   y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
GELU_AC = GELU_A * GELU_C              # u = x (AC x^2 + C)
GELU_AC3 = 3.0 * GELU_A * GELU_C       # du/dx = AC3 x^2 + C


class AttentionCache(NamedTuple):
    """What the attention core keeps from forward to backward, and the backward that reads it.

    q (scaled by 1/sqrt(hs)), k, v: (B*n_head, T, hs) contiguous; y4: the output as a
    (B, n_head, T, hs) view; lse: each query row's log-sum-exp; probs: the probabilities when the
    forward kept them (else None: backward recomputes them from q, k and lse)."""
    q: object
    k: object
    v: object
    y4: object
    lse: object
    probs: object
    block: int
    backward: Callable


class Ops:
    """The reference implementation of every piece, against `xp`."""

    name = "generic"

    def __init__(self, xp=np):
        self.xp = xp
        self.kernels_line = "kernels: generic (NumPy)" if xp is np else "kernels: generic"  # for the log

    def __repr__(self):
        return f"{type(self).__name__}({self.name})"

    # --- how work is spread: one piece here; a backend splits it over threads ---

    def over_rows(self, n, fn, cost_per_item=1):
        """fn(start, stop) over range(n), in parts whose rows are independent."""
        fn(0, n)

    def over_heads(self, B, n_head, fn):
        """fn(start, stop) over the B * n_head heads (flat index b * n_head + h), each call within one b."""
        for b in range(B):
            fn(b * n_head, (b + 1) * n_head)

    def row_dot(self, a, b):
        """sum(a * b) over the last axis, (N, C) -> (N,)."""
        return (a * b).sum(axis=-1)

    def col_dot(self, a, b):
        """sum(a * b) over the rows, (N, C) -> (C,)."""
        return (a * b).sum(axis=0)

    # --- Linear: y = x @ W + b (+ r) ---

    def add_epilogue(self, y, b=None, r=None):
        """In place over y (N, C): y += b (C,) and y += r (N, C), either optional."""
        if b is not None:
            y += b
        if r is not None:
            y += r

    def linear_weight_grads(self, x, dy, dW, db, write=False):
        """forward was y = x @ W + b, x (N, n_in), dy (N, n_out): dW += x^T dy, db += sum_n dy.

        With write, dW and db hold nothing to keep (just zeroed): the GEMM writes dW itself
        instead of a temporary that is then added."""
        if write:
            self.xp.matmul(x.T, dy, out=dW)
        else:
            dW += x.T @ dy
        if db is not None:
            if write:
                db[...] = self.bias_grad(dy)
            else:
                db += self.bias_grad(dy)

    def gemm(self, a, b, out, accumulate=False):
        """out = a @ b, or out += a @ b with accumulate, for 2-D a (M, K), b (K, N), out (M, N)."""
        if accumulate:
            out += a @ b
        else:
            self.xp.matmul(a, b, out=out)

    def bias_grad(self, dy):
        """sum over the rows of dy (N, C) -> (C,)."""
        return dy.sum(axis=0)

    # --- LayerNorm over rows: y = w * (x - mean) * rstd + b, rstd = 1 / sqrt(var + eps) ---

    def layernorm_forward(self, x, w, b, eps):
        """x (N, C) -> y (N, C), mean and rstd (N, 1), the biased variance (divides by C)."""
        xp = self.xp
        N, C = x.shape
        y = xp.empty_like(x)
        mean = xp.empty((N, 1), dtype=x.dtype)
        rstd = xp.empty((N, 1), dtype=x.dtype)

        def rows(s, e):
            xs, ys = x[s:e], y[s:e]
            mean[s:e] = xs.mean(axis=-1, keepdims=True)
            xp.subtract(xs, mean[s:e], out=ys)               # x - mean: centred first, no cancellation
            var = self.row_dot(ys, ys)[:, None] / C
            rstd[s:e] = 1.0 / xp.sqrt(var + eps)
            ys *= rstd[s:e]                                  # xhat
            ys *= w
            ys += b

        self.over_rows(N, rows, cost_per_item=C)
        return y, mean, rstd

    def layernorm_backward(self, dy, x, mean, rstd, w, dw, db, dres=None):
        """dx (N, C) from dy and the forward's x, mean, rstd; dw and db accumulate. dres (N, C),
        if given, is added to dx: the gradient that reaches x around the layer (a skip)."""
        xp = self.xp
        N, C = x.shape
        dx = xp.empty_like(x)
        parts = []

        def rows(s, e):
            xhat = x[s:e] - mean[s:e]                        # forward was: xhat = (x - mean) * rstd
            xhat *= rstd[s:e]
            g = dy[s:e]
            # forward was: y = w * xhat + b; the parameter gradients sum over rows
            parts.append((s, self.col_dot(g, xhat), g.sum(axis=0)))
            dxhat = xp.multiply(g, w, out=dx[s:e])
            # xhat depends on x directly and through mean and rstd; with g = dxhat, summing the
            # three paths gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
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

    # --- GELU: y = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3) ---
    #
    # Written through 0.5 (1 + tanh u) = sigmoid(2u), one exp instead of a tanh:
    #   sig = 1 / (1 + exp(-2u)),  y = x sig
    #   dy/dx = sig + x sig (1 - sig) 2 du/dx = sig (1 + (1 - sig) 2 x du/dx),
    #   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    # For x below about -10, exp(-2u) overflows to inf: y = x / inf = -0 and dx = 0, as they should.

    def gelu_forward(self, x):
        """y = GELU(x), any shape."""
        xp = self.xp
        with np.errstate(over="ignore"):
            e = xp.exp(x * (x * x * (-2.0 * GELU_AC) - 2.0 * GELU_C))   # exp(-2u)
        return x / (1.0 + e)

    def gelu_backward(self, x, dy, recompute_output=False):
        """dx = dy GELU'(x); with recompute_output, (dx, GELU(x)) (the output may be written over x)."""
        xp = self.xp
        x2 = x * x
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + xp.exp(x * (x2 * (-2.0 * GELU_AC) - 2.0 * GELU_C)))
        two_x_du = x * (x2 * (2.0 * GELU_AC3) + 2.0 * GELU_C)                # 2 x du/dx
        dx = ((1.0 - sig) * two_x_du + 1.0) * sig * dy
        return (dx, self.gelu_forward(x)) if recompute_output else dx

    def bias_gelu_forward(self, x, b):
        """GELU(x + b) for x (N, C), b (C,): a Linear's bias added in GELU's pass. x may be
        updated to x + b in place; hand the same x and b to bias_gelu_backward."""
        x += b
        return self.gelu_forward(x)

    def bias_gelu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b from the x and b given to bias_gelu_forward (here x already
        holds h); with recompute_output, also GELU(h)."""
        return self.gelu_backward(x, dy, recompute_output)

    # --- ReLU: y = max(x, 0), dy/dx = 1 where x > 0, else 0 (the kink at 0 takes the 0 side) ---
    #
    # The design document's alternative to GELU (model.activation=relu). No backend overrides it:
    # it runs here, against xp, on the CPU and the GPU alike.

    def relu_forward(self, x):
        """y = max(x, 0), any shape."""
        return self.xp.maximum(x, 0)

    def relu_backward(self, x, dy, recompute_output=False):
        """dx = dy where x > 0, else 0; with recompute_output, (dx, ReLU(x))."""
        dx = dy * (x > 0)
        return (dx, self.relu_forward(x)) if recompute_output else dx

    def bias_relu_forward(self, x, b):
        """ReLU(x + b), x (N, C) updated to x + b in place, as bias_gelu_forward."""
        x += b
        return self.relu_forward(x)

    def bias_relu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b (x already holds h); with recompute_output, also ReLU(h)."""
        return self.relu_backward(x, dy, recompute_output)

    # --- SwiGLU: y = SiLU(a) * b over the halves h = [a | b] of the last axis (Shazeer 2020) ---
    #
    #   SiLU(a) = a sig(a),  sig(a) = 1 / (1 + exp(-a)),  dSiLU/da = sig(a) (1 + a (1 - sig(a)))
    #   so, with y = SiLU(a) b:  da = dy b sig(a) (1 + a (1 - sig(a))),  db = dy SiLU(a)
    # The design document's alternative MLP (model.activation=swiglu, minitensor.layers.swiglu); no backend
    # overrides it: it runs here, against xp, on the CPU and the GPU alike. For a below about -88
    # (float32) exp(-a) overflows to inf: sig = 0, so y = -0 and da = 0, as they should.

    @staticmethod
    def swiglu_halves(h):
        """The views a, b of h (..., 2F): its first and second F columns."""
        if h.shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last axis (gate and value halves), got {h.shape}")
        F = h.shape[-1] // 2
        return h[..., :F], h[..., F:]

    def swiglu_forward(self, h):
        """y (..., F) = SiLU(a) * b for h = [a | b] (..., 2F)."""
        a, b = self.swiglu_halves(h)
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + self.xp.exp(-a))
        return a * sig * b

    def swiglu_backward(self, h, dy, recompute_output=False):
        """dh (..., 2F) = [da | db] from dy (..., F); with recompute_output, (dh, SwiGLU(h))."""
        xp = self.xp
        a, b = self.swiglu_halves(h)
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + xp.exp(-a))
        silu = a * sig
        dh = xp.empty_like(h)
        da, db = self.swiglu_halves(dh)
        xp.multiply(dy, silu, out=db)                        # forward was: y = silu * b
        xp.multiply(dy * b, sig * (1.0 + a * (1.0 - sig)), out=da)
        return (dh, silu * b) if recompute_output else dh

    def bias_swiglu_forward(self, x, b):
        """SwiGLU(x + b), x (N, 2F) updated to x + b in place, as bias_gelu_forward."""
        x += b
        return self.swiglu_forward(x)

    def bias_swiglu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b (x already holds h); with recompute_output, also SwiGLU(h)."""
        return self.swiglu_backward(x, dy, recompute_output)

    # --- causal self-attention core: y = softmax(q k^T / sqrt(hs) + mask) v, per head ---
    #
    # The core runs over blocks of query rows: rows i0..i1 see keys 0..i1 only, so the scores
    # above the diagonal are never computed and no (T, T) matrix is materialised. The forward
    # keeps each row's log-sum-exp; backward recomputes the probabilities from it (or reads them
    # when they were kept), and uses rowsum(dP * P) = rowsum(dY * Y) (since Y = P V and
    # dP = dY V^T), which costs hs per row instead of T.

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
        """The causal attention of the heads qkv4 (three (B, nh, T, hs) views, c_attn's output
        without its bias b) into y4 ((B, nh, T, hs), a view of the (B, T, C) output); returns
        the AttentionCache for attention_backward.

        block: query rows per block. Probabilities up to keep_probs_max_bytes in all are kept
        from forward to backward; larger ones are recomputed there from q, k and the row
        log-sum-exp (one more q k^T GEMM per block). dense=True runs the dense core instead
        (None: the backend chooses; here, blocks)."""
        if dense:
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
        return AttentionCache(q, k, v, y4, lse, kept, block, self._attention_backward_blocks)

    def attention_backward(self, dy4, cache, dqkv4):
        """From dy4 ((B, nh, T, hs) view of the output's gradient) and the forward's cache, writes
        d(q), d(k), d(v) into dqkv4 (three (B, nh, T, hs) views of c_attn's output gradient)."""
        cache.backward(dy4, cache, dqkv4)

    def _attention_backward_blocks(self, dy4, cache, grads4):
        xp = self.xp
        q, k, v, y4, lse, kept, block = cache[:7]
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
            for g, d in zip(grads4, (dq, dk, dv)):
                heads_of(g, s, e)[...] = d

        self.over_heads(dy4.shape[0], dy4.shape[1], heads)

    # The dense core: all heads in one batched GEMM per product, the (BH, T, T) probabilities
    # kept. Every (T, T) operand is used as stored (backward computes dv^T = dy^T p and
    # dk^T = q^T ds), so only the small (T, hs) operands are transposed.

    def attention_forward_dense(self, qkv4, b, y4):
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        q, k, v = (xp.empty((B * nh, T, hs), dtype=y4.dtype) for _ in range(3))
        self.split_heads(qkv4, b, q, k, v)
        s = xp.matmul(q, k.transpose(0, 2, 1))               # (BH, T, T) scores
        p = self.causal_softmax(s)
        y4[...] = xp.matmul(p, v).reshape(B, nh, T, hs)      # (BH, T, hs), heads back in order
        return AttentionCache(q, k, v, y4, None, p, T, self._attention_backward_dense)

    def _attention_backward_dense(self, dy4, cache, grads4):
        xp = self.xp
        q, k, v, y4, _, p = cache[:6]
        BH, T, hs = q.shape
        B, nh = dy4.shape[:2]
        dy = xp.ascontiguousarray(dy4).reshape(BH, T, hs)
        # forward was: y = p @ v, so dv = p^T dy, computed as dv^T = dy^T p with p read as stored
        dvT = xp.matmul(dy.transpose(0, 2, 1), p)            # (BH, hs, T)
        dp = xp.matmul(dy, v.transpose(0, 2, 1))             # (BH, T, T)
        # forward was: p = softmax(s) per row, so ds = p * (dp - D), D = rowsum(dp p) = rowsum(dy y)
        ds = self.causal_softmax_backward(dp, p, (dy * y4.reshape(BH, T, hs)).sum(axis=-1, keepdims=True))
        # forward was: s = (q / sqrt(hs)) @ k^T, with q already scaled in the cache
        dq = xp.matmul(ds, k)                                # (BH, T, hs)
        dq *= 1.0 / math.sqrt(hs)                            # d(q) from d(scaled q)
        dkT = xp.matmul(q.transpose(0, 2, 1), ds)            # (BH, hs, T)
        for g, d in zip(grads4, (dq, dkT.transpose(0, 2, 1), dvT.transpose(0, 2, 1))):
            g[...] = d.reshape(B, nh, T, hs)

    def causal_softmax(self, s):
        """In place over the scores s (BH, T, T): the causal row softmax."""
        return self.block_softmax(s, 0, self.xp.empty((*s.shape[:-1], 1), dtype=s.dtype))

    def causal_softmax_backward(self, dp, p, D):
        """ds = p * (dp - D), in place over dp (BH, T, T); D = rowsum(dp p) (BH, T, 1)."""
        return self.block_softmax_backward(dp, p, D)

    # The causal row softmax over a block of scores s (..., bq, i1): query rows i0..i0+bq against
    # keys 0..i1. Row r sees keys 0..i0+r; the rest of the row (in the diagonal block) is masked
    # with -inf. Every row keeps its diagonal entry, so its maximum is finite.

    def block_exp(self, s, i0, lse):
        """In place: each row becomes exp(row - max), masked; writes its log-sum-exp into lse
        (..., bq, 1) and returns the row sums (..., bq, 1): the probabilities are s / sums."""
        s[..., i0:] += causal_mask(self.xp, s.shape[-2], s.dtype)
        total, row_lse = exp_rows(s)
        lse[...] = row_lse
        return total

    def block_softmax(self, s, i0, lse):
        """In place: block_exp, then each row divided by its sum; returns the probabilities s."""
        s /= self.block_exp(s, i0, lse)
        return s

    def block_probs_again(self, s, i0, lse):
        """In place: the probabilities block_softmax gave, from the same scores and its lse."""
        s[..., i0:] += causal_mask(self.xp, s.shape[-2], s.dtype)
        s -= lse
        self.xp.exp(s, out=s)
        return s

    def block_softmax_backward(self, dp, p, D):
        """In place: dp <- p * (dp - D), D = rowsum(dP * P) per row (..., bq, 1)."""
        dp -= D
        dp *= p
        return dp

    # --- softmax cross-entropy: loss = mean_n (logsumexp(z_n) - z_n[t_n]) ---

    def softmax_xent_forward(self, z, t, inplace=False):
        """z (N, V) logits, t (N,) ids -> (loss as a 0-d array, probs for the backward). The
        probabilities are kept already divided by N (backward's scale), over z with inplace."""
        xp = self.xp
        N, V = z.shape
        probs = z if inplace else xp.empty_like(z)
        logsumexp = xp.empty(N, dtype=z.dtype)
        picked = z[xp.arange(N), t].astype(z.dtype)          # z[target], before z is overwritten
        rows = self.softmax_rows_per_block(N, V)

        def blocks(first, last):                             # row blocks that stay in cache for all passes
            for s in range(first * rows, min(last * rows, N), rows):
                pb = probs[s:s + rows]
                total, lse = exp_rows(z[s:s + rows], out=pb)
                xp.divide(pb, total * N, out=pb)             # softmax / N: backward's scale, folded in
                logsumexp[s:s + rows] = lse[:, 0]

        self.over_rows(-(-N // rows), blocks, cost_per_item=rows * V)
        return (logsumexp - picked).mean(), probs

    def vocab_padding(self, V):
        """The width the tied head computes its logits over for a vocabulary of V (here V itself; a
        GPU backend pads it so that the head's GEMMs are aligned, its loss masking the columns past V)."""
        return V

    def softmax_rows_per_block(self, N, V):
        return N

    def softmax_xent_backward(self, probs, t, dloss=1.0):
        """forward was: loss = mean_n(logsumexp(z_n) - z_n[t_n]), so
        dz_n = dloss (softmax(z_n) - onehot(t_n)) / N; in place over probs (softmax / N)."""
        N, V = probs.shape
        probs[self.xp.arange(N), t] -= 1.0 / N
        if not (isinstance(dloss, (int, float)) and dloss == 1.0):
            self.over_rows(N, lambda s, e: probs[s:e].__imul__(dloss), cost_per_item=V)
        return probs

    # --- embedding: out[n] = W[idx[n]], so dW[idx[n]] += dy[n], repeated ids summed ---

    def scatter_add_rows(self, dW, idx, rows):
        """dW[idx[i]] += rows[i] for every i, idx (n,), rows (n, C); repeated ids add up (which
        `dW[idx] += rows` would not do: it keeps one of them)."""
        self.xp.add.at(dW, idx, rows)

    # --- gradient clipping: the whole gradient's norm, and the scale that brings it to `clip` ---

    def global_norm(self, grads):
        """sqrt(sum g^2) over the flat gradient buffer, left on the device (0-d array): reading
        it would wait for the whole step."""
        return self.xp.sqrt(self.xp.dot(grads, grads))

    def clip_scale(self, norm, clip, loss):
        """(scale, finite) on the device, reading nothing: scale = clip / (norm + 1e-6) when clip
        and norm > clip, else 1; finite says whether both the loss and the norm are finite (the
        step's guard). The AdamW step takes scale as it is; the host reads only finite."""
        xp = self.xp
        norm = xp.asanyarray(norm)  # asanyarray: a float becomes 0-d, an array stays what it is
        scale = xp.where(norm > clip, clip / (norm + 1e-6), 1.0) if clip else xp.ones((), norm.dtype)
        return scale, xp.isfinite(norm) & xp.isfinite(xp.asanyarray(loss))

    # --- AdamW, decoupled weight decay (Loshchilov & Hutter), over the flat buffers ---
    #
    #   m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2            g = gradient * grad_scale
    #   p = p (1 - lr wd [decayed]) - lr (m / c1) / (sqrt(v / c2) + eps),  c1 = 1 - b1^t, c2 = 1 - b2^t
    # and m/c1 / (sqrt(v/c2) + eps) = (m s) / (sqrt(v) + eps sqrt(c2)) with s = sqrt(c2) / c1, so
    # the bias corrections become two scalars: step_size = lr sqrt(c2) / c1, eps_hat = eps sqrt(c2).

    def adamw_decay_layout(self, params, decays):
        """What adamw_step takes to know the decayed tensors: here a 0/1 mask over the buffer."""
        return params.mask(decays)

    def adamw_step(self, p, g, m, v, layout, b1, b2, grad_scale, step_size, eps_hat, decay):
        """One update over the flat buffers in place; decay = lr * weight_decay, applied where
        layout says; grad_scale a number or a 0-d array on p's device (never read here)."""
        self.adamw_update(p, g, m, v, self.xp.empty_like(p), b1, b2, grad_scale, step_size, eps_hat,
                          1.0 - decay * layout)

    def adamw_update(self, p, g, m, v, w, b1, b2, grad_scale, step_size, eps_hat, keep):
        """In place over p, m, v from g (all one shape), w a workspace like them; keep is the
        decay factor 1 - lr wd where decayed: a number, or an array like p."""
        xp = self.xp
        xp.multiply(g, (1.0 - b1) * grad_scale, out=w)       # (1 - b1) g
        m *= b1
        m += w
        xp.multiply(g, g, out=w)
        w *= (1.0 - b2) * grad_scale * grad_scale             # (1 - b2) g^2
        v *= b2
        v += w
        if not (isinstance(keep, float) and keep == 1.0):
            p *= keep                                         # decoupled weight decay
        xp.sqrt(v, out=w)
        w += eps_hat
        xp.divide(m, w, out=w)
        w *= step_size
        p -= w

    def fill_zero(self, a):
        a.fill(0)


def heads_of(a4, s, e):
    """The (e - s, T, hs) view of heads s..e (flat index b * nh + h, all within one b) of a
    (B, nh, T, hs) array or view."""
    nh = a4.shape[1]
    b = s // nh
    return a4[b, s - b * nh:e - b * nh]


_mask_cache = {}


def causal_mask(xp, T, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above; cached per size and dtype."""
    key = (xp.__name__, T, np.dtype(dtype).str)
    if key not in _mask_cache:
        _mask_cache[key] = xp.asarray(np.triu(np.full((T, T), -np.inf, dtype=dtype), k=1))
    return _mask_cache[key]
