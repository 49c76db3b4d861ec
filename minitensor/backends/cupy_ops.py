"""The GPU backend: CuPy, with GELU as an ElementwiseKernel and the fused CUDA kernels.

`CupyOps` overrides pieces of `minitensor.backends.ops.Ops`, each with a kernel that must equal the Ops
method it replaces, and falls back to `super()` where a kernel does not apply:

    gelu_forward / gelu_backward       'gelu_fwd' / 'gelu_bwd' (ElementwiseKernels, any float dtype)
    add_epilogue                       'bias_residual_add' with a bias and a residual (ElementwiseKernel,
                                       the same adds as Ops': any float dtype)
    bias_gelu_forward / _backward      'bias_gelu_fwd' / '_bwd' ('_bwd_fwd' with the output recomputed),
                                       fused piece bias_gelu
    layernorm_forward / _backward      'layernorm_fwd', '_bwd', '_bwd_params' fused piece layernorm
    attention_forward_dense            'causal_softmax_fwd' / '_bwd' (the dense core's softmax, backward through
                                       attention_backward by its cache type) fused piece causal_softmax
    softmax_xent_forward / _backward   'softmax_xent_fwd' / '_bwd'           fused piece softmax_xent
    adamw_step                         'adamw_step'                          fused piece adamw
    scatter_add_rows                   'scatter_add_rows' (always: deterministic where add.at's atomics are not)
    linear_weight_grads, gemm          cuBLAS's own GEMM and GEMV (minitensor.backends.cublas, always): beta 1
                                       accumulates a gradient in the GEMM's output pass, transposed operands
                                       and longer rows taken as stored (the dense core's batched GEMMs too)
    attention_forward                  'flash_attention_fwd', '_bwd_dq', '_bwd_dkv' (head sizes a multiple
                                       of 16 up to 64, float32 on TF32 tensor cores) fused piece
                                       flash_attention; else the dense core within a memory budget (a
                                       64th of the GPU's memory per layer: 2.2 GB on an H200, where
                                       ANDREA-120M at 8 x 1024 needs 384 MiB), else the query
                                       blocks of minitensor.backends.blocked

Which fused pieces a CupyOps runs is fixed when it is built (`CupyOps(xp, fused=...)`; through
`minitensor.backends.get_ops(cupy, kernels)`, where kernels="auto" runs the start-up self-check of
minitensor.checks.selfcheck once: each piece's sample once through the Ops code and once through the
kernel, keeping those that agree).

Each fused piece is declared once, by a record (`cuda.fused_piece`) at the end of its section below:
its name, the Ops methods it replaces, its kernels, how to build its sample inputs (`sample`, the
self-check's) and gpu_check's comparisons at ANDREA-120M shapes (`cases`). The CUDA source of every
kernel is in minitensor/backends/kernels/, the section `// @kernel NAME` of one .cu file.

Every kernel is registered in minitensor.backends.cuda.KERNELS, so that two checks run without a GPU
(`python -m minitensor.checks --check | --host-check`): NVRTC compiles each one, and g++ runs
each elementwise operation on the host against its `reference`, which is the Ops code. Only
CuPy's public API is called here (ElementwiseKernel and RawKernel through minitensor.backends.cuda,
cupy.cuda for the device, cuBLAS through cupy_backends.cuda.libs.cublas in minitensor.backends.cublas),
so a NumPy-backed stand-in of CuPy can run this file in CI.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor.backends import cublas, cuda
from minitensor.backends.blocked import BlockedAttention
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import FreshGrads, adamw_scalars, adamw_update
from minitensor.device import CUBLAS_TF32_TENSOR_OP_MATH, array_module

_REFERENCE = Ops(np)  # what every elementwise kernel's host check compares with


class FusedAttentionCache(NamedTuple):
    """What the fused dense core keeps: q (unscaled), k, v (B*n_head, T, hs); p (B*n_head, T, T)."""
    q: object
    k: object
    v: object
    p: object


class FlashAttentionCache(NamedTuple):
    """What the flash core keeps: q (unscaled), k, v (B*n_head, T, hs); y4, the output as a
    (B, n_head, T, hs) view; lse, each query row's log-sum-exp."""
    q: object
    k: object
    v: object
    y4: object
    lse: object


def _draw(xp, rng, *shape, scale=1.0, shift=0.0):
    return xp.asarray((shift + scale * rng.standard_normal(shape)).astype(np.float32))


