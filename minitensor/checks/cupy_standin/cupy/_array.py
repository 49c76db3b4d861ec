"""The stand-in's device array: a NumPy array behind CuPy 14.2's wall between host and device.

What CuPy refuses, this refuses too, with CuPy's exception types:

- implicit conversion to NumPy (`np.asarray(a)`, `np.array(a)`, `__array__`): TypeError, as CuPy
  says it: use `.get()`;
- NumPy arrays mixed into device operations (`a + numpy_array`, `cupy.matmul(a, numpy_array)`,
  `np.add(a, numpy_array)`): TypeError "Unsupported type" (only `cupy.asarray`/`cupy.array` and
  `a[...] = numpy_array` take host data, as in CuPy).

What CuPy does silently, this counts: every read back to the host (`.get()`, `cupy.asnumpy`,
`float()`, `int()`, `bool()`, `.item()`, `.tolist()`, printing) is a `Read` in `cupy.standin.reads`,
with the place in the caller's code that asked for it, so a test can assert how many reads a
training step makes.

Reductions and indexing give 0-d device arrays, as CuPy's do (NumPy would give host scalars).
"""

import numbers
import traceback

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from cupy import standin

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy "
            "array explicitly.")


def _unsupported(obj):
    return TypeError(f"Unsupported type {type(obj)}")


