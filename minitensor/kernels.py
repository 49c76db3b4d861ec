"""The CUDA kernels of the project, each beside the NumPy formula it must equal, and their checks.

GELU, the tanh approximation (SPEC 1), elementwise over any shape, float32 or float64:

    y  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
    dx = dy (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))

(Hendrycks & Gimpel 2016, "Gaussian Error Linear Units"; the form GPT-2 uses.) `gelu_forward`
and `gelu_backward` take NumPy or CuPy arrays: NumPy runs the formula in place over cache-sized
chunks, CuPy runs the ElementwiseKernels 'gelu_fwd' and 'gelu_bwd' (type placeholder `T`, so
float64 works on the GPU too). `gelu_*_reference` are the formulas written plainly, for tests.

Fused kernels for the GPU path, each with its NumPy `*_reference` and a wrapper over CuPy arrays
(`*_gpu`); opt-in until a GPU run has verified each against the generic xp code of its layer:

    bias_gelu_fwd, bias_gelu_bwd       y = GELU(x + b) and dL/dh, elementwise (b by column)
    layernorm_fwd, layernorm_bwd       one block per row: y, mean, rstd; dx (optionally adding
                                       in x + residual / into the residual gradient, fused)
    layernorm_bwd_params               dw, db as per-chunk column sums, added in a fixed order
    causal_softmax_fwd, _bwd           one block per row of (..., T, T) scores, optional lse
    causal_softmax_recompute           p again from the scores and lse, elementwise
    softmax_xent_fwd, softmax_xent_bwd per-row log-sum-exp and loss, probabilities over the
                                       logits in place; dlogits in place
    adamw_step                         AdamW over the whole flat buffer, one pass

`KERNELS` registers every CUDA kernel of the project. A spec holds what CuPy needs to build the
kernel (built lazily, once) and can produce the exact source NVRTC compiles for a dtype, which
makes two checks possible without a GPU:

    python -m minitensor.kernels --check       NVRTC compiles every kernel x dtype x arch
    python -m minitensor.kernels --host-check  g++ runs each elementwise operation on the CPU
                                               and compares it with its NumPy formula

and `emulate_launch` runs a RawKernel's code on the CPU as C++ (a thread per CUDA thread), which
the tests use to compare the row kernels with their formulas without a GPU.

The compile check uses CuPy private APIs (SPEC 5), so CuPy's minor version is pinned by the
`kernel-check` extra. Importing this module costs nothing: CuPy is imported only by the
functions that need it.
"""

import argparse
import atexit
import dataclasses
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from minitensor.backend import array_module
from minitensor.parallel import parallel_for

INSTALL_HINT = "pip install -e '.[kernel-check]'  (CuPy 14.2 with NVRTC; no GPU needed)"
DTYPES = ("float32", "float64")
ARCHS = ("sm_80", "sm_90")
_CHUNK = 65536  # elements per NumPy pass, so a chunk's operands stay in cache: 1.3-1.6x faster on 4-12 MB


# ---------------------------------------------------------------------------------------------
# The registry


@dataclasses.dataclass(frozen=True)
class ElementwiseSpec:
    """A `cupy.ElementwiseKernel`, described without CuPy.

    `reference(**inputs)` is the NumPy formula the kernel must equal (one output array, or a
    tuple for several). `scalars` names the in-params passed as host scalars, each with a sample
    value for the host check; every other param is an array. Only the type placeholder `T`.
    """

    name: str
    in_params: str
    out_params: str
    operation: str
    reference: Callable = dataclasses.field(compare=False)
    preamble: str = ""
    options: tuple = ()
    scalars: tuple = ()  # ((name, sample value), ...)
    # ((name, fn), ...): fn maps the host check's samples of an input into its domain (v >= 0, ...)
    domains: tuple = dataclasses.field(default=(), compare=False)

    def kernel(self, dtype=None):
        """The CuPy kernel; one object serves every dtype."""
        return _elementwise_kernel(self)

    def source(self, dtype):
        """The exact source CuPy hands NVRTC for contiguous arguments of `dtype`."""
        return _elementwise_source(self, np.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class RawSpec:
    """A `cupy.RawKernel` whose code is written against the type name `T` (one build per dtype)."""

    name: str
    code: str
    options: tuple = ()

    def kernel(self, dtype):
        return _raw_kernel(self, np.dtype(dtype))

    def source(self, dtype):
        return f"typedef {_C_TYPES[np.dtype(dtype).name]} T;\n{self.code}"


# name -> spec, for every CUDA kernel in the project. A spec has `name`, `options` (passed to
# NVRTC before CuPy's own), `source(dtype)` (the exact source NVRTC compiles) and `kernel(dtype)`
# (the CuPy kernel, built once); a ReductionKernel spec would add its generated source likewise.
KERNELS = {}
_C_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "bool": "bool"}


