"""The maths of every layer, written once against an array module `xp` (NumPy or CuPy): the textbook.

    ops = get_ops(xp, kernels)      # minitensor.backends: chosen once, when a model is built
    y, mean, rstd = ops.layernorm_forward(x, w, b, eps)

`Ops` holds each piece in its plainest vectorised form, with the derivation beside it: new arrays,
the formulas as a reader knows them, no threads, blocks, folded constants or workspaces. It is the
reference every optimised implementation is checked against. A backend subclasses it and overrides
the pieces it speeds up, falling back to `super()` for what it does not handle (a dtype, a layout,
a size):

    minitensor.backends.numpy_ops.NumpyOps   the CPU: NumPy work split over threads, numba kernels
    minitensor.backends.cupy_ops.CupyOps     the GPU: CUDA kernels accepted by the start-up self-check
    minitensor.backends.blocked              the attention core over blocks of query rows, for both

Layers hold an `ops`, hand it plain arrays and get plain results; none of them looks at an array's
type. What a forward returns for its backward (the attention's and the loss's `saved`) is read only
by the same backend's backward. Shapes follow the layers: N rows of C (or V) values; B sequences of
T positions; n_head heads of hs values.

Mixed precision (minitensor.precision, precision bf16): given bfloat16 arrays, every piece computes in
their accumulate dtype, float32, and stores what it returns for the next layer (an activation, an input
gradient) in bfloat16, rounded once: `summed` widens a piece's inputs, the formulas run as written,
`stored` rounds the result. The norms' mean and rstd, the softmax's and the cross-entropy's sums, the
loss and what a backward keeps stay float32; GEMMs of bfloat16 operands are summed in float32 and
rounded once (as cuBLAS's GemmEx with float32 compute); weight and bias gradients are added in float32
into the float32 gradient buffer. Given float32 or float64 arrays both helpers are the identity (the
same objects, nothing copied), so those paths compute exactly as they did before bf16 existed.
"""

import contextlib
import math
from typing import NamedTuple

import numpy as np

from minitensor.backends.softmax import exp_rows
from minitensor.precision import accumulate_of

# GELU, the tanh approximation GPT-2 uses (Hendrycks & Gimpel 2016):
#   y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


class AttentionCache(NamedTuple):
    """What Ops' dense attention keeps from forward to backward: q, k, v (B, nh, T, hs) with c_attn's
    bias added, and the probabilities p (B, nh, T, T)."""
    q: object
    k: object
    v: object
    p: object


