"""Fused CUDA kernels for the GPU path, each beside the NumPy formula it must equal.

    bias_gelu_fwd, bias_gelu_bwd       y = GELU(x + b) and dL/dh, elementwise (b by column)
    layernorm_fwd, layernorm_bwd       one block per row: y, mean, rstd; dx (optionally adding
                                       in x + residual / into the residual gradient, fused)
    layernorm_bwd_params               dw, db as per-chunk column sums, added in a fixed order
    causal_softmax_fwd, _bwd           one block per row of (..., T, T) scores, optional lse
    causal_softmax_recompute           p again from the scores and lse, elementwise
    softmax_xent_fwd, softmax_xent_bwd per-row log-sum-exp and loss, probabilities over the
                                       logits in place; dlogits in place
    adamw_step                         AdamW over the whole flat buffer, one pass

Each section: the NumPy formula (`*_reference`, written plainly, for tests), the CUDA kernel(s)
that must equal it, registered in `minitensor.kernels.KERNELS`, and a wrapper taking CuPy arrays
(`*_gpu`). They are opt-in: the layers run the generic xp code until a GPU run has verified a
kernel against it. RawKernels are written against `T` (typedef'd per dtype), one block per row;
the wrappers pass scalars as NumPy scalars of the kernel's C types (`_launch` checks them: CuPy
would pass a Python int as 64 bits and a Python float as a double, silently). Without a GPU,
`minitensor.kernelcheck.emulate_launch` can stand in for `_launch` and run the RawKernels on the
CPU. Importing this module does not import CuPy.
"""

import functools
import math
import re

import numpy as np

from minitensor.backend import array_module
from minitensor.kernels import (
    _AC,
    _AC3,
    _C,
    ElementwiseSpec,
    RawSpec,
    _check_operands,
    gelu_backward_reference,
    gelu_forward_reference,
    register,
)

# --- bias + GELU: y = GELU(x + b), b broadcast over the rows; x is the matmul output (N, C) ---


def bias_gelu_forward_reference(x, b):
    return gelu_forward_reference(x + b)


def bias_gelu_backward_reference(x, b, dy):
    """dL/dh for h = x + b; dL/dx is the same, dL/db its sum over the rows."""
    return gelu_backward_reference(x + b, dy)


def _column(n, C):
    """Column of each flat index of an (n / C, C) array: what `i % C` gives in the kernels."""
    return np.arange(n) % int(C)


# `i` is the flat C-order index over x's shape, so `i % C` is the column even for strided x; the
# 32-bit cast avoids a 64-bit modulo per element (the wrappers refuse 2**31 elements or more).
BIAS_GELU_FWD = register(ElementwiseSpec(
    "bias_gelu_fwd", "T x, raw T b, int32 C", "T y",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n"
    f"const T t = tanh(h * ((T){_AC!r} * h * h + (T){_C!r}));\n"
    "y = h * ((T)0.5 * ((T)1 + t));",
    reference=lambda x, b, C: bias_gelu_forward_reference(x, b[_column(x.size, C)]),
    scalars=(("C", 7),),
))

BIAS_GELU_BWD = register(ElementwiseSpec(
    "bias_gelu_bwd", "T x, raw T b, int32 C, T dy", "T dh",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n"
    "const T h2 = h * h;\n"
    f"const T s = (T)1 - tanh(h * ((T){_AC!r} * h2 + (T){_C!r}));\n"
    f"const T g = h * ((T){_AC3!r} * h2 + (T){_C!r});\n"
    "dh = dy * (((T)1 + s * g) * ((T)1 - (T)0.5 * s));",
    reference=lambda x, b, C, dy: bias_gelu_backward_reference(x, b[_column(x.size, C)], dy),
    scalars=(("C", 7),),
))


def bias_gelu_forward_gpu(x, b, out=None):
    """GELU(x + b) for x (..., C) and b (C,) CuPy arrays, into `out` if given; returns y.

    The caller keeps x (the matmul output without its bias) for the backward: h = x + b is never
    stored."""
    _check_bias(x, b, out, "bias_gelu_forward_gpu")
    _on_cupy("bias_gelu_forward_gpu", x, "gelu_forward(x + b)")
    kern = BIAS_GELU_FWD.kernel()
    C = np.int32(x.shape[-1])
    return kern(x, b, C) if out is None else kern(x, b, C, out)


