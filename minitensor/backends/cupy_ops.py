"""The GPU backend: CuPy, with GELU as an ElementwiseKernel and the fused CUDA kernels.

`CupyOps` overrides pieces of `minitensor.backends.ops.Ops`, each with a kernel that must equal the Ops
method it replaces, and falls back to `super()` where a kernel does not apply:

    gelu_forward / gelu_backward       'gelu_fwd' / 'gelu_bwd' (ElementwiseKernels, any float dtype)
    add_epilogue                       'bias_residual_add' with a bias and a residual (ElementwiseKernel,
                                       the same adds as Ops': any float dtype)
    bias_gelu_forward / _backward      'bias_gelu_fwd' / '_bwd' ('_bwd_fwd' with the output recomputed),
                                       fused piece bias_gelu
    layernorm_forward / _backward      'layernorm_fwd', '_bwd', '_bwd_params' fused piece layernorm
    causal_softmax / _backward         'causal_softmax_fwd' / '_bwd'         fused piece causal_softmax
    softmax_xent_forward / _backward   'softmax_xent_fwd' / '_bwd'           fused piece softmax_xent
    adamw_step                         'adamw_step'                          fused piece adamw
    scatter_add_rows                   'scatter_add_rows' (always: deterministic where add.at's atomics are not)
    attention_forward                  the dense core within a memory budget (a 64th of the GPU's
                                       memory per layer: 2.2 GB on an H200, where ANDREA-120M at
                                       8 x 1024 needs 384 MiB), else the query blocks of
                                       minitensor.backends.blocked

Which fused pieces a CupyOps runs is fixed when it is built (`CupyOps(xp, fused=...)`; through
`minitensor.backends.get_ops(cupy, kernels)`, where kernels="auto" runs the start-up self-check of
minitensor.checks.selfcheck once: each piece's check (minitensor/checks/cupy_checks.py) once through the Ops
code and once through the kernel, keeping those that agree).

Every kernel is registered in minitensor.backends.cuda.KERNELS, so that two checks run without a GPU
(`python -m minitensor.checks --check | --host-check`): NVRTC compiles each one, and g++ runs
each elementwise operation on the host against its `reference`, which is the Ops code. Only
CuPy's public API is called here (ElementwiseKernel and RawKernel through minitensor.backends.cuda,
cupy.cuda for the device), so a NumPy-backed stand-in of CuPy can run this file in CI.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor.backends import cuda
from minitensor.backends.blocked import BlockedAttention
from minitensor.backends.ops import GELU_C, Ops
from minitensor.backends.tricks import GELU_AC, GELU_AC3, FreshGrads, adamw_scalars, adamw_update
from minitensor.device import array_module

_REFERENCE = Ops(np)  # what every elementwise kernel's host check compares with


class FusedAttentionCache(NamedTuple):
    """What the fused dense core keeps: q (unscaled), k, v (B*n_head, T, hs); p (B*n_head, T, T)."""
    q: object
    k: object
    v: object
    p: object


class CupyOps(BlockedAttention, Ops):
    name = "cupy"
    # the dense attention core when all heads' probabilities fit this many bytes (None: a 64th of
    # the GPU's memory)
    dense_max_bytes = None

    def __init__(self, xp, fused=(), kernels_line=None):
        """fused: the fused pieces to run (names of minitensor.backends.cuda.FUSED), the others through the
        Ops code; kernels_line: the log line that says how they were chosen."""
        super().__init__(xp)
        unknown = set(fused) - set(cuda.FUSED)
        if unknown:
            raise ValueError(f"unknown fused pieces {sorted(unknown)}: choose from {', '.join(cuda.FUSED)}")
        self.in_use = frozenset(fused)
        self._fresh = FreshGrads()        # the gradient views a GEMM may write (linear_weight_grads)
        self.kernels_line = kernels_line or f"kernels: fused {', '.join(sorted(self.in_use)) or 'none'}"

    def __repr__(self):
        return f"CupyOps(fused {', '.join(sorted(self.in_use)) or 'none'})"

    def fused(self, name):
        """Whether the fused piece `name` runs (chosen when this backend was built)."""
        return name in self.in_use

    def fill_zero(self, a):
        super().fill_zero(a)
        self._fresh.zeroed(a)

    # --- Linear ---

    def add_epilogue(self, y, b=None, r=None):
        """y += b and y += r in one pass ('bias_residual_add', the same two float adds in the same
        order) when both are given, as in the residual branches' last products."""
        if b is None or r is None or not _epilogue_fits(y, b, r):
            return super().add_epilogue(y, b, r)
        BIAS_RESIDUAL_ADD.kernel()(y, b, np.int32(y.shape[-1]), r, y)

    def linear_weight_grads(self, x, dy, dW, db):
        """The first time after fill_zero (the first micro-batch after zero_grad, FreshGrads), dW
        written by its GEMM and db by its reduction itself (`sum(out=db)`) rather than through
        temporaries; else, where db follows dW in the gradient buffer (Params lays a weight and its
        bias out so), both added in one pass."""
        if self._fresh.take(dW):
            self.xp.matmul(x.T, dy, out=dW)
            if db is not None:
                dy.sum(axis=0, out=db)
            return
        joint = None if db is None else _joined(dW, db, (dW.shape[0] + 1, dW.shape[1]))
        if joint is None:
            return super().linear_weight_grads(x, dy, dW, db)
        grads = self.xp.empty(joint.shape, dtype=joint.dtype)  # x^T dy and sum(dy) side by side, added in one pass
        self.xp.matmul(x.T, dy, out=grads[:-1])
        dy.sum(axis=0, out=grads[-1])
        joint += grads

    # --- GELU ---

    def gelu_forward(self, x):
        if x.dtype not in (np.float32, np.float64):
            return super().gelu_forward(x)
        return GELU_FWD.kernel()(x)

    def gelu_backward(self, x, dy, recompute_output=False):
        if x.dtype not in (np.float32, np.float64) or dy.dtype != x.dtype:
            return super().gelu_backward(x, dy, recompute_output)
        dx = GELU_BWD.kernel()(x, dy)
        return (dx, self.gelu_forward(x)) if recompute_output else dx

    def bias_gelu_forward(self, x, b):
        """fused: x is kept as it is, h = x + b never stored."""
        if not self.fused("bias_gelu"):
            return super().bias_gelu_forward(x, b)
        return bias_gelu_forward_gpu(x, b)

    def bias_gelu_backward(self, x, b, dy, recompute_output=False):
        if not self.fused("bias_gelu"):
            return super().bias_gelu_backward(x, b, dy, recompute_output)
        if recompute_output:
            return bias_gelu_backward_recompute_gpu(x, b, dy)
        return bias_gelu_backward_gpu(x, b, dy)

    # --- LayerNorm ---

    def layernorm_forward(self, x, w, b, eps):
        if not self.fused("layernorm"):
            return super().layernorm_forward(x, w, b, eps)
        return layernorm_forward_gpu(x, w, b, eps)

    def layernorm_backward(self, dy, x, mean, rstd, w, dw, db, dres=None):
        if not self.fused("layernorm"):
            return super().layernorm_backward(dy, x, mean, rstd, w, dw, db, dres)
        # the kernel reads the skip gradient and writes dx beside it: the caller's array is kept
        residual = None if dres is None else self.xp.ascontiguousarray(dres)
        return layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=residual)

    # --- attention ---

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        if dense is None:
            B, nh, T, _ = qkv4[0].shape
            dense = B * nh * T * T * y4.itemsize <= (self.dense_max_bytes or _gpu_memory(self.xp) // 64)
        return super().attention_forward(qkv4, b, y4, block, keep_probs_max_bytes, dense)

    # The dense core with the fused softmax: the 1/sqrt(hs) scale goes into the softmax kernels
    # (forward: p = softmax(scale s); backward: ds = scale p (dp - rowsum(dp p))), so q is kept
    # unscaled and neither q nor dq takes a pass of its own, and rowsum(dy y) (Ops' D) is not
    # computed: the backward kernel sums dp p itself. CuPy's batched matmul copies an operand that
    # is not C-contiguous (SPEC section 5): k^T (forward), dy^T, v^T and q^T (backward) are those
    # copies; dv and dk come out transposed (dv^T = dy^T p, dk^T = q^T ds), read as stored.

    def attention_forward_dense(self, qkv4, b, y4):
        if not self.fused("causal_softmax"):
            return super().attention_forward_dense(qkv4, b, y4)
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        heads = xp.empty((3, B * nh, T, hs), dtype=y4.dtype)  # q, k, v, each (BH, T, hs) contiguous
        _split_heads(xp, qkv4, b, heads.reshape(3, B, nh, T, hs))
        q, k, v = heads
        s = xp.matmul(q, k.transpose(0, 2, 1))                # (BH, T, T) unscaled scores
        p = causal_softmax_forward_gpu(s, 1.0 / math.sqrt(hs), out=s)
        y4[...] = xp.matmul(p, v).reshape(B, nh, T, hs)       # heads back in order
        return FusedAttentionCache(q, k, v, p)

    def attention_backward(self, dy4, saved, grads4):
        if not isinstance(saved, FusedAttentionCache):
            return super().attention_backward(dy4, saved, grads4)
        xp = self.xp
        q, k, v, p = saved                                    # q unscaled (attention_forward_dense above)
        BH, T, hs = q.shape
        B, nh = dy4.shape[:2]
        dy = xp.ascontiguousarray(dy4).reshape(BH, T, hs)
        dkvT = xp.empty((2, BH, hs, T), dtype=q.dtype)        # dk^T, dv^T side by side
        xp.matmul(dy.transpose(0, 2, 1), p, out=dkvT[1])      # forward was y = p v: dv^T = dy^T p
        dp = xp.matmul(dy, v.transpose(0, 2, 1))
        # forward was p = softmax(scale q k^T): ds = scale p (dp - rowsum(dp p)), dq = ds k, dk^T = q^T ds
        ds = causal_softmax_backward_gpu(dp, p, 1.0 / math.sqrt(hs), out=dp)
        dq = xp.matmul(ds, k)
        xp.matmul(q.transpose(0, 2, 1), ds, out=dkvT[0])
        dkv = dkvT.transpose(0, 1, 3, 2).reshape(2, B, nh, T, hs)
        stacked = _stacked_heads(grads4)
        if stacked is not None:                               # dk and dv in one copy
            stacked[0][...] = dq.reshape(B, nh, T, hs)
            stacked[1:][...] = dkv
            return
        for g, d in zip(grads4, (dq.reshape(B, nh, T, hs), dkv[0], dkv[1])):
            g[...] = d

    # --- softmax cross-entropy ---

    def vocab_padding(self, V):
        """With the fused cross-entropy (which masks the padding), V rounded up to a multiple of 128,
        as llm.c pads GPT-2's 50257 to 50304: every leading dimension of the tied head's three GEMMs
        a multiple of 16 bytes (8449 -> 8576), so cuBLAS can use its aligned (TMA) kernels."""
        return -(-V // 128) * 128 if self.fused("softmax_xent") else V

    def softmax_xent_forward(self, z, t, inplace=False, valid=None):
        """fused: the probabilities (not divided by N) over a contiguous z; with valid, over its
        first `valid` columns, the rest given probability 0 (the tied head's padding)."""
        if not self.fused("softmax_xent"):
            if valid not in (None, z.shape[-1]):
                raise ValueError("padded logits need the fused cross-entropy (vocab_padding pads only with it)")
            return super().softmax_xent_forward(z, t, inplace)
        z = z if inplace and z.flags.c_contiguous else self.xp.array(z, order="C")
        loss, _ = softmax_xent_forward_gpu(z, t, valid)
        return loss, z

    def softmax_xent_backward(self, probs, t, dloss=1.0):
        if not self.fused("softmax_xent"):
            return super().softmax_xent_backward(probs, t, dloss)
        return softmax_xent_backward_gpu(probs, t, dloss)

    # --- embedding ---

    def scatter_add_rows(self, dW, idx, rows):
        """dW[idx[i]] += rows[i], deterministic (Ops' add.at is atomic on CuPy: its sums' order
        varies from run to run): the positions sorted by (id, position), then one thread per id
        and column adds that id's rows in position order, the order of the numba CPU kernel."""
        xp, n = self.xp, idx.shape[0]
        if (rows.dtype != dW.dtype or dW.dtype not in (np.float32, np.float64) or dW.ndim != 2
                or not dW.flags.c_contiguous):
            return super().scatter_add_rows(dW, idx, rows)
        if n == 0:
            return
        ids = xp.ascontiguousarray(idx, dtype=np.int64)
        order = xp.argsort(ids * n + xp.arange(n, dtype=np.int64))  # unique keys: any sort gives this order
        C = dW.shape[1]
        block = cuda.threads(C, 256)
        cuda.launch(SCATTER_ADD_ROWS, dW.dtype, (n, -(-C // block)), (block,),
                    (dW, xp.ascontiguousarray(rows), order, ids[order], np.int64(n), np.int32(C)))

    # --- AdamW ---

    def adamw_step(self, p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale=1.0):
        if not self.fused("adamw"):
            return super().adamw_step(p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale)
        adamw_kernel(p, g, m, v, decayed, b1, b2, grad_scale, *adamw_scalars(lr, b1, b2, eps, t), lr * weight_decay)


def _joined(first, second, shape):
    """The view of `shape` over `first` and then `second` where both are contiguous views of one
    contiguous array and second starts where first ends (Params' gradient buffer: a weight and then
    its bias), found through CuPy's public base and data.ptr; else None."""
    base = first.base
    if (base is None or second.base is None or not base.flags.c_contiguous or second.base.data.ptr != base.data.ptr
            or not (first.flags.c_contiguous and second.flags.c_contiguous) or first.dtype != second.dtype
            or second.data.ptr != first.data.ptr + first.nbytes or math.prod(shape) != first.size + second.size):
        return None
    start, item = first.data.ptr - base.data.ptr, first.itemsize
    if start < 0 or start % item or start // item + first.size + second.size > base.size:
        return None
    return base.reshape(-1)[start // item:start // item + first.size + second.size].reshape(shape)


def _stacked_heads(views):
    """The (3, B, nh, T, hs) view of the (B*T, 3C) array that the three (B, nh, T, hs) views were cut
    from (CausalSelfAttention._heads: q, k, v side by side in each row), found through CuPy's public
    `base` and `data.ptr`; None where they are not exactly that (then each is handled on its own)."""
    base = views[0].base
    B, nh, T, hs = views[0].shape
    C, item = nh * hs, views[0].itemsize
    if (base is None or base.size != B * T * 3 * C or base.dtype != views[0].dtype or not base.flags.c_contiguous
            or len(views) != 3):
        return None
    strides = (T * 3 * C * item, hs * item, 3 * C * item, item)
    for i, v in enumerate(views):
        if v.shape != (B, nh, T, hs) or v.strides != strides or v.data.ptr != base.data.ptr + i * C * item:
            return None
    return base.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)


def _split_heads(xp, qkv4, b, out):
    """out (3, B, nh, T, hs) = the heads of qkv4 (three (B, nh, T, hs) views) plus c_attn's bias b
    (3C,): one pass over all three where they are views of one array, else one each."""
    B, nh, T, hs = qkv4[0].shape
    stacked = _stacked_heads(qkv4)
    bias = None if b is None else b.reshape(3, 1, nh, 1, hs)
    pairs = [(stacked, bias, out)] if stacked is not None else [
        (src, None if bias is None else bias[i], out[i]) for i, src in enumerate(qkv4)]
    for src, add, dst in pairs:
        if add is None:
            dst[...] = src
        else:
            xp.add(src, add, out=dst)


_gpu_memory_bytes = {}


def _gpu_memory(xp):
    """The current GPU's total memory in bytes, asked once per device."""
    device = xp.cuda.Device()
    if device.id not in _gpu_memory_bytes:
        _gpu_memory_bytes[device.id] = device.mem_info[1]
    return _gpu_memory_bytes[device.id]


# =============================================================================================
# GELU (the ElementwiseKernels)

# GELU in the sigmoid form (sigmoid(2u) = 0.5 (1 + tanh u), the tanh of Ops.gelu_forward / gelu_backward):
#   sig = 1 / (1 + exp(x (-2AC x^2 - 2C))),  y = x sig,  dx = dy sig (1 + (1 - sig) x (2AC3 x^2 + 2C))
# with AC = 0.044715 sqrt(2/pi), AC3 = 3 AC, C = sqrt(2/pi). exp = inf (x below about -10) gives
# y = -0 and dx = 0, as it should. The references are the Ops methods themselves.
_M2AC, _M2C, _2AC3, _2C = -2.0 * GELU_AC, -2.0 * GELU_C, 2.0 * GELU_AC3, 2.0 * GELU_C
_GELU_FWD_SRC = f"y = {{x}} / ((T)1 + exp({{x}} * ({{x}} * {{x}} * (T){_M2AC!r} + (T){_M2C!r})));"
_GELU_BWD_SRC = (f"const T x2 = {{x}} * {{x}};\n"
                 f"const T sig = (T)1 / ((T)1 + exp({{x}} * (x2 * (T){_M2AC!r} + (T){_M2C!r})));\n"
                 f"{{dx}} = (((T)1 - sig) * ({{x}} * (x2 * (T){_2AC3!r} + (T){_2C!r})) + (T)1) * sig * dy;")

GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_fwd", "T x", "T y", _GELU_FWD_SRC.format(x="x"),
    reference=lambda x: _REFERENCE.gelu_forward(x),
))

GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_bwd", "T x, T dy", "T dx", _GELU_BWD_SRC.format(x="x", dx="dx"),
    reference=lambda x, dy: _REFERENCE.gelu_backward(x, dy),
))


