"""The causal softmax over (..., T, T) attention scores on the GPU (forward, backward, recomputed): the
kernels of kernels/causal_softmax.cu, their wrappers and the fused piece causal_softmax's record (the
dense attention core with this softmax: Ops.attention_forward_dense and its backward)."""

import math
from typing import NamedTuple

import numpy as np

from minitensor import precision
from minitensor.backends import cublas, cuda
from minitensor.backends.cuda import draw
from minitensor.backends.kernels.attention import attention_core_timed, split_heads, stacked_heads
from minitensor.device import array_module


def _causal_fraction(n_ctx):
    """The share of a (T, T) matrix on and below the diagonal: what the causal kernels read."""
    return (int(n_ctx) + 1) / (2 * int(n_ctx))


def _causal_softmax_fwd_traffic(s, p, lse, n_ctx, write_lse, **_):
    """s read on and below the diagonal; p written in full (the masked part as zeros), lse if asked."""
    return s.nbytes * _causal_fraction(n_ctx), p.nbytes + (lse.nbytes if write_lse else 0)


def _causal_softmax_bwd_traffic(dp, p, ds, n_ctx, **_):
    """dp and p read on and below the diagonal; ds written in full."""
    return (dp.nbytes + p.nbytes) * _causal_fraction(n_ctx), ds.nbytes


def _causal_softmax_model(m):
    """The dense core's softmax at the model's sizes, forward and backward in place, as
    CupyOps.attention_forward_dense and attention_backward call them (minitensor.checks.counts)."""
    s = np.zeros((m.BH, m.T, m.T), np.float32)
    p = causal_softmax_forward_gpu(s, m.hs ** -0.5, out=s)
    causal_softmax_backward_gpu(np.zeros_like(p), p, m.hs ** -0.5, out=p)


