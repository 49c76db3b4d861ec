"""Causal attention without T x T in memory on the GPU, FlashAttention-2: the RawKernels of
kernels/attention.cu (their shared code in kernels/flash.cuh; the bf16 kernels', on mma.m16n8k16, in
kernels/flash16.cuh), their wrappers (float32, float64 or bfloat16 q, k, v), the fused piece
flash_attention's record, and the heads' layout both fused attention cores share (the dense one's
in kernels/causal_softmax.py)."""

import math
from typing import NamedTuple

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.backends.kernels.gelu import add_column_sums
from minitensor.backends.ops import qkv_heads
from minitensor.device import CUBLAS_TF32_TENSOR_OP_MATH, array_module, math_mode

# The kernels' tiles (attention.cu's constants), by dtype: (query rows, keys) of the forward's and of
# flash_attention_bwd_dq's tiles, (keys, query rows) of flash_attention_bwd_dkv's; 16 rows a warp.
FLASH_FWD_TILE = {np.dtype(np.float32): (128, 64), np.dtype(np.float64): (64, 32)}
FLASH_DQ_TILE = {np.dtype(np.float32): (64, 32), np.dtype(np.float64): (64, 16)}
FLASH_DKV_TILE = {np.dtype(np.float32): (64, 32), np.dtype(np.float64): (64, 16)}
FLASH_HS_MAX = {np.dtype(np.float32): 64, np.dtype(np.float64): 32}  # flash.cuh's HS_MAX
# The bf16 kernels' (attention.cu's *_bf16 sections, flash16.cuh): the same tiles but the forward's keys (32:
# its registers), heads up to 64
FLASH16_FWD_TILE, FLASH16_DQ_TILE, FLASH16_DKV_TILE, FLASH16_HS_MAX = (128, 32), (64, 32), (64, 32), 64
# The backward's blocks, every dtype's: 64 query rows (dq) or keys (dk, dv), 16 a warp; a block's column sums of
# its gradients are one row of flash_backward's partial bias sums
FLASH_BIAS_ROWS = 64
assert all(t[0] == FLASH_BIAS_ROWS for tiles in (FLASH_DQ_TILE, FLASH_DKV_TILE) for t in tiles.values())
assert FLASH16_DQ_TILE[0] == FLASH16_DKV_TILE[0] == FLASH_BIAS_ROWS


def is_bf16(dtype):
    """Whether dtype is the policy's bfloat16 (the bf16 kernels' stored type)."""
    return getattr(dtype, "name", None) == precision.BF16


def flash_instances(dtype):
    """(hs, tf32) of each instance the flash kernels are compiled for in dtype: every head size they take,
    float32's products on tensor cores or by FMAs, float64's by FMAs."""
    dtype = np.dtype(dtype)
    if dtype not in FLASH_HS_MAX:
        return ()
    sizes = range(16, FLASH_HS_MAX[dtype] + 1, 16)
    return tuple((hs, tf32) for hs in sizes for tf32 in ((0, 1) if dtype == np.float32 else (0,)))


def flash16_instances(dtype):
    """(hs,) of each instance the bf16 flash kernels are compiled for: in bfloat16, every head size they take;
    none in any other dtype."""
    return tuple((hs,) for hs in range(16, FLASH16_HS_MAX + 1, 16)) if is_bf16(np.dtype(dtype)) else ()


def flash_fits(hs, dtype):
    """Whether the flash kernels take heads of size hs in dtype."""
    dtype = np.dtype(dtype)
    if is_bf16(dtype):
        return hs % 16 == 0 and 16 <= hs <= FLASH16_HS_MAX
    return dtype in FLASH_FWD_TILE and hs % 16 == 0 and 16 <= hs <= FLASH_HS_MAX[dtype]


def _warp_tiles(n_ctx, rows, cols, keys_first):
    """(16-row band, tile) pairs a head's launch computes: blocks of `rows` rows (16 per warp) over tiles
    of `cols`, a warp skipping the tiles the causal mask hides from all of its rows. keys_first: the
    block's rows are keys and its tiles queries (flash_attention_bwd_dkv), else the reverse."""
    T, pairs = int(n_ctx), 0
    for b0 in range(0, T, rows):
        for r0 in range(b0, b0 + rows, 16):
            if keys_first:  # query tiles from the block's diagonal down, those with a query >= the band's first key
                pairs += sum(1 for i0 in range(b0 - b0 % cols, T, cols) if i0 + cols - 1 >= r0)
            else:  # key tiles up to the block's last row, those with a key <= the band's last row
                pairs += sum(1 for j0 in range(0, min(T, b0 + rows), cols) if j0 <= r0 + 15)
    return pairs