# ---------------------------------------------------------------------------------------------
# bias + GELU: y = GELU(x + b), b broadcast over the rows; x is the matmul output (N, C) ---


def _column(n, C):
    """Column of each flat index of an (n / C, C) array: what `i % C` gives in the kernels."""
    return np.arange(n) % int(C)


# `i` is the flat C-order index over x's shape, so `i % C` is the column even for strided x; the
# 32-bit cast avoids a 64-bit modulo per element (the wrappers refuse 2**31 elements or more).
# The references are GELU's Ops code applied to h = x + b, on flat arrays as the kernels see them,
# gathering the bias by i % C (the host check's flat samples, C = 7, are not whole rows).
BIAS_GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "bias_gelu_fwd", "T x, raw T b, int32 C", "T y",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n" + _GELU_FWD_SRC.format(x="h"),
    reference=lambda x, b, C: _REFERENCE.gelu_forward(x + b[_column(x.size, C)]),
    scalars=(("C", 7),),
))

BIAS_GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "bias_gelu_bwd", "T x, raw T b, int32 C, T dy", "T dh",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n" + _GELU_BWD_SRC.format(x="h", dx="dh"),
    reference=lambda x, b, C, dy: _REFERENCE.gelu_backward(x + b[_column(x.size, C)], dy),
    scalars=(("C", 7),),
))