def register(spec):
    if spec.name in KERNELS:
        raise ValueError(f"a kernel named {spec.name!r} is already registered")
    KERNELS[spec.name] = spec
    return spec


# ---------------------------------------------------------------------------------------------
# GELU

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715
_AC = _A * _C  # u = x (AC x^2 + C)
_AC3 = 3.0 * _A * _C  # du/dx = AC3 x^2 + C


def gelu_forward_reference(x):
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t)


def gelu_backward_reference(x, dy):
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * np.sqrt(2.0 / np.pi) * (1.0 + 3.0 * 0.044715 * x**2))


# The kernels and the NumPy blocks below compute the same factored form, in the same order:
#   t = tanh(x (AC x^2 + C)),  y = x * (0.5 (1 + t))
#   g = x (AC3 x^2 + C),       dx = dy * ((1 + (1 - t) g) * (1 - 0.5 (1 - t)))
# using 1 - t^2 = (1 - t)(1 + t), so dGELU = 0.5 (1 + t) (1 + (1 - t) g).

GELU_FWD = register(ElementwiseSpec(
    "gelu_fwd", "T x", "T y",
    f"const T t = tanh(x * ((T){_AC!r} * x * x + (T){_C!r}));\n"
    "y = x * ((T)0.5 * ((T)1 + t));",
    reference=gelu_forward_reference,
))

GELU_BWD = register(ElementwiseSpec(
    "gelu_bwd", "T x, T dy", "T dx",
    "const T x2 = x * x;\n"
    f"const T s = (T)1 - tanh(x * ((T){_AC!r} * x2 + (T){_C!r}));\n"
    f"const T g = x * ((T){_AC3!r} * x2 + (T){_C!r});\n"
    "dx = dy * (((T)1 + s * g) * ((T)1 - (T)0.5 * s));",
    reference=gelu_backward_reference,
))


def gelu_forward(x, out=None):
    """GELU of x (NumPy or CuPy, float32/float64, any shape), into `out` if given; returns y."""
    _check_operands("gelu_forward", x, out)
    if isinstance(x, np.ndarray):
        out = np.empty_like(x) if out is None else out
        x = _unaliased(x, out)
        _run_blocks(_gelu_fwd_block, (x, out), n_work=1)
        return out
    kern = GELU_FWD.kernel()
    return kern(x) if out is None else kern(x, out)


def gelu_backward(x, dy, out=None):
    """dL/dx from the forward input x and dy = dL/dy, into `out` if given; returns dx."""
    _check_operands("gelu_backward", x, out, dy)
    if isinstance(x, np.ndarray):
        out = np.empty_like(x) if out is None else out
        x, dy = _unaliased(x, out), _unaliased(dy, out)
        _run_blocks(_gelu_bwd_block, (x, dy, out), n_work=2)
        return out
    kern = GELU_BWD.kernel()
    return kern(x, dy) if out is None else kern(x, dy, out)


def _gelu_fwd_block(x, y, w):
    np.multiply(x, x, out=w)
    w *= _AC
    w += _C
    w *= x
    np.tanh(w, out=w)
    w += 1.0
    w *= 0.5
    np.multiply(x, w, out=y)  # y is written last: it may be x itself


def _gelu_bwd_block(x, dy, dx, g, s):
    np.multiply(x, x, out=g)
    np.multiply(g, _AC, out=s)
    s += _C
    s *= x
    np.tanh(s, out=s)
    np.subtract(1.0, s, out=s)  # s = 1 - t
    g *= _AC3
    g += _C
    g *= x
    g *= s
    g += 1.0  # 1 + (1 - t) g
    s *= -0.5
    s += 1.0  # 0.5 (1 + t)
    g *= s
    np.multiply(g, dy, out=dx)  # dx is written last: it may be x or dy itself


