"""LayerNorm over the last axis on the GPU, one block per row: the RawKernels of kernels/layernorm.cu
(their shared reductions in kernels/rows.cuh), their wrappers and the fused piece layernorm's record."""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.backends.kernels.gelu import add_column_sums
from minitensor.device import array_module

# What these kernels must equal is Ops.layernorm_forward / _backward: the start-up self-check runs
# the layer both ways on the GPU. The tests run the kernels on the host (kernelcheck.emulate_launch)
# against the textbook form in tests/support/reference.py. The kernels: kernels/layernorm.cu.


def _layernorm_fwd_traffic(x, residual, bias, w, b, y, mean, rstd, add_residual, add_bias, **_):
    """x (and the residual and bias, when added: x is then written back) read once, y and the statistics
    written."""
    joined = x.nbytes if add_residual else 0
    read = x.nbytes + joined + w.nbytes + b.nbytes + (bias.nbytes if add_bias else 0)
    return read, y.nbytes + mean.nbytes + rstd.nbytes + joined


def _layernorm_model(m):
    """A block's ln_2 at the model's sizes, as the step calls it: forward joining the residual, backward
    adding the residual gradient and summing its columns (c_proj's bias gradient; minitensor.checks.counts)."""
    x, residual, dy = (np.zeros((m.N, m.C), np.float32) for _ in range(3))
    w, b = np.ones(m.C, np.float32), np.zeros(m.C, np.float32)
    _, mean, rstd = layernorm_forward_gpu(x, w, b, residual=residual, bias=b)
    layernorm_backward_gpu(dy, x, w, mean, rstd, np.zeros_like(w), np.zeros_like(b), residual=residual,
                           res_db=np.zeros_like(b))


# Every kernel here is built for bfloat16 too (bf16=True): rows stored in T, summed in ACC, the statistics
# (mean, rstd) and the parameters' sums in ACC (float32 for bfloat16: precision.accumulate_of).
LAYERNORM_FWD = cuda.RawSpec("layernorm_fwd", "layernorm.cu", traffic=_layernorm_fwd_traffic, model=_layernorm_model,
                             bf16=True)


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


def _layernorm_bwd_traffic(dy, x, w, mean, rstd, res, dx, part_w, part_b, part_r, accumulate, sum_res, **_):
    """dy, x and the statistics read once, and res when accumulating; dx and the partial sums written (res's
    too with sum_res)."""
    read = dy.nbytes + x.nbytes + w.nbytes + mean.nbytes + rstd.nbytes + (res.nbytes if accumulate else 0)
    return read, dx.nbytes + part_w.nbytes + part_b.nbytes + (part_r.nbytes if sum_res else 0)


def _layernorm_bwd_params_traffic(part_w, part_b, part_r, dw, db, dr, sum_res, more, more_out, more_C, **_):
    """The partial sums read and dw, db (dr with sum_res) written (part_r and dr stand in for part_b and
    db without sum_res, unread and unwritten); another set's partial sums read and its sums added (more_C
    0: none, more and more_out unread)."""
    n = 3 if sum_res else 2
    more_read, more_written = (more.nbytes + more_out.nbytes, more_out.nbytes) if more_C else (0, 0)  # out +=
    return n * part_w.nbytes + more_read, n * dw.nbytes + more_written


LAYERNORM_BWD = cuda.RawSpec("layernorm_bwd", "layernorm.cu", traffic=_layernorm_bwd_traffic, model=_layernorm_model,
                             bf16=True)


# The parameter sums' second launch: blocks of (32, 8) threads, each adding 32 columns' partials.
LN_PARAM_BLOCK = (32, 8)
LAYERNORM_BWD_PARAMS = cuda.RawSpec("layernorm_bwd_params", "layernorm.cu", traffic=_layernorm_bwd_params_traffic,
                                    model=_layernorm_model, bf16=True)


