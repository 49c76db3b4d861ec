"""RMSNorm over the last axis on the GPU, one block per row: the RawKernels of kernels/rmsnorm.cu
(their shared reductions in kernels/rows.cuh), their wrappers and the fused piece rmsnorm's record.
LayerNorm's (kernels/layernorm.py) less the mean and the bias."""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.device import array_module

# What these kernels must equal is Ops.rmsnorm_forward / _backward: the start-up self-check runs the
# layer both ways on the GPU. The tests run the kernels on the host (kernelcheck.emulate_launch)
# against Ops' methods in float64. The kernels: kernels/rmsnorm.cu.


def _rmsnorm_model(m):
    """A block's ln_2 at the model's sizes, as the step calls it: forward, then backward adding the
    residual gradient (minitensor.checks.counts)."""
    x, residual, dy = (np.zeros((m.N, m.C), np.float32) for _ in range(3))
    w = np.ones(m.C, np.float32)
    _, rstd = rmsnorm_forward_gpu(x, w)
    rmsnorm_backward_gpu(dy, x, w, rstd, np.zeros_like(w), residual=residual)


# Built for bfloat16 too (bf16=True): rows stored in T, summed in ACC; rstd and the weight's sums in ACC.
RMSNORM_FWD = cuda.RawSpec("rmsnorm_fwd", "rmsnorm.cu", model=_rmsnorm_model, bf16=True)

# forward was: y = xhat w, xhat = x rstd. As layernorm_bwd (kernels/layernorm.py): rows in chunks of
# rows_per_chunk per block, RMS_COLS columns per thread kept in registers, so C <= RMS_COLS x RMS_THREADS.
RMS_COLS, RMS_THREADS = 8, 256
RMS_MAX_C = RMS_COLS * RMS_THREADS  # 2048
RMS_CHUNKS, RMS_CHUNK_ROWS = 512, 16


def _rmsnorm_bwd_traffic(dy, x, w, rstd, res, dx, part_w, accumulate, **_):
    """dy, x and rstd read once, and res when accumulating; dx and the partial sums written."""
    read = dy.nbytes + x.nbytes + w.nbytes + rstd.nbytes + (res.nbytes if accumulate else 0)
    return read, dx.nbytes + part_w.nbytes


RMSNORM_BWD = cuda.RawSpec("rmsnorm_bwd", "rmsnorm.cu", traffic=_rmsnorm_bwd_traffic, model=_rmsnorm_model,
                           bf16=True)

# The weight sums' second launch: blocks of (32, 8) threads, each adding 32 columns' partials.
RMS_PARAM_BLOCK = (32, 8)
RMSNORM_BWD_PARAMS = cuda.RawSpec("rmsnorm_bwd_params", "rmsnorm.cu", model=_rmsnorm_model, bf16=True)


def rmsnorm_forward_gpu(x, w, eps=1e-5):
    """RMSNorm of the rows of x (..., C) (CuPy, contiguous); returns (y, rstd), y shaped like x, rstd
    (N, 1) as minitensor/layers/rmsnorm.py caches it (N = x.size / C), in what x is summed in (float32
    for bfloat16 x and w)."""
    fn = "rmsnorm_forward_gpu"
    N, C = cuda.rows(fn, x, RMSNORM_FWD)
    cuda.vector(fn, "w", w, x)
    xp = array_module(x)
    y = xp.empty_like(x)
    acc = precision.accumulate_of(x.dtype)
    rstd = xp.empty((N, 1), dtype=acc)
    if N:
        cuda.launch(RMSNORM_FWD, x.dtype, (N,), (cuda.threads(C, 128),),
                    (x, w, y, rstd, np.int32(C), acc.type(eps)))
    return y, rstd