def _check_operands(fn, x, out, dy=None):
    dtype = getattr(x, "dtype", None)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"{fn}: x must be a float32 or float64 NumPy/CuPy array, got {type(x).__name__}"
                        + (f" of {dtype}" if dtype is not None else ""))
    if not isinstance(x, np.ndarray) and type(x).__module__.split(".")[0] != "cupy":
        raise TypeError(f"{fn}: x must be a NumPy or CuPy array, got {type(x).__name__}")
    for name, a in (("dy", dy), ("out", out)):
        if a is not None and (type(a) is not type(x) or a.shape != x.shape or a.dtype != x.dtype):
            raise ValueError(f"{fn}: {name} must be a {type(x).__name__} of shape {x.shape} and dtype "
                             f"{x.dtype}, like x; got {type(a).__name__} {getattr(a, 'shape', '')} "
                             f"{getattr(a, 'dtype', '')}")


def _unaliased(a, out):
    """`a`, or a copy of it if it partly overlaps `out` (an exact alias is fine elementwise)."""
    same = (a.__array_interface__["data"][0] == out.__array_interface__["data"][0]
            and a.strides == out.strides)
    return a.copy() if not same and np.may_share_memory(a, out) else a


def _run_blocks(block_fn, arrays, n_work):
    """Calls block_fn(*pieces, *work) over matching pieces of same-shape arrays, with `n_work` work
    buffers per piece: _CHUNK-element slices spread over the CPU threads when all arrays are
    C-contiguous, else the whole arrays in one piece."""
    size, dtype = arrays[0].size, arrays[0].dtype
    if size > _CHUNK and all(a.flags.c_contiguous for a in arrays):
        flat = [a.reshape(-1) for a in arrays]

        def run(first, last):
            work = [np.empty(_CHUNK, dtype) for _ in range(n_work)]
            for start in range(first * _CHUNK, min(last * _CHUNK, size), _CHUNK):
                stop = min(start + _CHUNK, size)
                block_fn(*[f[start:stop] for f in flat], *[w[: stop - start] for w in work])

        parallel_for(-(-size // _CHUNK), run, min_work=0)
    else:
        block_fn(*arrays, *[np.empty(arrays[0].shape, dtype) for _ in range(n_work)])


# ---------------------------------------------------------------------------------------------
# Fused kernels for the GPU path. Each section: the NumPy formula (`*_reference`, written plainly,
# for tests), the CUDA kernel(s) that must equal it, and a wrapper taking CuPy arrays. They are
# opt-in: the layers run the generic xp code until a GPU run has verified a kernel against it.
# RawKernels are written against `T` (typedef'd per dtype), one block per row; the wrappers pass
# scalars as NumPy scalars of the kernel's C types (`_launch` checks them: CuPy would pass a Python
# int as 64 bits and a Python float as a double, silently).

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


# ---------------------------------------------------------------------------------------------
# CuPy: lazy builds and exact sources


class ToolchainMissing(ImportError):
    """CuPy (with NVRTC) is not importable here; the message says how to install it."""


@functools.cache
def _toolchain():
    """CuPy's modules that the builds and the compile check use, with NVRTC proven loadable."""
    try:
        import cupy
        from cupy._core import _carray, _kernel, _scalar, core
        from cupy.cuda import compiler
        from cupy_backends.cuda.libs import nvrtc

        nvrtc_version = nvrtc.getVersion()  # loads libnvrtc: fails here if it is missing
    except Exception as e:
        raise ToolchainMissing(f"CuPy with NVRTC is not importable ({type(e).__name__}: {e}); "
                               f"install it with: {INSTALL_HINT}") from e
    return argparse.Namespace(cupy=cupy, carray=_carray, kernel=_kernel, scalar=_scalar, core=core,
                              compiler=compiler, nvrtc_version=nvrtc_version)


@functools.cache
def _elementwise_kernel(spec):
    import cupy

    return cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation, spec.name,
                                  preamble=spec.preamble, options=spec.options)


@functools.cache
def _raw_kernel(spec, dtype):
    import cupy

    return cupy.RawKernel(spec.source(dtype), spec.name, options=spec.options)


# Values of CuPy's `_ArgKind` enum (cupy/_core/_kernel.pxd), not exported to Python.
_ARG_NDARRAY, _ARG_INDEXER, _ARG_SCALAR = 1, 2, 3


def _elementwise_source(spec, dtype):
    """Rebuilds what `ElementwiseKernel.__call__` compiles for C-contiguous arrays of fewer than
    2**31 elements (reduced to 1-D, 32-bit indexing), and what `compile_with_cache` prepends."""
    tc = _toolchain()
    kern = spec.kernel()
    scalars = {name for name, _ in spec.scalars}
    in_dtypes = tuple(None if p.name in scalars else p.dtype or dtype for p in kern.in_params)
    in_types, out_types, type_map = kern._decide_params_type(in_dtypes, ())

    def arg(p, t):
        if p.name in scalars:
            return tc.kernel._ArgInfo(_ARG_SCALAR, tc.scalar.CScalar, t, 0, True, True)
        return tc.kernel._ArgInfo(_ARG_NDARRAY, tc.cupy.ndarray, t, 1, True, True)

    arginfos = tuple(arg(p, t) for p, t in zip(kern.in_params + kern.out_params, in_types + out_types))
    arginfos += (tc.kernel._ArgInfo(_ARG_INDEXER, tc.carray.Indexer, None, 1, True, True),)
    code = tc.kernel._get_elementwise_kernel_code(arginfos, type_map, kern.params, kern.operation,
                                                  kern.name, kern.preamble, **kern.kwargs)
    if f"void {spec.name}(" not in code or "CIndexer<1, 1> _ind" not in code:
        raise RuntimeError(f"CuPy {tc.cupy.__version__} generated unexpected code for {spec.name}: its "
                           f"private kernel-code API changed; {INSTALL_HINT}")
    header = "".join(f"#include <{h}>\n" for h in tc.core._cupy_header_list)
    return header + code


# ---------------------------------------------------------------------------------------------
# The compile check: NVRTC, as CuPy calls it, for an arch given rather than queried from a GPU


@dataclasses.dataclass
class CheckResult:
    name: str
    dtype: str
    arch: str
    seconds: float
    error: str = ""  # the first error line; empty when it compiled

    @property
    def ok(self):
        return not self.error

    def line(self, width=0):
        status = "ok  " if self.ok else "FAIL"
        text = f"{status} {self.name:<{width}} {self.dtype} {self.arch}  ({self.seconds:.2f} s)"
        return text + (f"  {self.error}" if self.error else "")


def compile_source(source, name, options=(), arch="sm_90"):
    """NVRTC-compiles `source` to a cubin with the options CuPy would use; returns the cubin.
    Raises cupy.cuda.compiler.CompileException with NVRTC's log on an error."""
    tc = _toolchain()
    opts = tc.core.assemble_cupy_compiler_options(tuple(options))
    opts += ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    cubin, _ = tc.compiler._NVRTCProgram(source, f"{name}.cu", method="cubin").compile(opts)
    return cubin


def check_kernels(specs=None, dtypes=DTYPES, archs=ARCHS):
    """Compiles every spec x dtype x arch; yields a CheckResult for each as it finishes."""
    tc = _toolchain()
    for spec in KERNELS.values() if specs is None else specs:
        for dtype in dtypes:
            for arch in archs:
                start = time.perf_counter()
                try:
                    compile_source(spec.source(dtype), spec.name, spec.options, arch)
                    error = ""
                except (tc.compiler.CompileException, RuntimeError) as e:
                    error = _first_error_line(e)
                yield CheckResult(spec.name, dtype, arch, time.perf_counter() - start, error)


def _first_error_line(e):
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [type(e).__name__])[0]


