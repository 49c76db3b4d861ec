"""GELU's formula, its NumPy code and its CUDA kernels (plain and with the bias fused), and the
command line of the kernel checks.

GELU, the tanh approximation (SPEC 1), elementwise over any shape, float32 or float64:

    y  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
    dx = dy (0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))

(Hendrycks & Gimpel 2016, "Gaussian Error Linear Units"; the form GPT-2 uses.) `gelu_forward`
and `gelu_backward` take NumPy or CuPy arrays: NumPy runs the formula in place over cache-sized
chunks, CuPy runs the ElementwiseKernels 'gelu_fwd' and 'gelu_bwd' (type placeholder `T`, so
float64 works on the GPU too). `bias_gelu_*_gpu` fuse the Linear's bias into the same pass
(GELU's fused piece `bias_gelu`, used by minitensor/gelu.py when minitensor.cuda says it is in
use).

The formula is written once, as `gelu_forward` and `gelu_backward` on NumPy arrays: the generic
code of minitensor/gelu.py (what the CPU runs without numba; these two functions never switch to
numba themselves) and the reference every CUDA kernel here is checked against (the `reference`
of each spec, for kernelcheck's host check and the tests). The textbook form the tests compare
that code with is in tests/formulas.py.

The registry of every CUDA kernel is `minitensor.cuda.KERNELS`; each layer's kernels live in
its own module. Two checks of them need no GPU (minitensor/kernelcheck.py):

    python -m minitensor.kernels --check       NVRTC compiles every kernel x dtype x arch
    python -m minitensor.kernels --host-check  g++ runs each elementwise operation on the CPU
                                               and compares it with its NumPy reference
"""
import argparse
import math
import sys

import numpy as np

from minitensor import cuda
from minitensor.parallel import parallel_for

_CHUNK = 65536  # elements per NumPy pass, so a chunk's operands stay in cache: 1.3-1.6x faster on 4-12 MB


# ---------------------------------------------------------------------------------------------
# GELU

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715
_AC = _A * _C  # u = x (AC x^2 + C)
_AC3 = 3.0 * _A * _C  # du/dx = AC3 x^2 + C


# The kernels compute a factored form of the formula:
#   t = tanh(x (AC x^2 + C)),  y = x * (0.5 (1 + t))
#   g = x (AC3 x^2 + C),       dx = dy * ((1 + (1 - t) g) * (1 - 0.5 (1 - t)))
# using 1 - t^2 = (1 - t)(1 + t), so dGELU = 0.5 (1 + t) (1 + (1 - t) g). The NumPy blocks use
# the same formula through 0.5 (1 + tanh(u)) = sigmoid(2u), because NumPy's float32 exp costs
# ~2.2 ns per element here against ~3.0 for tanh (SIMD sqrt, by comparison, 0.45):
#   e = exp(-2u) = exp(x (-2AC x^2 - 2C)),  sig = 1 / (1 + e),  y = x * sig = x / (1 + e)
#   dx = dy * sig * (1 + (1 - sig) 2g)      [0.5 (1 - t) = 1 - sig]
# GELU forward 25% and backward 15-20% faster on 1-38 M elements, equal to float32 rounding.

GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_fwd", "T x", "T y",
    f"const T t = tanh(x * ((T){_AC!r} * x * x + (T){_C!r}));\n"
    "y = x * ((T)0.5 * ((T)1 + t));",
    reference=lambda x: gelu_forward(x),  # the NumPy code below (a lambda: defined after the spec)
))

GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_bwd", "T x, T dy", "T dx",
    "const T x2 = x * x;\n"
    f"const T s = (T)1 - tanh(x * ((T){_AC!r} * x2 + (T){_C!r}));\n"
    f"const T g = x * ((T){_AC3!r} * x2 + (T){_C!r});\n"
    "dx = dy * (((T)1 + s * g) * ((T)1 - (T)0.5 * s));",
    reference=lambda x, dy: gelu_backward(x, dy),
))