def _tiles_of(tiles):
    """tiles (a table by dtype, or the bf16 kernels' one tile) as a function of the dtype."""
    return tiles.__getitem__ if isinstance(tiles, dict) else lambda _: tiles


def _flash_flops(products, tiles, keys_first=False):
    """FLOPs of a launch's tensor-core products: `products` (16 x cols x hs) products per band and tile."""
    def flops(qkv, n_ctx, hs, **_):
        rows, cols = _tiles_of(tiles)(qkv.dtype)
        heads = qkv.size // (3 * int(n_ctx) * int(hs))
        return products * 2 * heads * _warp_tiles(n_ctx, rows, cols, keys_first) * 16 * cols * int(hs)
    return flops


def _flash_model(m, dtype=np.float32):
    """The attention core of every head at the model's sizes, forward and backward, as the step calls it
    (q, k, v and their gradients c_attn's (B, T, 3C) arrays, its bias added as they are read; y and dy the
    heads' rows of (B, T, C) arrays; minitensor.checks.counts)."""
    qkv, dqkv = (np.zeros((m.B, m.T, 3, m.n_head, m.hs), dtype) for _ in range(2))
    b = np.zeros(3 * m.C, dtype)
    y, dy = (np.zeros((m.B, m.T, m.n_head, m.hs), dtype) for _ in range(2))
    lse = flash_forward(qkv, b, m.hs ** -0.5, y)
    flash_backward(qkv, b, y, dy, lse, m.hs ** -0.5, dqkv, db=np.zeros(3 * m.C, precision.accumulate_of(dtype)))


def _flash16_model(m):
    """_flash_model in bfloat16: the bf16 kernels as a bf16 step calls them."""
    _flash_model(m, precision.bfloat16())