# ---------------------------------------------------------------------------------------------
# The host check: an elementwise operation compiled as plain C++ and compared with its formula

_HOST_PRELUDE = """#include <math.h>  /* in C++, also the float overloads: tanh(float) stays float */
#include <stdio.h>
#include <stdlib.h>
template <class U> U rsqrt(U v) { return U(1) / sqrt(v); }
"""


@dataclasses.dataclass
class HostCheckResult:
    name: str
    dtype: str
    worst: float  # max over elements of |kernel - formula| / tolerance: <= 1 passes

    @property
    def ok(self):
        return self.worst <= 1.0

    def line(self, width=0):
        status = "ok  " if self.ok else "FAIL"
        return f"{status} {self.name:<{width}} {self.dtype}  worst error {self.worst:.3g} x tolerance"


def host_check(spec, dtype, n=4096, seed=0):
    """Runs `spec.operation` as C++ (T = float or double) over sample inputs and compares it with
    `spec.reference` in float64, elementwise: |got - want| <= rtol (1 + |want|) prod(1 + |input|),
    rtol 1e-12 for float64, 16 float32 epsilons for float32."""
    dtype = np.dtype(dtype)
    ins, outs = _parse_params(spec.in_params), _parse_params(spec.out_params)
    scalars = dict(spec.scalars)
    domains = dict(spec.domains)
    arrays = {name: domains.get(name, np.asarray)(_sample(np.random.default_rng([seed, i]), n, _param_dtype(t, dtype)))
              for i, (_, t, name) in enumerate(ins) if name not in scalars}
    program = _host_program(spec, dtype, ins, outs, scalars)
    blob = b"".join(arrays[name].tobytes() for _, _, name in ins if name in arrays)
    raw = _run_host_program(program, n, blob)
    got, offset = [], 0
    for _, t, _ in outs:
        dt = _param_dtype(t, dtype)
        got.append(np.frombuffer(raw, dt, n, offset).astype(np.float64))
        offset += n * dt.itemsize
    want = spec.reference(**{k: v.astype(np.float64) for k, v in arrays.items()},
                         **{k: float(v) for k, v in scalars.items()})
    want = want if isinstance(want, tuple) else (want,)
    rtol = 1e-12 if dtype == np.float64 else 16 * float(np.finfo(np.float32).eps)
    scale = np.prod([1.0 + np.abs(a.astype(np.float64)) for a in arrays.values()], axis=0)
    worst = max(float(np.max(np.abs(g - w) / (rtol * (1.0 + np.abs(w)) * scale))) for g, w in zip(got, want))
    return HostCheckResult(spec.name, dtype.name, worst if np.isfinite(worst) else math.inf)


