"""Causal attention without T x T in memory on the GPU, FlashAttention-2: the RawKernels of
kernels/attention.cu (their shared code in kernels/flash.cuh), their wrappers and the fused piece
flash_attention's record (CupyOps.attention_forward_flash)."""

import numpy as np

from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.device import array_module

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
    weights = [draw(xp, rng, C, 3 * C, scale=0.3), draw(xp, rng, 3 * C), draw(xp, rng, C, C, scale=0.3),
               draw(xp, rng, C)]
    x, dy = draw(xp, rng, B, T, C), draw(xp, rng, B, T, C)
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