def _flash_blocks(tiles, keys_first=False):
    """count_blocks for a flash kernel: the heads (grid y) do the same work, so head 0 stands for all;
    within a head, a block's work is a fixed part plus a part per tile it visits (the diagonal's
    pattern the same in every block when T is a multiple of the tiles), so the two blocks with the
    fewest tiles stand for all, weighted by how many tiles each block visits. Otherwise every block of
    head 0."""
    def blocks(grid, block, args):
        gx, heads = grid[0], grid[1] if len(grid) > 1 else 1
        rows, cols = _tiles_of(tiles)(args[0].dtype)
        T = int(args[0].shape[1])
        if keys_first:  # block x: keys x rows.., query tiles from there down
            visits = [-(-(T - x * rows) // cols) for x in range(gx)]
        else:  # block x: query tile gx - 1 - x, key tiles up to its last row
            visits = [-(-min(T, (gx - x) * rows) // cols) for x in range(gx)]
        if gx < 3 or T % rows or T % cols:
            return [(x, heads) for x in range(gx)]
        a, b = sorted(range(gx), key=lambda x: visits[x])[:2]
        f = [(visits[x] - visits[a]) / (visits[b] - visits[a]) for x in range(gx)]
        return [(a, heads * sum(1 - fx for fx in f)), (b, heads * sum(f))]
    return blocks


# The kernels: kernels/attention.cu (their shared code in kernels/flash.cuh), templates over (hs, tf32).
# warps_per_sm: what the registers __launch_bounds__ caps them at (attention.cu) must let an SM hold at
# the training path's instance (float32, hs 64, tf32): 2 blocks of 8 warps (<= 128 registers), 3 of 4
# (<= 168), 2 of 4 (dkv holds k, v and both gradients' accumulators: ~210 registers).
# Traffic: the default (each input read once, each output written once): the tiles a block reads again
# are L2 hits, which the step model prices from the sectors the emulation counts (minitensor.checks.counts).
FLASH_FWD = cuda.RawSpec("flash_attention_fwd", "attention.cu",
                         flops=_flash_flops(2, FLASH_FWD_TILE), model=_flash_model,
                         count_blocks=_flash_blocks(FLASH_FWD_TILE), template=("hs", "tf32"),
                         instances=flash_instances, warps_per_sm=16)
FLASH_BWD_DQ = cuda.RawSpec("flash_attention_bwd_dq", "attention.cu",
                            flops=_flash_flops(3, FLASH_DQ_TILE), model=_flash_model,
                            count_blocks=_flash_blocks(FLASH_DQ_TILE), template=("hs", "tf32"),
                            instances=flash_instances, warps_per_sm=12)
FLASH_BWD_DKV = cuda.RawSpec("flash_attention_bwd_dkv", "attention.cu",
                             flops=_flash_flops(4, FLASH_DKV_TILE, keys_first=True), model=_flash_model,
                             count_blocks=_flash_blocks(FLASH_DKV_TILE, keys_first=True), template=("hs", "tf32"),
                             instances=flash_instances, warps_per_sm=8)

# The bf16 kernels (attention.cu's *_bf16 sections, flash16.cuh): templates over hs, compiled in bfloat16
# only. The same blocks; their fragments take half the registers of TF32's (two bfloat16 to a register), so
# the backward's hold one block an SM more: dq 4 of 4 warps (<= 128 registers), dkv 3 of 4 (<= 168).
FLASH16_FWD = cuda.RawSpec("flash_attention_fwd_bf16", "attention.cu",
                           flops=_flash_flops(2, FLASH16_FWD_TILE), model=_flash16_model,
                           count_blocks=_flash_blocks(FLASH16_FWD_TILE), template=("hs",), bf16=True,
                           instances=flash16_instances, warps_per_sm=16)
FLASH16_BWD_DQ = cuda.RawSpec("flash_attention_bwd_dq_bf16", "attention.cu",
                              flops=_flash_flops(3, FLASH16_DQ_TILE), model=_flash16_model,
                              count_blocks=_flash_blocks(FLASH16_DQ_TILE), template=("hs",), bf16=True,
                              instances=flash16_instances, warps_per_sm=16)
FLASH16_BWD_DKV = cuda.RawSpec("flash_attention_bwd_dkv_bf16", "attention.cu",
                               flops=_flash_flops(4, FLASH16_DKV_TILE, keys_first=True), model=_flash16_model,
                               count_blocks=_flash_blocks(FLASH16_DKV_TILE, keys_first=True), template=("hs",), bf16=True,
                               instances=flash16_instances, warps_per_sm=12)


def _head_size(fn, hs, dtype):
    if not flash_fits(hs, dtype):
        most = FLASH16_HS_MAX if is_bf16(dtype) else FLASH_HS_MAX[dtype]
        raise ValueError(f"{fn}: head size {hs}: the kernels take multiples of 16 up to {most} in {dtype}")


def _flash_operands(fn, q, k, v):
    """(BH, T, hs) of contiguous q, k, v that flash_attention_*_gpu take."""
    dtype = getattr(q, "dtype", None)
    if dtype is None or not precision.is_float(dtype, bf16=True) or q.ndim != 3 or not q.flags.c_contiguous:
        raise ValueError(f"{fn}: q must be a contiguous float32, float64 or bfloat16 array (BH, T, hs)")
    cuda.like(fn, "k", k, q)
    cuda.like(fn, "v", v, q)
    _head_size(fn, q.shape[2], q.dtype)
    return q.shape


def _packed_operands(fn, qkv, b):
    """(B, T, n_head, hs) of the packed q, k, v the kernels take: a contiguous (B, T, 3, n_head, hs) array of
    float32, float64 or bfloat16 (c_attn's (B * T, 3 C) output as it is), and c_attn's bias b, (3 C,) of its
    dtype, contiguous."""
    dtype = getattr(qkv, "dtype", None)
    if (dtype is None or not precision.is_float(dtype, bf16=True) or qkv.ndim != 5 or qkv.shape[2] != 3
            or not qkv.flags.c_contiguous):
        raise ValueError(f"{fn}: qkv must be a contiguous float32, float64 or bfloat16 array (B, T, 3, n_head, hs), "
                         f"got {getattr(qkv, 'dtype', type(qkv).__name__)} {getattr(qkv, 'shape', '')}")
    B, T, _, n_head, hs = qkv.shape
    if b.dtype != dtype or b.shape != (3 * n_head * hs,) or not b.flags.c_contiguous:
        raise ValueError(f"{fn}: b must be a contiguous {dtype} array of shape {(3 * n_head * hs,)}, got "
                         f"{b.dtype} {b.shape}")
    _head_size(fn, hs, dtype)
    return B, T, n_head, hs


def _flash_rows(fn, name, a, q, n_head):
    """a holds q's BH heads' (T, hs) rows as (B, T, n_head, hs), contiguous."""
    BH = q.shape[0]
    if a.dtype != q.dtype or a.size != q.size or not a.flags.c_contiguous or n_head < 1 or BH % n_head:
        raise ValueError(f"{fn}: {name} must be a contiguous array of {BH} heads' (T, hs) rows as "
                         f"(B, T, {n_head}, hs), got {a.dtype} {a.shape}")


def _tf32_flag(tf32, q):
    """The kernels' tf32 argument (which instance runs): 1 for float32 on tensor cores, else 0 (float64's
    products are FMAs whatever tf32 says)."""
    return np.int32(bool(tf32) and q.dtype == np.float32)


def _stats(fn, name, a, q):
    """a holds one value per row of q's heads (q (BH, T, hs), or packed (B, T, 3, n_head, hs)), in the type the
    kernels sum in (float32 for bfloat16 q)."""
    BH, T = (q.shape[0], q.shape[1]) if q.ndim == 3 else (q.shape[0] * q.shape[3], q.shape[1])
    want = precision.accumulate_of(q.dtype)
    if a.size != BH * T or a.dtype != want or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must hold {BH * T} contiguous {want} values (one per row), got "
                         f"{a.dtype} {a.shape}")


def flash_forward(qkv, b, scale, y=None, lse=None, tf32=True):
    """y = softmax(scale q k^T + causal mask) v, head by head, without the (T, T) scores in memory, for q, k,
    v as c_attn writes them: qkv a contiguous (B, T, 3, n_head, hs) array (CuPy), read in place, with c_attn's
    bias b (3C,) added as the kernels read it (None: no bias). y: the heads' rows of a (B, T, n_head, hs) array
    (the layer's (B, T, C) output), or a new one; returns lse (B * n_head, T), each row's log-sum-exp in the
    summed type (float32 for bfloat16: the bf16 kernels). tf32: float32 products on TF32 tensor cores (else,
    as float64's, by FMAs); bfloat16's run on bf16 tensor cores whatever it says."""
    fn = "flash_forward"
    xp = array_module(qkv)
    b = _bias(xp, qkv, b)
    B, T, n_head, hs = _packed_operands(fn, qkv, b)
    acc = precision.accumulate_of(qkv.dtype)
    y = xp.empty((B, T, n_head, hs), dtype=qkv.dtype) if y is None else y
    lse = xp.empty((B * n_head, T), dtype=acc) if lse is None else lse
    _heads_of(fn, "y", y, qkv)
    _stats(fn, "lse", lse, qkv)
    if qkv.size:
        common = (np.int32(T), np.int32(hs), np.int32(n_head), acc.type(scale))
        if is_bf16(qkv.dtype):
            rows = FLASH16_FWD_TILE[0]
            cuda.launch(FLASH16_FWD, qkv.dtype, (-(-T // rows), B * n_head), (2 * rows,), (qkv, b, y, lse, *common))
        else:
            rows = FLASH_FWD_TILE[qkv.dtype][0]
            cuda.launch(FLASH_FWD, qkv.dtype, (-(-T // rows), B * n_head), (2 * rows,),
                        (qkv, b, y, lse, *common, _tf32_flag(tf32, qkv)))
    return lse


def flash_backward(qkv, b, y, dy, lse, scale, out=None, tf32=True, db=None, add_sums=add_column_sums):
    """The gradients of flash_forward's y = attention(q, k, v) with respect to q, k and v from dy (laid out as
    y), the forward's qkv, b, y and lse: into out, an array of qkv's layout (what c_attn's backward reads:
    dq, dk, dv side by side in each row), or a new one; returns it. Deterministic: delta = rowsum(dy y) and
    dq per query tile, then dk and dv per key tile. bfloat16: bfloat16 gradients from the bf16 kernels,
    every sum in float32. db ((3C,), the summed type): c_attn's bias gradient, db += the column sums of the
    gradients as written, summed by the kernels that write them (a row of partial sums per sequence and
    tile of FLASH_BIAS_ROWS rows, then add_sums(part, db, dtype), column_sums_add by default: no atomics, the
    same bits on every run)."""
    fn = "flash_backward"
    xp = array_module(qkv)
    b = _bias(xp, qkv, b)
    B, T, n_head, hs = _packed_operands(fn, qkv, b)
    for name, a in (("y", y), ("dy", dy)):
        _heads_of(fn, name, a, qkv)
    _stats(fn, "lse", lse, qkv)
    out = xp.empty_like(qkv) if out is None else out
    if out.shape != qkv.shape or out.dtype != qkv.dtype or not out.flags.c_contiguous:
        raise ValueError(f"{fn}: out must be a contiguous {qkv.dtype} array of shape {qkv.shape}")
    acc = precision.accumulate_of(qkv.dtype)
    rows = out.reshape(B * T, -1)
    if db is not None:
        cuda.vector(fn, "db", db, rows, summed=True)
    if qkv.size:
        delta = xp.empty((B * n_head, T), dtype=acc)
        tiles = -(-T // FLASH_BIAS_ROWS)
        sums = xp.empty((B * tiles, rows.shape[1]) if db is not None else 1, dtype=acc)
        common = (sums, np.int32(T), np.int32(hs), np.int32(n_head), acc.type(scale), np.int32(db is not None))
        if is_bf16(qkv.dtype):  # no tf32 argument: one instance per head size
            specs = (FLASH16_BWD_DQ, FLASH16_BWD_DKV)
        else:
            specs = (FLASH_BWD_DQ, FLASH_BWD_DKV)
            common += (_tf32_flag(tf32, qkv),)
        cuda.launch(specs[0], qkv.dtype, (tiles, B * n_head), (2 * FLASH_BIAS_ROWS,),
                    (qkv, b, y, dy, lse, delta, out, *common))
        cuda.launch(specs[1], qkv.dtype, (tiles, B * n_head), (2 * FLASH_BIAS_ROWS,),
                    (qkv, b, dy, lse, delta, out, *common))
        if db is not None:
            add_sums(sums, db, qkv.dtype)
    return out


def _bias(xp, qkv, b):
    """b, or where there is none, zeros of c_attn's bias's shape (the kernels add a bias whatever)."""
    return xp.zeros(3 * math.prod(qkv.shape[3:]), dtype=qkv.dtype) if b is None else b


def _heads_of(fn, name, a, qkv):
    """a holds the heads' rows of qkv's q as (B, T, n_head, hs), contiguous."""
    B, T, _, n_head, hs = qkv.shape
    if a.dtype != qkv.dtype or a.size != B * T * n_head * hs or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be a contiguous {qkv.dtype} array of {B * n_head} heads' (T, hs) rows "
                         f"as {(B, T, n_head, hs)}, got {a.dtype} {a.shape}")


def pack_heads(xp, views, dtype):
    """q, k, v, each (B, n_head, T, hs), as the kernels take them: one (B, T, 3, n_head, hs) array of dtype (a
    copy)."""
    B, nh, T, hs = views[0].shape
    qkv = xp.empty((B, T, 3, nh, hs), dtype=dtype)
    for i, a in enumerate(views):
        qkv[:, :, i] = a.transpose(0, 2, 1, 3)
    return qkv


def _apart(q, k, v, n_head):
    """q, k, v (BH, T, hs) as (B, n_head, T, hs) views, heads bh = b n_head + h."""
    BH, T, hs = q.shape
    return [a.reshape(BH // n_head, n_head, T, hs) for a in (q, k, v)]


def flash_attention_forward_gpu(q, k, v, scale, y=None, lse=None, n_head=1, tf32=True):
    """flash_forward for q, k, v given apart, each (BH, T, hs) (CuPy, contiguous; heads bh = b n_head + h),
    no bias: the kernels' own tests' and gpu_check's form (they are packed into one array first, a copy);
    returns (y, lse). y: (BH, T, hs), or with n_head, the heads' rows of a (B, T, n_head, hs) array."""
    fn = "flash_attention_forward_gpu"
    BH, T, hs = _flash_operands(fn, q, k, v)
    xp = array_module(q)
    y = xp.empty_like(q) if y is None else y
    _flash_rows(fn, "y", y, q, n_head)
    if lse is not None:
        _stats(fn, "lse", lse, q)
    if not q.size:
        return y, xp.empty((BH, T), dtype=precision.accumulate_of(q.dtype)) if lse is None else lse
    qkv = pack_heads(xp, _apart(q, k, v, n_head), q.dtype)
    return y, flash_forward(qkv, None, scale, y.reshape(BH // n_head, T, n_head, hs), lse, tf32)


def flash_attention_backward_gpu(q, k, v, y, dy, lse, scale, n_head=1, out=None, tf32=True):
    """flash_backward for q, k, v given apart, as flash_attention_forward_gpu takes them: (dq, dk, dv), into
    out ((3, BH, T, hs), contiguous) or a new array."""
    fn = "flash_attention_backward_gpu"
    BH, T, hs = _flash_operands(fn, q, k, v)
    for name, a in (("y", y), ("dy", dy)):
        _flash_rows(fn, name, a, q, n_head)
    _stats(fn, "lse", lse, q)
    xp = array_module(q)
    grads = xp.empty((3, BH, T, hs), dtype=q.dtype) if out is None else out
    if grads.shape != (3, BH, T, hs) or grads.dtype != q.dtype or not grads.flags.c_contiguous:
        raise ValueError(f"{fn}: out must be a contiguous {q.dtype} array of shape {(3, BH, T, hs)}")
    if q.size:
        rows = (BH // n_head, T, n_head, hs)
        packed = flash_backward(pack_heads(xp, _apart(q, k, v, n_head), q.dtype), None, y.reshape(rows),
                                dy.reshape(rows), lse, scale, tf32=tf32)
        for i in range(3):
            grads[i] = packed[:, :, i].transpose(0, 2, 1, 3).reshape(BH, T, hs)
    return grads


# --- the heads as the dense fused core takes them (kernels/causal_softmax.py): q, k, v (B*n_head, T, hs)
# contiguous, c_attn's bias added; and the packed heads the flash kernels read in place ---


def stacked_heads(views):
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


def split_heads(xp, qkv4, b, dtype):
    """q, k, v, each (B*nh, T, hs) contiguous (one (3, B*nh, T, hs) array of dtype), from the heads
    qkv4 (three (B, nh, T, hs) views) plus c_attn's bias b (3C,): one pass over all three where they
    are views of one array, else one each."""
    B, nh, T, hs = qkv4[0].shape
    heads = xp.empty((3, B * nh, T, hs), dtype=dtype)
    out = heads.reshape(3, B, nh, T, hs)
    stacked = stacked_heads(qkv4)
    bias = None if b is None else b.reshape(3, 1, nh, 1, hs)
    pairs = [(stacked, bias, out)] if stacked is not None else [
        (src, None if bias is None else bias[i], out[i]) for i, src in enumerate(qkv4)]
    for src, add, dst in pairs:
        if add is None:
            dst[...] = src
        else:
            xp.add(src, add, out=dst)
    return heads


def write_heads(dqkv4, grads):
    """grads (3, B*nh, T, hs), the gradients of q, k, v, into the views dqkv4: one copy where they are
    the heads of one (B*T, 3C) array, else one each."""
    B, nh, T, hs = dqkv4[0].shape
    stacked = stacked_heads(dqkv4)
    if stacked is not None:
        stacked[...] = grads.reshape(3, B, nh, T, hs)
        return
    for g, d in zip(dqkv4, grads):
        g[...] = d.reshape(B, nh, T, hs)


def packed_heads(views):
    """The (B, T, 3, n_head, hs) array the three (B, n_head, T, hs) views q, k, v are the heads of (c_attn's
    (B * T, 3 C) output, CausalSelfAttention._heads), contiguous; None where they are not exactly that."""
    stacked = stacked_heads(views)
    return None if stacked is None else stacked.transpose(1, 3, 0, 2, 4)


def _rows(xp, a4):
    """The (B, T, n_head, hs) rows of a (B, n_head, T, hs) array: the array it is a view of where it is one (the
    heads of a (B, T, C) array), else a contiguous copy."""
    rows = a4.transpose(0, 2, 1, 3)
    return rows if rows.flags.c_contiguous else xp.ascontiguousarray(rows)


# --- the fused piece flash_attention: the Ops methods it replaces, the self-check's sample, gpu_check's
# cases, its record ---
#
# No (T, T) array at all, and no copy of q, k, v: the kernels read them where c_attn wrote them, adding its
# bias as they read, and write their gradients where c_attn's backward reads them. q is kept unscaled (the
# kernels take the scale), y and dy are read and written where they lie in the layer's (B, T, C) arrays,
# rowsum(dy y) is computed by the backward's first kernel.


class FlashAttentionCache(NamedTuple):
    """What the flash core keeps: qkv, c_attn's output (B, T, 3, n_head, hs) (q unscaled, no bias), and b, its
    bias; y4, the output as a (B, n_head, T, hs) view; lse, each query row's log-sum-exp."""
    qkv: object
    b: object
    y4: object
    lse: object


def tensor_cores(ops):
    """Whether the flash kernels' float32 products run on TF32 tensor cores: ops.flash_tf32 where set,
    else as the batched GEMMs do, by the cuBLAS handle's math mode (minitensor.device.set_tf32)."""
    if ops.flash_tf32 is not None:
        return ops.flash_tf32
    return math_mode(ops.xp.cuda.device.get_cublas_handle()) == CUBLAS_TF32_TENSOR_OP_MATH


def _fused_attention_forward(ops, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
    """Ops.attention_forward by the flash kernels, unless dense or blocks are asked for or they do not
    take the head size and dtype, or the bias is of another dtype (the kernels add it in theirs). q, k, v read
    where c_attn wrote them (packed by a copy where they are not the heads of one array of y's dtype), its
    bias added by the kernels (zeros kept for the backward where there is none)."""
    B, nh, T, hs = qkv4[0].shape
    if dense is not None or not flash_fits(hs, y4.dtype) or (b is not None and b.dtype != y4.dtype):
        return cuda.FALLBACK
    xp = ops.xp
    qkv = packed_heads(qkv4)
    if qkv is None or qkv.dtype != y4.dtype:
        qkv = pack_heads(xp, qkv4, y4.dtype)
    b = _bias(xp, qkv, b)
    y = y4.transpose(0, 2, 1, 3)
    in_place = y.flags.c_contiguous                       # y4: the heads of a (B, T, C) array
    if not in_place:
        y = xp.empty((B, T, nh, hs), dtype=y4.dtype)
    lse = flash_forward(qkv, b, 1.0 / math.sqrt(hs), y, tf32=tensor_cores(ops))
    if not in_place:
        y4[...] = y.transpose(0, 2, 1, 3)
    return FlashAttentionCache(qkv, b, y4, lse)


def _fused_attention_backward(ops, dy4, saved, dqkv4):
    """Ops.attention_backward from what _fused_attention_forward kept: the gradients written where
    c_attn's backward reads them (dqkv4 the heads of one (B * T, 3 C) array), else copied into dqkv4."""
    if not isinstance(saved, FlashAttentionCache):
        return cuda.FALLBACK
    xp = ops.xp
    qkv, b, y4, lse = saved
    hs = qkv.shape[-1]
    out = packed_heads(dqkv4)
    in_place = out is not None and out.dtype == qkv.dtype
    grads = flash_backward(qkv, b, _rows(xp, y4), _rows(xp, dy4), lse, 1.0 / math.sqrt(hs),
                           out if in_place else None, tf32=tensor_cores(ops))
    if not in_place:
        for i, d in enumerate(dqkv4):
            d[...] = grads[:, :, i].transpose(0, 2, 1, 3)


def _fused_attention_backward_and_bias(ops, dy4, saved, dqkv, db):
    """Ops.attention_backward_and_bias from what _fused_attention_forward kept, into dqkv (B*T, 3C) of its
    dtype, contiguous: the bias gradient summed by the kernels that write dqkv (flash_backward's db), their
    partial sums added up by ops.add_partial_sums (within deferred_bias_sums, by the LayerNorm backward's
    second launch)."""
    if not isinstance(saved, FlashAttentionCache) or db is None:
        return cuda.FALLBACK
    qkv, b, y4, lse = saved
    if dqkv.dtype != qkv.dtype or dqkv.shape != (qkv.shape[0] * qkv.shape[1], qkv[0, 0].size) \
            or not dqkv.flags.c_contiguous or db.dtype != precision.accumulate_of(qkv.dtype):
        return cuda.FALLBACK
    xp = ops.xp
    flash_backward(qkv, b, _rows(xp, y4), _rows(xp, dy4), lse, 1.0 / math.sqrt(qkv.shape[-1]), dqkv.reshape(qkv.shape),
                   tf32=tensor_cores(ops), db=db, add_sums=ops.add_partial_sums)


# TF32 rounds each product's operands to 11 significant bits (relative error up to 2**-11, ~5e-4): the
# attention's outputs and gradients land within ~1e-3 of float32's; 5e-3 still refuses a wrong mask, tile
# or fragment layout, whose errors are of the outputs' own size.
FLASH_RTOL = 5e-3


def _flash_attention_sample(ops, rng, sizes=None):
    """A 4-head attention layer, forward and backward, over 2 x 72 positions: three query tiles, the
    last one partial, a full one over two key tiles (its running max and sum rescaled); the core as
    the backend chooses it (flash with the piece, else the Ops code), its float32 products once on
    TF32 tensor cores and once by FMAs, whatever train.tf32 will say. Heads of the run's size where
    sizes (a cuda.Sizes) gives one the kernels take (64 for ANDREA-120M: the tensor-core path a run
    uses), else of 16. For a bf16 run (sizes.precision) a third pass in bfloat16 (its weights' copy, its
    activations), its float32 gradients returned rounded to bfloat16 (compared at bfloat16's precision, as
    what they are summed from): the m16n8k16 kernels a bf16 run launches."""
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.layers.linear import Linear

    xp = ops.xp
    hs = sizes.hs if sizes is not None and flash_fits(sizes.hs, np.dtype(np.float32)) else 16
    B, T, nh = 2, 72, 4
    C, scale = nh * hs, 2.4 / math.sqrt(nh * hs)  # 0.3 at C = 64: pre-activations of the same size at any hs
    weights = [draw(xp, rng, C, 3 * C, scale=scale), draw(xp, rng, 3 * C), draw(xp, rng, C, C, scale=scale),
               draw(xp, rng, C)]
    x, dy = draw(xp, rng, B, T, C), draw(xp, rng, B, T, C)
    passes = [(True, weights, x, dy), (False, weights, x, dy)]
    if sizes is not None and precision.get(sizes.precision).compute == precision.BF16 and xp is not np:
        bf16 = precision.bfloat16()
        passes.append((None, [w.astype(bf16) for w in weights], x.astype(bf16), dy.astype(bf16)))
    outputs = []
    try:
        for tf32, ws, x_, dy_ in passes:
            ops.flash_tf32 = tf32
            grads = [xp.zeros(w.shape, np.float32) for w in ws]
            attn = CausalSelfAttention(Linear(ws[0], grads[0], ws[1], grads[1], ops=ops),
                                       Linear(ws[2], grads[2], ws[3], grads[3], ops=ops), nh, ops=ops)
            outputs += [attn.forward(x_), attn.backward(dy_), *(g if tf32 is not None else g.astype(x_.dtype)
                                                                 for g in grads)]
    finally:
        ops.flash_tf32 = None
    return tuple(outputs)


def attention_core_timed(ops, sizes, dense=None):
    """The attention core of every head (the layer's q, k, v as views of one (B, T, 3C) array), forward
    and backward, as CausalSelfAttention calls it; `dense` as the layer passes it (None: the backend's
    choice)."""
    xp, B, T, C, nh = ops.xp, sizes.B, sizes.T, sizes.C, sizes.n_head
    qkv = cuda.normals(xp, B, T, 3 * C).reshape(B, T, 3, nh, C // nh)
    qkv4 = [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]
    y = xp.empty((B, T, C), np.float32)
    y4 = y.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)
    dy4 = cuda.normals(xp, B, T, C).reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3)
    dqkv = xp.empty((B, T, 3, nh, C // nh), np.float32)
    grads4 = [dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]
    return lambda: ops.attention_backward(dy4, ops.attention_forward(qkv4, None, y4, dense=dense), grads4)


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

    def heads(d):  # q, k, v as one head each of BH in a sequence: the (1, T, 3, BH, hs) array c_attn writes
        return pack_heads(k.xp, [d[n][None] for n in "qkv"], k.dtype)

    def fused_bias(d):  # c_attn's bias gradient from the flash backward's own column sums, and the gradients
        qkv, acc = heads(d), precision.accumulate_of(k.dtype)
        y = k.xp.empty((1, T, BH, hs), k.dtype)
        lse = flash_forward(qkv, None, scale, y, tf32=False)
        db = k.xp.zeros(3 * BH * hs, acc)
        dy = k.xp.ascontiguousarray(d["dy"].transpose(1, 0, 2)[None])  # (1, T, BH, hs), as y
        dqkv = flash_backward(qkv, None, y, dy, lse, scale, tf32=False, db=db)
        return db, dqkv

    def generic_bias(d):  # Ops' dense core, then add_bias_grad over its gradients' rows
        qkv4 = qkv_heads(heads(d).reshape(T, -1), 1, T, BH)
        y4 = k.xp.empty((1, BH, T, hs), k.dtype)
        cache = k.ref.attention_forward(qkv4, None, y4, dense=True)
        dqkv, db = k.xp.empty((T, 3 * BH * hs), k.dtype), k.xp.zeros(3 * BH * hs, precision.accumulate_of(k.dtype))
        k.ref.attention_backward_and_bias(d["dy"][None], cache, dqkv, db)
        return db, dqkv.reshape(1, T, 3, BH, hs)

    return [("flash attention fwd + bwd", setup, fused, generic, False),
            ("flash attention bias grad", setup, fused_bias, generic_bias, False)]


FLASH_ATTENTION = cuda.fused_piece(
    "flash_attention",
    replaces={"attention_forward": _fused_attention_forward, "attention_backward": _fused_attention_backward,
              "attention_backward_and_bias": _fused_attention_backward_and_bias},
    kernels=(FLASH_FWD, FLASH_BWD_DQ, FLASH_BWD_DKV, FLASH16_FWD, FLASH16_BWD_DQ, FLASH16_BWD_DKV),
    sample=_flash_attention_sample,
    cases=_flash_attention_cases,
    rtol=FLASH_RTOL,
    timed=attention_core_timed,  # against the core the backend takes without it: dense within its budget
)