def _parse_params(params):
    """'T x, raw T y' -> [(raw, type, name), ...]"""
    parsed = []
    for p in params.split(","):
        *mods, t, name = p.split()
        parsed.append(("raw" in mods, t, name))
    return parsed


def _param_dtype(t, dtype):
    return dtype if t == "T" else np.dtype(t)


def _sample(rng, n, dtype):
    special = np.array([0.0, 1e-3, -1e-3, 1.0, -1.0, 5.0, -5.0, 12.0, -12.0])
    values = np.concatenate([special, 3.0 * rng.standard_normal(n)])[:n]
    return values.astype(dtype)


def _host_program(spec, dtype, ins, outs, scalars):
    def c(t):
        return "T" if t == "T" else _C_TYPES[np.dtype(t).name]

    decl, read, bind, write = [], [], [], []
    for raw, t, name in ins:
        if name in scalars:
            decl.append(f"const {c(t)} {name} = ({c(t)}){scalars[name]!r};")
            continue
        decl.append(f"{c(t)} *_raw_{name} = ({c(t)} *)malloc(n * sizeof({c(t)}));")
        read.append(f"if (fread(_raw_{name}, sizeof({c(t)}), n, stdin) != (size_t)n) return 1;")
        bind.append(f"const {c(t)} *{name} = _raw_{name};" if raw else f"const {c(t)} &{name} = _raw_{name}[i];")
    for raw, t, name in outs:
        decl.append(f"{c(t)} *_raw_{name} = ({c(t)} *)malloc(n * sizeof({c(t)}));")
        write.append(f"fwrite(_raw_{name}, sizeof({c(t)}), n, stdout);")
        bind.append(f"{c(t)} *{name} = _raw_{name};" if raw else f"{c(t)} &{name} = _raw_{name}[i];")
    body = "\n".join([*decl, *read, "for (long i = 0; i < n; ++i) {", *bind, spec.operation + ";", "}", *write])
    return (f"{_HOST_PRELUDE}typedef {_C_TYPES[dtype.name]} T;\n{spec.preamble}\n"
            f"int main(int argc, char **argv) {{\nconst long n = atol(argv[1]);\n{body}\nreturn 0;\n}}\n")


