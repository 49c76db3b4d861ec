"""The recording mode's rules: for each NumPy function, ufunc and array method the CuPy code calls, the
launches CuPy 14.2 makes for it, as Ops of the recorder `rec` (cupy/_record.py), and its outputs,
allocated without being touched. A rule is rule(rec, name, fn, self_, args, kwargs) over the NumPy
arrays behind the device arrays; `_rule(fn)` finds the one for a callable. The kinds of Op:

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
                  (cupy_backends/cuda/libs/cublas.py computes them)
    kernel        an ElementwiseKernel (every array argument read or written once) or a RawKernel (the
                  traffic its minitensor.backends.cuda spec declares, `RawSpec.bytes_moved`, and the
                  FLOPs of its inner products where it declares them, `RawSpec.flops_of`)
    h2d, d2h      copies between host and device (not launches); a read gives ones: values are not tracked;
                  `cupy.asarray`/`cupy.array` of host data without blocking is "h2d_async" (CuPy stages it
                  in pinned memory and copies it on the current stream)
"""

import math

import numpy as np

from cupy import standin


def _nbytes(a):
    return a.nbytes if isinstance(a, np.ndarray) else 0


def _shapes(*arrays):
    return [tuple(a.shape) for a in arrays if isinstance(a, np.ndarray)]


def _rule(fn):
    """(rule, name, the array a bound method belongs to) for a NumPy callable."""
    if fn is standin.skipped_gemm or fn is standin.bf16_matmul:
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
                              f"add one in minitensor/checks/cupy_standin/cupy/_rules.py")


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
    if batched and standin.is_bf16(a, b):
        standin.bf16_matmul(a, b)  # refused, as when computing
    _gemm_operand_copies(rec, a, b, a2, b2, batch, batched)
    result = out if out is not None else np.empty(shape, dtype)
    aligned = all(_leading(x) * dtype.itemsize % 16 == 0 for x in (a2, b2) + ((result,) if result.ndim > 1 else ()))
    name = ("matmul (batched)" if batched else "matmul") + ("" if aligned else " (unaligned)")
    rec.add("gemm", name, 2 * math.prod(batch) * M * N * K,
            a.nbytes + b.nbytes, math.prod(shape) * dtype.itemsize, _shapes(a, b, result))
    if out is not None and (not out.flags.c_contiguous or out.dtype != dtype or np.may_share_memory(out, a)
                            or np.may_share_memory(out, b)):
        _copy(rec, "copy (matmul output)", out, out)
    return result


def _gemm_operand_copies(rec, a, b, a2, b2, batch, batched):
    """What CuPy does to the operands before the GEMM: a copy of each that cuBLAS cannot take as it is
    (a 2-D one neither C- nor F-contiguous, a batched one not C-contiguous), and the pointer arrays of
    a broadcast batched GEMM (_mat_ptrs)."""
    for x in (a, b):
        if x.ndim > 1 and not (x.flags.c_contiguous or (not batched and x.flags.f_contiguous)):
            _copy(rec, "copy (matmul operand)", x, x)
    if batched and (a2.shape[:-2] != batch or b2.shape[:-2] != batch):
        for _ in range(3):
            rec.add("elementwise", "cupy_mat_ptrs", math.prod(batch), 0, 8 * math.prod(batch))


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