def _one_matrix(grid, block, args):
    """Every row of the first matrix, each standing for its row in all of them: row r's work grows with r."""
    n_ctx = int(args[3])  # both kernels' fourth parameter
    return [(r, grid[0] // n_ctx) for r in range(n_ctx)]


# Both built for bfloat16 too (bf16=True): scores and probabilities in T, the max, the sums, lse and the
# scale in ACC (float32 for bfloat16).
CAUSAL_SOFTMAX_FWD = cuda.RawSpec("causal_softmax_fwd", "causal_softmax.cu", traffic=_causal_softmax_fwd_traffic,
                                 model=_causal_softmax_model, count_blocks=_one_matrix, bf16=True)

CAUSAL_SOFTMAX_BWD = cuda.RawSpec("causal_softmax_bwd", "causal_softmax.cu", traffic=_causal_softmax_bwd_traffic,
                                 model=_causal_softmax_model, count_blocks=_one_matrix, bf16=True)

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
    log-sum-exp is written there (in what s is summed in: float32 for bfloat16 s), for
    causal_softmax_recompute_gpu."""
    fn = "causal_softmax_forward_gpu"
    rows, T = cuda.square_rows(fn, s, CAUSAL_SOFTMAX_FWD)
    p = cuda.out_like(fn, s, out)
    acc, write_lse = precision.accumulate_of(s.dtype), lse is not None
    if write_lse:
        cuda.row_values(fn, "lse", lse, s, rows)
    elif rows:  # the kernel's lse argument, not written: p where it is of that dtype (not bfloat16)
        lse = p if p.dtype == acc else array_module(s).empty(1, acc)
    if rows:
        cuda.launch(CAUSAL_SOFTMAX_FWD, s.dtype, (rows,), (cuda.threads(T, 128),),
                (s, p, lse, np.int32(T), acc.type(scale), np.int32(write_lse)))
    return p


def causal_softmax_backward_gpu(dp, p, scale=1.0, out=None):
    """ds = scale p (dp - rowsum(dp p)) for dp, p (..., T, T) (CuPy, contiguous), into `out`
    (which may be dp) or a new array; returns ds."""
    fn = "causal_softmax_backward_gpu"
    rows, T = cuda.square_rows(fn, p, CAUSAL_SOFTMAX_BWD)
    cuda.like(fn, "dp", dp, p)
    ds = cuda.out_like(fn, p, out)
    if rows:
        cuda.launch(CAUSAL_SOFTMAX_BWD, p.dtype, (rows,), (cuda.threads(T, 128),),
                (dp, p, ds, np.int32(T), precision.accumulate_of(p.dtype).type(scale)))
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


# --- the fused piece causal_softmax: the Ops methods it replaces, the self-check's sample, gpu_check's
# cases, its record ---
#
# The dense core with the fused softmax: the 1/sqrt(hs) scale goes into the softmax kernels (forward:
# p = softmax(scale s); backward: ds = scale p (dp - rowsum(dp p))), so q is kept unscaled and neither
# q nor dq takes a pass of its own, and rowsum(dy y) (Ops' D) is not computed: the backward kernel
# sums dp p itself. CuPy's batched matmul would copy an operand that is not C-contiguous (SPEC section
# 5): k^T (forward), dy^T, v^T and q^T (backward) go to cuBLAS's strided batched GEMM with the
# transpose flag instead (cublas.matmul); dv and dk come out transposed (dv^T = dy^T p,
# dk^T = q^T ds), read as stored.


class FusedAttentionCache(NamedTuple):
    """What the fused dense core keeps: q (unscaled), k, v (B*n_head, T, hs); p (B*n_head, T, T)."""
    q: object
    k: object
    v: object
    p: object


def _fused_attention_forward_dense(ops, qkv4, b, y4):
    """Ops.attention_forward_dense: all heads' scores in one batched GEMM, the causal softmax in place."""
    B, nh, T, hs = qkv4[0].shape
    q, k, v = split_heads(ops.xp, qkv4, b, y4.dtype)     # each (BH, T, hs) contiguous
    s = cublas.matmul(q, k.transpose(0, 2, 1))            # (BH, T, T) unscaled scores
    p = causal_softmax_forward_gpu(s, 1.0 / math.sqrt(hs), out=s)
    y4[...] = cublas.matmul(p, v).reshape(B, nh, T, hs)   # heads back in order
    return FusedAttentionCache(q, k, v, p)


def _fused_attention_backward(ops, dy4, saved, dqkv4):
    """Ops.attention_backward from what _fused_attention_forward_dense kept."""
    if not isinstance(saved, FusedAttentionCache):
        return cuda.FALLBACK
    xp = ops.xp
    q, k, v, p = saved                                    # q unscaled (_fused_attention_forward_dense)
    BH, T, hs = q.shape
    B, nh = dy4.shape[:2]
    dy = xp.ascontiguousarray(dy4).reshape(BH, T, hs)
    dkvT = xp.empty((2, BH, hs, T), dtype=q.dtype)        # dk^T, dv^T side by side
    cublas.matmul(dy.transpose(0, 2, 1), p, out=dkvT[1])  # forward was y = p v: dv^T = dy^T p
    dp = cublas.matmul(dy, v.transpose(0, 2, 1))
    # forward was p = softmax(scale q k^T): ds = scale p (dp - rowsum(dp p)), dq = ds k, dk^T = q^T ds
    ds = causal_softmax_backward_gpu(dp, p, 1.0 / math.sqrt(hs), out=dp)
    dq = cublas.matmul(ds, k)
    cublas.matmul(q.transpose(0, 2, 1), ds, out=dkvT[0])
    dkv = dkvT.transpose(0, 1, 3, 2).reshape(2, B, nh, T, hs)
    stacked = stacked_heads(dqkv4)
    if stacked is not None:                               # dk and dv in one copy
        stacked[0][...] = dq.reshape(B, nh, T, hs)
        stacked[1:][...] = dkv
        return
    for g, d in zip(dqkv4, (dq.reshape(B, nh, T, hs), dkv[0], dkv[1])):
        g[...] = d


def _causal_softmax_sample(ops, rng):
    """A 4-head attention layer's dense core, forward and backward, over 2 x 40 positions."""
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.layers.linear import Linear

    xp = ops.xp
    B, T, C, nh = 2, 40, 48, 4
    grads = [xp.zeros(shape, np.float32) for shape in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    attn = CausalSelfAttention(Linear(draw(xp, rng, C, 3 * C, scale=0.3), grads[0], draw(xp, rng, 3 * C), grads[1],
                                      ops=ops),
                               Linear(draw(xp, rng, C, C, scale=0.3), grads[2], draw(xp, rng, C), grads[3], ops=ops),
                               nh, ops=ops)
    attn.dense = True
    out = attn.forward(draw(xp, rng, B, T, C))
    return (out, attn.backward(draw(xp, rng, B, T, C)), *grads)


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


def _dense_core_timed(ops, sizes):
    """The dense attention core of every head at the run's sizes, forward and backward (the flash
    piece's timed run, the dense core asked for)."""
    return attention_core_timed(ops, sizes, dense=True)


CAUSAL_SOFTMAX = cuda.fused_piece(
    "causal_softmax",
    replaces={"attention_forward_dense": _fused_attention_forward_dense,
              "attention_backward": _fused_attention_backward},
    kernels=(CAUSAL_SOFTMAX_FWD, CAUSAL_SOFTMAX_BWD, CAUSAL_SOFTMAX_RECOMPUTE),
    sample=_causal_softmax_sample,
    cases=_causal_softmax_cases,
    timed=_dense_core_timed,
)