# The backward and the recomputed output in one pass (MLP.backward needs both): h read once, the
# exp shared. y = h / den is the forward kernel's expression, dh the backward kernel's (sig = 1 / den).
BIAS_GELU_BWD_FWD = cuda.register(cuda.ElementwiseSpec(
    "bias_gelu_bwd_fwd", "T x, raw T b, int32 C, T dy", "T dh, T y",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n"
    "const T h2 = h * h;\n"
    f"const T den = (T)1 + exp(h * (h2 * (T){_M2AC!r} + (T){_M2C!r}));\n"
    "const T sig = (T)1 / den;\n"
    f"dh = (((T)1 - sig) * (h * (h2 * (T){_2AC3!r} + (T){_2C!r})) + (T)1) * sig * dy;\n"
    "y = h / den;",
    reference=lambda x, b, C, dy: (_REFERENCE.gelu_backward(x + b[_column(x.size, C)], dy),
                                   _REFERENCE.gelu_forward(x + b[_column(x.size, C)])),
    scalars=(("C", 7),),
))


def bias_gelu_forward_gpu(x, b, out=None):
    """GELU(x + b) for x (..., C) and b (C,) CuPy arrays, into `out` if given; returns y.

    The caller keeps x (the matmul output without its bias) for the backward: h = x + b is never
    stored."""
    _check_bias_gpu(x, b, out, "bias_gelu_forward_gpu")
    cuda.on_cupy("bias_gelu_forward_gpu", x, "Ops.bias_gelu_forward")
    kern = BIAS_GELU_FWD.kernel()
    C = np.int32(x.shape[-1])
    return kern(x, b, C) if out is None else kern(x, b, C, out)


