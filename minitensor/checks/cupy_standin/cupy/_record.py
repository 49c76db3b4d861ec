"""The stand-in's recording mode: CuPy code runs at any size without computing, every launch recorded.

    from cupy import _record
    with _record.recording(total_bytes=141 * 10**9) as rec:
        with rec.scope("forward"):
            ...                          # CuPy code, e.g. a whole ANDREA-120M step at 8 x 1024
    rec.ops                              # [Op(kind, name, flops, read, written, shapes, scope), ...]

While recording, a device array holds an uninitialised NumPy array of its shape and dtype
(`np.empty`: the system commits no memory until it is written, and nothing writes it), so views,
reshapes, strides and contiguity are NumPy's own. Every operation that would compute is caught
where the stand-in would run it (`_array.call` and the entry points beside it, the two kernel
classes): it allocates its outputs without touching them and appends one Op per launch CuPy 14.2
makes for it, with the bytes that launch reads and writes
(the kinds of Op, and which operation makes which, are listed in cupy/_rules.py).

An operation without a rule raises NotImplementedError naming it, so that nothing is left out of a
record silently. `recording(verify=True)` computes as the stand-in normally does as well and checks
that each prediction (shape, dtype, contiguity) is what NumPy computed: the rules are tested that way
at a small size (tests/gpu/test_stepmodel.py).
"""

import contextlib
import math
from collections import namedtuple

import numpy as np
from cupy_backends.cuda.libs import cublas

import cupy
from cupy import _array, _kernels, standin
from cupy._array import ndarray, unwrap, wrap
from cupy._rules import _copy, _nbytes, _rule, _shapes

Op = namedtuple("Op", "kind name flops read written shapes scope blocks", defaults=(0,))  # blocks: a RawKernel's grid

LAUNCHES = ("gemm", "kernel", "elementwise", "reduction", "copy", "fill", "gather", "scatter")


class Recorder:
    def __init__(self, verify=False):
        self.ops = []
        self.verify = verify
        self._scopes = []

    def add(self, kind, name, flops=0, read=0, written=0, shapes=(), blocks=0):
        self.ops.append(Op(kind, name, int(flops), int(read), int(written), tuple(shapes), tuple(self._scopes),
                           int(blocks)))

    @contextlib.contextmanager
    def scope(self, label):
        """Every Op recorded inside has label in its scope (outermost first)."""
        self._scopes.append(label)
        try:
            yield
        finally:
            self._scopes.pop()


_active = None
_saved = {}


@contextlib.contextmanager
def recording(total_bytes=None, verify=False):
    """Within the block the stand-in records instead of computing (or as well, with verify); the
    device reports total_bytes of memory (free and total) if given."""
    global _active
    if _active is not None:
        raise RuntimeError("the stand-in is already recording")
    rec = Recorder(verify)
    saved_bytes = (standin.TOTAL_BYTES, standin.free_bytes)
    if total_bytes:
        standin.TOTAL_BYTES = standin.free_bytes = int(total_bytes)
    _install()
    _active = rec
    try:
        yield rec
    finally:
        _active = None
        _uninstall()
        standin.TOTAL_BYTES, standin.free_bytes = saved_bytes


# ---------------------------------------------------------------------------------------------
# What is replaced while recording

def _targets():
    return [(_array, "call", _call), (_array, "asarray", _asarray), (cupy, "asarray", _asarray),
            (_array, "array", _array_fn), (cupy, "array", _array_fn), (cupy, "ascontiguousarray", _ascontiguous),
            (ndarray, "__getitem__", _getitem), (ndarray, "__setitem__", _setitem), (ndarray, "set", _set),
            (ndarray, "get", _get), (ndarray, "item", _item), (ndarray, "tolist", _tolist),
            (ndarray, "_scalar", _scalar), (ndarray, "__repr__", _repr), (ndarray, "__str__", _repr),
            (ndarray, "__format__", _format), (_array.ufunc, "at", _ufunc_at),
            (_kernels.ElementwiseKernel, "__call__", _elementwise_kernel),
            (_kernels.RawKernel, "__call__", _raw_kernel),
            *((cublas, name, _cublas_rule(name)) for name in ("sgemm", "dgemm", "sgemv", "dgemv", "sgemmStridedBatched",
                                                              "dgemmStridedBatched", "gemmEx", "gemmStridedBatchedEx"))]