class CupyOps(BlockedAttention, Ops):
    name = "cupy"
    # the dense attention core when all heads' probabilities fit this many bytes (None: a 64th of
    # the GPU's memory)
    dense_max_bytes = None
    # the flash kernels' float32 products on TF32 tensor cores: None as the cuBLAS math mode says
    # (train.tf32), True or False whatever it says (the self-check checks both)
    flash_tf32 = None

    def __init__(self, xp, fused=(), kernels_line=None):
        """fused: the fused pieces to run (names of their records, minitensor.backends.fused_pieces()),
        the others through the Ops code; kernels_line: the log line that says how they were chosen."""
        super().__init__(xp)
        unknown = set(fused) - set(cuda.PIECES)  # every record is in: this module declares them
        if unknown:
            raise ValueError(f"unknown fused pieces {sorted(unknown)}: choose from {', '.join(cuda.PIECES)}")
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
        """dW = x^T dy by cuBLAS with beta 0 the first time after fill_zero (the first micro-batch after
        zero_grad, FreshGrads), beta 1 on later micro-batches (the gradient accumulated in the GEMM's
        output pass: no temporary, no add); db likewise as the GEMV dy^T ones
        (minitensor.backends.cublas). Ops' code where cuBLAS cannot take an operand as it is laid out."""
        write = self._fresh.take(dW)
        beta = 0.0 if write else 1.0
        if not cublas.gemm(x.T, dy, dW, beta):                # Ops adds (to zeros, when write)
            return super().linear_weight_grads(x, dy, dW, db)
        if db is None or cublas.colsum(dy, db, _ones(self.xp, dy.shape[0], dy.dtype), beta):
            return
        if write:
            dy.sum(axis=0, out=db)
        else:
            db += dy.sum(axis=0)

    def gemm(self, a, b, out, accumulate=False):
        """By cuBLAS with beta 1 to accumulate, taking operands and out with longer rows or transposed
        as they are laid out (CuPy's matmul would copy them)."""
        if not cublas.gemm(a, b, out, 1.0 if accumulate else 0.0):
            super().gemm(a, b, out, accumulate)

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
        if not self.fused("layernorm") or x.shape[-1] > LN_MAX_C:
            return super().layernorm_backward(dy, x, mean, rstd, w, dw, db, dres)
        # the kernel reads the skip gradient and writes dx beside it: the caller's array is kept
        residual = None if dres is None else self.xp.ascontiguousarray(dres)
        return layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=residual)

    # --- attention ---

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """fused flash_attention (unless dense or blocks are asked for): the flash kernels where they take
        the head size and dtype; else the dense core within a memory budget, else Ops' query blocks."""
        if dense is None and self.fused("flash_attention") and flash_fits(qkv4[0].shape[-1], y4.dtype):
            return self.attention_forward_flash(qkv4, b, y4)
        if dense is None:
            B, nh, T, _ = qkv4[0].shape
            dense = B * nh * T * T * y4.itemsize <= (self.dense_max_bytes or _gpu_memory(self.xp) // 64)
        return super().attention_forward(qkv4, b, y4, block, keep_probs_max_bytes, dense)

    # The dense core with the fused softmax: the 1/sqrt(hs) scale goes into the softmax kernels
    # (forward: p = softmax(scale s); backward: ds = scale p (dp - rowsum(dp p))), so q is kept
    # unscaled and neither q nor dq takes a pass of its own, and rowsum(dy y) (Ops' D) is not
    # computed: the backward kernel sums dp p itself. CuPy's batched matmul would copy an operand
    # that is not C-contiguous (SPEC section 5): k^T (forward), dy^T, v^T and q^T (backward) go to
    # cuBLAS's strided batched GEMM with the transpose flag instead (_bmm); dv and dk come out
    # transposed (dv^T = dy^T p, dk^T = q^T ds), read as stored.

    def _bmm(self, a, b, out=None):
        """a @ b for (batch, M, K) @ (batch, K, N), one strided batched cuBLAS GEMM with transposed
        operands as they are stored, into out or a new C-contiguous array (CuPy's matmul where
        cuBLAS cannot take them)."""
        if out is None:
            out = self.xp.empty((*a.shape[:-1], b.shape[-1]), dtype=np.result_type(a.dtype, b.dtype))
        if not cublas.gemm(a, b, out):
            self.xp.matmul(a, b, out=out)
        return out

    def attention_forward_dense(self, qkv4, b, y4):
        if not self.fused("causal_softmax"):
            return super().attention_forward_dense(qkv4, b, y4)
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        heads = xp.empty((3, B * nh, T, hs), dtype=y4.dtype)  # q, k, v, each (BH, T, hs) contiguous
        _split_heads(xp, qkv4, b, heads.reshape(3, B, nh, T, hs))
        q, k, v = heads
        s = self._bmm(q, k.transpose(0, 2, 1))                # (BH, T, T) unscaled scores
        p = causal_softmax_forward_gpu(s, 1.0 / math.sqrt(hs), out=s)
        y4[...] = self._bmm(p, v).reshape(B, nh, T, hs)       # heads back in order
        return FusedAttentionCache(q, k, v, p)

    def attention_backward(self, dy4, saved, grads4):
        if isinstance(saved, FlashAttentionCache):
            return self._attention_backward_flash(dy4, saved, grads4)
        if not isinstance(saved, FusedAttentionCache):
            return super().attention_backward(dy4, saved, grads4)
        xp = self.xp
        q, k, v, p = saved                                    # q unscaled (attention_forward_dense above)
        BH, T, hs = q.shape
        B, nh = dy4.shape[:2]
        dy = xp.ascontiguousarray(dy4).reshape(BH, T, hs)
        dkvT = xp.empty((2, BH, hs, T), dtype=q.dtype)        # dk^T, dv^T side by side
        self._bmm(dy.transpose(0, 2, 1), p, out=dkvT[1])      # forward was y = p v: dv^T = dy^T p
        dp = self._bmm(dy, v.transpose(0, 2, 1))
        # forward was p = softmax(scale q k^T): ds = scale p (dp - rowsum(dp p)), dq = ds k, dk^T = q^T ds
        ds = causal_softmax_backward_gpu(dp, p, 1.0 / math.sqrt(hs), out=dp)
        dq = self._bmm(ds, k)
        self._bmm(q.transpose(0, 2, 1), ds, out=dkvT[0])
        dkv = dkvT.transpose(0, 1, 3, 2).reshape(2, B, nh, T, hs)
        stacked = _stacked_heads(grads4)
        if stacked is not None:                               # dk and dv in one copy
            stacked[0][...] = dq.reshape(B, nh, T, hs)
            stacked[1:][...] = dkv
            return
        for g, d in zip(grads4, (dq.reshape(B, nh, T, hs), dkv[0], dkv[1])):
            g[...] = d

    # The flash core (minitensor/backends/kernels/attention.cu): no (T, T) array at all. q is kept
    # unscaled (the kernels take the scale), y and dy are read and written where they lie in the
    # layer's (B, T, C) arrays, rowsum(dy y) is computed by the backward's first kernel.

    def attention_forward_flash(self, qkv4, b, y4):
        xp = self.xp
        B, nh, T, hs = qkv4[0].shape
        heads = xp.empty((3, B * nh, T, hs), dtype=y4.dtype)  # q, k, v, each (BH, T, hs) contiguous
        _split_heads(xp, qkv4, b, heads.reshape(3, B, nh, T, hs))
        q, k, v = heads
        rows, n_head, in_place = _head_rows(xp, y4, write=True)
        _, lse = flash_attention_forward_gpu(q, k, v, 1.0 / math.sqrt(hs), rows, n_head=n_head, tf32=self._tf32())
        if not in_place:                                      # y4 is not the heads of a (B, T, C) array
            y4[...] = rows.reshape(B, nh, T, hs)
        return FlashAttentionCache(q, k, v, y4, lse)

    def _tf32(self):
        """Whether the flash kernels' float32 products run on TF32 tensor cores: flash_tf32 where set,
        else as the batched GEMMs do, by the cuBLAS handle's math mode (minitensor.device.set_tf32)."""
        if self.flash_tf32 is not None:
            return self.flash_tf32
        from cupy_backends.cuda.libs import cublas

        mode = cublas.getMathMode(self.xp.cuda.device.get_cublas_handle())
        return mode & 0xF == CUBLAS_TF32_TENSOR_OP_MATH  # the flags above the low bits aside

    def _attention_backward_flash(self, dy4, saved, grads4):
        xp = self.xp
        q, k, v, y4, lse = saved
        BH, T, hs = q.shape
        B, nh = dy4.shape[:2]
        y, n_y, _ = _head_rows(xp, y4)
        dy, n_dy, _ = _head_rows(xp, dy4)
        if n_y != n_dy:                                       # one n_head for both: both as (BH, T, hs)
            (y, n_y), (dy, n_dy) = ((xp.ascontiguousarray(a).reshape(BH, T, hs), 1) for a in (y4, dy4))
        grads = flash_attention_backward_gpu(q, k, v, y, dy, lse, 1.0 / math.sqrt(hs), n_head=n_y, tf32=self._tf32())
        stacked = _stacked_heads(grads4)
        if stacked is not None:                               # dq, dk and dv in one copy
            stacked[...] = grads.reshape(3, B, nh, T, hs)
            return
        for g, d in zip(grads4, grads):
            g[...] = d.reshape(B, nh, T, hs)

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


def _head_rows(xp, a4, write=False):
    """(rows, n_head, in place) for the flash kernels from a (B, nh, T, hs) array: the (B, T, nh, hs)
    array it is a view of, read (and written) in place, where it is one (the heads of a (B, T, C)
    array); else a contiguous (B*nh, T, hs) copy (write: an empty one) with n_head 1."""
    rows = a4.transpose(0, 2, 1, 3)
    if rows.flags.c_contiguous:
        return rows, a4.shape[1], True
    B, nh, T, hs = a4.shape
    if write:
        return xp.empty((B * nh, T, hs), dtype=a4.dtype), 1, False
    return xp.ascontiguousarray(a4).reshape(B * nh, T, hs), 1, False


_gpu_memory_bytes = {}
_ones_kept = {}  # (CuPy module, device, dtype) -> a device vector of ones (_ones)


def _ones(xp, n, dtype):
    """A device vector of at least n ones of dtype on the current device, kept (copied from the host
    once: no launch)."""
    key = (xp, xp.cuda.Device().id, np.dtype(dtype))
    have = _ones_kept.get(key)
    if have is None or have.shape[0] < n:
        have = _ones_kept[key] = xp.asarray(np.ones(n, dtype))
    return have


def _gpu_memory(xp):
    """The current GPU's total memory in bytes, asked once per device."""
    device = xp.cuda.Device()
    if device.id not in _gpu_memory_bytes:
        _gpu_memory_bytes[device.id] = device.mem_info[1]
    return _gpu_memory_bytes[device.id]


# =============================================================================================
# GELU (the ElementwiseKernels)

# The formulas and their constants: kernels/gelu.cu. The references are the Ops methods themselves.
GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_fwd", "T x", "T y", "gelu.cu",
    reference=lambda x: _REFERENCE.gelu_forward(x),
))

GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_bwd", "T x, T dy", "T dx", "gelu.cu",
    reference=lambda x, dy: _REFERENCE.gelu_backward(x, dy),
))


# ---------------------------------------------------------------------------------------------
# bias + GELU: y = GELU(x + b), b broadcast over the rows; x is the matmul output (N, C) ---


def _column(n, C):
    """Column of each flat index of an (n / C, C) array: what `i % C` gives in the kernels."""
    return np.arange(n) % int(C)


# The references are GELU's Ops code applied to h = x + b, on flat arrays as the kernels see them,
# gathering the bias by i % C (the host check's flat samples, C = 7, are not whole rows).
BIAS_GELU_FWD = cuda.ElementwiseSpec(
    "bias_gelu_fwd", "T x, raw T b, int32 C", "T y", "gelu.cu",
    reference=lambda x, b, C: _REFERENCE.gelu_forward(x + b[_column(x.size, C)]),
    scalars=(("C", 7),),
)

BIAS_GELU_BWD = cuda.ElementwiseSpec(
    "bias_gelu_bwd", "T x, raw T b, int32 C, T dy", "T dh", "gelu.cu",
    reference=lambda x, b, C, dy: _REFERENCE.gelu_backward(x + b[_column(x.size, C)], dy),
    scalars=(("C", 7),),
)


BIAS_GELU_BWD_FWD = cuda.ElementwiseSpec(
    "bias_gelu_bwd_fwd", "T x, raw T b, int32 C, T dy", "T dh, T y", "gelu.cu",
    reference=lambda x, b, C, dy: (_REFERENCE.gelu_backward(x + b[_column(x.size, C)], dy),
                                   _REFERENCE.gelu_forward(x + b[_column(x.size, C)])),
    scalars=(("C", 7),),
)


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


# --- the fused piece bias_gelu: its record, the self-check's sample, gpu_check's cases ---


def _bias_gelu_sample(ops, rng):
    """GELU(x + b) forward and backward over (150, 70), wide enough to reach the tails; the backward
    also with the output recomputed (as MLP.backward asks)."""
    xp = ops.xp
    x, b, dy = _draw(xp, rng, 150, 70, scale=4.0), _draw(xp, rng, 70), _draw(xp, rng, 150, 70)
    y = ops.bias_gelu_forward(x, b)
    return y, ops.bias_gelu_backward(x, b, dy), *ops.bias_gelu_backward(x, b, dy, recompute_output=True)


def _bias_gelu_cases(k):
    """The MLP's bias + GELU, forward and backward (the bias gradient summed in), against the Ops."""

    def setup():
        k.reseed()
        a, b = k.rand(k.N, k.F, scale=2.0), k.rand(k.F, scale=0.1)
        return dict(a=a, b=b, h=a + b, dy=k.rand(k.N, k.F), db=k.zeros(k.F), hb=k.xp.empty_like(a))

    def generic_fwd(d):
        k.xp.add(d["a"], d["b"], out=d["hb"])  # the Linear adds its bias into the matmul output
        return (k.ref.gelu_forward(d["hb"]),)

    def generic_bwd(d):
        dh = k.ref.gelu_backward(d["h"], d["dy"])
        d["db"] += dh.sum(axis=0)
        return dh, d["db"]

    return [
        ("bias + gelu fwd", setup, lambda d: (bias_gelu_forward_gpu(d["a"], d["b"]),), generic_fwd, True),
        ("bias + gelu bwd", setup, lambda d: (bias_gelu_backward_gpu(d["a"], d["b"], d["dy"], db=d["db"]),
                                              d["db"]), generic_bwd, True),
    ]