def bias_gelu_backward_gpu(x, b, dy, db=None, out=None):
    """dL/dh for h = x + b, y = GELU(h), from the forward's x and b and dy = dL/dy; into `out`
    if given (it may be dy). With `db`, also db += the column sums of dh. Returns dh."""
    _check_bias_gpu(x, b, out, "bias_gelu_backward_gpu", dy)
    cuda.on_cupy("bias_gelu_backward_gpu", x, "Ops.bias_gelu_backward")
    kern = BIAS_GELU_BWD.kernel()
    C = np.int32(x.shape[-1])
    dh = kern(x, b, C, dy) if out is None else kern(x, b, C, dy, out)
    if db is not None:
        db += dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return dh


def bias_gelu_backward_recompute_gpu(x, b, dy):
    """(dh, y): bias_gelu_backward_gpu's dh and bias_gelu_forward_gpu's y in one pass, new arrays."""
    _check_bias_gpu(x, b, None, "bias_gelu_backward_recompute_gpu", dy)
    cuda.on_cupy("bias_gelu_backward_recompute_gpu", x, "Ops.bias_gelu_backward")
    return BIAS_GELU_BWD_FWD.kernel()(x, b, np.int32(x.shape[-1]), dy)


# y = (y + b) + r, Ops.add_epilogue's two adds in one pass; y is its own output (in place).
BIAS_RESIDUAL_ADD = cuda.register(cuda.ElementwiseSpec(
    "bias_residual_add", "T y_in, raw T b, int32 C, T r", "T y",
    "y = (y_in + b[(unsigned int)i % (unsigned int)C]) + r;",
    reference=lambda y_in, b, C, r: (y_in + b[_column(y_in.size, C)]) + r,
    scalars=(("C", 7),),
))


