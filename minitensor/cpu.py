"""The optional CPU fast path: numba-compiled kernels beside each layer's NumPy code.

NumPy makes one pass over memory per operation, and its float32 exp/tanh are a few ns per
element; a compiled loop nest makes one pass per kernel and keeps the arithmetic in registers.
Each layer file (gelu.py, layernorm.py, loss.py, attention.py, optim.py, embedding.py) holds its
kernels as plain functions decorated with `kernel(...)`, and asks `enabled(*arrays)` whether to
run them; otherwise it runs its NumPy code, which stays the reference the tests compare against.

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

import numpy as np

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


def mode():
    """'numba' or 'numpy': what ANDREA_CPU_KERNELS asks for, 'numpy' when numba is missing."""
    asked = os.environ.get("ANDREA_CPU_KERNELS", "numba").strip().lower() or "numba"
    if asked not in MODES:
        raise ValueError(f"ANDREA_CPU_KERNELS={asked!r}: use one of {', '.join(MODES)}")
    return "numba" if asked == "numba" and numba is not None else "numpy"


def enabled(*arrays):
    """True when the numba kernels should run on these arrays: NumPy float32/float64 arrays and the
    fast path chosen (read on every call, so tests can switch it with the environment variable)."""
    if mode() != "numba":
        return False
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype not in (np.float32, np.float64):
            return False
    _configure()
    return True


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
    numba.set_num_threads(min(num_threads(), numba.config.NUMBA_NUM_THREADS))
    _configured = True


def kernel(parallel=False, contract=True):
    """The decorator of every fast-path kernel: compiled without the GIL, with FLAGS, cached on
    disk; `parallel=True` spreads its `prange` loop over numba's threads; `contract=False` keeps
    a * b - c from becoming one FMA (where c is a rounded a * b and the difference must be 0).
    Without numba it leaves the function as it is (never called then)."""
    def wrap(fn):
        if numba is None:
            return fn
        flags = FLAGS if contract else FLAGS - {"contract"}
        return njit(parallel=parallel, fastmath=flags, error_model="numpy", cache=True, nogil=True)(fn)
    return wrap


# ---------------------------------------------------------------------------------------------
# exp that vectorises: numba has no SIMD math library here (no SVML), so math.exp on float32 is
# one libm call per element (~10x NumPy's AVX-512 exp). The float32 version is written out:
#
#   exp(x) = 2^n exp(r),  n = round(x / ln 2),  r = x - n ln 2  (|r| <= ln2 / 2, in float64)
#   exp(r) = sum_{k<=7} r^k / k!   (truncation r^8 / 8! < 6e-9 relative: below float32 rounding)
#   2^n    = the float whose exponent bits are n + 127
#
# with x clamped to [-87.33, 88.37], where n + 127 stays in 1..254 (2^n a normal float): exp = 0
# below (libm would give subnormals down to -103.9) and inf above (libm: above 88.72); within 1.3
# float32 ulp of the exact value in between (measured over 4M points). Softmax arguments are <= 0
# and GELU's exp(-2u) only overflows where y = x / inf = -0 anyway.

_INV_LN2 = 1.0 / math.log(2.0)

if numba is not None:
    @intrinsic
    def _bits_to_float32(typingctx, bits):
        """The float32 whose IEEE bits are the int32 `bits` (a bit cast, no conversion)."""
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

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
            # r in float64, one rounding: a two-part ln 2 in float32 would be re-associated away
            r = np.float32(np.float64(xc) - np.float64(n) * math.log(2.0))
            p = t(1.0 / 5040) + r * t(1.0 / 40320)
            p = t(1.0 / 720) + r * p
            p = t(1.0 / 120) + r * p
            p = t(1.0 / 24) + r * p
            p = t(1.0 / 6) + r * p
            p = t(0.5) + r * p
            p = t(1) + r * p
            p = t(1) + r * p
            e = p * _bits_to_float32((np.int32(n) + np.int32(127)) << np.int32(23))
            if x < t(-87.33):
                e = t(0)
            if x > t(88.37):
                e = t(np.inf)
            return e
        return exp32
else:
    def exp(x):
        return math.exp(x)