def _run_host_program(program, n, stdin_bytes):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("the host check needs a C++ compiler: install g++ or set CXX")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "op.cpp"), os.path.join(tmp, "op")
        with open(src, "w") as f:
            f.write(program)
        built = subprocess.run([cxx, "-O1", "-std=c++17", src, "-o", exe], capture_output=True, text=True,
                               check=False)
        if built.returncode:
            raise RuntimeError(f"the operation does not compile as C++:\n{built.stderr}\n{program}")
        ran = subprocess.run([exe, str(n)], input=stdin_bytes, capture_output=True, check=True)
    return ran.stdout


# ---------------------------------------------------------------------------------------------
# The host emulation of a RawKernel: its CUDA code compiled as C++20, one std::thread per CUDA
# thread, the blocks one after another; __syncthreads is a std::barrier over the block, a warp
# shuffle two of them (every thread of a block must shuffle together, as full-warp shuffles in a
# 1-D block of whole warps do). Slow, and blind to what only a GPU shows (races between blocks,
# the launch itself), but it runs the kernel's indexing, masks and reductions on the CPU.

_EMU_PRELUDE = r"""#include <barrier>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<> *block_barrier;
static double shuffle_slots[1024];
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static void __syncthreads() { block_barrier->arrive_and_wait(); }
template <class U> static U __shfl_xor_sync(unsigned, U v, int lane_mask) {
  const unsigned me = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  shuffle_slots[me] = (double)v;
  __syncthreads();
  const U other = (U)shuffle_slots[me ^ (unsigned)lane_mask];
  __syncthreads();
  return other;
}
static float __int_as_float(int v) { float f; memcpy(&f, &v, sizeof f); return f; }
static double __longlong_as_double(long long v) { double f; memcpy(&f, &v, sizeof f); return f; }
template <class F> static void launch(dim3 grid, dim3 block, F body) {
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(n);
        block_barrier = &bar;
        std::vector<std::thread> team;
        team.reserve(n);
        for (unsigned t = 0; t < n; ++t)
          team.emplace_back([&, t] {
            threadIdx = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            blockIdx = dim3{bx, by, bz};
            body();
          });
        for (auto &member : team) member.join();
      }
}
"""


def emulate_launch(spec, dtype, grid, block, args):
    """Runs a RawSpec kernel on the CPU over NumPy arguments, as `_launch` does on the GPU: the
    arrays are updated in place, and an array passed twice is one buffer, as on the GPU."""
    _check_launch_args(spec, dtype, args)
    dims = [*grid, 1, 1][:3] + [*block, 1, 1][:3]
    if np.prod(dims[3:]) > 1024 or dims[3] % 32:
        raise ValueError(f"{spec.name}: a block of {dims[3:]} threads: at most 1024, x a multiple of 32")
    # one program per dtype serves every registered RawKernel (each g++ build takes seconds)
    registered = tuple(s for s in KERNELS.values() if isinstance(s, RawSpec))
    specs = registered if spec in registered else (spec,)
    blob, owned, slots = [np.array([specs.index(spec), *dims], np.uint32).tobytes()], [], {}
    for k, ((_, _, pointer), a) in enumerate(zip(_raw_params(spec), args)):
        if not pointer:
            blob.append(a.tobytes())
            continue
        key = (a.__array_interface__["data"][0], a.nbytes)
        if key not in slots and any(np.may_share_memory(a, b) for b in owned):
            raise ValueError(f"{spec.name}: argument {k} partly overlaps another one")
        blob.append(np.int64(slots.get(key, -1)).tobytes())
        if key not in slots:
            slots[key] = k
            owned.append(a)
            blob += [np.int64(a.size).tobytes(), a.tobytes()]
    raw = subprocess.run([_emulator(specs, np.dtype(dtype).name)], input=b"".join(blob), capture_output=True,
                         check=True).stdout
    offset = 0
    for a in owned:
        a.reshape(-1)[...] = np.frombuffer(raw, a.dtype, a.size, offset)
        offset += a.nbytes