def bias_gelu_backward_gpu(x, b, dy, db=None, out=None):
    """dL/dh for h = x + b, y = GELU(h), from the forward's x and b and dy = dL/dy; into `out`
    if given (it may be dy). With `db`, also db += the column sums of dh. Returns dh."""
    _check_bias(x, b, out, "bias_gelu_backward_gpu", dy)
    _on_cupy("bias_gelu_backward_gpu", x, "gelu_backward(x + b, dy)")
    kern = BIAS_GELU_BWD.kernel()
    C = np.int32(x.shape[-1])
    dh = kern(x, b, C, dy) if out is None else kern(x, b, C, dy, out)
    if db is not None:
        db += dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return dh


def _check_bias(x, b, out, fn, dy=None):
    _check_operands(fn, x, out, dy)
    if x.ndim < 1 or x.size >= 2**31:
        raise ValueError(f"{fn}: x must have 1 to 2**31 - 1 elements and a last axis, got shape {x.shape}")
    if b.shape != x.shape[-1:] or b.dtype != x.dtype or not b.flags.c_contiguous:
        raise ValueError(f"{fn}: b must be a contiguous {x.dtype} vector of shape {x.shape[-1:]}, got "
                         f"{b.dtype} {b.shape}")


# --- LayerNorm over the last axis (minitensor/layernorm.py): one block per row ---


def layernorm_forward_reference(x, w, b, eps=1e-5):
    """(y, mean, rstd) for rows x (N, C): y = (x - mean) rstd w + b, mean and rstd (N, 1)."""
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    return xc * rstd * w + b, mean, rstd


def layernorm_backward_reference(dy, x, w, mean, rstd):
    """(dx, dw, db): dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, xhat = (x - mean) rstd."""
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


# Shared by the row kernels: overloads that keep float maths in float, and block-wide reductions.
# The reductions need a 1-D block of a multiple of 32 threads (at most 1024), all calling them
# (they use __syncthreads and full-warp shuffles); every thread gets the result; `buf` is 32 Ts of
# shared memory, reusable by the next call. NVRTC has no INFINITY or NAN: the bit patterns instead.
_ROW_COMMON = r"""
__device__ __forceinline__ float exp_of(float v) { return expf(v); }
__device__ __forceinline__ double exp_of(double v) { return exp(v); }
__device__ __forceinline__ float log_of(float v) { return logf(v); }
__device__ __forceinline__ double log_of(double v) { return log(v); }
__device__ __forceinline__ float sqrt_of(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_of(double v) { return sqrt(v); }
__device__ __forceinline__ float lowest_of(float) { return -3.40282347e+38f; }
__device__ __forceinline__ double lowest_of(double) { return -1.7976931348623157e+308; }
__device__ __forceinline__ float nan_of(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double nan_of(double) { return __longlong_as_double(0x7ff8000000000000LL); }

__device__ T block_sum(T v, T *buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  /* buf may still be read by the previous call */
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < n_warps ? buf[lane] : (T)0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ T block_max(T v, T *buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < n_warps ? buf[lane] : lowest_of(v);
  for (int o = 16; o > 0; o >>= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}
"""

# One block per row of x (N, C). With add_residual, x is first updated in place to x + residual
# (the residual join before a pre-norm LayerNorm, fused); otherwise `residual` is not read. Each
# thread touches the same columns in every loop, so y may be x itself.
LAYERNORM_FWD = register(RawSpec("layernorm_fwd", _ROW_COMMON + r"""
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
"""))

# forward was: y = xhat w + b, xhat = (x - mean) rstd. One block per row: dx, written or (with
# accumulate) added into dx, the residual gradient of a pre-norm block, fused.
LAYERNORM_BWD = register(RawSpec("layernorm_bwd", _ROW_COMMON + r"""
extern "C" __global__ void layernorm_bwd(const T *dy, const T *x, const T *w, const T *mean, const T *rstd,
                                         T *dx, const int C, const int accumulate) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const T *dyr = dy + row * C;
  const T *xr = x + row * C;
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
    dxr[j] = accumulate ? dxr[j] + v : v;
  }
}
"""))