def gelu_forward(x, out=None, bias=None):
    """GELU of x (NumPy or CuPy, float32/float64, any shape), into `out` if given; returns y.

    With bias (C,), x (..., C) must be C-contiguous: x += bias in place first (on NumPy in the same
    cache-sized pass), and y = GELU(x + bias).
    """
    cuda.check_operands("gelu_forward", x, out)
    if bias is not None:
        _check_bias("gelu_forward", x, out, bias)
        if isinstance(x, np.ndarray):
            return _gelu_forward_bias(x, np.empty_like(x) if out is None else out, bias)
        x += bias
    if isinstance(x, np.ndarray):
        out = np.empty_like(x) if out is None else out
        x = _unaliased(x, out)
        _run_blocks(_gelu_fwd_block, (x, out), n_work=1)
        return out
    kern = GELU_FWD.kernel()
    return kern(x) if out is None else kern(x, out)


def gelu_backward(x, dy, out=None):
    """dL/dx from the forward input x and dy = dL/dy, into `out` if given; returns dx."""
    cuda.check_operands("gelu_backward", x, out, dy)
    if isinstance(x, np.ndarray):
        out = np.empty_like(x) if out is None else out
        x, dy = _unaliased(x, out), _unaliased(dy, out)
        _run_blocks(_gelu_bwd_block, (x, dy, out), n_work=3)
        return out
    kern = GELU_BWD.kernel()
    return kern(x, dy) if out is None else kern(x, dy, out)


def _gelu_fwd_block(x, y, w):
    np.multiply(x, x, out=w)
    w *= -2.0 * _AC
    w -= 2.0 * _C
    w *= x                      # -2u
    with np.errstate(over="ignore"):  # x below about -10: e = inf gives y = x / inf = -0, as it should
        np.exp(w, out=w)
    w += 1.0
    np.divide(x, w, out=y)      # y = x sigmoid(2u), written last: it may be x itself


def _gelu_bwd_block(x, dy, dx, g, s, w):
    np.multiply(x, x, out=g)
    np.multiply(g, -2.0 * _AC, out=s)
    s -= 2.0 * _C
    s *= x                      # -2u
    with np.errstate(over="ignore"):  # e = inf gives sig = 0 and dx = 0, as it should
        np.exp(s, out=s)
    s += 1.0
    np.reciprocal(s, out=s)     # sig = sigmoid(2u) = 0.5 (1 + t)
    g *= 2.0 * _AC3
    g += 2.0 * _C
    g *= x                      # 2g = 2 x du/dx
    np.subtract(1.0, s, out=w)  # 1 - sig = 0.5 (1 - t)
    w *= g
    w += 1.0
    w *= s
    np.multiply(w, dy, out=dx)  # dx is written last: it may be x or dy itself


def _check_bias(fn, x, out, bias):
    if x.ndim == 0 or bias.shape != x.shape[-1:] or bias.dtype != x.dtype or type(bias) is not type(x):
        raise ValueError(f"{fn}: bias must be a {type(x).__name__} of shape {x.shape[-1:]} and dtype {x.dtype}, "
                         f"got {type(bias).__name__} {getattr(bias, 'shape', '')} {getattr(bias, 'dtype', '')}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{fn}: with a bias, x must be C-contiguous (it is updated in place)")
    if out is not None and out is not x and isinstance(x, np.ndarray) and np.may_share_memory(x, out):
        raise ValueError(f"{fn}: with a bias, out must be x itself or not overlap it")