def _install():
    for owner, name, fn in _targets():
        _saved[(owner, name)] = owner.__dict__[name]
        setattr(owner, name, fn)


def _uninstall():
    for (owner, name), fn in _saved.items():
        setattr(owner, name, fn)
    _saved.clear()


def _original(owner, name):
    return _saved[(owner, name)]


def _check(what, predicted, real):
    """verify: the prediction must be what NumPy computed (shape, dtype, C-contiguity)."""
    pairs = zip(predicted, real) if isinstance(predicted, tuple) else [(predicted, real)]
    for p, r in pairs:
        r = r._a if isinstance(r, ndarray) else r
        if isinstance(p, np.ndarray) != isinstance(r, np.ndarray) or (isinstance(p, np.ndarray) and (
                p.shape != r.shape or p.dtype != r.dtype or p.flags.c_contiguous != r.flags.c_contiguous)):
            raise AssertionError(f"recording: {what} predicted {_describe(p)}, NumPy gave {_describe(r)}")


def _describe(a):
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {a.shape} ({'C' if a.flags.c_contiguous else 'not C'}-contiguous)"
    return type(a).__name__


# ---------------------------------------------------------------------------------------------
# NumPy functions, ufuncs and array methods: _array.call, by the rules of cupy/_rules.py

def _call(fn, args, kwargs):
    rule, name, self_ = _rule(fn)
    a_args, a_kwargs = unwrap(args), {k: unwrap(v) for k, v in kwargs.items()}
    ufunc = getattr(fn, "__self__", None) if getattr(fn, "__name__", "") == "__call__" else None
    predicted = rule(_active, name, ufunc if isinstance(ufunc, np.ufunc) else fn, self_, a_args, a_kwargs)
    if _active.verify:
        real = _original(_array, "call")(fn, args, kwargs)
        _check(f"cupy.{name}", predicted, real)
        return real
    return _original(_array, "call")(lambda *a, **k: predicted, args, kwargs)


# ---------------------------------------------------------------------------------------------
# Host and device, indexing, the module-level constructors

def _read_back(what, a):
    """Counts a read of device array a; True when its real value is to be returned (verify)."""
    _active.add("d2h", what, 0, a._a.nbytes, 0, _shapes(a._a))
    return _active.verify


def _get(self, stream=None, order="C", out=None, blocking=True):
    if _read_back("get", self):
        return _original(ndarray, "get")(self, stream, order, out, blocking)
    host = np.ones(self._a.shape, self._a.dtype)
    if out is not None:
        out[...] = host
        return out
    return host


def _item(self, *args):
    if _read_back("item", self):
        return _original(ndarray, "item")(self, *args)
    return self._a.dtype.type(1).item()


def _tolist(self):
    if _read_back("tolist", self):
        return _original(ndarray, "tolist")(self)
    return np.ones(self._a.shape, self._a.dtype).tolist()


def _scalar(self, kind, fn):
    if self._a.size != 1:
        raise TypeError(f"only length-1 arrays can be converted to Python scalars ({kind} of {self._a.shape})")
    if _read_back(kind, self):
        return fn(self._a.reshape(()))
    return fn(np.ones((), self._a.dtype))


def _repr(self):
    if _read_back("repr", self):
        return repr(self._a)
    return f"<device array {self._a.dtype} {self._a.shape} (recording: no values)>"


def _format(self, spec):
    if _read_back("format", self):
        return format(self._a.reshape(()) if self._a.ndim == 0 else self._a, spec)
    return format(1.0, spec) if self._a.ndim == 0 else f"<device array {self._a.shape}>"


def _basic(key):
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, slice | int | np.integer) for k in keys)


def _view_of(a, key):
    """a[key] for a basic index, as a view even where every axis is indexed (CuPy: a 0-d array)."""
    keys = key if isinstance(key, tuple) else (key,)
    return a[keys if Ellipsis in keys else (*keys, Ellipsis)]


def _advanced_shape(a, key):
    keys = key if isinstance(key, tuple) else (key,)
    arrays = [np.asarray(k) if isinstance(k, list) else k for k in keys]
    if not all(isinstance(k, np.ndarray) and k.dtype.kind in "iu" for k in arrays):
        raise NotImplementedError("recording: only indexing by integer arrays on the leading axes is modelled")
    return (*np.broadcast_shapes(*(k.shape for k in arrays)), *a.shape[len(arrays):]), arrays


