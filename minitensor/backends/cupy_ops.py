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

Each kernel lives in minitensor/backends/kernels/: its CUDA source, the section `// @kernel NAME` of
a .cu file, and beside it, in the .py of the same name, its spec, its wrapper and, for a fused piece,
the piece's record (`cuda.fused_piece`): its name, the Ops methods it replaces, its kernels, how to
build its sample inputs (`sample`, the self-check's) and gpu_check's comparisons at ANDREA-120M
shapes (`cases`). This module imports them all.

Every kernel is registered in minitensor.backends.cuda.KERNELS, so that two checks run without a GPU
(`python -m minitensor.checks --check | --host-check`): NVRTC compiles each one, and g++ runs
each elementwise operation on the host against its `reference`, which is the Ops code. Only
CuPy's public API is called here and in the kernels' modules (ElementwiseKernel and RawKernel through
minitensor.backends.cuda, cupy.cuda for the device, cuBLAS through cupy_backends.cuda.libs.cublas in
minitensor.backends.cublas), so a NumPy-backed stand-in of CuPy can run them in CI.
"""

import math
from typing import NamedTuple

import numpy as np

from minitensor.backends import cublas, cuda
from minitensor.backends.blocked import BlockedAttention

# The pieces' modules, in the order their records are declared (cuda.PIECES, the kernels line's order):
# importing this module registers every kernel and record.
# isort: off
from minitensor.backends.kernels.gelu import (GELU_BWD, GELU_FWD, bias_gelu_backward_gpu,
                                              bias_gelu_backward_recompute_gpu, bias_gelu_forward_gpu)
from minitensor.backends.kernels.linear import BIAS_RESIDUAL_ADD, epilogue_fits
from minitensor.backends.kernels.layernorm import LN_MAX_C, layernorm_backward_gpu, layernorm_forward_gpu
from minitensor.backends.kernels.causal_softmax import causal_softmax_backward_gpu, causal_softmax_forward_gpu
from minitensor.backends.kernels.attention import (flash_attention_backward_gpu, flash_attention_forward_gpu,
                                                   flash_fits)
from minitensor.backends.kernels.softmax_xent import softmax_xent_backward_gpu, softmax_xent_forward_gpu
from minitensor.backends.kernels.embedding import scatter_add_rows_gpu
from minitensor.backends.kernels.adamw import adamw_kernel
# isort: on
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import FreshGrads, adamw_scalars
from minitensor.device import CUBLAS_TF32_TENSOR_OP_MATH, math_mode


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
        unknown = set(fused) - set(cuda.PIECES)  # every record is in: this module imports them
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
        if b is None or r is None or not epilogue_fits(y, b, r):
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
        return math_mode(self.xp.cuda.device.get_cublas_handle()) == CUBLAS_TF32_TENSOR_OP_MATH

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
        if (rows.dtype != dW.dtype or dW.dtype not in (np.float32, np.float64) or dW.ndim != 2
                or not dW.flags.c_contiguous):
            return super().scatter_add_rows(dW, idx, rows)
        scatter_add_rows_gpu(dW, idx, rows)

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