def layernorm_forward_gpu(x, w, b, eps=1e-5, residual=None, out=None, bias=None):
    """LayerNorm of the rows of x (..., C) (CuPy, contiguous); returns (y, mean, rstd), y shaped
    like x, mean and rstd (N, 1) as minitensor/layers/layernorm.py caches them (N = x.size / C), in
    what x is summed in (x's dtype; float32 for bfloat16 x, w and b).

    With `residual` (x's shape), x is first updated in place to x + residual, the residual join
    of a pre-norm block fused into the normalisation; the caller then caches x as the input. With
    `bias` too (C values like w), to (x + bias) + residual: Ops.add_epilogue(x, bias, residual)'s adds, the
    sublayer's last bias joined with its residual. `out` may be x itself."""
    fn = "layernorm_forward_gpu"
    N, C = cuda.rows(fn, x, LAYERNORM_FWD)
    cuda.vector(fn, "w", w, x)
    cuda.vector(fn, "b", b, x)
    if bias is not None:
        cuda.vector(fn, "bias", bias, x)
        if residual is None:
            raise ValueError(f"{fn}: bias is joined with a residual; give residual too")
    for name, a in (("residual", residual), ("out", out)):
        if a is not None:
            cuda.like(fn, name, a, x)
    xp = array_module(x)
    y = xp.empty_like(x) if out is None else out
    acc = precision.accumulate_of(x.dtype)
    mean = xp.empty((N, 1), dtype=acc)
    rstd = xp.empty((N, 1), dtype=acc)
    if N:
        cuda.launch(LAYERNORM_FWD, x.dtype, (N,), (cuda.threads(C, 128),),
                (x, x if residual is None else residual, b if bias is None else bias, w, b, y, mean, rstd,
                 np.int32(C), acc.type(eps), np.int32(residual is not None), np.int32(bias is not None)))
    return y, mean, rstd


def layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, add_to=None, residual=None, res_db=None, more=None):
    """dx of LayerNorm from dy and the forward's x, w, mean, rstd (all CuPy, contiguous; x and dy
    (..., C), C at most LN_MAX_C, mean and rstd N values); accumulates dw += sum(dy xhat),
    db += sum(dy) over rows. mean, rstd, dw and db are in what x is summed in (float32 for bfloat16).

    Returns a new dx; with `residual` (x's shape, contiguous), a new residual + dx, the residual
    gradient of a pre-norm block, fused (residual is kept); with `add_to` instead, adds dx into
    add_to in place and returns it. res_db (C values, like db), with either: accumulates the column
    sums of what was added (residual's, or add_to's as it was), summed as dw and db are (in chunks of
    rows, then the chunks in order). Two launches: dx with the partial sums per chunk of rows
    (layernorm_bwd), then those summed into dw, db (and res_db) (layernorm_bwd_params). more: (part, out),
    another backward's partial column sums (chunks, n) in the summed type and the gradient (n,) they add up
    into, out += the sum of part's rows, in the second launch (as column_sums_add would)."""
    fn = "layernorm_backward_gpu"
    N, C = cuda.rows(fn, x, LAYERNORM_BWD)
    _check_backward(fn, dy, x, w, mean, rstd, dw, db, add_to, residual, res_db, N, C)
    if more is not None:
        _check_more(fn, *more, x)
    xp = array_module(x)
    dx = xp.empty_like(x) if add_to is None else add_to
    res = add_to if add_to is not None else residual
    if not N:
        if more is not None:
            add_column_sums(*more, x.dtype)
        return dx
    rows_per_chunk = max(LN_CHUNK_ROWS, -(-N // LN_CHUNKS))
    chunks = -(-N // rows_per_chunk)
    sum_res = np.int32(res_db is not None)
    # dw's, db's (and res_db's) partial sums per chunk
    parts = xp.empty((2 + int(sum_res), chunks, C), dtype=precision.accumulate_of(x.dtype))
    part_r, dr = (parts[2], res_db) if sum_res else (parts[1], db)  # unread and unwritten without sum_res
    cuda.launch(LAYERNORM_BWD, x.dtype, (chunks,), (max(128, cuda.threads(-(-C // LN_COLS), LN_THREADS)),),
                (dy, x, w, mean, rstd, dx if res is None else res, dx, parts[0], parts[1], part_r, np.int32(N),
                 np.int32(C), np.int32(rows_per_chunk), np.int32(res is not None), sum_res))
    more_part, more_out = more if more is not None else (parts[0], dw)  # unread and unwritten without more
    more_chunks, more_C = more_part.shape if more is not None else (0, 0)
    cuda.launch(LAYERNORM_BWD_PARAMS, x.dtype, (-(-C // 32) + -(-more_C // 32),), LN_PARAM_BLOCK,
                (parts[0], parts[1], part_r, dw, db, dr, np.int32(chunks), np.int32(C), sum_res, more_part, more_out,
                 np.int32(more_chunks), np.int32(more_C)))
    return dx


def _check_backward(fn, dy, x, w, mean, rstd, dw, db, add_to, residual, res_db, N, C):
    """layernorm_backward_gpu's arguments as its docstring says, or a ValueError saying which is not."""
    if C > LN_MAX_C:
        raise ValueError(f"{fn}: rows of {C} values; at most {LN_MAX_C} are supported (Ops.layernorm_backward "
                         f"takes any)")
    cuda.like(fn, "dy", dy, x)
    cuda.vector(fn, "w", w, x)
    for name, a in (("mean", mean), ("rstd", rstd)):
        cuda.row_values(fn, name, a, x, N)
    for name, a in (("dw", dw), ("db", db), ("res_db", res_db)):
        if a is not None:
            cuda.vector(fn, name, a, x, summed=True)
    if add_to is not None and residual is not None:
        raise ValueError(f"{fn}: give add_to (in place) or residual (kept), not both")
    if res_db is not None and add_to is None and residual is None:
        raise ValueError(f"{fn}: res_db sums the columns of residual or add_to; give one of them")
    for name, a in (("add_to", add_to), ("residual", residual)):
        if a is not None:
            cuda.like(fn, name, a, x)


def _check_more(fn, part, out, x):
    """more = (part, out): partial column sums (chunks, n), contiguous, in what x is summed in, and out (n,)."""
    acc = precision.accumulate_of(x.dtype)
    if part.ndim != 2 or part.dtype != acc or not part.flags.c_contiguous:
        raise ValueError(f"{fn}: more's partial sums must be a contiguous {acc} array (chunks, n), got "
                         f"{part.dtype} {part.shape}")
    cuda.vector(fn, "more's gradient", out, part, summed=True)


# --- the fused piece layernorm: the Ops methods it replaces, the self-check's sample, gpu_check's
# cases, its record ---


def _fused_layernorm_forward(ops, x, w, b, eps):
    """Ops.layernorm_forward, one block per row."""
    return layernorm_forward_gpu(x, w, b, eps)


def _fused_joined_layernorm_forward(ops, x, bias, residual, w, b, eps):
    """Ops.joined_layernorm_forward, the join in the normalisation's first pass over x (one launch, x read
    once, for add_epilogue's launch and the LayerNorm's); Ops' code where an operand is not laid out as
    the kernel reads it."""
    if not (x.flags.c_contiguous and residual.flags.c_contiguous and residual.shape == x.shape
            and residual.dtype == x.dtype and (bias is None or (bias.dtype == x.dtype and bias.flags.c_contiguous))
            and not ops.xp.may_share_memory(x, residual)):
        return cuda.FALLBACK
    return layernorm_forward_gpu(x, w, b, eps, residual=residual, bias=bias)


def _fused_layernorm_backward(ops, dy, x, mean, rstd, w, dw, db, dres=None, dres_db=None):
    """Ops.layernorm_backward for rows of at most LN_MAX_C values, the skip gradient dres added, and its
    columns summed into dres_db, in the same pass; a bias gradient's partial sums left within
    deferred_bias_sums (CupyOps.take_partial_sums) added up in its second launch."""
    if x.shape[-1] > LN_MAX_C:
        return cuda.FALLBACK
    # the kernel reads the skip gradient and writes dx beside it: the caller's array is kept
    residual = None if dres is None else ops.xp.ascontiguousarray(dres)
    return layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=residual, res_db=dres_db,
                                  more=ops.take_partial_sums(x.dtype))


def _layernorm_sample(ops, rng):
    """LayerNorm forward and backward (with a skip gradient, its columns summed) over 40 rows of 100 columns."""
    from minitensor.layers.layernorm import LayerNorm
    from minitensor.layers.linear import Linear

    xp = ops.xp
    C = 100  # not a multiple of the 32-thread warps
    dw, db, skip_db = (xp.zeros(C, np.float32) for _ in range(3))
    ln = LayerNorm(draw(xp, rng, C, shift=1.0), dw, draw(xp, rng, C), db, ops=ops)
    y = ln.forward(draw(xp, rng, 4, 10, C, scale=3.0, shift=0.5))
    skipped = Linear(None, None, None, skip_db)  # the sublayer's c_proj: only its bias gradient is read
    dx = ln.backward_and_sum_skip(draw(xp, rng, 4, 10, C), draw(xp, rng, 4, 10, C), skipped)
    joined = draw(xp, rng, 4, 10, C)  # a sublayer's product, joined with its bias and the residual
    y2 = ln.forward_joined(joined, draw(xp, rng, C), draw(xp, rng, 4, 10, C))
    return y, dx, dw, db, skip_db, joined, y2


def _layernorm_cases(k):
    """LayerNorm forward and backward, each also with the residual join folded in (the forward's with the
    sublayer's bias, the backward's summing the skip's columns), against the layer."""
    from minitensor.layers.layernorm import LayerNorm

    N, C = k.N, k.C

    def setup():
        k.reseed()
        x, dy, w, b = k.rand(N, C, shift=0.3), k.rand(N, C), k.rand(C, scale=0.2, shift=1.0), k.rand(C, scale=0.1)
        layer = LayerNorm(w, k.zeros(C), b, k.zeros(C), ops=k.ref)
        layer.forward(x)
        return dict(x=x, dy=dy, w=w, b=b, r=k.rand(N, C), rb=k.rand(C, scale=0.1), layer=layer, cache=layer._cache,
                    dw=k.zeros(C), db=k.zeros(C), rdb=k.zeros(C))

    def generic_fwd(d):
        y = d["layer"].forward(d["x"])
        return y, d["layer"]._cache.mean, d["layer"]._cache.rstd

    def generic_bwd(d, add_to=None):
        layer = d["layer"]
        layer._save(d["cache"])
        dx = layer.backward(d["dy"])
        if add_to is None:
            return dx, layer.dw, layer.db
        d["rdb"] += add_to.sum(axis=0)                      # the skip's column sums: c_proj's bias gradient
        dx += add_to
        return dx, layer.dw, layer.db, d["rdb"]

    def generic_res(d):
        d["x"] += d["rb"]                                    # (y + b) + x: add_epilogue's order
        d["x"] += d["r"]
        return d["layer"].forward(d["x"]), d["x"]

    def fused_bwd(d, add_to=None):
        dx = layernorm_backward_gpu(d["dy"], d["x"], d["w"], d["cache"].mean, d["cache"].rstd, d["dw"], d["db"],
                                    add_to=add_to, res_db=None if add_to is None else d["rdb"])
        return (dx, d["dw"], d["db"]) if add_to is None else (dx, d["dw"], d["db"], d["rdb"])

    return [
        ("layernorm fwd", setup, lambda d: layernorm_forward_gpu(d["x"], d["w"], d["b"]), generic_fwd,
         False),
        ("layernorm bwd", setup, fused_bwd, generic_bwd, False),
        ("layernorm fwd + bias + residual", setup,
         lambda d: (layernorm_forward_gpu(d["x"], d["w"], d["b"], residual=d["r"], bias=d["rb"])[0], d["x"]),
         generic_res, False),
        ("layernorm bwd + residual, its column sums", setup, lambda d: fused_bwd(d, add_to=d["r"]),
         lambda d: generic_bwd(d, add_to=d["r"]), False),
    ]


def _layernorm_timed(ops, sizes):
    """LayerNorm over N rows of C, forward and backward with a skip gradient."""
    xp = ops.xp
    x, dy, skip = (cuda.normals(xp, sizes.N, sizes.C) for _ in range(3))
    w, b, dw, db = xp.ones(sizes.C, np.float32), xp.zeros(sizes.C, np.float32), *(xp.zeros(sizes.C, np.float32)
                                                                                 for _ in range(2))

    def run():
        _, mean, rstd = ops.layernorm_forward(x, w, b, 1e-5)
        return ops.layernorm_backward(dy, x, mean, rstd, w, dw, db, dres=skip)
    return run


LAYERNORM = cuda.fused_piece(
    "layernorm",
    replaces={"layernorm_forward": _fused_layernorm_forward, "joined_layernorm_forward": _fused_joined_layernorm_forward,
              "layernorm_backward": _fused_layernorm_backward},
    kernels=(LAYERNORM_FWD, LAYERNORM_BWD, LAYERNORM_BWD_PARAMS),
    sample=_layernorm_sample,
    cases=_layernorm_cases,
    timed=_layernorm_timed,
)