def _getitem(self, key):
    key_a = unwrap(key)
    if _basic(key_a):
        return ndarray._of(_view_of(self._a, key_a))
    shape, idx = _advanced_shape(self._a, key_a)
    result = np.empty(shape, self._a.dtype)
    _active.add("gather", "take", 0, result.nbytes + sum(i.nbytes for i in idx), result.nbytes, [shape])
    if _active.verify:
        real = _original(ndarray, "__getitem__")(self, key)
        _check("indexing", result, real)
        return real
    return ndarray._of(result)


def _setitem(self, key, value):
    key_a = unwrap(key)
    v = value._a if isinstance(value, ndarray) else value
    if _basic(key_a):
        target = _view_of(self._a, key_a)
        if isinstance(v, np.ndarray) and not isinstance(value, ndarray):
            _active.add("h2d", "setitem", 0, v.nbytes, target.nbytes, _shapes(target))
        elif isinstance(v, np.ndarray):
            _copy(_active, "copy (setitem)", v, target)
        else:
            _active.add("fill", "fill (setitem)", 0, 0, target.nbytes, _shapes(target))
    else:
        shape, idx = _advanced_shape(self._a, key_a)
        n = math.prod(shape) * self._a.itemsize
        _active.add("scatter", "scatter (setitem)", 0, _nbytes(v) + sum(i.nbytes for i in idx), n, [shape])
    if _active.verify:
        _original(ndarray, "__setitem__")(self, key, value)


def _set(self, arr, stream=None):
    _active.add("h2d", "set", 0, arr.nbytes, self._a.nbytes, _shapes(self._a))
    if _active.verify:
        _original(ndarray, "set")(self, arr, stream)


def _ufunc_at(self, a, indices, b=None):
    if not isinstance(a, ndarray):
        raise _array._unsupported(a)
    idx, rows = unwrap(indices), unwrap(b)
    n = _nbytes(rows) or _nbytes(idx) // max(1, idx.itemsize) * a._a.itemsize
    _active.add("scatter", f"{self.__name__}.at", 0, n + _nbytes(idx) + n, n, _shapes(a._a, rows))
    if _active.verify:
        _original(_array.ufunc, "at")(self, a, indices, b)


def _host_to_device(obj, dtype, order, blocking):
    """CuPy 14.2 (_array_default) copies host data through a pinned staging buffer on the current
    stream: asynchronous ("h2d_async") unless blocking."""
    host = np.asarray(_array._host(obj), dtype=dtype)
    result = np.empty(host.shape, host.dtype, order="F" if order == "F" else "C")
    _active.add("h2d" if blocking else "h2d_async", "asarray", 0, host.nbytes, result.nbytes, _shapes(result))
    return result


def _asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        predicted = _copy(_active, "astype", a._a, np.empty_like(a._a, dtype=dtype))
    else:
        predicted = _host_to_device(a, dtype, order, blocking)
    return _predicted_or_real(predicted, _original(_array, "asarray"), (a, dtype, order), {"blocking": blocking})


