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
makes for it, with the bytes that launch reads and writes:

    elementwise   a ufunc (with `out=`, in place), `where`, `arange`: its array inputs read, outputs written
    reduction     sum, mean, max, ..., `ufunc.reduce`, a 1-D `dot`: the input read, the result written
    gemm          matmul, `@`, 2-D `dot`, `tensordot`: 2 M N K FLOPs per matrix, operands read, result written;
                  as CuPy does it (cupy/_core/_routines_linalg.pyx): a 2-D operand neither C- nor F-contiguous
                  is copied first, a batched operand that is not C-contiguous is copied first, and an `out`
                  that is not C-contiguous (or overlaps an operand) is written through a temporary and a copy;
                  named "(unaligned)" when a leading dimension is not a multiple of 16 bytes
    copy          `copy`, `astype`, `ascontiguousarray` and a reshape that cannot be a view, `a[...] = b`
    fill          `fill`, `zeros`, `ones`, `full`, `a[...] = 0`
    gather        indexing by an integer array; scatter: `ufunc.at` and assigning through one
    gemm          also cuBLAS's own sgemm/dgemm and their strided batched forms (2 m n k FLOPs a matrix; A and
                  B read, C written, and read when beta is not 0) and sgemv/dgemv (2 m n; A and x read, y
                  written, and read when beta is not 0), named "(unaligned)" likewise
                  (tests/support/cupy_standin/cupy_backends/cuda/libs/cublas.py computes them)
    kernel        an ElementwiseKernel (every array argument read or written once) or a RawKernel (the
                  traffic its minitensor.backends.cuda spec declares, `RawSpec.bytes_moved`, and the
                  FLOPs of its inner products where it declares them, `RawSpec.flops_of`)
    h2d, d2h      copies between host and device (not launches); a read gives ones: values are not tracked;
                  `cupy.asarray`/`cupy.array` of host data without blocking is "h2d_async" (CuPy stages it
                  in pinned memory and copies it on the current stream)

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
                                                              "dgemmStridedBatched"))]


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


def _nbytes(a):
    return a.nbytes if isinstance(a, np.ndarray) else 0


def _shapes(*arrays):
    return [tuple(a.shape) for a in arrays if isinstance(a, np.ndarray)]


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
# NumPy functions, ufuncs and array methods: _array.call

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


def _rule(fn):
    """(rule, name, the array a bound method belongs to) for a NumPy callable."""
    if fn is standin.skipped_gemm:
        return _matmul_rule, "matmul", None
    if isinstance(fn, np.ufunc):
        return (_matmul_rule if fn is np.matmul else _ufunc_rule), fn.__name__, None
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, np.ufunc):
        if fn.__name__ == "__call__":
            return _rule(owner)
        if fn.__name__ in ("reduce", "accumulate"):
            return _ufunc_reduce_rule, f"{owner.__name__}.{fn.__name__}", owner
    elif isinstance(owner, np.ndarray):
        if fn.__name__ in METHODS:
            return METHODS[fn.__name__], fn.__name__, owner
    elif getattr(fn, "__name__", None) in FUNCTIONS:
        return FUNCTIONS[fn.__name__], fn.__name__, None
    raise NotImplementedError(f"the stand-in's recording mode has no rule for {getattr(fn, '__name__', fn)!r}: "
                              f"add one in tests/support/cupy_standin/cupy/_record.py")


def _ufunc_rule(rec, name, u, _, args, kwargs):
    ins = args[:u.nin]
    outs = kwargs.get("out", args[u.nin:])
    outs = () if outs is None else outs if isinstance(outs, tuple) else (outs,)
    shape = np.broadcast_shapes(*(np.shape(a) for a in ins))
    with np.errstate(all="ignore"):
        probe = u(*(np.zeros((), a.dtype) if isinstance(a, np.ndarray) else a for a in ins),
                  **{k: v for k, v in kwargs.items() if k in ("dtype", "casting")})
    probe = probe if isinstance(probe, tuple) else (probe,)
    results = tuple(o if isinstance(o, np.ndarray) else np.empty(shape, np.asarray(p).dtype)
                    for o, p in zip(outs + (None,) * u.nout, probe))
    rec.add("elementwise", name, math.prod(shape), sum(map(_nbytes, ins)), sum(map(_nbytes, results)),
            _shapes(*ins, *results))
    return results if u.nout > 1 else results[0]