def rmsnorm_backward_gpu(dy, x, w, rstd, dw, residual=None):
    """dx of RMSNorm from dy and the forward's x, w, rstd (all CuPy, contiguous; x and dy (..., C), C at
    most RMS_MAX_C, rstd N values); accumulates dw += sum(dy xhat) over rows. Returns a new dx, or
    with `residual` (x's shape, contiguous, kept) a new residual + dx, fused. Two launches: dx with the
    weight's partial sums per chunk of rows (rmsnorm_bwd), then those summed into dw (rmsnorm_bwd_params)."""
    fn = "rmsnorm_backward_gpu"
    N, C = cuda.rows(fn, x, RMSNORM_BWD)
    if C > RMS_MAX_C:
        raise ValueError(f"{fn}: rows of {C} values; at most {RMS_MAX_C} are supported (Ops.rmsnorm_backward "
                         f"takes any)")
    cuda.like(fn, "dy", dy, x)
    cuda.vector(fn, "w", w, x)
    cuda.vector(fn, "dw", dw, x, summed=True)
    cuda.row_values(fn, "rstd", rstd, x, N)
    if residual is not None:
        cuda.like(fn, "residual", residual, x)
    xp = array_module(x)
    dx = xp.empty_like(x)
    if not N:
        return dx
    rows_per_chunk = max(RMS_CHUNK_ROWS, -(-N // RMS_CHUNKS))
    chunks = -(-N // rows_per_chunk)
    part_w = xp.empty((chunks, C), dtype=precision.accumulate_of(x.dtype))  # dw's partial sums per chunk of rows
    cuda.launch(RMSNORM_BWD, x.dtype, (chunks,), (max(128, cuda.threads(-(-C // RMS_COLS), RMS_THREADS)),),
                (dy, x, w, rstd, dx if residual is None else residual, dx, part_w, np.int32(N), np.int32(C),
                 np.int32(rows_per_chunk), np.int32(residual is not None)))
    cuda.launch(RMSNORM_BWD_PARAMS, x.dtype, (-(-C // 32),), RMS_PARAM_BLOCK,
                (part_w, dw, np.int32(chunks), np.int32(C)))
    return dx


# --- the fused piece rmsnorm: the Ops methods it replaces, the self-check's sample, gpu_check's cases,
# its record ---


def _fused_rmsnorm_forward(ops, x, w, eps):
    """Ops.rmsnorm_forward, one block per row."""
    return rmsnorm_forward_gpu(x, w, eps)


def _fused_rmsnorm_backward(ops, dy, x, rstd, w, dw, dres=None):
    """Ops.rmsnorm_backward for rows of at most RMS_MAX_C values, the skip gradient dres added in the
    same pass."""
    if x.shape[-1] > RMS_MAX_C:
        return cuda.FALLBACK
    # the kernel reads the skip gradient and writes dx beside it: the caller's array is kept
    residual = None if dres is None else ops.xp.ascontiguousarray(dres)
    return rmsnorm_backward_gpu(dy, x, w, rstd, dw, residual=residual)


def _rmsnorm_sample(ops, rng):
    """RMSNorm forward and backward (with a skip gradient) over 40 rows of 100 columns."""
    from minitensor.layers.rmsnorm import RMSNorm

    xp = ops.xp
    C = 100  # not a multiple of the 32-thread warps
    dw = xp.zeros(C, np.float32)
    norm = RMSNorm(draw(xp, rng, C, shift=1.0), dw, ops=ops)
    y = norm.forward(draw(xp, rng, 4, 10, C, scale=3.0, shift=0.5))
    dx = norm.backward(draw(xp, rng, 4, 10, C), skip=draw(xp, rng, 4, 10, C))
    return y, dx, dw


def _rmsnorm_cases(k):
    """RMSNorm forward, and backward with and without the skip gradient, against the layer."""
    from minitensor.layers.rmsnorm import RMSNorm

    N, C = k.N, k.C

    def setup():
        k.reseed()
        x, dy, w = k.rand(N, C, shift=0.3), k.rand(N, C), k.rand(C, scale=0.2, shift=1.0)
        layer = RMSNorm(w, k.zeros(C), ops=k.ref)
        layer.forward(x)
        return dict(x=x, dy=dy, w=w, r=k.rand(N, C), layer=layer, cache=layer._cache, dw=k.zeros(C))

    def generic_fwd(d):
        return d["layer"].forward(d["x"]), d["layer"]._cache.rstd

    def generic_bwd(d, skip=None):
        d["layer"]._save(d["cache"])
        return d["layer"].backward(d["dy"], skip=skip), d["layer"].dw

    def fused_bwd(d, residual=None):
        return rmsnorm_backward_gpu(d["dy"], d["x"], d["w"], d["cache"].rstd, d["dw"], residual=residual), d["dw"]

    return [
        ("rmsnorm fwd", setup, lambda d: rmsnorm_forward_gpu(d["x"], d["w"]), generic_fwd, False),
        ("rmsnorm bwd", setup, fused_bwd, generic_bwd, False),
        ("rmsnorm bwd + residual", setup, lambda d: fused_bwd(d, d["r"]), lambda d: generic_bwd(d, d["r"]), False),
    ]


def _rmsnorm_timed(ops, sizes):
    """RMSNorm over N rows of C, forward and backward with a skip gradient."""
    xp = ops.xp
    x, dy, skip = (cuda.normals(xp, sizes.N, sizes.C) for _ in range(3))
    w, dw = xp.ones(sizes.C, np.float32), xp.zeros(sizes.C, np.float32)

    def run():
        _, rstd = ops.rmsnorm_forward(x, w, 1e-5)
        return ops.rmsnorm_backward(dy, x, rstd, w, dw, dres=skip)
    return run


RMSNORM = cuda.fused_piece(
    "rmsnorm",
    replaces={"rmsnorm_forward": _fused_rmsnorm_forward, "rmsnorm_backward": _fused_rmsnorm_backward},
    kernels=(RMSNORM_FWD, RMSNORM_BWD, RMSNORM_BWD_PARAMS),
    sample=_rmsnorm_sample,
    cases=_rmsnorm_cases,
    timed=_rmsnorm_timed,
)