@functools.cache
def _emulator(specs, dtype_name):
    """The compiled emulation program of the kernels `specs` for one dtype: it reads the kernel's
    index, the launch dimensions and the arguments from stdin, and writes the arrays back."""
    parts = [_EMU_PRELUDE, f"typedef {_C_TYPES[dtype_name]} T;"]
    for index, spec in enumerate(specs):  # a namespace each: the kernels share helper names
        parts += [f"namespace k{index} {{", spec.code, "}", _emulator_runner(index, spec)]
    cases = "\n".join(f"case {i}: return run{i}(d);" for i in range(len(specs)))
    parts += ["int main() {", "unsigned d[7];", "if (fread(d, sizeof d[0], 7, stdin) != 7) return 1;",
              f"switch (d[0]) {{\n{cases}\n}}", "return 1;", "}", ""]
    exe = os.path.join(_emulator_dir(), f"emulator{len(os.listdir(_emulator_dir()))}_{dtype_name}")
    with open(exe + ".cpp", "w") as f:
        f.write("\n".join(parts))
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("the emulation needs a C++20 compiler: install g++ or set CXX")
    built = subprocess.run([cxx, "-O1", "-std=c++20", "-pthread", exe + ".cpp", "-o", exe], capture_output=True,
                           text=True, check=False)
    if built.returncode:
        raise RuntimeError(f"{', '.join(s.name for s in specs)}: does not compile as C++ for the emulation:\n"
                           f"{built.stderr}")
    return exe


def _emulator_runner(index, spec):
    """C++ `int run<index>(d)`: reads spec's arguments, launches it, writes its arrays back."""
    params = _raw_params(spec)
    n = len(params)
    read, call, write = [], [], []
    for k, (_, base, pointer) in enumerate(params):
        if pointer:
            read.append(f"if (fread(&alias, 8, 1, stdin) != 1) return 1;\n"
                        f"if (alias >= 0) buf[{k}] = buf[alias]; else {{\n"
                        f"  own[{k}] = 1;\n"
                        f"  if (fread(&count[{k}], 8, 1, stdin) != 1) return 1;\n"
                        f"  buf[{k}] = malloc(count[{k}] * sizeof({base}) + 1);\n"
                        f"  if (fread(buf[{k}], sizeof({base}), count[{k}], stdin) != (size_t)count[{k}])"
                        " return 1;\n}")
            call.append(f"({base} *)buf[{k}]")
            write.append(f"if (own[{k}]) fwrite(buf[{k}], sizeof({base}), count[{k}], stdout);")
        else:
            read.append(f"{base} arg{k};\nif (fread(&arg{k}, sizeof arg{k}, 1, stdin) != 1) return 1;")
            call.append(f"arg{k}")
    return "\n".join([
        f"static int run{index}(const unsigned *d) {{", f"void *buf[{n}] = {{0}};",
        f"long long count[{n}] = {{0}}, alias = -1;", f"int own[{n}] = {{0}};", *read,
        "launch(dim3{d[1], d[2], d[3]}, dim3{d[4], d[5], d[6]}, [&] {",
        f"  k{index}::{spec.name}({', '.join(call)});", "});",
        *write, "return 0;", "}"])


@functools.cache
def _emulator_dir():
    path = tempfile.mkdtemp(prefix="minitensor-emulator-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minitensor.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="NVRTC-compile every kernel (no GPU needed)")
    parser.add_argument("--host-check", action="store_true", help="run elementwise operations as C++ vs NumPy")
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), help="GPU archs to compile for (sm_XX)")
    args = parser.parse_args(argv)
    if not (args.check or args.host_check):
        print("kernels:", ", ".join(KERNELS))
        parser.print_usage()
        return 0
    width = max(map(len, KERNELS), default=0)
    failed = 0
    if args.host_check:
        for spec in (s for s in KERNELS.values() if isinstance(s, ElementwiseSpec)):
            for dtype in DTYPES:
                result = host_check(spec, dtype)
                failed += not result.ok
                print(result.line(width), flush=True)
    if args.check:
        try:
            tc = _toolchain()
        except ToolchainMissing as e:
            print(f"cannot run the compile check: {e}")
            return 2
        start, count = time.perf_counter(), 0
        for result in check_kernels(archs=args.arch):
            count += 1
            failed += not result.ok
            print(result.line(width), flush=True)
        nvrtc = ".".join(map(str, tc.nvrtc_version))
        print(f"{count} compiled in {time.perf_counter() - start:.1f} s with NVRTC {nvrtc}, "
              f"CuPy {tc.cupy.__version__}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    # Run the registry of the imported module, where kernels defined elsewhere register too,
    # rather than this __main__ copy of it.
    from minitensor.kernels import main as _main

    sys.exit(_main())
