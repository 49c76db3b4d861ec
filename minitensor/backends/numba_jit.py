"""The numba side of the CPU backend: the kernel decorator, and the scalar helpers kernels share.

NumPy makes one pass over memory per operation, and its float32 exp/tanh are a few ns per
element; a compiled loop nest makes one pass per kernel and keeps the arithmetic in registers.
The kernels themselves are plain functions decorated with `kernel(...)` in minitensor/backends/cpu/NAME.py,
beside the NumpyOps methods that run them (one module per piece). Whether they run is chosen once,
when a model is built (minitensor.backends.get_ops, `mode` below):

    ANDREA_CPU_KERNELS=numpy   NumPy only, even with numba installed
    (unset, or =numba)         numba if importable (pip install 'andrea[fast]'), else NumPy

Both float32 and float64 run on the fast path (the float64 gradient checks exercise the kernels
themselves); `exp` below is a vectorisable float32 exp and math.exp in float64. Kernels run in
float32 arithmetic on float32 data: a Python constant would promote a float32 loop to float64,
so every constant is written `t(c)` with t = x.dtype.type. `fastmath` is limited to FLAGS:
reassociation (SIMD sums within a row), contraction to FMA, reciprocal and signed-zero
freedom; never no-NaN/no-inf, which the causal mask's -inf and GELU's overflow rely on. Results
then differ from NumPy's by float32 rounding, and at a fixed machine and thread count they are
bit-reproducible: every reduction is within one row (or one fixed block of rows) on one thread.

Compilation is lazy (first call per dtype) and cached on disk (`cache=True`, in __pycache__), so
a machine pays it once; a fresh clone pays it in its first run (see BENCHMARKS.md). numba keys a
kernel's cache on its own file only: after editing `exp` here, delete __pycache__/*.nbi and
*.nbc in minitensor/ (or set NUMBA_CACHE_DIR elsewhere), or the layers keep the old code.
"""

import math
import os
import threading

import numpy as np

from minitensor import precision

MODES = ("numba", "numpy")
FLAGS = {"reassoc", "contract", "arcp", "nsz"}

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange
    from numba.core import types
    from numba.extending import intrinsic, overload
except ImportError:  # the fast path is optional: without numba, every layer runs its NumPy code
    numba = None
    prange = range

_configured = False


def mode(kernels=None):
    """'numba' or 'numpy': `kernels` if given, else what ANDREA_CPU_KERNELS asks for (default
    numba); 'numpy' when numba is missing. Read when a backend is chosen, not per call."""
    asked = (kernels or os.environ.get("ANDREA_CPU_KERNELS", "numba")).strip().lower() or "numba"
    if asked not in MODES:
        raise ValueError(f"ANDREA_CPU_KERNELS={asked!r}: use one of {', '.join(MODES)}")
    return "numba" if asked == "numba" and numba is not None else "numpy"


def takes(*arrays):
    """Whether a kernel takes these arrays: C-contiguous float32 or float64 NumPy arrays of one dtype (the
    precision policy's FLOATS)."""
    return all(isinstance(a, np.ndarray) and precision.is_float(a.dtype) and a.flags.c_contiguous
               and a.dtype == arrays[0].dtype for a in arrays)


_blas_ok = None


def blas_in_kernels():
    """True when a kernel may call np.dot (a BLAS GEMM without leaving compiled code): numba
    reaches BLAS through SciPy's, which must be importable. The first call loads it and makes
    minitensor.parallel's BLAS thread control see the new library."""
    global _blas_ok
    if _blas_ok is None:
        try:
            import scipy.linalg.cython_blas  # noqa: F401  numba's route to sgemm/dgemm
        except ImportError:
            _blas_ok = False
        else:
            from minitensor import parallel

            parallel.forget_blas()
            _blas_ok = True
    return _blas_ok