def _reduced(shape, axis, keepdims):
    axes = range(len(shape)) if axis is None else np.lib.array_utils.normalize_axis_tuple(axis, len(shape))
    return tuple(1 if i in axes else n for i, n in enumerate(shape) if keepdims or i not in axes)


def _reduce(rec, name, a, probe_fn, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
    """One reduction launch over a; probe_fn(small array, **kw) gives the result's dtype."""
    kw = {"axis": axis, "keepdims": keepdims, **({"dtype": dtype} if dtype is not None else {}), **kwargs}
    with np.errstate(all="ignore"):
        probe = np.asarray(probe_fn(np.ones((1,) * a.ndim, a.dtype), **kw))
    result = out if out is not None else np.empty(_reduced(a.shape, axis, keepdims), probe.dtype)
    rec.add("reduction", name, a.size, a.nbytes, result.nbytes, _shapes(a, result))
    return result


def _reduction_function(rec, name, fn, _, args, kwargs):
    return _reduce(rec, name, args[0], fn, *args[1:], **kwargs)


def _reduction_method(rec, name, fn, self_, args, kwargs):
    return _reduce(rec, name, self_, lambda small, **kw: getattr(small, name)(**kw), *args, **kwargs)


def _ufunc_reduce_rule(rec, name, fn, u, args, kwargs):
    method = fn.__name__
    if method == "accumulate":  # a scan: one launch, the input's shape out
        a = args[0]
        result = np.empty(a.shape, np.result_type(a.dtype, kwargs.get("dtype") or a.dtype))
        rec.add("reduction", name, a.size, a.nbytes, result.nbytes, _shapes(a))
        return result
    kwargs.setdefault("axis", args[1] if len(args) > 1 else 0)
    return _reduce(rec, name, args[0], lambda small, **kw: getattr(u, method)(small, **kw), **kwargs)


def _matmul_rule(rec, name, fn, _, args, kwargs):
    return _gemm(rec, args[0], args[1], kwargs.get("out"))


def _copy(rec, name, src, dst):
    rec.add("copy", name, 0, _nbytes(src), _nbytes(dst), _shapes(src, dst))
    return dst


def _gemm(rec, a, b, out=None):
    """A matmul as CuPy 14.2 runs it: operand copies, one cuBLAS call, a copy from a temporary."""
    if a.ndim == 1 and b.ndim == 1:
        result = out if out is not None else np.empty((), np.result_type(a, b))
        rec.add("reduction", "dot", 2 * a.size, a.nbytes + b.nbytes, result.nbytes, _shapes(a, b))
        return result
    a2 = a if a.ndim > 1 else a[None, :]
    b2 = b if b.ndim > 1 else b[:, None]
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    M, K, N = a2.shape[-2], a2.shape[-1], b2.shape[-1]
    shape = (*batch, *a.shape[-2:-1], *(b.shape[-1:] if b.ndim > 1 else ()))
    dtype = np.result_type(a, b)
    batched = max(a.ndim, b.ndim) > 2
    for x in (a, b):
        if x.ndim > 1 and not (x.flags.c_contiguous or (not batched and x.flags.f_contiguous)):
            _copy(rec, "copy (matmul operand)", x, x)
    if batched and (a2.shape[:-2] != batch or b2.shape[:-2] != batch):
        for _ in range(3):  # the pointer arrays of a broadcast batched GEMM (_mat_ptrs)
            rec.add("elementwise", "cupy_mat_ptrs", math.prod(batch), 0, 8 * math.prod(batch))
    result = out if out is not None else np.empty(shape, dtype)
    aligned = all(_leading(x) * dtype.itemsize % 16 == 0 for x in (a2, b2) + ((result,) if result.ndim > 1 else ()))
    name = ("matmul (batched)" if batched else "matmul") + ("" if aligned else " (unaligned)")
    rec.add("gemm", name, 2 * math.prod(batch) * M * N * K,
            a.nbytes + b.nbytes, math.prod(shape) * dtype.itemsize, _shapes(a, b, result))
    if out is not None and (not out.flags.c_contiguous or out.dtype != dtype or np.may_share_memory(out, a)
                            or np.may_share_memory(out, b)):
        _copy(rec, "copy (matmul output)", out, out)
    return result


def _leading(x):
    """The leading dimension cuBLAS is given for matrix x (after any copy CuPy makes): its row
    length, or its column length when only F-contiguous."""
    return x.shape[-2] if x.flags.f_contiguous and not x.flags.c_contiguous and x.ndim == 2 else x.shape[-1]


def _dot_rule(rec, name, fn, self_, args, kwargs):
    a, b = (self_, args[0]) if self_ is not None else args[:2]
    out = kwargs.get("out", args[2 - (self_ is not None)] if len(args) > 2 - (self_ is not None) else None)
    if max(a.ndim, b.ndim) > 2:
        raise NotImplementedError("recording: cupy.dot of arrays of more than 2 dimensions")
    return _gemm(rec, a, b, out)


def _tensordot_rule(rec, name, fn, _, args, kwargs):
    a, b = args[:2]
    axes = kwargs.get("axes", args[2] if len(args) > 2 else 2)
    a_axes, b_axes = ((list(range(a.ndim - axes, a.ndim)), list(range(axes))) if isinstance(axes, int) else axes)
    a_axes, b_axes = np.atleast_1d(a_axes) % a.ndim, np.atleast_1d(b_axes) % b.ndim
    K = math.prod(a.shape[i] for i in a_axes)
    free_a = [a.shape[i] for i in range(a.ndim) if i not in a_axes]
    free_b = [b.shape[i] for i in range(b.ndim) if i not in b_axes]
    result = np.empty((*free_a, *free_b), np.result_type(a, b))
    rec.add("gemm", "tensordot", 2 * math.prod(free_a) * math.prod(free_b) * K, a.nbytes + b.nbytes,
            result.nbytes, _shapes(a, b, result))
    return result


def _where_rule(rec, name, fn, _, args, kwargs):
    cond, x, y = args
    shape = np.broadcast_shapes(*(np.shape(v) for v in args))
    dtype = np.result_type(*(v.dtype if isinstance(v, np.ndarray) else v for v in (x, y)))
    result = np.empty(shape, dtype)
    rec.add("elementwise", "where", result.size, sum(map(_nbytes, args)), result.nbytes, _shapes(*args))
    return result


def _allocation(fill):
    def rule(rec, name, fn, _, args, kwargs):
        kw = {k: v for k, v in kwargs.items() if k in ("dtype", "order", "shape")}
        if name.endswith("_like"):
            result = np.empty_like(args[0], **kw)
        else:
            shape = args[0]
            dtype = kwargs.get("dtype", args[2] if name == "full" and len(args) > 2 else
                               args[1] if name != "full" and len(args) > 1 else None)
            if dtype is None:
                dtype = np.asarray(args[1]).dtype if name == "full" else np.float64
            result = np.empty(shape, dtype, order=kwargs.get("order", "C"))
        if fill:
            rec.add("fill", name, 0, 0, result.nbytes, _shapes(result))
        return result
    return rule


def _argsort_rule(rec, name, fn, _, args, kwargs):
    """A 1-D argsort: CuPy sorts (key, index) pairs with a radix sort, several passes over both; it is
    recorded as one launch that reads the keys and writes the indices, once per pass of 8 bits."""
    a = args[0]
    if a.ndim != 1:
        raise NotImplementedError("recording: argsort of more than one dimension")
    result = np.empty(a.shape, np.int64)
    passes = a.dtype.itemsize
    rec.add("sort", "argsort", 0, passes * (a.nbytes + result.nbytes), passes * (a.nbytes + result.nbytes),
            _shapes(a))
    return result


def _arange_rule(rec, name, fn, _, args, kwargs):
    probe = np.arange(*args, **kwargs)  # host-side: ranges here are small (an index per row at most)
    result = np.empty(probe.shape, probe.dtype)
    rec.add("elementwise", "arange", result.size, 0, result.nbytes, _shapes(result))
    return result


def _view_method(rec, name, fn, self_, args, kwargs):
    return fn(*args, **kwargs)  # views: NumPy computes nothing


def _view_function(rec, name, fn, _, args, kwargs):
    return fn(*args, **kwargs)


def _reshape_to(a, shape):
    """a reshaped to shape: a view where NumPy (and CuPy) can make one, else None."""
    if a.flags.c_contiguous:
        return a.reshape(shape)  # always a view
    view = a.view()
    try:
        view.shape = shape
    except AttributeError:  # "Incompatible shape for in-place modification": it needs a copy
        return None
    return view


def _reshape_method(rec, name, fn, self_, args, kwargs):
    shape = tuple(args[0]) if len(args) == 1 and not isinstance(args[0], int | np.integer) else args
    if kwargs.get("order", "C") != "C":
        raise NotImplementedError("recording: reshape with order other than 'C'")
    view = _reshape_to(self_, shape)
    if view is not None:
        return view
    known = math.prod(n for n in shape if n != -1)
    return _copy(rec, "copy (reshape)", self_, np.empty(tuple(self_.size // known if n == -1 else n for n in shape),
                                                        self_.dtype))


def _reshape_function(rec, name, fn, _, args, kwargs):
    return _reshape_method(rec, name, None, args[0], args[1:], kwargs)


def _ravel_method(rec, name, fn, self_, args, kwargs):
    return _reshape_method(rec, name, None, self_, ((-1,),), {})


def _copy_method(rec, name, fn, self_, args, kwargs):
    order = kwargs.get("order", args[0] if args else "C")
    return _copy(rec, "copy", self_, np.empty(self_.shape, self_.dtype, order="F" if order == "F" else "C"))


def _astype_method(rec, name, fn, self_, args, kwargs):
    dtype = np.dtype(args[0] if args else kwargs["dtype"])
    if not kwargs.get("copy", True) and dtype == self_.dtype:
        return self_
    return _copy(rec, "astype", self_, np.empty_like(self_, dtype=dtype))


def _fill_method(rec, name, fn, self_, args, kwargs):
    rec.add("fill", "fill", 0, 0, self_.nbytes, _shapes(self_))


def _copyto_rule(rec, name, fn, _, args, kwargs):
    _copy(rec, "copyto", args[1], args[0])


METHODS = {
    **{n: _reduction_method for n in ("sum", "mean", "max", "min", "prod", "any", "all", "argmax", "argmin")},
    **{n: _view_method for n in ("view", "transpose", "swapaxes", "squeeze")},
    "reshape": _reshape_method, "ravel": _ravel_method, "copy": _copy_method, "flatten": _copy_method,
    "astype": _astype_method, "fill": _fill_method, "dot": _dot_rule,
}

FUNCTIONS = {
    **{n: _reduction_function for n in ("sum", "mean", "max", "min", "amax", "amin", "prod", "any", "all",
                                        "argmax", "argmin")},
    **{n: _view_function for n in ("transpose", "swapaxes", "squeeze", "expand_dims", "broadcast_to",
                                   "moveaxis", "may_share_memory", "shares_memory", "result_type")},
    "empty": _allocation(False), "empty_like": _allocation(False),
    **{n: _allocation(True) for n in ("zeros", "zeros_like", "ones", "ones_like", "full", "full_like")},
    "arange": _arange_rule, "argsort": _argsort_rule, "where": _where_rule, "dot": _dot_rule,
    "tensordot": _tensordot_rule,
    "reshape": _reshape_function, "copyto": _copyto_rule,
}


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

def _cublas_rule(name):
    """sgemm/dgemm/sgemv/dgemv recorded from their arguments (checked as cuBLAS checks them)."""
    item = 4 if name[0] == "s" else 8

    def rule(handle, *args):
        if name.endswith("Batched"):
            transa, transb, m, n, k, alpha, A, lda, _, B, ldb, _, beta, C, ldc, _, count = args
            a, b = cublas.gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc)
            lds, flops = (lda, ldb, ldc), 2 * m * n * k * count
            read, out = count * item * (a[0] * a[1] + b[0] * b[1]), count * item * m * n
        elif name.endswith("gemm"):
            transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc = args
            a, b = cublas.gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc)
            lds, flops, read, out = (lda, ldb, ldc), 2 * m * n * k, item * (a[0] * a[1] + b[0] * b[1]), item * m * n
        else:
            trans, m, n, alpha, A, lda, x, incx, beta, y, incy = args
            nx, ny = cublas.gemv_shapes(trans, m, n, lda, incx, incy)
            lds, flops, read, out = (lda,), 2 * m * n, item * (m * n + nx), item * ny
        beta_value = cublas.host_scalar(beta, np.float32 if item == 4 else np.float64)
        aligned = all(ld * item % 16 == 0 for ld in lds)
        _active.add("gemm", f"cublas {name}" + ("" if aligned else " (unaligned)"), flops,
                    read + (out if beta_value != 0 else 0), out)
        if _active.verify:
            _original(cublas, name)(handle, *args)

    return rule