class Ops:
    """The reference implementation of every piece, against `xp`."""

    name = "generic"

    def __init__(self, xp=np):
        self.xp = xp
        self.kernels_line = "kernels: generic (NumPy)" if xp is np else "kernels: generic"  # for the log

    def __repr__(self):
        return f"{type(self).__name__}({self.name})"

    def fill_zero(self, a):
        """a[...] = 0 (the gradient buffer before a step's first backward)."""
        a.fill(0)

    # --- mixed precision: the dtype a piece sums in, and the one it stores (the module's docstring) ---

    @staticmethod
    def summed(*arrays):
        """Each array in the dtype its sums are carried in (precision.accumulate_of): a bfloat16 one as a
        float32 copy, the others (None too) as they are. One array gives one array, several a tuple."""
        wide = tuple(a if a is None or accumulate_of(a.dtype) == a.dtype else a.astype(accumulate_of(a.dtype))
                     for a in arrays)
        return wide[0] if len(wide) == 1 else wide

    @staticmethod
    def stored(y, dtype):
        """y, computed in the accumulate dtype of `dtype`, as an array of `dtype`: rounded once (to
        nearest even) where dtype is narrower than its sums (bfloat16); y itself otherwise."""
        return y if accumulate_of(dtype) == np.dtype(dtype) else y.astype(dtype)

    def matmul(self, a, b):
        """a @ b (2-D, or batched over leading axes): the products summed in the accumulate dtype and
        rounded once to the operands' dtype."""
        wide_a, wide_b = self.summed(a, b)
        return self.stored(wide_a @ wide_b, a.dtype)

    # --- Linear: y = x @ W + b (+ r) ---

    def add_epilogue(self, y, b=None, r=None):
        """In place over y (N, C): y += b (C,) and y += r (N, C), either optional (a bfloat16 y: both
        added in float32, the sum rounded once)."""
        acc = self.summed(y)
        if b is not None:
            acc += self.summed(b)
        if r is not None:
            acc += self.summed(r)
        if acc is not y:
            y[...] = acc

    def linear_weight_grads(self, x, dy, dW, db):
        """forward was y = x @ W + b, x (N, n_in), dy (N, n_out): dW += x^T dy, db += sum_n dy (summed in
        the accumulate dtype, which is dW's and db's: the float32 gradient buffer under bf16)."""
        x, dy = self.summed(x, dy)
        dW += x.T @ dy
        self.add_bias_grad(dy, db)  # dy already in the accumulate dtype: summed() there is dy itself

    @contextlib.contextmanager
    def deferred_bias_sums(self):
        """A scope (with ops.deferred_bias_sums(): ...) in which a backend whose kernels sum a bias gradient
        in partial sums as they write the gradient may leave their last reduction to the next pass that
        reduces partial sums anyway (a LayerNorm backward's), one launch fewer each; all are added by the
        scope's end. Nothing in the scope may read those bias gradients (a pre-norm block's backward: its
        gradients are read after it). Ops sums every bias gradient at once: nothing is left."""
        yield

    def add_bias_grad(self, dy, db):
        """db += sum over rows of dy (N, n_out), summed in db's dtype: the gradient of a bias added to
        every row (a Linear's, or the last bias of a sublayer whose output gradient a norm's backward
        reads: layernorm_backward's dres_db); nothing where db is None (a Linear without a bias)."""
        if db is not None:
            db += self.summed(dy).sum(axis=0)

    def gemm(self, a, b, out, accumulate=False):
        """out = a @ b, or out += a @ b with accumulate, for 2-D a (M, K), b (K, N), out (M, N); out of a
        narrower dtype than the sums (bfloat16) gets them rounded once."""
        a, b = self.summed(a, b)
        if accumulate:
            out += a @ b
        elif accumulate_of(out.dtype) != out.dtype:
            out[...] = a @ b
        else:
            self.xp.matmul(a, b, out=out)

    # --- LayerNorm over rows: y = w * (x - mean) * rstd + b, rstd = 1 / sqrt(var + eps) ---

    def layernorm_forward(self, x, w, b, eps):
        """x (N, C) -> y (N, C) of x's dtype, mean and rstd (N, 1) in the accumulate dtype, the biased
        variance (divides by C)."""
        dtype = x.dtype
        x, w, b = self.summed(x, w, b)
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean                                        # centred first: no cancellation in var
        var = (xc * xc).mean(axis=-1, keepdims=True)
        rstd = 1.0 / self.xp.sqrt(var + eps)
        return self.stored(xc * rstd * w + b, dtype), mean, rstd

    def joined_layernorm_forward(self, x, bias, residual, w, b, eps):
        """The residual join of a pre-norm block and the LayerNorm after it: x += bias (if any) and
        += residual in place (add_epilogue's adds: x is the sublayer's last product, bias its bias), then
        layernorm_forward(x): (y, mean, rstd). A backend can make both in one pass over x."""
        self.add_epilogue(x, bias, residual)
        return self.layernorm_forward(x, w, b, eps)

    def layernorm_backward(self, dy, x, mean, rstd, w, dw, db, dres=None, dres_db=None):
        """dx (N, C) from dy and the forward's x, mean, rstd; dw and db accumulate. dres (N, C),
        if given, is added to dx: the gradient that reaches x around the layer (a skip). dx has dy's dtype.
        dres_db (C,), if given, accumulates dres's column sums (add_bias_grad): in a pre-norm block dres is
        the gradient of the sublayer's output, so they are its last bias's gradient (c_proj's), which a
        backend can sum in the pass that reads dres anyway."""
        if dres_db is not None:
            self.add_bias_grad(dres, dres_db)
        dtype = dy.dtype
        dy, x, w, dres = self.summed(dy, x, w, dres)
        xhat = (x - mean) * rstd
        # forward was: y = w * xhat + b; the parameter gradients sum over rows
        dw += (dy * xhat).sum(axis=0)
        db += dy.sum(axis=0)
        g = dy * w                                           # the gradient at xhat
        # xhat = (x - mean) rstd depends on x directly, through mean and through rstd; the three
        # paths: g rstd, -mean(g) rstd, and -xhat mean(g xhat) rstd (d rstd / dx = -rstd^3 (x - mean) / C)
        dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        return self.stored(dx if dres is None else dx + dres, dtype)

    # --- RMSNorm over rows: y = w * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps) ---

    def rmsnorm_forward(self, x, w, eps):
        """x (N, C) -> y (N, C) of x's dtype, rstd (N, 1) in the accumulate dtype; the mean square
        divides by C."""
        dtype = x.dtype
        x, w = self.summed(x, w)
        rstd = 1.0 / self.xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        return self.stored(x * rstd * w, dtype), rstd

    def rmsnorm_backward(self, dy, x, rstd, w, dw, dres=None):
        """dx (N, C) from dy and the forward's x, rstd; dw accumulates. dres (N, C), if given, is
        added to dx (a skip), as in layernorm_backward."""
        dtype = dy.dtype
        dy, x, w, dres = self.summed(dy, x, w, dres)
        xhat = x * rstd
        # forward was: y = w * xhat; the weight's gradient sums over rows
        dw += (dy * xhat).sum(axis=0)
        g = dy * w                                           # the gradient at xhat
        # xhat = x rstd depends on x directly and through rstd (d rstd / dx = -rstd^3 x / C): the
        # paths g rstd and -xhat mean(g xhat) rstd; no mean was subtracted, so no -mean(g) path
        dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        return self.stored(dx if dres is None else dx + dres, dtype)

    # --- GELU: y = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3) ---

    def gelu_forward(self, x):
        """y = GELU(x), any shape."""
        dtype, x = x.dtype, self.summed(x)
        u = GELU_C * (x + GELU_A * x ** 3)
        return self.stored(0.5 * x * (1.0 + self.xp.tanh(u)), dtype)

    def gelu_backward(self, x, dy, recompute_output=False):
        """dx = dy GELU'(x), the product rule on 0.5 x (1 + tanh u) with tanh' = 1 - tanh^2:
            dx = dy (0.5 (1 + tanh u) + 0.5 x (1 - tanh(u)^2) du/dx),  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        with recompute_output, (dx, GELU(x)), both of dy's dtype."""
        dtype = dy.dtype
        x, dy = self.summed(x, dy)
        t = self.xp.tanh(GELU_C * (x + GELU_A * x ** 3))
        du = GELU_C * (1.0 + 3.0 * GELU_A * x ** 2)
        dx = self.stored(dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du), dtype)
        return (dx, self.stored(0.5 * x * (1.0 + t), dtype)) if recompute_output else dx

    # A Linear's bias fused into the activation's pass: act(x + b), x (N, C), b (C,). A backend may
    # update x to x + b in place; hand the same x and b to the backward.

    def bias_gelu_forward(self, x, b):
        """GELU(x + b), of x's dtype (the sum rounded once, in the activation's output)."""
        return self.stored(self.gelu_forward(self.summed(x) + self.summed(b)), x.dtype)

    def bias_gelu_backward(self, x, b, dy, recompute_output=False, db=None):
        """The gradient dh at h = x + b (forward was y = GELU(h)); with recompute_output, also GELU(h).
        db, if given, accumulates dh's column sums (b's gradient: add_bias_grad), which a backend can sum
        in the same pass."""
        out = self.gelu_backward(self.summed(x) + self.summed(b), dy, recompute_output)
        self._add_dh_sums(out[0] if recompute_output else out, db)
        return out

    def _add_dh_sums(self, dh, db):
        """add_bias_grad over dh's rows (nothing where db is None)."""
        if db is not None:
            self.add_bias_grad(dh.reshape(-1, dh.shape[-1]), db)

    # --- ReLU: y = max(x, 0), dy/dx = 1 where x > 0, else 0 (the kink at 0 takes the 0 side) ---

    def relu_forward(self, x):
        """y = max(x, 0), any shape."""
        return self.xp.maximum(x, 0)

    def relu_backward(self, x, dy, recompute_output=False):
        """dx = dy where x > 0, else 0; with recompute_output, (dx, ReLU(x))."""
        dx = dy * (x > 0)
        return (dx, self.relu_forward(x)) if recompute_output else dx

    def bias_relu_forward(self, x, b):
        """ReLU(x + b)."""
        return self.relu_forward(x + b)

    def bias_relu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b; with recompute_output, also ReLU(h)."""
        return self.relu_backward(x + b, dy, recompute_output)

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
        a, b = self.swiglu_halves(self.summed(h))
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + self.xp.exp(-a))
        return self.stored(a * sig * b, h.dtype)

    def swiglu_backward(self, h, dy, recompute_output=False):
        """dh (..., 2F) = [da | db] from dy (..., F); with recompute_output, (dh, SwiGLU(h)), both of dy's
        dtype."""
        xp, dtype = self.xp, dy.dtype
        h, dy = self.summed(h, dy)
        a, b = self.swiglu_halves(h)
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + xp.exp(-a))
        silu = a * sig
        dh = xp.empty_like(h)
        da, db = self.swiglu_halves(dh)
        xp.multiply(dy, silu, out=db)                        # forward was: y = silu * b
        xp.multiply(dy * b, sig * (1.0 + a * (1.0 - sig)), out=da)
        dh = self.stored(dh, dtype)
        return (dh, self.stored(silu * b, dtype)) if recompute_output else dh

    def bias_swiglu_forward(self, x, b):
        """SwiGLU(x + b), x (N, 2F), b (2F,): c_fc's bias in the activation's pass, as bias_gelu_forward."""
        return self.stored(self.swiglu_forward(self.summed(x) + self.summed(b)), x.dtype)

    def bias_swiglu_backward(self, x, b, dy, recompute_output=False):
        """The gradient at h = x + b (forward was y = SwiGLU(h)); with recompute_output, also SwiGLU(h)."""
        return self.swiglu_backward(self.summed(x) + self.summed(b), dy, recompute_output)

    # --- causal self-attention core, per head: y = softmax(q k^T / sqrt(hs) + mask) v ---

    def causal_softmax(self, s):
        """The row softmax of the scores s (..., n_q, n_k) under the causal mask: the n_q query rows
        are the last positions of the n_k keys, so row r sees keys 0..n_k - n_q + r (the rest -inf)."""
        n_q, n_k = s.shape[-2:]
        dtype, s = s.dtype, self.summed(s)
        z = s + causal_mask(self.xp, n_q, n_k, s.dtype)
        total, _ = exp_rows(z)                               # z <- exp(z - max(z)), by rows
        return self.stored(z / total, dtype)

    def causal_softmax_backward(self, p, dp):
        """ds from p = causal_softmax(s) and dp: the softmax's Jacobian diag(p) - p p^T contracted with
        dp by rows, ds = p (dp - rowsum(dp p)); the masked entries have p = 0 and get no gradient."""
        dtype = dp.dtype
        p, dp = self.summed(p, dp)
        return self.stored(p * (dp - (dp * p).sum(axis=-1, keepdims=True)), dtype)

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """The causal attention of the heads qkv4 (three (B, nh, T, hs) views of c_attn's output
        without its bias b (3C,) or None) into y4 ((B, nh, T, hs), a view of the (B, T, C) output);
        returns what attention_backward takes. block, keep_probs_max_bytes, dense: hints for a
        backend with a blocked core (minitensor.backends.blocked); here the core is always dense, in the
        accumulate dtype, y4 written in its own (rounded once)."""
        B, nh, T, hs = qkv4[0].shape
        C = nh * hs
        q, k, v = self.summed(*(src.copy() for src in qkv4))  # (B, nh, T, hs) each, contiguous
        b = self.summed(b)
        if b is not None:                                    # c_attn's bias, head by head
            for i, h in enumerate((q, k, v)):
                h += b[i * C:(i + 1) * C].reshape(nh, 1, hs)
        s = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T) scores
        p = self.causal_softmax(s)
        y4[...] = p @ v
        return AttentionCache(q, k, v, p)

    def attention_backward(self, dy4, saved, dqkv4):
        """From dy4 ((B, nh, T, hs) view of the output's gradient) and what the forward returned,
        writes d(q), d(k), d(v) into dqkv4 (three (B, nh, T, hs) views of c_attn's output gradient)."""
        q, k, v, p = saved
        dy4 = self.summed(dy4)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # forward was: y = p v
        dv = p.swapaxes(-1, -2) @ dy4
        dp = dy4 @ v.swapaxes(-1, -2)
        # forward was: p = causal_softmax(s)
        ds = self.causal_softmax_backward(p, dp)
        # forward was: s = q k^T / sqrt(hs)
        dqkv4[0][...] = (ds @ k) * scale
        dqkv4[1][...] = (ds.swapaxes(-1, -2) @ q) * scale
        dqkv4[2][...] = dv

    def attention_backward_and_bias(self, dy4, saved, dqkv, db):
        """attention_backward into dqkv, c_attn's output gradient (B*T, 3C) (its heads cut as
        CausalSelfAttention cuts them: qkv_heads), and db += its column sums (c_attn's bias gradient,
        add_bias_grad; nothing where db is None): a backend whose kernels write dqkv can sum them as they
        write (the flash piece)."""
        B, nh, T, _ = dy4.shape
        self.attention_backward(dy4, saved, qkv_heads(dqkv, B, T, nh))
        self.add_bias_grad(dqkv, db)

    # --- softmax cross-entropy: loss = mean_n (logsumexp(z_n) - z_n[t_n]) ---

    def softmax_xent_forward(self, z, t, inplace=False, valid=None):
        """z (N, V) logits, t (N,) ids -> (the loss as a 0-d array in the accumulate dtype, what
        softmax_xent_backward takes: here the probabilities softmax(z), of z's dtype). inplace: z may be
        overwritten (a backend saves memory so). valid: the first columns that are the vocabulary's, the
        rest a padded head's (TiedHead.forward(padded=True)), never read: probability 0, no gradient."""
        xp, dtype = self.xp, z.dtype
        probs = xp.zeros(z.shape, dtype) if valid not in (None, z.shape[1]) else None
        z = self.summed(z if probs is None else z[:, :valid])
        N = z.shape[0]
        top = z.max(axis=1, keepdims=True)                   # the row maximum first: exp never overflows
        e = xp.exp(z - top)
        total = e.sum(axis=1, keepdims=True)
        logsumexp = top[:, 0] + xp.log(total[:, 0])
        loss = (logsumexp - z[xp.arange(N), t]).mean()
        if probs is None:
            return loss, self.stored(e / total, dtype)
        probs[:, :valid] = e / total
        return loss, probs

    def softmax_xent_backward(self, saved, t, dloss=1.0):
        """forward was: loss = mean_n(logsumexp(z_n) - z_n[t_n]), so
        dz_n = dloss (softmax(z_n) - onehot(t_n)) / N, of the logits' dtype."""
        N, dtype = saved.shape[0], saved.dtype
        saved = self.summed(saved)
        onehot = self.xp.zeros_like(saved)
        onehot[self.xp.arange(N), t] = 1.0
        return self.stored((saved - onehot) * (dloss / N), dtype)

    def vocab_padding(self, V):
        """The width the tied head computes its logits over for a vocabulary of V (here V itself; a
        GPU backend pads it so that the head's GEMMs are aligned, its loss masking the columns past V)."""
        return V

    # --- embedding: out[n] = W[idx[n]], so dW[idx[n]] += dy[n], repeated ids summed ---

    def scatter_add_rows(self, dW, idx, rows):
        """dW[idx[i]] += rows[i] for every i, idx (n,), rows (n, C); repeated ids add up (which
        `dW[idx] += rows` would not do: it keeps one of them); summed in dW's dtype."""
        self.xp.add.at(dW, idx, self.summed(rows))

    def add_batch_sum(self, dW, dy):
        """dW (T, C) += the sum over the batch of dy (B, T, C), or dy itself (T, C): the position
        embedding's gradient (forward was out[b, t] = W[t] for every b)."""
        dy = self.summed(dy)
        dW += dy.sum(axis=0) if dy.ndim == 3 else dy

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

    # --- AdamW, decoupled weight decay (Loshchilov & Hutter 2019, Algorithm 2), over the flat buffers ---

    mask_dtype = None  # the decay mask's: the parameters' (a backend whose step only reads it may take uint8)

    def decay_mask(self, params, decays):
        """The `decayed` that adamw_step takes: 1 over the tensors decays(name, shape) selects, 0
        elsewhere (the padding too), of mask_dtype: the parameters' own, as the formula below multiplies
        it, unless the backend's step only reads where it changes."""
        return params.mask(decays, dtype=self.mask_dtype)

    def adamw_step(self, p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale=1.0, copy=None):
        """One update in place over p, m, v (step t, counting from 1) from the gradient g times
        grad_scale (a number or a 0-d array on p's device, never read here); decayed is 1 over the
        decayed tensors, 0 elsewhere (Params.mask):
            m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
            m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)
            p = p - lr wd decayed p - lr m_hat / (sqrt(v_hat) + eps)
        copy (a flat bfloat16 array as long as p, or None): then copy[:] = p rounded to it."""
        g = g * grad_scale
        m[...] = b1 * m + (1.0 - b1) * g
        v[...] = b2 * v + (1.0 - b2) * g * g
        m_hat = m / (1.0 - b1 ** t)
        v_hat = v / (1.0 - b2 ** t)
        p -= lr * weight_decay * decayed * p + lr * m_hat / (self.xp.sqrt(v_hat) + eps)
        if copy is not None:
            copy[...] = p.astype(copy.dtype)


def causal_mask(xp, n_q, n_k, dtype):
    """(n_q, n_k) additive mask for the last n_q positions of n_k as queries against all n_k as keys:
    0 where the key is at or before the query, -inf after it."""
    rows = np.arange(n_k - n_q, n_k)[:, None]
    return xp.asarray(np.where(np.arange(n_k)[None, :] <= rows, 0.0, -np.inf).astype(dtype))


def qkv_heads(a, B, T, n_head, parts=3):
    """The heads of a (B*T, parts*C) array of rows, c_attn's output or its gradient (parts 3: q, k, v side
    by side in each row; 1: the heads' output), as `parts` (B, n_head, T, hs) views: head h is columns
    h*hs .. (h+1)*hs of each part, hs = C / n_head."""
    hs = a.shape[-1] // parts // n_head
    a = a.reshape(B, T, parts, n_head, hs)
    return [a[:, :, i].transpose(0, 2, 1, 3) for i in range(parts)]