def _configure():
    """Once: numba's thread count from minitensor's (ANDREA_NUM_THREADS), and its own worker threads
    rather than OpenMP's (which spin after each kernel and would steal the BLAS threads' cores),
    unless the user chose a threading layer."""
    global _configured
    if _configured:
        return
    from minitensor.parallel import num_threads

    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    _wide_vectors()
    numba.set_num_threads(min(num_threads(), numba.config.NUMBA_NUM_THREADS))
    _configured = True


def _wide_vectors():
    """On an AVX-512 CPU, let LLVM vectorise the kernels 16 float32 lanes wide.

    LLVM's default for every AVX-512 CPU is 256-bit vectors (`prefer-256-bit`, against the
    down-clocking of early AVX-512 chips); the BLAS runs 512-bit GEMMs in the same process
    anyway, and the exp-bound kernels (softmax, GELU) run faster at the full width (measured on a
    Xeon, Emerald Rapids: BENCHMARKS.md, "The CPU kernels"). The CPU features are
    read when numba compiles its first function in the process, so this is set before that; it
    yields to NUMBA_CPU_FEATURES, and the on-disk cache keys on the features (no stale code)."""
    if os.environ.get("NUMBA_CPU_FEATURES") or numba.config.CPU_FEATURES:
        return
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if features.get("avx512f"):
        numba.config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


def kernel(parallel=False, contract=True):
    """The decorator of every fast-path kernel: compiled without the GIL, with FLAGS, cached on
    disk; `parallel=True` spreads its `prange` loop over numba's threads; `contract=False` keeps
    a * b - c from becoming one FMA (where c is a rounded a * b and the difference must be 0).
    The numba function is made at the kernel's first call, not at import: making one starts
    numba's compiler, which fixes the CPU features for the process (see _wide_vectors).
    Without numba it leaves the function as it is (never called then)."""
    def wrap(fn):
        if numba is None:
            return fn
        flags = FLAGS if contract else FLAGS - {"contract"}
        return _Kernel(fn, dict(parallel=parallel, fastmath=flags, error_model="numpy", cache=True, nogil=True))
    return wrap


class _Kernel:
    """A kernel's numba function, made at its first call (after _configure), once even when the
    first calls come from several threads at a time (parallel_for's parts)."""

    _lock = threading.Lock()

    def __init__(self, fn, options):
        self.fn, self.options, self.jit = fn, options, None
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __call__(self, *args):
        if self.jit is None:
            with self._lock:
                if self.jit is None:
                    _configure()
                    self.jit = njit(**self.options)(self.fn)
        return self.jit(*args)


# ---------------------------------------------------------------------------------------------
# exp that vectorises: numba has no SIMD math library here (no SVML), so math.exp on float32 is
# one libm call per element (~10x NumPy's AVX-512 exp). The float32 version is written out:
#
#   exp(x) = 2^n exp(r),  n = round(x / ln 2),  r = x - n ln 2  (|r| <= ln2 / 2)
#   exp(r) = sum_{k<=7} r^k / k!   (truncation r^8 / 8! < 6e-9 relative: below float32 rounding)
#   2^n    = the float whose exponent bits are n + 127
#
# r is x - n ln2_hi - n ln2_lo (Cody & Waite): ln2_hi has 12 significant bits, so n ln2_hi
# (|n| <= 127) is exact in float32 and the first subtraction loses nothing. Both steps and the
# polynomial are explicit fused multiply-adds (llvm.fma), which the reassociation in FLAGS
# may not rewrite (as plain float32 arithmetic it could fold ln2_hi + ln2_lo back into one
# rounded ln 2); all of it stays in float32 lanes. x is clamped to [-87.33, 88.37], where n + 127
# stays in 1..254 (2^n a normal float): exp = 0 below (libm would give subnormals down to
# -103.9) and inf above (libm: above 88.72); within 2 float32 ulp of the exact value in between
# (tests/engine/test_cpu_kernels.py). Softmax arguments are <= 0 and GELU's exp(-2u) only overflows
# where y = x / inf = -0 anyway.

_INV_LN2 = 1.0 / math.log(2.0)
_LN2_HI = 0.693145751953125            # ln 2 to 12 significant bits (0x3f317200)
_LN2_LO = math.log(2.0) - _LN2_HI      # the rest, rounded once to float32 where it is used