def unwrap(obj):
    """The NumPy arrays behind device arrays, in obj and the lists/tuples in it; a NumPy array
    found there is refused as CuPy refuses it."""
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, np.ndarray):
        raise _unsupported(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(unwrap(o) for o in obj)
    return obj


def wrap(obj):
    """Device arrays for the NumPy arrays (and NumPy scalars, as 0-d arrays) in a result."""
    if isinstance(obj, np.ndarray):
        return ndarray._of(obj)
    if isinstance(obj, np.generic):
        return ndarray._of(np.asarray(obj))
    if isinstance(obj, tuple | list):
        return type(obj)(wrap(o) for o in obj)
    return obj


def call(fn, args, kwargs):
    """fn (a NumPy function) on device arguments; `out=` arrays are given back as the caller's own."""
    out = kwargs.get("out")
    result = fn(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
    if out is not None:
        outs = out if isinstance(out, tuple) else (out,)
        if isinstance(result, tuple):
            return tuple(o if isinstance(o, ndarray) and r is o._a else wrap(r) for o, r in zip(outs, result))
        if isinstance(outs[0], ndarray) and result is outs[0]._a:
            return outs[0]
    return wrap(result)


def record_read(what, nbytes):
    """Counts a device-to-host read and where the caller's code asked for it."""
    frames = [f for f in traceback.extract_stack()[:-2] if "cupy_standin" not in f.filename]
    standin.reads.append(standin.Read(what, nbytes, tuple(f"{f.filename}:{f.lineno}:{f.name}" for f in frames)))


class MemoryPointer:
    """`a.data`: only its address (`.ptr`), which NCCL calls take."""

    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(NDArrayOperatorsMixin):  # noqa: N801 (CuPy's name)
    """A device array: NumPy's data and arithmetic, CuPy's refusals, counted reads."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = np.empty(shape, dtype=dtype, order=order)

    @classmethod
    def _of(cls, a):
        obj = object.__new__(cls)
        obj._a = a
        return obj

    # --- what CuPy refuses ---

    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.matmul and method == "__call__":
            return _matmul(inputs, kwargs)
        return call(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return call(func, args, kwargs)

    # --- reads back to the host, counted ---

    def get(self, stream=None, order="C", out=None, blocking=True):
        record_read("get", self._a.nbytes)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order)

    def item(self, *args):
        record_read("item", self._a.itemsize)
        return self._a.item(*args)

    def tolist(self):
        record_read("tolist", self._a.nbytes)
        return self._a.tolist()

    def _scalar(self, kind, fn):
        if self._a.size != 1:
            raise TypeError(f"only length-1 arrays can be converted to Python scalars ({kind} of {self._a.shape})")
        record_read(kind, self._a.itemsize)
        return fn(self._a.reshape(()))

    def __float__(self):
        return self._scalar("float", float)

    def __int__(self):
        return self._scalar("int", int)

    def __bool__(self):
        return self._scalar("bool", bool)

    def __complex__(self):
        return self._scalar("complex", complex)

    def __repr__(self):
        record_read("repr", self._a.nbytes)
        return repr(self._a)

    def __str__(self):
        record_read("str", self._a.nbytes)
        return str(self._a)

    def __format__(self, spec):
        record_read("format", self._a.nbytes)
        return format(self._a.reshape(()) if self._a.ndim == 0 else self._a, spec)

    # --- host to device, allowed ---

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray) or arr.shape != self._a.shape:
            raise ValueError(f"set: a NumPy array of shape {self._a.shape} is needed")
        self._a[...] = arr

    def __setitem__(self, key, value):
        value = value._a if isinstance(value, ndarray) else value  # NumPy values: a host-to-device copy
        self._a[unwrap(key)] = value

    def __getitem__(self, key):
        return wrap(self._a[unwrap(key)])

    # --- attributes ---

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))
    data = property(lambda self: MemoryPointer(self._a.__array_interface__["data"][0]))

    @property
    def device(self):
        from cupy import cuda

        return cuda.Device(0)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (wrap(row) for row in self._a)

    __hash__ = None

    # methods that would hand host memory out: CuPy has none of them
    _HOST_ONLY = frozenset({"tobytes", "tofile", "dump", "dumps", "ctypes", "__array_interface__",
                            "__array_struct__", "byteswap", "getfield", "setfield"})

    def __getattr__(self, name):
        if name.startswith("__") or name in ndarray._HOST_ONLY:
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        attr = getattr(self._a, name)
        if callable(attr):
            return lambda *args, **kwargs: call(attr, args, kwargs)
        return wrap(attr)


class ufunc:  # noqa: N801 (CuPy's name)
    """A NumPy ufunc on device arrays: call, reduce, accumulate, at (scatter-add: `cupy.add.at`)."""

    def __init__(self, np_ufunc):
        self._u = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args, **kwargs):
        if self._u is np.matmul:
            return _matmul(args, kwargs)
        return call(self._u, args, kwargs)

    def reduce(self, *args, **kwargs):
        return call(self._u.reduce, args, kwargs)

    def accumulate(self, *args, **kwargs):
        return call(self._u.accumulate, args, kwargs)

    def at(self, a, indices, b=None):
        """As CuPy's, whose atomics land in no fixed order: the updates of one index array and
        as many rows of b are applied in an order drawn anew at each call, so a sum's rounding
        may differ from run to run, as on a GPU."""
        if not isinstance(a, ndarray):
            raise _unsupported(a)
        indices, b = unwrap(indices), unwrap(b)
        if isinstance(indices, np.ndarray) and indices.ndim == 1 and np.ndim(b) and len(b) == len(indices):
            order = _atomics.permutation(len(indices))
            indices, b = indices[order], b[order]
        self._u.at(a._a, indices, *(() if b is None else (b,)))


def _matmul(args, kwargs):
    """cupy.matmul and `@`: NumPy's, but past GEMM_LIMIT not computed, and with a bfloat16 operand as
    CuPy computes it (cupy.standin)."""
    operands = unwrap(args[:2])
    if standin.gemm_too_big(*operands):
        return call(standin.skipped_gemm, args[:2], kwargs)
    if standin.is_bf16(*operands):
        return call(standin.bf16_matmul, args[:2], kwargs)
    return call(np.matmul, args, kwargs)


_atomics = np.random.default_rng()  # unseeded: the order of a GPU's atomics is not reproducible either


def function(np_fn):
    """A NumPy function on device arguments (NumPy arrays refused, results on the device)."""
    def fn(*args, **kwargs):
        return call(np_fn, args, kwargs)

    fn.__name__ = getattr(np_fn, "__name__", "function")
    fn.__doc__ = f"cupy.{fn.__name__} (the stand-in: NumPy's on the arrays behind)"
    return fn


def asarray(a, dtype=None, order=None, *, blocking=False):
    """Device arrays unchanged (or cast); host data copied to the device, as CuPy does."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else ndarray._of(a._a.astype(dtype))
    return ndarray._of(np.array(_host(a), dtype=dtype, order=order or "K", copy=True))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return ndarray._of(np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return ndarray._of(np.array(_host(obj), dtype=dtype, copy=True, order=order, ndmin=ndmin))


def _host(obj):
    """Host data for asarray/array: a list of device 0-d arrays is refused (CuPy refuses it too)."""
    if isinstance(obj, list | tuple) and any(isinstance(o, ndarray) for o in obj):
        raise TypeError("cupy.asarray of a list holding device arrays: stack them with cupy.stack")
    if not isinstance(obj, np.ndarray | numbers.Number | np.generic | list | tuple | range | bytes):
        raise _unsupported(obj)
    return obj


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream, order, out)
    return np.asarray(a, order=order)