def _array_fn(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if ndmin:
        raise NotImplementedError("recording: cupy.array with ndmin")
    if isinstance(obj, ndarray):
        dtype = np.dtype(dtype or obj.dtype)
        if not copy and dtype == obj.dtype:
            return obj
        layout = "C" if order == "C" or (order in ("K", "A") and obj.flags.c_contiguous) else "F"
        predicted = _copy(_active, "copy (array)", obj._a, np.empty(obj.shape, dtype, order=layout))
    else:
        predicted = _host_to_device(obj, dtype, order, blocking)
    return _predicted_or_real(predicted, _original(_array, "array"), (obj, dtype, copy, order, subok, ndmin),
                              {"blocking": blocking})


def _ascontiguous(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    predicted = _copy(_active, "ascontiguousarray", a._a, np.empty(a.shape, dtype or a.dtype))
    return _predicted_or_real(predicted, _original(cupy, "ascontiguousarray"), (a, dtype), {})


def _predicted_or_real(predicted, original, args, kwargs):
    if _active.verify:
        real = original(*args, **kwargs)
        _check("a copy to or on the device", predicted, real)
        return real
    return wrap(predicted)


# ---------------------------------------------------------------------------------------------
# The project's kernels

def _elementwise_kernel(self, *args, size=None, block_size=None, stream=None):
    n_in = len(self.in_params)
    params = self.in_params + self.out_params
    types = self._types(args)
    shape = np.broadcast_shapes(*(a.shape for p, a in zip(params, args) if isinstance(a, ndarray) and not p.raw))
    outs = [a._a for a in args[n_in:]] or [np.empty(shape, self._dtype(p, types)) for p in self.out_params]
    ins = [a._a for a in args[:n_in] if isinstance(a, ndarray)]
    _active.add("kernel", self.name, 0, sum(a.nbytes for a in ins), sum(o.nbytes for o in outs), _shapes(*ins, *outs))
    if _active.verify:
        real = _original(_kernels.ElementwiseKernel, "__call__")(self, *args, size=size, block_size=block_size,
                                                                 stream=stream)
        _check(self.name, tuple(outs), real if isinstance(real, tuple) else (real,))
        return real
    if len(args) > n_in:
        result = tuple(args[n_in:])
    else:
        result = tuple(ndarray._of(o) for o in outs)
    return result[0] if len(result) == 1 and not self.return_tuple else result


def _raw_kernel(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
    from minitensor.backends import cuda

    host = [a._a if isinstance(a, ndarray) else a for a in args]
    spec = cuda.KERNELS.get(self.name) or cuda.RawSpec(self.name, options=self.options, inline=self.body)
    read, written = spec.bytes_moved(host)
    _active.add("kernel", self.name, spec.flops_of(host), read, written, _shapes(*host), math.prod(grid))
    self.compile()
    if _active.verify:
        _original(_kernels.RawKernel, "__call__")(self, grid, block, args, shared_mem=shared_mem,
                                                  enable_cooperative_groups=enable_cooperative_groups)


# ---------------------------------------------------------------------------------------------
# cuBLAS's own calls

def _gemm_args(name, args):
    """((transa, transb, m, n, k, lda, ldb, ldc, beta, count), (A's and B's dtype, C's, the scalars')) of a
    cuBLAS GEMM's arguments (the signatures in cupy_backends/cuda/libs/cublas.py)."""
    count = 1
    if name == "gemmEx":
        transa, transb, m, n, k, _, _, at, lda, _, bt, ldb, beta, _, ct, ldc, compute, _ = args
    elif name == "gemmStridedBatchedEx":
        transa, transb, m, n, k, _, _, at, lda, _, _, bt, ldb, _, beta, _, ct, ldc, _, count, compute, _ = args
    elif name.endswith("Batched"):
        transa, transb, m, n, k, _, _, lda, _, _, ldb, _, beta, _, ldc, _, count = args
    else:
        transa, transb, m, n, k, _, _, lda, _, ldb, beta, _, ldc = args
    if name.endswith("Ex"):
        dtypes = cublas._ex_dtypes(at, bt, ct, compute)
    else:
        dtypes = (np.dtype(np.float32 if name[0] == "s" else np.float64),) * 3
    return (transa, transb, m, n, k, lda, ldb, ldc, beta, count), dtypes


def _cublas_rule(name):
    """sgemm/dgemm/sgemv/dgemv and gemmEx recorded from their arguments (checked as cuBLAS checks them): A and
    B (or x) read at their type's size, C (or y) written at its own, and read when beta is not 0."""
    def rule(handle, *args):
        if "gemm" in name:
            (transa, transb, m, n, k, lda, ldb, ldc, beta, count), (operand, output, scale) = _gemm_args(name, args)
            a, b = cublas.gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc)
            lds = ((lda, operand), (ldb, operand), (ldc, output))
            flops, read = 2 * m * n * k * count, count * operand.itemsize * (a[0] * a[1] + b[0] * b[1])
            out, shape = count * output.itemsize * m * n, ((count, m, n) if "Batched" in name else (m, n))
        else:
            trans, m, n, _, _, lda, _, incx, beta, _, incy = args
            nx, ny = cublas.gemv_shapes(trans, m, n, lda, incx, incy)
            scale = np.dtype(np.float32 if name[0] == "s" else np.float64)
            lds, flops, read, out, shape = ((lda, scale),), 2 * m * n, scale.itemsize * (m * n + nx), \
                scale.itemsize * ny, (ny,)
        aligned = all(ld * dtype.itemsize % 16 == 0 for ld, dtype in lds)
        _active.add("gemm", f"cublas {name}" + ("" if aligned else " (unaligned)"), flops,
                    read + (out if cublas.host_scalar(beta, scale) != 0 else 0), out, [shape])  # [C's shape]: its tiles
        if _active.verify:
            _original(cublas, name)(handle, *args)

    return rule