def _epilogue_fits(y, b, r):
    """Whether bias_residual_add applies: y (N, C) float and contiguous, b (C,) and r (N, C) alike."""
    return (y.dtype in (np.float32, np.float64) and y.ndim == 2 and y.flags.c_contiguous and y.size < 2**31
            and b.dtype == y.dtype and b.shape == y.shape[-1:] and b.flags.c_contiguous
            and r.dtype == y.dtype and r.shape == y.shape and not array_module(y).may_share_memory(y, r))


def _check_bias_gpu(x, b, out, fn, dy=None):
    cuda.check_operands(fn, x, out, dy)
    if x.ndim < 1 or x.size >= 2**31:
        raise ValueError(f"{fn}: x must have 1 to 2**31 - 1 elements and a last axis, got shape {x.shape}")
    if b.shape != x.shape[-1:] or b.dtype != x.dtype or not b.flags.c_contiguous:
        raise ValueError(f"{fn}: b must be a contiguous {x.dtype} vector of shape {x.shape[-1:]}, got "
                         f"{b.dtype} {b.shape}")


# =============================================================================================
# LayerNorm over the last axis, one block per row

# What these kernels must equal is Ops.layernorm_forward / _backward: the start-up self-check runs
# the layer both ways on the GPU. The tests run the kernels on the host (kernelcheck.emulate_launch)
# against the textbook form in tests/formulas.py.
#
# One block per row of x (N, C). With add_residual, x is first updated in place to x + residual
# (the residual join before a pre-norm LayerNorm, fused); otherwise `residual` is not read. Each
# thread touches the same columns in every loop, so y may be x itself.
def _layernorm_fwd_traffic(x, residual, w, b, y, mean, rstd, add_residual, **_):
    """x (and the residual, when added: x is then written back) read once, y and the statistics written."""
    joined = x.nbytes if add_residual else 0
    return x.nbytes + joined + w.nbytes + b.nbytes, y.nbytes + mean.nbytes + rstd.nbytes + joined


LAYERNORM_FWD = cuda.register(cuda.RawSpec("layernorm_fwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void layernorm_fwd(T *x, const T *residual, const T *w, const T *b, T *y, T *mean,
                                         T *rstd, const int C, const T eps, const int add_residual) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  T *xr = x + row * C;
  T *yr = y + row * C;
  T sum = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    T v = xr[j];
    if (add_residual) {
      v += residual[row * C + j];
      xr[j] = v;
    }
    sum += v;
  }
  const T m = block_sum(sum, buf) / (T)C;
  T sq = 0;  /* the centred second pass, as NumPy: no cancellation from E[x^2] - E[x]^2 */
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T d = xr[j] - m;
    sq += d * d;
  }
  const T r = (T)1 / sqrt_of(block_sum(sq, buf) / (T)C + eps);
  for (int j = threadIdx.x; j < C; j += blockDim.x) yr[j] = (xr[j] - m) * r * w[j] + b[j];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}
""", traffic=_layernorm_fwd_traffic))

# forward was: y = xhat w + b, xhat = (x - mean) rstd. One block per row: dx, written or (with
# accumulate) written as res + dx, the residual gradient of a pre-norm block, fused. res may be dx
# itself (each thread reads res[j] before it writes dx[j]).
def _layernorm_bwd_traffic(dy, x, w, mean, rstd, res, dx, accumulate, **_):
    """dy, x and the statistics read, and res when accumulating; dx written."""
    return dy.nbytes + x.nbytes + w.nbytes + mean.nbytes + rstd.nbytes + (res.nbytes if accumulate else 0), dx.nbytes


LAYERNORM_BWD = cuda.register(cuda.RawSpec("layernorm_bwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void layernorm_bwd(const T *dy, const T *x, const T *w, const T *mean, const T *rstd,
                                         const T *res, T *dx, const int C, const int accumulate) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const T *dyr = dy + row * C;
  const T *xr = x + row * C;
  const T *resr = res + row * C;
  T *dxr = dx + row * C;
  const T m = mean[row], r = rstd[row];
  T sg = 0, sgx = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T g = dyr[j] * w[j];
    sg += g;
    sgx += g * ((xr[j] - m) * r);
  }
  const T mg = block_sum(sg, buf) / (T)C;
  const T mgx = block_sum(sgx, buf) / (T)C;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T v = r * (dyr[j] * w[j] - mg - (xr[j] - m) * r * mgx);
    dxr[j] = accumulate ? resr[j] + v : v;
  }
}
""", traffic=_layernorm_bwd_traffic))