if numba is not None:
    @intrinsic
    def _bits_to_float32(typingctx, bits):
        """The float32 whose IEEE bits are the int32 `bits` (a bit cast, no conversion)."""
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    @intrinsic
    def _fma32(typingctx, a, b, c):
        """a * b + c rounded once (llvm.fma on float32: never split or re-associated)."""
        def codegen(context, builder, sig, args):
            return builder.fma(*args)
        return types.float32(types.float32, types.float32, types.float32), codegen

    def exp(x):
        """exp(x) for a float32 or float64 scalar inside a kernel."""
        return math.exp(x)

    @overload(exp, fastmath=FLAGS, inline="always")
    def _exp_overload(x):
        if x == types.float64:
            return lambda x: math.exp(x)
        if x != types.float32:
            return None

        def exp32(x):
            t = np.float32
            xc = min(max(x, t(-87.33)), t(88.37))
            n = np.rint(xc * t(_INV_LN2))
            r = _fma32(n, t(-_LN2_HI), xc)
            r = _fma32(n, t(-_LN2_LO), r)
            p = _fma32(r, t(1.0 / 40320), t(1.0 / 5040))
            p = _fma32(r, p, t(1.0 / 720))
            p = _fma32(r, p, t(1.0 / 120))
            p = _fma32(r, p, t(1.0 / 24))
            p = _fma32(r, p, t(1.0 / 6))
            p = _fma32(r, p, t(0.5))
            p = _fma32(r, p, t(1))
            p = _fma32(r, p, t(1))
            e = p * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))
            if x < t(-87.33):
                e = t(0)
            if x > t(88.37):
                e = t(np.inf)
            return e
        return exp32

    def row_max(row, n):
        """max(row[:n]) of a contiguous 1-D float32 or float64 row inside a kernel (n >= 1)."""
        return max(row[:n])

    # LLVM vectorises a float max only when told there are no NaNs, which FLAGS never says. The
    # float32 bits, with the 31 low bits flipped when the sign bit is set, are integers in the
    # same order as the floats (-0 just below +0), and an integer max vectorises: the maximum is
    # exact, and a NaN row still gives NaN probabilities (the exp pass meets the NaN itself).
    @overload(row_max, fastmath=FLAGS, inline="always")
    def _row_max_overload(row, n):
        if row.dtype == types.float64:
            def max64(row, n):
                m = row[0]
                for j in range(n):
                    m = row[j] if row[j] > m else m
                return m
            return max64
        if row.dtype != types.float32:
            return None

        def max32(row, n):
            bits = row.view(np.int32)
            low = np.int32(0x7FFFFFFF)
            m = np.int32(-2147483648)
            for j in range(n):
                k = bits[j] ^ ((bits[j] >> np.int32(31)) & low)
                m = k if k > m else m
            return _bits_to_float32(m ^ ((m >> np.int32(31)) & low))
        return max32

    def causal_exp_row(row, n, normalise):
        """In place over a contiguous row inside a kernel: its first n entries (n >= 1) become
        exp(x - max), divided by their sum when normalise, the rest 0 (a causal row's mask is
        its length n); returns (max, sum). The softmax row of every attention kernel."""
        raise NotImplementedError("causal_exp_row runs inside numba kernels only")

    @overload(causal_exp_row, fastmath=FLAGS, inline="always")
    def _causal_exp_row_overload(row, n, normalise):
        def impl(row, n, normalise):
            t = row.dtype.type
            m = row_max(row, n)
            total = t(0)
            for j in range(n):
                e = exp(row[j] - m)
                row[j] = e
                total += e
            if normalise:
                inv = t(1) / total
                for j in range(n):
                    row[j] *= inv
            for j in range(n, row.size):
                row[j] = t(0)
            return m, total
        return impl
else:
    def exp(x):
        return math.exp(x)

    def row_max(row, n):
        return max(row[:n])

    def causal_exp_row(row, n, normalise):
        raise NotImplementedError("causal_exp_row runs inside numba kernels only")