BIAS_GELU = cuda.fused_piece(
    "bias_gelu",
    replaces=("bias_gelu_forward", "bias_gelu_backward"),
    kernels=(BIAS_GELU_FWD, BIAS_GELU_BWD, BIAS_GELU_BWD_FWD),
    sample=_bias_gelu_sample,
    cases=_bias_gelu_cases,
)


BIAS_RESIDUAL_ADD = cuda.register(cuda.ElementwiseSpec(
    "bias_residual_add", "T y_in, raw T b, int32 C, T r", "T y", "linear.cu",
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
# against the textbook form in tests/support/formulas.py. The kernels: kernels/layernorm.cu.


def _layernorm_fwd_traffic(x, residual, w, b, y, mean, rstd, add_residual, **_):
    """x (and the residual, when added: x is then written back) read once, y and the statistics written."""
    joined = x.nbytes if add_residual else 0
    return x.nbytes + joined + w.nbytes + b.nbytes, y.nbytes + mean.nbytes + rstd.nbytes + joined


LAYERNORM_FWD = cuda.RawSpec("layernorm_fwd", "layernorm.cu", traffic=_layernorm_fwd_traffic)


# forward was: y = xhat w + b, xhat = (x - mean) rstd. Block b handles rows [b rpc, (b + 1) rpc) (rpc =
# rows_per_chunk) one after another: each row's dx, written or (with accumulate) written as res + dx,
# the residual gradient of a pre-norm block, fused (res may be dx itself: each thread reads res[j]
# before it writes dx[j]); and, over the block's rows in order, the partial parameter sums
# part_w[b] = sum dy xhat, part_b[b] = sum dy, each thread holding its columns' sums in registers
# (column j = threadIdx.x + k blockDim.x, k < LN_COLS, so C <= LN_COLS blockDim.x). The row's dy w
# and xhat stay in registers between the two passes over it.
LN_COLS, LN_THREADS = 8, 256
LN_MAX_C = LN_COLS * LN_THREADS  # 2048: at most 256 threads, so that any register count fits a block
# At most LN_CHUNKS blocks of at least LN_CHUNK_ROWS rows: for 8 x 1024 rows, 512 blocks of 16 (4 a
# streaming multiprocessor on an H200), their partial sums 2 x 512 x C values (3 MB at C = 768,
# against dy's and x's 50 MB).
LN_CHUNKS, LN_CHUNK_ROWS = 512, 16


def _layernorm_bwd_traffic(dy, x, w, mean, rstd, res, dx, part_w, part_b, accumulate, **_):
    """dy, x and the statistics read once, and res when accumulating; dx and the partial sums written."""
    read = dy.nbytes + x.nbytes + w.nbytes + mean.nbytes + rstd.nbytes + (res.nbytes if accumulate else 0)
    return read, dx.nbytes + part_w.nbytes + part_b.nbytes


LAYERNORM_BWD = cuda.RawSpec("layernorm_bwd", "layernorm.cu", traffic=_layernorm_bwd_traffic)


# The parameter sums' second launch: blocks of (32, 8) threads, each adding 32 columns' partials.
LN_PARAM_BLOCK = (32, 8)
LAYERNORM_BWD_PARAMS = cuda.RawSpec("layernorm_bwd_params", "layernorm.cu")


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
    (..., C), C at most LN_MAX_C, mean and rstd N values); accumulates dw += sum(dy xhat),
    db += sum(dy) over rows.

    Returns a new dx; with `residual` (x's shape, contiguous), a new residual + dx, the residual
    gradient of a pre-norm block, fused (residual is kept); with `add_to` instead, adds dx into
    add_to in place and returns it. Two launches: dx with the parameters' partial sums per chunk of
    rows (layernorm_bwd), then those summed into dw and db (layernorm_bwd_params)."""
    fn = "layernorm_backward_gpu"
    N, C = cuda.rows(fn, x)
    if C > LN_MAX_C:
        raise ValueError(f"{fn}: rows of {C} values; at most {LN_MAX_C} are supported (Ops.layernorm_backward "
                         f"takes any)")
    cuda.like(fn, "dy", dy, x)
    cuda.vector(fn, "w", w, x)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.size != N or a.dtype != x.dtype or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must hold {N} contiguous {x.dtype} values, got {a.dtype} {a.shape}")
    for name, a in (("dw", dw), ("db", db)):
        cuda.vector(fn, name, a, x)
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
    rows_per_chunk = max(LN_CHUNK_ROWS, -(-N // LN_CHUNKS))
    chunks = -(-N // rows_per_chunk)
    parts = xp.empty((2, chunks, C), dtype=x.dtype)  # the partial sums of dw and db per chunk of rows
    cuda.launch(LAYERNORM_BWD, x.dtype, (chunks,), (max(128, cuda.threads(-(-C // LN_COLS), LN_THREADS)),),
                (dy, x, w, mean, rstd, dx if res is None else res, dx, parts[0], parts[1], np.int32(N), np.int32(C),
                 np.int32(rows_per_chunk), np.int32(res is not None)))
    cuda.launch(LAYERNORM_BWD_PARAMS, x.dtype, (-(-C // 32),), LN_PARAM_BLOCK,
                (parts[0], parts[1], dw, db, np.int32(chunks), np.int32(C)))
    return dx


# --- the fused piece layernorm: its record, the self-check's sample, gpu_check's cases ---


def _layernorm_sample(ops, rng):
    """LayerNorm forward and backward (with a skip gradient) over 40 rows of 100 columns."""
    from minitensor.layers.layernorm import LayerNorm

    xp = ops.xp
    C = 100  # not a multiple of the 32-thread warps
    dw, db = xp.zeros(C, np.float32), xp.zeros(C, np.float32)
    ln = LayerNorm(_draw(xp, rng, C, shift=1.0), dw, _draw(xp, rng, C), db, ops=ops)
    y = ln.forward(_draw(xp, rng, 4, 10, C, scale=3.0, shift=0.5))
    dx = ln.backward(_draw(xp, rng, 4, 10, C), skip=_draw(xp, rng, 4, 10, C))
    return y, dx, dw, db


def _layernorm_cases(k):
    """LayerNorm forward and backward, each also with the residual add folded in, against the layer."""
    from minitensor.layers.layernorm import LayerNorm

    N, C = k.N, k.C

    def setup():
        k.reseed()
        x, dy, w, b = k.rand(N, C, shift=0.3), k.rand(N, C), k.rand(C, scale=0.2, shift=1.0), k.rand(C, scale=0.1)
        layer = LayerNorm(w, k.zeros(C), b, k.zeros(C), ops=k.ref)
        layer.forward(x)
        return dict(x=x, dy=dy, w=w, b=b, r=k.rand(N, C), layer=layer, cache=layer._cache, dw=k.zeros(C),
                    db=k.zeros(C))

    def generic_fwd(d):
        y = d["layer"].forward(d["x"])
        return y, d["layer"]._cache.mean, d["layer"]._cache.rstd

    def generic_bwd(d, add_to=None):
        layer = d["layer"]
        layer._save(d["cache"])
        dx = layer.backward(d["dy"])
        if add_to is not None:
            dx += add_to
        return dx, layer.dw, layer.db

    def generic_res(d):
        d["x"] += d["r"]
        return d["layer"].forward(d["x"]), d["x"]

    def fused_bwd(d, add_to=None):
        return (layernorm_backward_gpu(d["dy"], d["x"], d["w"], d["cache"].mean, d["cache"].rstd,
                                                d["dw"], d["db"], add_to=add_to), d["dw"], d["db"])

    return [
        ("layernorm fwd", setup, lambda d: layernorm_forward_gpu(d["x"], d["w"], d["b"]), generic_fwd,
         False),
        ("layernorm bwd", setup, fused_bwd, generic_bwd, False),
        ("layernorm fwd + residual", setup,
         lambda d: (layernorm_forward_gpu(d["x"], d["w"], d["b"], residual=d["r"])[0], d["x"]),
         generic_res, False),
        ("layernorm bwd + residual", setup, lambda d: fused_bwd(d, add_to=d["r"]),
         lambda d: generic_bwd(d, add_to=d["r"]), False),
    ]


LAYERNORM = cuda.fused_piece(
    "layernorm",
    replaces=("layernorm_forward", "layernorm_backward"),
    kernels=(LAYERNORM_FWD, LAYERNORM_BWD, LAYERNORM_BWD_PARAMS),
    sample=_layernorm_sample,
    cases=_layernorm_cases,
)


# =============================================================================================
# The causal softmax over (..., T, T) attention scores, forward, backward, recomputed

# The kernels: kernels/causal_softmax.cu.


def _causal_fraction(n_ctx):
    """The share of a (T, T) matrix on and below the diagonal: what the causal kernels read."""
    return (int(n_ctx) + 1) / (2 * int(n_ctx))


def _causal_softmax_fwd_traffic(s, p, lse, n_ctx, write_lse, **_):
    """s read on and below the diagonal; p written in full (the masked part as zeros), lse if asked."""
    return s.nbytes * _causal_fraction(n_ctx), p.nbytes + (lse.nbytes if write_lse else 0)


def _causal_softmax_bwd_traffic(dp, p, ds, n_ctx, **_):
    """dp and p read on and below the diagonal; ds written in full."""
    return (dp.nbytes + p.nbytes) * _causal_fraction(n_ctx), ds.nbytes


CAUSAL_SOFTMAX_FWD = cuda.RawSpec("causal_softmax_fwd", "causal_softmax.cu",
                                 traffic=_causal_softmax_fwd_traffic)

CAUSAL_SOFTMAX_BWD = cuda.RawSpec("causal_softmax_bwd", "causal_softmax.cu",
                                 traffic=_causal_softmax_bwd_traffic)

CAUSAL_SOFTMAX_RECOMPUTE = cuda.ElementwiseSpec(
    "causal_softmax_recompute", "T s, raw T lse, int32 n_ctx, T scale", "T p", "causal_softmax.cu",
    reference=lambda s, lse, n_ctx, scale: _recompute_flat(s, lse, int(n_ctx), scale),
    scalars=(("n_ctx", 6), ("scale", 0.35)),
)


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


# --- the fused piece causal_softmax: its record, the self-check's sample, gpu_check's cases ---


def _causal_softmax_sample(ops, rng):
    """A 4-head attention layer's dense core, forward and backward, over 2 x 40 positions."""
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.layers.linear import Linear

    xp = ops.xp
    B, T, C, nh = 2, 40, 48, 4
    grads = [xp.zeros(shape, np.float32) for shape in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    attn = CausalSelfAttention(Linear(_draw(xp, rng, C, 3 * C, scale=0.3), grads[0], _draw(xp, rng, 3 * C), grads[1],
                                      ops=ops),
                               Linear(_draw(xp, rng, C, C, scale=0.3), grads[2], _draw(xp, rng, C), grads[3], ops=ops),
                               nh, ops=ops)
    attn.dense = True
    out = attn.forward(_draw(xp, rng, B, T, C))
    return (out, attn.backward(_draw(xp, rng, B, T, C)), *grads)


def _causal_softmax_cases(k):
    """The attention's causal softmax: forward, backward, and the probabilities recomputed from the
    saved log-sum-exp, against the Ops' block softmax."""

    BH, T = k.BH, k.T

    def setup():
        k.reseed()
        s = k.rand(BH, T, T, scale=2.0)
        p, lse = s.copy(), k.xp.empty((BH, T, 1), k.dtype)
        k.ref.block_softmax(p[None], 0, lse[None])
        return dict(s=s, p=p, lse=lse, dp=k.rand(BH, T, T), lse_out=k.xp.empty((BH, T, 1), k.dtype))

    def generic_fwd(d):
        k.ref.block_softmax(d["s"][None], 0, d["lse_out"][None])
        return d["s"], d["lse_out"]

    def generic_bwd(d):
        D = (d["dp"] * d["p"]).sum(axis=-1, keepdims=True)
        k.ref.block_softmax_backward(d["dp"][None], d["p"][None], D[None])
        return (d["dp"],)

    return [
        ("causal softmax fwd", setup,
         lambda d: (causal_softmax_forward_gpu(d["s"], lse=d["lse_out"], out=d["s"]), d["lse_out"]),
         generic_fwd, False),
        ("causal softmax bwd", setup,
         lambda d: (causal_softmax_backward_gpu(d["dp"], d["p"], out=d["dp"]),), generic_bwd, False),
        ("causal softmax recompute", setup,
         lambda d: (causal_softmax_recompute_gpu(d["s"], d["lse"], out=d["s"]),),
         lambda d: (k.ref.block_probs_again(d["s"][None], 0, d["lse"][None])[0],), True),
    ]


CAUSAL_SOFTMAX = cuda.fused_piece(
    "causal_softmax",
    replaces=("attention_forward_dense",),
    kernels=(CAUSAL_SOFTMAX_FWD, CAUSAL_SOFTMAX_BWD, CAUSAL_SOFTMAX_RECOMPUTE),
    sample=_causal_softmax_sample,
    cases=_causal_softmax_cases,
)


# =============================================================================================
# Causal attention without T x T in memory: FlashAttention-2 (minitensor/backends/kernels/attention.cu)

# Keys per key tile (and query rows per tile of the backward), query rows per tile of the forward, by
# dtype (attention.cu's ROWS and FWD_ROWS); a head size a multiple of 16, at most 64.
FLASH_TILE = {np.dtype(np.float32): 32, np.dtype(np.float64): 16}
FLASH_FWD_TILE = {np.dtype(np.float32): 64, np.dtype(np.float64): 16}
FLASH_HS_MAX = 64


def flash_fits(hs, dtype):
    """Whether the flash kernels take heads of size hs in dtype."""
    return np.dtype(dtype) in FLASH_TILE and hs % 16 == 0 and 16 <= hs <= FLASH_HS_MAX


def _flash_pairs(n_ctx, query_rows, key_rows):
    """(query tile, key tile) pairs a head's launch visits: each query tile, the key tiles up to its
    last row (the diagonal tiles' masked parts computed too)."""
    T = int(n_ctx)
    return sum(-(-min(T, i0 + query_rows) // key_rows) for i0 in range(0, T, query_rows))


def _flash_work(q, n_ctx, hs, forward):
    """(BH, pairs per head, query rows per tile, keys per tile) of a launch."""
    keys = FLASH_TILE[q.dtype]
    rows = FLASH_FWD_TILE[q.dtype] if forward else keys
    return q.size // (int(n_ctx) * int(hs)), _flash_pairs(n_ctx, rows, keys), rows, keys


def _flash_flops(products, forward=False):
    """FLOPs of `products` (query rows, keys, hs) products per pair."""
    def flops(q, n_ctx, hs, **_):
        bh, pairs, rows, keys = _flash_work(q, n_ctx, hs, forward)
        return products * 2 * bh * pairs * rows * keys * int(hs)
    return flops


# Traffic counts every tile a block loads as a device-memory read: on a GPU most repeats of a head's
# tiles are L2 hits, which the step model does not see (an upper bound).
def _flash_fwd_traffic(q, k, v, y, lse, n_ctx, hs, **_):
    """q read once, a k and a v tile per pair; y and lse written."""
    bh, pairs, _, keys = _flash_work(q, n_ctx, hs, True)
    return q.nbytes + 2 * bh * pairs * keys * int(hs) * q.itemsize, y.nbytes + lse.nbytes


def _flash_bwd_dq_traffic(q, k, v, y, dy, lse, delta, dq, n_ctx, hs, **_):
    """q, dy, y and lse read once, a k and a v tile per pair; delta and dq written."""
    bh, pairs, _, keys = _flash_work(q, n_ctx, hs, False)
    return (q.nbytes + dy.nbytes + y.nbytes + lse.nbytes + 2 * bh * pairs * keys * int(hs) * q.itemsize,
            delta.nbytes + dq.nbytes)


def _flash_bwd_dkv_traffic(q, k, v, dy, lse, delta, dk, dv, n_ctx, hs, **_):
    """k and v read once, a q and a dy tile per pair (and their rows' lse and delta); dk and dv written."""
    bh, pairs, rows, _ = _flash_work(q, n_ctx, hs, False)
    return k.nbytes + v.nbytes + 2 * bh * pairs * rows * (int(hs) + 1) * q.itemsize, dk.nbytes + dv.nbytes


# The kernels: kernels/attention.cu (their shared code in kernels/flash.cuh).
FLASH_FWD = cuda.RawSpec("flash_attention_fwd", "attention.cu", traffic=_flash_fwd_traffic,
                         flops=_flash_flops(2, forward=True))
FLASH_BWD_DQ = cuda.RawSpec("flash_attention_bwd_dq", "attention.cu", traffic=_flash_bwd_dq_traffic,
                            flops=_flash_flops(3))
FLASH_BWD_DKV = cuda.RawSpec("flash_attention_bwd_dkv", "attention.cu", traffic=_flash_bwd_dkv_traffic,
                             flops=_flash_flops(4))


def _flash_operands(fn, q, k, v):
    """(BH, T, hs) of contiguous q, k, v that the kernels take."""
    if getattr(q, "dtype", None) not in FLASH_TILE or q.ndim != 3 or not q.flags.c_contiguous:
        raise ValueError(f"{fn}: q must be a contiguous float32 or float64 array (BH, T, hs)")
    cuda.like(fn, "k", k, q)
    cuda.like(fn, "v", v, q)
    BH, T, hs = q.shape
    if not flash_fits(hs, q.dtype):
        raise ValueError(f"{fn}: head size {hs}: the kernels take multiples of 16 up to {FLASH_HS_MAX}")
    return BH, T, hs


def _flash_rows(fn, name, a, q, n_head):
    """a holds q's BH heads' (T, hs) rows as (B, T, n_head, hs), contiguous."""
    BH = q.shape[0]
    if a.dtype != q.dtype or a.size != q.size or not a.flags.c_contiguous or n_head < 1 or BH % n_head:
        raise ValueError(f"{fn}: {name} must be a contiguous array of {BH} heads' (T, hs) rows as "
                         f"(B, T, {n_head}, hs), got {a.dtype} {a.shape}")


def flash_attention_forward_gpu(q, k, v, scale, y=None, lse=None, n_head=1, tf32=True):
    """y = softmax(scale q k^T + causal mask) v for q, k, v (BH, T, hs) (CuPy, contiguous), without the
    (T, T) scores in memory; returns (y, lse). y: (BH, T, hs), or with n_head, the heads' rows of a
    (B, T, n_head, hs) array (e.g. the layer's (B, T, C) output); lse (BH, T): each row's log-sum-exp.
    tf32: float32 products on TF32 tensor cores (else, as float64's, by FMAs)."""
    fn = "flash_attention_forward_gpu"
    BH, T, hs = _flash_operands(fn, q, k, v)
    xp = array_module(q)
    y = xp.empty_like(q) if y is None else y
    lse = xp.empty((BH, T), dtype=q.dtype) if lse is None else lse
    _flash_rows(fn, "y", y, q, n_head)
    cuda.row_values(fn, "lse", lse, q, BH * T)
    if q.size:
        rows = FLASH_FWD_TILE[q.dtype]
        cuda.launch(FLASH_FWD, q.dtype, (-(-T // rows), BH), (4 * rows,),
                    (q, k, v, y, lse, np.int32(T), np.int32(hs), np.int32(n_head), q.dtype.type(scale),
                     np.int32(bool(tf32))))
    return y, lse


def flash_attention_backward_gpu(q, k, v, y, dy, lse, scale, n_head=1, out=None, tf32=True):
    """(dq, dk, dv) of flash_attention_forward_gpu's y = attention(q, k, v) from dy (laid out as y, with
    the same n_head) and the forward's y and lse; into out ((3, BH, T, hs), contiguous) or a new array.
    Deterministic: delta = rowsum(dy y) and dq per query tile, then dk and dv per key tile."""
    fn = "flash_attention_backward_gpu"
    BH, T, hs = _flash_operands(fn, q, k, v)
    for name, a in (("y", y), ("dy", dy)):
        _flash_rows(fn, name, a, q, n_head)
    cuda.row_values(fn, "lse", lse, q, BH * T)
    xp = array_module(q)
    grads = xp.empty((3, BH, T, hs), dtype=q.dtype) if out is None else out
    if grads.shape != (3, BH, T, hs) or grads.dtype != q.dtype or not grads.flags.c_contiguous:
        raise ValueError(f"{fn}: out must be a contiguous {q.dtype} array of shape {(3, BH, T, hs)}")
    if q.size:
        delta = xp.empty((BH, T), dtype=q.dtype)
        grid, block = (-(-T // FLASH_TILE[q.dtype]), BH), (4 * FLASH_TILE[q.dtype],)
        common = (np.int32(T), np.int32(hs), np.int32(n_head), q.dtype.type(scale), np.int32(bool(tf32)))
        cuda.launch(FLASH_BWD_DQ, q.dtype, grid, block, (q, k, v, y, dy, lse, delta, grads[0], *common))
        cuda.launch(FLASH_BWD_DKV, q.dtype, grid, block, (q, k, v, dy, lse, delta, grads[1], grads[2], *common))
    return grads


# TF32 rounds each product's operands to 11 significant bits (relative error up to 2**-11, ~5e-4): the
# attention's outputs and gradients land within ~1e-3 of float32's; 5e-3 still refuses a wrong mask, tile
# or fragment layout, whose errors are of the outputs' own size.
FLASH_RTOL = 5e-3


def _flash_attention_sample(ops, rng):
    """A 4-head attention layer (head size 16), forward and backward, over 2 x 72 positions: three
    query tiles, the last one partial, a full one over two key tiles (its running max and sum
    rescaled); the core as the backend chooses it (flash with the piece, else the Ops code), its
    float32 products once on TF32 tensor cores and once by FMAs, whatever train.tf32 will say."""
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.layers.linear import Linear

    xp = ops.xp
    B, T, C, nh = 2, 72, 64, 4
    weights = [_draw(xp, rng, C, 3 * C, scale=0.3), _draw(xp, rng, 3 * C), _draw(xp, rng, C, C, scale=0.3),
               _draw(xp, rng, C)]
    x, dy = _draw(xp, rng, B, T, C), _draw(xp, rng, B, T, C)
    outputs = []
    try:
        for tf32 in (True, False):
            ops.flash_tf32 = tf32
            grads = [xp.zeros(w.shape, np.float32) for w in weights]
            attn = CausalSelfAttention(Linear(weights[0], grads[0], weights[1], grads[1], ops=ops),
                                       Linear(weights[2], grads[2], weights[3], grads[3], ops=ops), nh, ops=ops)
            outputs += [attn.forward(x), attn.backward(dy), *grads]
    finally:
        ops.flash_tf32 = None
    return tuple(outputs)


def _flash_attention_cases(k):
    """The flash attention core forward and backward against Ops' dense core, at the model's heads (64
    wide; 16 in a dry run). Its float32 products by FMAs here: TF32's would not meet 1e-5 (the start-up
    self-check compares the tensor-core path, at TF32's tolerance)."""
    BH, T, hs = k.BH, k.T, 16 if k.T < 64 else 64
    scale = 1.0 / np.sqrt(hs)

    def setup():
        k.reseed()
        return dict(q=k.rand(BH, T, hs), k=k.rand(BH, T, hs), v=k.rand(BH, T, hs), dy=k.rand(BH, T, hs))

    def fused(d):
        y, lse = flash_attention_forward_gpu(d["q"], d["k"], d["v"], scale, tf32=False)
        return (y, *flash_attention_backward_gpu(d["q"], d["k"], d["v"], y, d["dy"], lse, scale, tf32=False))

    def generic(d):
        y4 = k.xp.empty((BH, 1, T, hs), k.dtype)
        cache = k.ref.attention_forward([d[n][:, None] for n in "qkv"], None, y4, dense=True)
        grads = [k.xp.empty((BH, 1, T, hs), k.dtype) for _ in range(3)]
        k.ref.attention_backward(d["dy"][:, None], cache, grads)
        return (y4[:, 0], *(g[:, 0] for g in grads))

    return [("flash attention fwd + bwd", setup, fused, generic, False)]


FLASH_ATTENTION = cuda.fused_piece(
    "flash_attention",
    replaces=("attention_forward",),
    kernels=(FLASH_FWD, FLASH_BWD_DQ, FLASH_BWD_DKV),
    sample=_flash_attention_sample,
    cases=_flash_attention_cases,
    rtol=FLASH_RTOL,
)


# =============================================================================================
# Softmax cross-entropy over (N, V) logits

# The kernels: kernels/softmax_xent.cu.


def _softmax_xent_fwd_traffic(z, targets, losses, V, n_valid, **_):
    """The logits' first n_valid columns read, every column overwritten by the probabilities (in place),
    the targets read, the losses written."""
    return z.nbytes * int(n_valid) // int(V) + targets.nbytes, z.nbytes + losses.nbytes


SOFTMAX_XENT_FWD = cuda.RawSpec("softmax_xent_fwd", "softmax_xent.cu", traffic=_softmax_xent_fwd_traffic)

SOFTMAX_XENT_BWD = cuda.ElementwiseSpec(
    "softmax_xent_bwd", "T probs, raw int64 targets, int32 V, T scale", "T dz", "softmax_xent.cu",
    reference=lambda probs, targets, V, scale: _xent_bwd_flat(probs, targets, int(V), scale),
    scalars=(("V", 5), ("scale", 0.25)),
)


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


# --- the fused piece softmax_xent: its record, the self-check's sample, gpu_check's cases ---


def _softmax_xent_sample(ops, rng):
    """Cross-entropy forward and backward (dloss 0.5) over 48 rows of 1000 logits; then over the same
    logits padded as the tied head pads them (ops.vocab_padding: 1024 columns with the kernel, none
    without), whose padded columns must get no gradient."""
    from minitensor.layers.loss import SoftmaxCrossEntropy

    xp = ops.xp
    logits = _draw(xp, rng, 6, 8, 1000, scale=3.0)
    targets = xp.asarray(rng.integers(0, 1000, (6, 8)))
    fn = SoftmaxCrossEntropy(ops=ops)
    loss = fn.forward(logits.copy(), targets, inplace=True)
    grad = fn.backward(0.5)
    padded = xp.zeros((6, 8, ops.vocab_padding(1000)), dtype=logits.dtype)
    padded[..., :1000] = logits
    padded_loss = fn.forward(padded, targets, inplace=True, valid=1000)
    padded_grad = fn.backward(0.5)
    return (xp.asarray(loss).reshape(1), grad, xp.asarray(padded_loss).reshape(1),
            xp.ascontiguousarray(padded_grad[..., :1000]), xp.abs(padded_grad[..., 1000:]).sum(axis=-1))


def _softmax_xent_cases(k):
    """Softmax cross-entropy forward and backward against the loss layer on the reference (k.ref: Ops'
    plain cross-entropy), which keeps the probabilities as the fused kernels take and give them."""
    from minitensor.layers.loss import SoftmaxCrossEntropy

    N, V = k.N, k.V

    def setup():
        k.reseed()
        z = k.rand(N, V, scale=2.0)
        t = k.xp.asarray(np.random.default_rng(0).integers(0, V, N))
        loss_fn = SoftmaxCrossEntropy(ops=k.ref)
        loss_fn.forward(z.copy(), t)
        return dict(z=z, t=t, probs=loss_fn._cache.saved.copy(), cache=loss_fn._cache, loss_fn=loss_fn)

    def generic_fwd(d):
        loss = d["loss_fn"].forward(d["z"], d["t"])
        return loss, d["loss_fn"]._cache.saved

    def generic_bwd(d):
        d["loss_fn"]._save(d["cache"])
        return (d["loss_fn"].backward(1.0),)

    return [
        ("cross-entropy fwd", setup, lambda d: (softmax_xent_forward_gpu(d["z"], d["t"])[0], d["z"]),
         generic_fwd, False),
        ("cross-entropy bwd", setup, lambda d: (softmax_xent_backward_gpu(d["probs"], d["t"]),),
         generic_bwd, True),
    ]


SOFTMAX_XENT = cuda.fused_piece(
    "softmax_xent",
    replaces=("vocab_padding", "softmax_xent_forward", "softmax_xent_backward"),
    kernels=(SOFTMAX_XENT_FWD, SOFTMAX_XENT_BWD),
    sample=_softmax_xent_sample,
    cases=_softmax_xent_cases,
)


# =============================================================================================
# The embedding's backward: dW[id] += the rows at that id's positions, summed in position order

# The kernel: kernels/embedding.cu.
SCATTER_ADD_ROWS = cuda.register(cuda.RawSpec("scatter_add_rows", "embedding.cu"))


# =============================================================================================
# AdamW over the whole flat buffer, one elementwise pass

def _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    """ADAMW_STEP's operation through tricks.adamw_update (Ops.adamw_step folded), on copies of p, m, v."""
    p, m, v = p_in.copy(), m_in.copy(), v_in.copy()
    scale = np.asarray(grad_scale).reshape(-1)[0]  # the kernel reads grad_scale[0]
    adamw_update(np, p, g, m, v, np.empty_like(p), beta1, beta2, scale, step_size, eps_hat, 1.0 - decay * mask)
    return p, m, v


# The kernel (its form, adamw_update's, explained there): kernels/adamw.cu.
ADAMW_STEP = cuda.ElementwiseSpec(
    "adamw_step",
    "T p_in, T m_in, T v_in, T g, T mask, T beta1, T beta2, raw T grad_scale, T step_size, T eps_hat, T decay",
    "T p, T m, T v",
    "adamw.cu",
    reference=_adamw_op_reference,
    scalars=(("beta1", 0.9), ("beta2", 0.95), ("step_size", 1e-3), ("eps_hat", 1e-8), ("decay", 1e-4)),
    domains=(("v_in", np.abs), ("mask", lambda a: (a > 0).astype(a.dtype))),
)


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


# --- the fused piece adamw: its record, the self-check's sample, gpu_check's cases ---


def _adamw_sample(ops, rng):
    """Two AdamW steps over a small flat buffer of a decayed matrix and an undecayed vector."""
    from minitensor.optim import AdamW
    from minitensor.params import Params

    xp = ops.xp
    params = Params({"w": (7, 33), "b": (33,)}, xp=xp, dtype=np.float32, ops=ops)
    params.data[...] = xp.asarray(rng.standard_normal(params.data.shape).astype(np.float32))
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for scale in (1.0, 0.5):
        for name in params.names():  # through the views: the padding between tensors keeps g = 0
            view = params.grad(name)
            view[...] = xp.asarray(rng.standard_normal(view.shape).astype(np.float32))
        opt.step(grad_scale=xp.asarray(scale, dtype=np.float32))
    return params.data, opt.m, opt.v


def _adamw_cases(k):
    """One AdamW step over the model's parameter layout (decay on 2+-D tensors) against the optimizer."""
    from minitensor.optim import AdamW
    from minitensor.params import Params

    hyper = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def setup():
        k.reseed()
        params = Params(k.shapes, xp=k.xp, dtype=k.dtype, ops=k.ref)
        params.data[...] = k.rand(params.size, scale=0.02)
        params.grads[...] = k.rand(params.size, scale=1e-3)
        opt = AdamW(params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"])
        return dict(params=params, opt=opt, mask=params.mask(opt.decays))

    def generic(d):
        d["opt"].step(grad_scale=0.5)
        return d["params"].data, d["opt"].m, d["opt"].v

    def fused(d):
        p, opt = d["params"], d["opt"]
        adamw_step_gpu(p.data, p.grads, opt.m, opt.v, d["mask"], t=1, grad_scale=0.5, **hyper)
        return p.data, opt.m, opt.v

    return [("adamw step", setup, fused, generic, True)]


ADAMW = cuda.fused_piece(
    "adamw",
    replaces=("adamw_step",),
    kernels=(ADAMW_STEP,),
    sample=_adamw_sample,
    cases=_adamw_cases,
)