def _gelu_forward_bias(x, out, bias):
    """x += bias, out = GELU(x), over blocks of whole rows (the bias lines up with each row)."""
    if x.size == 0:
        return out
    C = x.shape[-1]
    x2, o2 = x.reshape(-1, C), out.reshape(-1, C)
    N, rows = x2.shape[0], max(1, _CHUNK // max(1, C))

    def run(first, last):
        work = np.empty(rows * C, x.dtype)
        for s in range(first * rows, min(last * rows, N), rows):
            e = min(s + rows, N)
            xb = x2[s:e]
            xb += bias
            _gelu_fwd_block(xb.reshape(-1), o2[s:e].reshape(-1), work[:(e - s) * C])

    parallel_for(-(-N // rows), run, min_work=0)
    return out


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
# bias + GELU: y = GELU(x + b), b broadcast over the rows; x is the matmul output (N, C) ---


def _column(n, C):
    """Column of each flat index of an (n / C, C) array: what `i % C` gives in the kernels."""
    return np.arange(n) % int(C)


# `i` is the flat C-order index over x's shape, so `i % C` is the column even for strided x; the
# 32-bit cast avoids a 64-bit modulo per element (the wrappers refuse 2**31 elements or more).
# The references are GELU's generic code applied to h = x + b, as the generic path runs it (the
# bias added, then gelu_forward / gelu_backward). They take flat arrays, as the kernels see them,
# and gather the bias by i % C: the host check's flat samples (4096 of them, C = 7) are not whole
# rows, so `gelu_forward(x, bias=b)` over (N, C) rows cannot take them.
BIAS_GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "bias_gelu_fwd", "T x, raw T b, int32 C", "T y",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n"
    f"const T t = tanh(h * ((T){_AC!r} * h * h + (T){_C!r}));\n"
    "y = h * ((T)0.5 * ((T)1 + t));",
    reference=lambda x, b, C: gelu_forward(x + b[_column(x.size, C)]),
    scalars=(("C", 7),),
))

BIAS_GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "bias_gelu_bwd", "T x, raw T b, int32 C, T dy", "T dh",
    "const T h = x + b[(unsigned int)i % (unsigned int)C];\n"
    "const T h2 = h * h;\n"
    f"const T s = (T)1 - tanh(h * ((T){_AC!r} * h2 + (T){_C!r}));\n"
    f"const T g = h * ((T){_AC3!r} * h2 + (T){_C!r});\n"
    "dh = dy * (((T)1 + s * g) * ((T)1 - (T)0.5 * s));",
    reference=lambda x, b, C, dy: gelu_backward(x + b[_column(x.size, C)], dy),
    scalars=(("C", 7),),
))


def bias_gelu_forward_gpu(x, b, out=None):
    """GELU(x + b) for x (..., C) and b (C,) CuPy arrays, into `out` if given; returns y.

    The caller keeps x (the matmul output without its bias) for the backward: h = x + b is never
    stored."""
    _check_bias_gpu(x, b, out, "bias_gelu_forward_gpu")
    cuda.on_cupy("bias_gelu_forward_gpu", x, "gelu_forward(x + b)")
    kern = BIAS_GELU_FWD.kernel()
    C = np.int32(x.shape[-1])
    return kern(x, b, C) if out is None else kern(x, b, C, out)


def bias_gelu_backward_gpu(x, b, dy, db=None, out=None):
    """dL/dh for h = x + b, y = GELU(h), from the forward's x and b and dy = dL/dy; into `out`
    if given (it may be dy). With `db`, also db += the column sums of dh. Returns dh."""
    _check_bias_gpu(x, b, out, "bias_gelu_backward_gpu", dy)
    cuda.on_cupy("bias_gelu_backward_gpu", x, "gelu_backward(x + b, dy)")
    kern = BIAS_GELU_BWD.kernel()
    C = np.int32(x.shape[-1])
    dh = kern(x, b, C, dy) if out is None else kern(x, b, C, dy, out)
    if db is not None:
        db += dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return dh


def _check_bias_gpu(x, b, out, fn, dy=None):
    cuda.check_operands(fn, x, out, dy)
    if x.ndim < 1 or x.size >= 2**31:
        raise ValueError(f"{fn}: x must have 1 to 2**31 - 1 elements and a last axis, got shape {x.shape}")
    if b.shape != x.shape[-1:] or b.dtype != x.dtype or not b.flags.c_contiguous:
        raise ValueError(f"{fn}: b must be a contiguous {x.dtype} vector of shape {x.shape[-1:]}, got "
                         f"{b.dtype} {b.shape}")


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minitensor.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="NVRTC-compile every kernel (no GPU needed)")
    parser.add_argument("--host-check", action="store_true", help="run elementwise operations as C++ vs NumPy")
    parser.add_argument("--arch", nargs="+", default=list(cuda.ARCHS), help="GPU archs to compile for (sm_XX)")
    args = parser.parse_args(argv)
    from minitensor import kernelcheck  # here: the library never needs it

    if not (args.check or args.host_check):
        print("kernels:", ", ".join(cuda.all_kernels()))
        parser.print_usage()
        return 0
    return kernelcheck.run(host=args.host_check, archs=args.arch if args.check else None)


if __name__ == "__main__":
    # the imported module's main, not this __main__ copy, whose kernel specs are other objects
    from minitensor.kernels import main as _main

    sys.exit(_main())
