"""A NumPy-backed stand-in for CuPy 14.2, so that CPU-only CI runs andrea's GPU code paths.

Only the tests that ask for it see it (tests/support/gpu_standin.py puts this folder first on sys.path, or
on PYTHONPATH for a command); the rest of the suite sees the real CuPy, or none, and no GPU.

- `ndarray` (cupy/_array.py): NumPy data that refuses implicit conversion to NumPy and NumPy
  operands as CuPy 14.2 does, and counts every read back to the host (`cupy.standin.reads`).
- every other `cupy.<name>` is NumPy's function or ufunc of that name on the arrays behind
  (`cupy.add.at` included, its updates in an order drawn anew at each call, as CUDA's atomics
  land); types and constants are NumPy's.
- `ElementwiseKernel` runs the project's operation as C++ on the host, `RawKernel` through
  minitensor's launch emulation (cupy/_kernels.py).
- `cupy.cuda`: one device (runtime, Device, Stream, Event, memGetInfo), the cuBLAS handle, and
  NCCL at one rank; `cupy._core._routines_linalg` and `cupy_backends.cuda.libs.cublas`: the GEMM
  compute type and cuBLAS math mode that `minitensor.device.set_tf32` sets and reads back, and
  cuBLAS's GEMM, strided batched GEMM and GEMV computed column-major from their pointers, with
  gemmEx / gemmStridedBatchedEx for bfloat16 in float32 (minitensor.backends.cublas calls them).
- bfloat16 arrays (ml_dtypes' dtype, as CuPy 14.2 takes it): NumPy's arithmetic on them, a 2-D
  matmul as CuPy computes it and a batched one refused (cupy/standin.py says why).

What it cannot show is listed in tests/support/gpu_standin.py.
"""

import numpy as _np

from cupy import cuda, standin  # noqa: F401
from cupy._array import array, asarray, asnumpy, function, ndarray, ufunc  # noqa: F401
from cupy._kernels import ElementwiseKernel, RawKernel, RawModule  # noqa: F401

__version__ = "14.2.0"
STANDIN = True  # not in CuPy: says which CuPy this is


def asanyarray(a, dtype=None, order=None):
    return asarray(a, dtype, order)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    return ndarray._of(_np.ascontiguousarray(a._a, dtype=dtype))


class _MemoryPool:
    """The device memory pool: nothing pooled (NumPy allocates), so it reports nothing held."""

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


_memory_pool, _pinned_pool = _MemoryPool(), _MemoryPool()


def get_default_memory_pool():
    return _memory_pool


def get_default_pinned_memory_pool():
    return _pinned_pool


def get_array_module(*args):
    return __import__("cupy") if any(isinstance(a, ndarray) for a in args) else _np


_made = {}


def __getattr__(name):
    """NumPy's name on the device: a ufunc or function wrapped once, anything else as it is."""
    if name.startswith("__") or name in ("testing", "random", "fft", "linalg"):
        raise AttributeError(f"module 'cupy' (stand-in) has no attribute {name!r}")
    if name not in _made:
        attr = getattr(_np, name)  # AttributeError for a name NumPy lacks
        if isinstance(attr, _np.ufunc):
            attr = ufunc(attr)
        elif callable(attr) and not isinstance(attr, type):
            attr = function(attr)
        _made[name] = attr
    return _made[name]