# dw = sum over rows of dy xhat, db = sum over rows of dy, as partial sums per chunk of rows:
# block (32, 8) sums 32 columns over one chunk; the wrapper adds the (chunks, C) partials in a
# fixed order, so the result is deterministic (no atomics).
LN_PARAM_BLOCK = (32, 8)
LAYERNORM_BWD_PARAMS = cuda.register(cuda.RawSpec("layernorm_bwd_params", r"""
extern "C" __global__ void layernorm_bwd_params(const T *dy, const T *x, const T *mean, const T *rstd,
                                                T *part_w, T *part_b, const int N, const int C,
                                                const int rows_per_chunk) {
  __shared__ T acc_w[8][32];
  __shared__ T acc_b[8][32];
  const int j = blockIdx.x * 32 + threadIdx.x;
  const int first = blockIdx.y * rows_per_chunk;
  const int stop = first + rows_per_chunk < N ? first + rows_per_chunk : N;
  T sw = 0, sb = 0;
  if (j < C) {
    for (int i = first + threadIdx.y; i < stop; i += 8) {
      const long long k = (long long)i * C + j;
      const T g = dy[k];
      sw += g * ((x[k] - mean[i]) * rstd[i]);
      sb += g;
    }
  }
  acc_w[threadIdx.y][threadIdx.x] = sw;
  acc_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && j < C) {
    for (int k = 1; k < 8; ++k) {
      sw += acc_w[k][threadIdx.x];
      sb += acc_b[k][threadIdx.x];
    }
    part_w[(long long)blockIdx.y * C + j] = sw;
    part_b[(long long)blockIdx.y * C + j] = sb;
  }
}
"""))


def layernorm_forward_gpu(x, w, b, eps=1e-5, residual=None, out=None):
    """LayerNorm of the rows of x (..., C) (CuPy, contiguous); returns (y, mean, rstd), y shaped
    like x, mean and rstd (N, 1) as minitensor/layers/layernorm.py caches them (N = x.size / C).

    With `residual` (x's shape), x is first updated in place to x + residual, the residual join
    of a pre-norm block fused into the normalisation; the caller then caches x as the input.
    `out` may be x itself."""
    fn = "layernorm_forward_gpu"
    N, C = cuda.rows(fn, x)
    cuda.vector(fn, "w", w, x)
    cuda.vector(fn, "b", b, x)
    for name, a in (("residual", residual), ("out", out)):
        if a is not None:
            cuda.like(fn, name, a, x)
    xp = array_module(x)
    y = xp.empty_like(x) if out is None else out
    mean = xp.empty((N, 1), dtype=x.dtype)
    rstd = xp.empty((N, 1), dtype=x.dtype)
    if N:
        cuda.launch(LAYERNORM_FWD, x.dtype, (N,), (cuda.threads(C, 128),),
                (x, x if residual is None else residual, w, b, y, mean, rstd, np.int32(C), x.dtype.type(eps),
                 np.int32(residual is not None)))
    return y, mean, rstd


def layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, add_to=None, residual=None):
    """dx of LayerNorm from dy and the forward's x, w, mean, rstd (all CuPy, contiguous; x and dy
    (..., C), mean and rstd N values); accumulates dw += sum(dy xhat), db += sum(dy) over rows.

    Returns a new dx; with `residual` (x's shape, contiguous), a new residual + dx, the residual
    gradient of a pre-norm block, fused (residual is kept); with `add_to` instead, adds dx into
    add_to in place and returns it."""
    fn = "layernorm_backward_gpu"
    N, C = cuda.rows(fn, x)
    cuda.like(fn, "dy", dy, x)
    cuda.vector(fn, "w", w, x)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.size != N or a.dtype != x.dtype or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must hold {N} contiguous {x.dtype} values, got {a.dtype} {a.shape}")
    for name, a in (("dw", dw), ("db", db)):
        if a.shape != (C,):
            raise ValueError(f"{fn}: {name} must have shape ({C},), got {a.shape}")
    if add_to is not None and residual is not None:
        raise ValueError(f"{fn}: give add_to (in place) or residual (kept), not both")
    for name, a in (("add_to", add_to), ("residual", residual)):
        if a is not None:
            cuda.like(fn, name, a, x)
    xp = array_module(x)
    dx = xp.empty_like(x) if add_to is None else add_to
    res = add_to if add_to is not None else residual
    if not N:
        return dx
    cuda.launch(LAYERNORM_BWD, x.dtype, (N,), (cuda.threads(C, 128),),
            (dy, x, w, mean, rstd, dx if res is None else res, dx, np.int32(C), np.int32(res is not None)))
    _layernorm_param_grads(dy, x, mean, rstd, dw, db, N, C)
    return dx