# dw = sum over rows of dy xhat, db = sum over rows of dy, as partial sums per chunk of rows:
# block (32, 8) sums 32 columns over one chunk; the wrapper adds the (chunks, C) partials in a
# fixed order, so the result is deterministic (no atomics).
LN_PARAM_BLOCK = (32, 8)
LAYERNORM_BWD_PARAMS = register(RawSpec("layernorm_bwd_params", r"""
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
    like x, mean and rstd (N, 1) as minitensor/layernorm.py caches them (N = x.size / C).

    With `residual` (x's shape), x is first updated in place to x + residual, the residual join
    of a pre-norm block fused into the normalisation; the caller then caches x as the input.
    `out` may be x itself."""
    fn = "layernorm_forward_gpu"
    N, C = _rows(fn, x)
    _vector(fn, "w", w, x)
    _vector(fn, "b", b, x)
    for name, a in (("residual", residual), ("out", out)):
        if a is not None:
            _like(fn, name, a, x)
    xp = array_module(x)
    y = xp.empty_like(x) if out is None else out
    mean = xp.empty((N, 1), dtype=x.dtype)
    rstd = xp.empty((N, 1), dtype=x.dtype)
    if N:
        _launch(LAYERNORM_FWD, x.dtype, (N,), (_threads(C, 128),),
                (x, x if residual is None else residual, w, b, y, mean, rstd, np.int32(C), x.dtype.type(eps),
                 np.int32(residual is not None)))
    return y, mean, rstd


def layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, add_to=None):
    """dx of LayerNorm from dy and the forward's x, w, mean, rstd (all CuPy, contiguous; x and dy
    (..., C), mean and rstd N values); accumulates dw += sum(dy xhat), db += sum(dy) over rows.

    Returns a new dx, or, with `add_to` (x's shape), adds dx into add_to and returns it: the
    residual gradient of a pre-norm block, fused."""
    fn = "layernorm_backward_gpu"
    N, C = _rows(fn, x)
    _like(fn, "dy", dy, x)
    _vector(fn, "w", w, x)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.size != N or a.dtype != x.dtype or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must hold {N} contiguous {x.dtype} values, got {a.dtype} {a.shape}")
    for name, a in (("dw", dw), ("db", db)):
        if a.shape != (C,):
            raise ValueError(f"{fn}: {name} must have shape ({C},), got {a.shape}")
    if add_to is not None:
        _like(fn, "add_to", add_to, x)
    xp = array_module(x)
    dx = xp.empty_like(x) if add_to is None else add_to
    if not N:
        return dx
    _launch(LAYERNORM_BWD, x.dtype, (N,), (_threads(C, 128),),
            (dy, x, w, mean, rstd, dx, np.int32(C), np.int32(add_to is not None)))
    rows_per_chunk = max(64, -(-N // 128))  # at most 128 chunks: enough blocks to fill a GPU
    chunks = -(-N // rows_per_chunk)
    part_w = xp.empty((chunks, C), dtype=x.dtype)
    part_b = xp.empty((chunks, C), dtype=x.dtype)
    _launch(LAYERNORM_BWD_PARAMS, x.dtype, (-(-C // 32), chunks), LN_PARAM_BLOCK,
            (dy, x, mean, rstd, part_w, part_b, np.int32(N), np.int32(C), np.int32(rows_per_chunk)))
    dw += part_w.sum(axis=0)
    db += part_b.sum(axis=0)
    return dx


# --- Causal softmax over (..., T, T) attention scores (minitensor/attention.py) ---


def _causal_mask(T):
    return np.triu(np.full((T, T), -np.inf), k=1)


def causal_softmax_reference(s, scale=1.0):
    """(p, lse): p = softmax(scale s + mask) by rows, lse (..., T, 1) each row's log-sum-exp."""
    z = scale * s + _causal_mask(s.shape[-1])
    top = z.max(axis=-1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, top + np.log(total)


def causal_softmax_backward_reference(dp, p, scale=1.0):
    """ds = scale p (dp - rowsum(dp p)): through p = softmax(z), z = scale s + mask."""
    return scale * (p * (dp - (dp * p).sum(axis=-1, keepdims=True)))


def causal_softmax_recompute_reference(s, lse, scale=1.0):
    """The probabilities again from the scores and each row's log-sum-exp."""
    return np.exp(scale * s + _causal_mask(s.shape[-1]) - lse)


# One block per row; row r of a matrix attends to columns 0..r only (r = the row's index mod T).
# The masked columns are never read and are written as exact zeros; p may be s itself.
CAUSAL_SOFTMAX_FWD = register(RawSpec("causal_softmax_fwd", _ROW_COMMON + r"""
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
"""))

# forward was: p = softmax(z) by rows, z = scale s + mask. ds may be dp itself.
CAUSAL_SOFTMAX_BWD = register(RawSpec("causal_softmax_bwd", _ROW_COMMON + r"""
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
"""))

# Elementwise: flat index i is row i / n_ctx (over all matrices), column i % n_ctx.
CAUSAL_SOFTMAX_RECOMPUTE = register(ElementwiseSpec(
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
    rows, T = _square_rows(fn, s)
    p = _out_like(fn, s, out)
    if lse is not None:
        _row_values(fn, "lse", lse, s, rows)
    if rows:
        _launch(CAUSAL_SOFTMAX_FWD, s.dtype, (rows,), (_threads(T, 128),),
                (s, p, p if lse is None else lse, np.int32(T), s.dtype.type(scale), np.int32(lse is not None)))
    return p


def causal_softmax_backward_gpu(dp, p, scale=1.0, out=None):
    """ds = scale p (dp - rowsum(dp p)) for dp, p (..., T, T) (CuPy, contiguous), into `out`
    (which may be dp) or a new array; returns ds."""
    fn = "causal_softmax_backward_gpu"
    rows, T = _square_rows(fn, p)
    _like(fn, "dp", dp, p)
    ds = _out_like(fn, p, out)
    if rows:
        _launch(CAUSAL_SOFTMAX_BWD, p.dtype, (rows,), (_threads(T, 128),),
                (dp, p, ds, np.int32(T), p.dtype.type(scale)))
    return ds


def causal_softmax_recompute_gpu(s, lse, scale=1.0, out=None):
    """The probabilities causal_softmax_forward_gpu gave, from the same s and its lse, into `out`
    (which may be s) or a new array."""
    fn = "causal_softmax_recompute_gpu"
    rows, T = _square_rows(fn, s)
    _row_values(fn, "lse", lse, s, rows)
    if s.size >= 2**31:
        raise ValueError(f"{fn}: s has {s.size} elements; at most 2**31 - 1 are supported")
    _on_cupy(fn, s, "minitensor.attention.block_probs_again")
    kern = CAUSAL_SOFTMAX_RECOMPUTE.kernel()
    args = (s, lse.reshape(-1), np.int32(T), s.dtype.type(scale))
    return kern(*args) if out is None else kern(*args, _out_like(fn, s, out))


# --- Softmax cross-entropy over (N, V) logits (minitensor/loss.py) ---


def softmax_xent_forward_reference(logits, targets):
    """(loss, probs, losses): losses = logsumexp(z) - z[target] per row, loss their mean."""
    z = logits.reshape(-1, logits.shape[-1])
    t = np.asarray(targets).reshape(-1)
    top = z.max(axis=1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=1, keepdims=True)
    losses = np.log(total[:, 0]) + top[:, 0] - z[np.arange(len(t)), t]
    return losses.mean(), (e / total).reshape(logits.shape), losses


def softmax_xent_backward_reference(probs, targets, dloss=1.0):
    """dlogits = dloss (probs - onehot(target)) / N, N = the number of rows."""
    d = probs.reshape(-1, probs.shape[-1]).copy()
    t = np.asarray(targets).reshape(-1)
    d[np.arange(len(t)), t] -= 1.0
    return (d * (dloss / len(t))).reshape(probs.shape)


# One block per row. The probabilities overwrite the logits; z[target] is read by thread 0 before
# any write (the writes come after two barriers). A target outside [0, V) makes the row's loss
# NaN rather than reading out of bounds: the check costs no host synchronisation.
SOFTMAX_XENT_FWD = register(RawSpec("softmax_xent_fwd", _ROW_COMMON + r"""
extern "C" __global__ void softmax_xent_fwd(T *z, const long long *targets, T *losses, const int V) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  T *zr = z + row * V;
  const long long t = targets[row];
  const bool valid = t >= 0 && t < V;
  const T picked = threadIdx.x == 0 && valid ? zr[t] : (T)0;
  T top = lowest_of(picked);
  for (int j = threadIdx.x; j < V; j += blockDim.x) top = zr[j] > top ? zr[j] : top;
  top = block_max(top, buf);
  T total = 0;
  for (int j = threadIdx.x; j < V; j += blockDim.x) total += exp_of(zr[j] - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < V; j += blockDim.x) zr[j] = exp_of(zr[j] - top) / total;
  if (threadIdx.x == 0) losses[row] = valid ? log_of(total) + top - picked : nan_of(top);
}
"""))

SOFTMAX_XENT_BWD = register(ElementwiseSpec(
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


def softmax_xent_forward_gpu(logits, targets):
    """Softmax cross-entropy of logits (..., V) (CuPy, contiguous, overwritten by the
    probabilities) against integer targets (...); returns (loss, losses): the mean as a 0-d
    device array (no host synchronisation) and the per-row terms. A target outside [0, V) gives
    a NaN loss."""
    fn = "softmax_xent_forward_gpu"
    z, t = _xent_operands(fn, logits, targets)
    xp = array_module(logits)
    losses = xp.empty(z.shape[0], dtype=z.dtype)
    if z.shape[0]:
        _launch(SOFTMAX_XENT_FWD, z.dtype, (z.shape[0],), (_threads(z.shape[1], 512),),
                (z, t, losses, np.int32(z.shape[1])))
    return losses.mean(), losses


def softmax_xent_backward_gpu(probs, targets, dloss=1.0):
    """In place over probs (..., V) from softmax_xent_forward_gpu: dlogits = dloss (probs -
    onehot(targets)) / N, N the number of rows; returns it."""
    fn = "softmax_xent_backward_gpu"
    z, t = _xent_operands(fn, probs, targets)
    if z.size >= 2**31:
        raise ValueError(f"{fn}: {z.size} logits; at most 2**31 - 1 are supported")
    _on_cupy(fn, probs, "minitensor.loss.SoftmaxCrossEntropy")
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


# --- AdamW over the whole flat buffer (minitensor/optim.py), one elementwise pass ---


def adamw_reference(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step in textbook form; returns the new (p, m, v). Decoupled decay on mask == 1."""
    gs = g * grad_scale
    m = beta1 * m + (1.0 - beta1) * gs
    v = beta2 * v + (1.0 - beta2) * gs * gs
    m_hat = m / (1.0 - beta1**t)
    v_hat = v / (1.0 - beta2**t)
    return p * (1.0 - lr * weight_decay * mask) - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    gs = g * grad_scale
    m = beta1 * m_in + (1.0 - beta1) * gs
    v = beta2 * v_in + (1.0 - beta2) * gs * gs
    return p_in * (1.0 - decay * mask) - step_size * (m / (np.sqrt(v) + eps_hat)), m, v


# optim.py's form: m_hat / (sqrt(v_hat) + eps) = (m sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)),
# so the bias corrections are two host scalars (step_size, eps_hat). Each output is computed from
# the inputs before any is written, so p, m, v may be passed as their own outputs (in place).
ADAMW_STEP = register(ElementwiseSpec(
    "adamw_step",
    "T p_in, T m_in, T v_in, T g, T mask, T beta1, T beta2, T grad_scale, T step_size, T eps_hat, T decay",
    "T p, T m, T v",
    "const T gs = g * grad_scale;\n"
    "const T m1 = beta1 * m_in + ((T)1 - beta1) * gs;\n"
    "const T v1 = beta2 * v_in + ((T)1 - beta2) * gs * gs;\n"
    "const T p1 = p_in * ((T)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));\n"
    "m = m1;\nv = v1;\np = p1;",
    reference=_adamw_op_reference,
    scalars=(("beta1", 0.9), ("beta2", 0.95), ("grad_scale", 0.7), ("step_size", 1e-3), ("eps_hat", 1e-8),
             ("decay", 1e-4)),
    domains=(("v_in", np.abs), ("mask", lambda a: (a > 0).astype(a.dtype))),
))


def adamw_step_gpu(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step, in place over the flat CuPy buffers p, m, v (same shape and dtype as g and
    mask, mask 1 where weight decay applies, 0 elsewhere); t counts steps from 1. Equals
    minitensor.optim.AdamW.step: the gradient is g * grad_scale (clipping)."""
    fn = "adamw_step_gpu"
    _check_operands(fn, p, None)
    for name, a in (("g", g), ("m", m), ("v", v), ("mask", mask)):
        _like(fn, name, a, p, contiguous=False)
    if t < 1:
        raise ValueError(f"{fn}: t counts steps from 1, got {t}")
    c1, c2 = 1.0 - beta1**t, 1.0 - beta2**t
    step_size = lr * math.sqrt(c2) / c1
    eps_hat = eps * math.sqrt(c2)
    _on_cupy(fn, p, "minitensor.optim.AdamW")
    ADAMW_STEP.kernel()(p, m, v, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, lr * weight_decay, p, m, v)
    return p


# --- Shared by the wrappers ---


def _threads(n, most):
    """Threads per block for rows of n elements: a multiple of 32, at most `most`."""
    return min(most, 32 * max(1, -(-n // 32)))


def _like(fn, name, a, ref, contiguous=True):
    if (type(a) is not type(ref) or a.shape != ref.shape or a.dtype != ref.dtype
            or (contiguous and not a.flags.c_contiguous)):
        raise ValueError(f"{fn}: {name} must be a {'contiguous ' if contiguous else ''}{type(ref).__name__} "
                         f"of shape {ref.shape} and dtype {ref.dtype}; got {type(a).__name__} "
                         f"{getattr(a, 'shape', '')} {getattr(a, 'dtype', '')}")


def _rows(fn, x):
    """(N, C) of a contiguous float array x (..., C)."""
    if getattr(x, "dtype", None) not in (np.float32, np.float64) or x.ndim < 1 or not x.flags.c_contiguous:
        raise ValueError(f"{fn}: x must be a contiguous float32 or float64 array (..., C), got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
    if x.shape[-1] < 1:
        raise ValueError(f"{fn}: x has rows of length 0")
    return x.size // x.shape[-1], x.shape[-1]


def _vector(fn, name, a, x):
    if a.shape != x.shape[-1:] or a.dtype != x.dtype or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be a contiguous {x.dtype} vector of shape {x.shape[-1:]}, "
                         f"got {a.dtype} {a.shape}")


def _square_rows(fn, s):
    if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
        raise ValueError(f"{fn}: expected (..., T, T) scores, got shape {s.shape}")
    return _rows(fn, s)


def _out_like(fn, x, out):
    if out is None:
        return array_module(x).empty_like(x)
    _like(fn, "out", out, x)
    return out


def _row_values(fn, name, a, x, rows):
    if a.size != rows or a.dtype != x.dtype or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must hold {rows} contiguous {x.dtype} values (one per row), got "
                         f"{a.dtype} {a.shape}")


def _on_cupy(fn, x, numpy_alternative):
    if isinstance(x, np.ndarray):
        raise TypeError(f"{fn} runs on CuPy arrays; on NumPy use {numpy_alternative}")


def _launch(spec, dtype, grid, block, args):
    """Runs a RawSpec kernel on CuPy arrays after checking each argument against its C type."""
    _check_launch_args(spec, dtype, args)
    if any(isinstance(a, np.ndarray) for a in args):
        raise TypeError(f"{spec.name} runs on CuPy arrays; for NumPy use its *_reference formula")
    spec.kernel(dtype)(grid, block, args)


@functools.cache
def _raw_params(spec):
    """[(name, C base type, is_pointer), ...] of the kernel's parameters, parsed from its code."""
    found = re.search(rf'extern "C" __global__ void {spec.name}\(([^)]*)\)', spec.code)
    if not found:
        raise ValueError(f"no extern \"C\" __global__ kernel named {spec.name!r} in its code")
    params = []
    for p in found.group(1).split(","):
        words = p.replace("*", " * ").split()
        params.append((words[-1], " ".join(w for w in words[:-1] if w not in ("const", "*")), "*" in words))
    return params


_ARG_TYPES = {"int": np.dtype(np.int32), "long long": np.dtype(np.int64)}


def _check_launch_args(spec, dtype, args):
    params = _raw_params(spec)
    if len(args) != len(params):
        raise TypeError(f"{spec.name} takes {len(params)} arguments, got {len(args)}")
    for (name, base, pointer), a in zip(params, args):
        want = np.dtype(dtype) if base == "T" else _ARG_TYPES[base]
        if pointer:
            ok = getattr(a, "dtype", None) == want and a.flags.c_contiguous
        else:
            ok = type(a) is want.type
        if not ok:
            kind = "a contiguous array" if pointer else "a NumPy scalar"
            raise TypeError(f"{spec.name}: argument {name} must be {kind} of {want}, got {type(a).__name__} "
                            f"{getattr(a, 'dtype', '')}")