def _layernorm_param_grads(dy, x, mean, rstd, dw, db, N, C):
    """dw += sum(dy xhat), db += sum(dy) over the rows: partial sums per chunk of rows, both into one
    (2, chunks, C) buffer, added up by one reduction."""
    rows_per_chunk = max(64, -(-N // 128))  # at most 128 chunks: enough blocks to fill a GPU
    chunks = -(-N // rows_per_chunk)
    parts = array_module(x).empty((2, chunks, C), dtype=x.dtype)
    cuda.launch(LAYERNORM_BWD_PARAMS, x.dtype, (-(-C // 32), chunks), LN_PARAM_BLOCK,
            (dy, x, mean, rstd, parts[0], parts[1], np.int32(N), np.int32(C), np.int32(rows_per_chunk)))
    sums = parts.sum(axis=1)
    joint = _joined(dw, db, (2, C))
    if joint is not None:  # db follows dw in the gradient buffer: one add
        joint += sums
    else:
        dw += sums[0]
        db += sums[1]


# =============================================================================================
# The causal softmax over (..., T, T) attention scores, forward, backward, recomputed

# One block per row; row r of a matrix attends to columns 0..r only (r = the row's index mod T).
# The masked columns are never read and are written as exact zeros; p may be s itself.
def _causal_fraction(n_ctx):
    """The share of a (T, T) matrix on and below the diagonal: what the causal kernels read."""
    return (int(n_ctx) + 1) / (2 * int(n_ctx))


def _causal_softmax_fwd_traffic(s, p, lse, n_ctx, write_lse, **_):
    """s read on and below the diagonal; p written in full (the masked part as zeros), lse if asked."""
    return s.nbytes * _causal_fraction(n_ctx), p.nbytes + (lse.nbytes if write_lse else 0)


def _causal_softmax_bwd_traffic(dp, p, ds, n_ctx, **_):
    """dp and p read on and below the diagonal; ds written in full."""
    return (dp.nbytes + p.nbytes) * _causal_fraction(n_ctx), ds.nbytes


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
""", traffic=_causal_softmax_fwd_traffic))

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
""", traffic=_causal_softmax_bwd_traffic))

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
    cuda.on_cupy(fn, s, "Ops.block_probs_again")
    kern = CAUSAL_SOFTMAX_RECOMPUTE.kernel()
    args = (s, lse.reshape(-1), np.int32(T), s.dtype.type(scale))
    return kern(*args) if out is None else kern(*args, cuda.out_like(fn, s, out))


# =============================================================================================
# Softmax cross-entropy over (N, V) logits

# One block per row of V logits, of which the first n_valid are the vocabulary's (the rest: the tied
# head's padding, given probability 0). The probabilities overwrite the logits; z[target] is read
# by thread 0 before any write (the writes come after two barriers). A target outside [0, n_valid)
# makes the row's loss NaN rather than reading out of bounds: the check costs no host synchronisation.
def _softmax_xent_fwd_traffic(z, targets, losses, V, n_valid, **_):
    """The logits' first n_valid columns read, every column overwritten by the probabilities (in place),
    the targets read, the losses written."""
    return z.nbytes * int(n_valid) // int(V) + targets.nbytes, z.nbytes + losses.nbytes


SOFTMAX_XENT_FWD = cuda.register(cuda.RawSpec("softmax_xent_fwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void softmax_xent_fwd(T *z, const long long *targets, T *losses, const int V,
                                            const int n_valid) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  T *zr = z + row * V;
  const long long t = targets[row];
  const bool valid = t >= 0 && t < n_valid;
  const T picked = threadIdx.x == 0 && valid ? zr[t] : (T)0;
  T top = lowest_of(picked);
  for (int j = threadIdx.x; j < n_valid; j += blockDim.x) top = zr[j] > top ? zr[j] : top;
  top = block_max(top, buf);
  T total = 0;
  for (int j = threadIdx.x; j < n_valid; j += blockDim.x) total += exp_of(zr[j] - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < V; j += blockDim.x) zr[j] = j < n_valid ? exp_of(zr[j] - top) / total : (T)0;
  if (threadIdx.x == 0) losses[row] = valid ? log_of(total) + top - picked : nan_of(top);
}
""", traffic=_softmax_xent_fwd_traffic))

SOFTMAX_XENT_BWD = cuda.register(cuda.ElementwiseSpec(
    "softmax_xent_bwd", "T probs, raw int64 targets, int32 V, T scale", "T dz",
    "const unsigned int row = (unsigned int)i / (unsigned int)V;\n"
    "const long long col = (long long)((unsigned int)i - row * (unsigned int)V);\n"
    "dz = (probs - (col == targets[row] ? (T)1 : (T)0)) * scale;",
    reference=lambda probs, targets, V, scale: _xent_bwd_flat(probs, targets, int(V), scale),
    scalars=(("V", 5), ("scale", 0.25)),
))


def _xent_bwd_flat(probs, targets, V, scale):
    i = np.arange(probs.size)
    onehot = i % V == targets.astype(np.int64)[i // V]
    return (probs - onehot) * scale


def softmax_xent_forward_gpu(logits, targets, valid=None):
    """Softmax cross-entropy of logits (..., V) (CuPy, contiguous, overwritten by the
    probabilities) against integer targets (...); returns (loss, losses): the mean as a 0-d
    device array (no host synchronisation) and the per-row terms. With valid (1..V), only the
    first `valid` columns are logits, the others padding given probability 0. A target outside
    [0, valid) gives a NaN loss."""
    fn = "softmax_xent_forward_gpu"
    z, t = _xent_operands(fn, logits, targets)
    V = z.shape[1]
    valid = V if valid is None else int(valid)
    if not 1 <= valid <= V:
        raise ValueError(f"{fn}: valid must be in [1, {V}], got {valid}")
    xp = array_module(logits)
    losses = xp.empty(z.shape[0], dtype=z.dtype)
    if z.shape[0]:
        cuda.launch(SOFTMAX_XENT_FWD, z.dtype, (z.shape[0],), (cuda.threads(valid, 512),),
                (z, t, losses, np.int32(V), np.int32(valid)))
    return losses.mean(), losses


def softmax_xent_backward_gpu(probs, targets, dloss=1.0):
    """In place over probs (..., V) from softmax_xent_forward_gpu: dlogits = dloss (probs -
    onehot(targets)) / N, N the number of rows; returns it."""
    fn = "softmax_xent_backward_gpu"
    z, t = _xent_operands(fn, probs, targets)
    if z.size >= 2**31:
        raise ValueError(f"{fn}: {z.size} logits; at most 2**31 - 1 are supported")
    cuda.on_cupy(fn, probs, "Ops.softmax_xent_backward")
    if z.shape[0]:
        SOFTMAX_XENT_BWD.kernel()(probs, t, np.int32(z.shape[1]), float(dloss) / z.shape[0], probs)
    return probs


def _xent_operands(fn, logits, targets):
    dtype = getattr(logits, "dtype", None)
    if dtype not in (np.float32, np.float64) or not logits.flags.c_contiguous or logits.ndim < 1:
        raise ValueError(f"{fn}: logits must be a contiguous float32 or float64 array (..., V)")
    if targets.shape != logits.shape[:-1] or targets.dtype.kind not in "iu":
        raise ValueError(f"{fn}: targets must be integers of shape {logits.shape[:-1]}, got "
                         f"{targets.dtype} {targets.shape}")
    xp = array_module(logits)
    t = xp.ascontiguousarray(targets.reshape(-1), dtype=np.int64)
    return logits.reshape(-1, logits.shape[-1]), t


# =============================================================================================
# The embedding's backward: dW[id] += the rows at that id's positions, summed in position order

# Block (k, j) handles position k of the sorted order and columns j*blockDim..: only the first
# position of each id's run works, adding that run's rows one after another (no atomics, so the
# same sums in the same order on every run). Blocks of the other positions return at once.
SCATTER_ADD_ROWS = cuda.register(cuda.RawSpec("scatter_add_rows", r"""
extern "C" __global__ void scatter_add_rows(T *dW, const T *rows, const long long *order,
                                            const long long *sorted_ids, const long long n, const int C) {
  const long long first = blockIdx.x;
  const long long c = (long long)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C || (first > 0 && sorted_ids[first - 1] == sorted_ids[first])) return;
  const long long id = sorted_ids[first];
  T acc = dW[id * C + c];
  for (long long k = first; k < n && sorted_ids[k] == id; ++k) acc += rows[order[k] * C + c];
  dW[id * C + c] = acc;
}
"""))


# =============================================================================================
# AdamW over the whole flat buffer, one elementwise pass

def _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    """ADAMW_STEP's operation through tricks.adamw_update (Ops.adamw_step folded), on copies of p, m, v."""
    p, m, v = p_in.copy(), m_in.copy(), v_in.copy()
    scale = np.asarray(grad_scale).reshape(-1)[0]  # the kernel reads grad_scale[0]
    adamw_update(np, p, g, m, v, np.empty_like(p), beta1, beta2, scale, step_size, eps_hat, 1.0 - decay * mask)
    return p, m, v


# adamw_update's form: m_hat / (sqrt(v_hat) + eps) = (m sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)),
# so the bias corrections are two host scalars (step_size, eps_hat). grad_scale is a one-element
# device array (the clipping scale, computed on the device: reading it would stall the step).
# Each output is computed from the inputs before any is written, so p, m, v may be passed as
# their own outputs (in place).
ADAMW_STEP = cuda.register(cuda.ElementwiseSpec(
    "adamw_step",
    "T p_in, T m_in, T v_in, T g, T mask, T beta1, T beta2, raw T grad_scale, T step_size, T eps_hat, T decay",
    "T p, T m, T v",
    "const T gs = g * grad_scale[0];\n"
    "const T m1 = beta1 * m_in + ((T)1 - beta1) * gs;\n"
    "const T v1 = beta2 * v_in + ((T)1 - beta2) * gs * gs;\n"
    "const T p1 = p_in * ((T)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));\n"
    "m = m1;\nv = v1;\np = p1;",
    reference=_adamw_op_reference,
    scalars=(("beta1", 0.9), ("beta2", 0.95), ("step_size", 1e-3), ("eps_hat", 1e-8), ("decay", 1e-4)),
    domains=(("v_in", np.abs), ("mask", lambda a: (a > 0).astype(a.dtype))),
))


def adamw_step_gpu(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step, in place over the flat CuPy buffers p, m, v (same shape and dtype as g and
    mask, mask 1 where weight decay applies, 0 elsewhere); t counts steps from 1. Equals
    Ops.adamw_step: the gradient is g * grad_scale (clipping), grad_scale a number or a
    one-element device array."""
    if t < 1:
        raise ValueError(f"adamw_step_gpu: t counts steps from 1, got {t}")
    adamw_kernel(p, g, m, v, mask, beta1, beta2, grad_scale, *adamw_scalars(lr, beta1, beta2, eps, t),
                 lr * weight_decay)
    return p


def adamw_kernel(p, g, m, v, mask, b1, b2, grad_scale, step_size, eps_hat, decay):
    """Ops.adamw_step through ADAMW_STEP: in place over the flat p, m, v (mask 1 where decayed)."""
    fn = "adamw_step_gpu"
    cuda.check_operands(fn, p, None)
    for name, a in (("g", g), ("m", m), ("v", v), ("mask", mask)):
        cuda.like(fn, name, a, p, contiguous=False)
    cuda.on_cupy(fn, p, "Ops.adamw_step")
    scale = array_module(p).asarray(grad_scale, dtype=p.dtype).reshape(1)
    ADAMW_STEP.kernel()(p, m, v, g, mask, b1, b2, scale, step_size, eps_hat, decay, p, m, v)
