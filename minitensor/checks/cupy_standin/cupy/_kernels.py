"""The stand-in's user kernels: the project's CUDA source, run on the CPU.

ElementwiseKernel: the operation is compiled as C++ (g++) inside the loop CuPy generates around
it, `for (ptrdiff_t i = 0; i < n; ++i)`, with each non-raw parameter bound by reference to its
element (`const T &x = _raw_x[i]`, `T &y = _raw_y[i]`, as CuPy 14.2 binds them: an output that is
also an input is one buffer), raw parameters as pointers to their C-order elements, scalars as
constants of their C type. A bfloat16 array is typed as CuPy 14.2 types it, `bfloat16`, its own class
(cupy/_core/_scalar.pyx at v14.2.0, lines 276-289; cupy/bfloat16.cuh), here a host class with the
same conversions: made from a float by rounding to nearest even, read as a float, and any other
assignment through an explicit conversion (so `y = narrow_bf16(v)` stores the number of the bits, as
it would on the GPU: a kernel writes bits through a uint16 view, `a.view(cupy.uint16)`, an
`unsigned short` in both). A fixed-type output must be an array of that type (CuPy's 'Type is
mismatched'). bf16.cuh's widen / narrow_bf16 build on the host (its CUDA intrinsics are defined
here). Each (operation, types) is built once, as a shared library called in this process (ctypes)
on copies of the arguments; the libraries are kept under the system's temporary folder by the hash
of their text, so later processes reuse them.

RawKernel: minitensor's own launch emulation (minitensor.checks.kernelcheck's: the CUDA code as C++, a
fiber per CUDA thread), for the kernels written against the type name `T` (`typedef <type> T;`
first, as minitensor.backends.cuda.RawSpec.source writes them: `unsigned short` for bfloat16, whose
arrays it takes), built the same way, one library per kernel and dtype. A kernel that crashed
would take the process with it (a test run sees which test).
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from math import prod

import numpy as np

from cupy import standin
from cupy._array import _unsupported, ndarray

from minitensor import precision

# a kernel's C type of each dtype: the float types the policy's (bfloat16: its 16 bits), then the others
C_TYPES = {**precision.C_TYPES, "int32": "int", "int64": "long long", "uint32": "unsigned int", "bool": "bool",
           "int8": "signed char", "uint8": "unsigned char", "uint16": "unsigned short"}
# an ElementwiseKernel's: CuPy's own class for bfloat16 (the module's docstring)
ELEMENTWISE_TYPES = {**C_TYPES, precision.BF16: "bfloat16"}

_PRELUDE = """#include <math.h>  /* C++: the float overloads too, as CUDA's math has them */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
template <class U> U rsqrt(U v) { return U(1) / sqrt(v); }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, sizeof f); return f; }
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, sizeof u); return u; }
"""

# CuPy 14.2's bfloat16 class (cupy/bfloat16.cuh) on the host: the conversions it has, and no others
_BF16_CLASS = """class bfloat16 {
  unsigned short bits_;
  static unsigned short round_(float f) {  /* to nearest, ties to even; a NaN: the quiet NaN of its sign */
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
 public:
  bfloat16() : bits_(0) {}
  bfloat16(float v) : bits_(round_(v)) {}
  explicit bfloat16(bool v) : bits_(round_(float(v))) {}
  explicit bfloat16(double v) : bits_(round_(float(v))) {}
  explicit bfloat16(int v) : bits_(round_(float(v))) {}
  explicit bfloat16(unsigned int v) : bits_(round_(float(v))) {}
  explicit bfloat16(long long v) : bits_(round_(float(v))) {}
  explicit bfloat16(unsigned long long v) : bits_(round_(float(v))) {}
  operator float() const { return __uint_as_float(((unsigned)bits_) << 16); }
  bfloat16 &operator=(const bfloat16 &) = default;
  template <typename U> bfloat16 &operator=(const U &rhs) { *this = static_cast<bfloat16>(rhs); return *this; }
  unsigned short to_bits() const { return bits_; }
  static bfloat16 from_bits(unsigned short v) { bfloat16 h; h.bits_ = v; return h; }
};
"""


class _Param:
    """One parameter of an ElementwiseKernel: '[raw] type name'."""

    def __init__(self, text):
        words = text.split()
        self.raw = words[0] == "raw"
        if self.raw:
            words = words[1:]
        if len(words) != 2:
            raise ValueError(f"cannot parse the kernel parameter {text!r}")
        self.type, self.name = words
        # a NumPy type name, or a type placeholder (T) decided by the arguments
        self.dtype = (precision.dtype_of(self.type) if self.type == precision.BF16 else np.dtype(self.type)
                      if self.type in C_TYPES else None)


def _params(text):
    return [_Param(p) for p in text.split(",") if p.strip()]


class ElementwiseKernel:
    """cupy.ElementwiseKernel with its operation run as C++ on the host (see the module docstring)."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True, preamble="",
                 no_return=False, return_tuple=False, loop_prep="", after_loop="", options=(), **kwargs):
        if loop_prep or after_loop:
            raise NotImplementedError("the stand-in runs ElementwiseKernels without loop_prep or after_loop")
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        if any(p.raw for p in self.out_params):
            raise NotImplementedError("the stand-in has no raw output parameters")
        self.operation, self.name, self.preamble, self.options = operation, name, preamble, tuple(options)
        self.return_tuple = return_tuple

    def __call__(self, *args, size=None, block_size=None, stream=None):
        n_in = len(self.in_params)
        if len(args) not in (n_in, n_in + len(self.out_params)):
            raise TypeError(f"{self.name}: takes {n_in} or {n_in + len(self.out_params)} arguments, got {len(args)}")
        for a in args:
            if isinstance(a, np.ndarray):
                raise _unsupported(a)
        params = self.in_params + self.out_params
        types = self._types(args)
        shape = np.broadcast_shapes(*(a.shape for p, a in zip(params, args) if isinstance(a, ndarray) and not p.raw))
        if len(args) == n_in:
            args += tuple(ndarray._of(np.empty(shape, self._dtype(p, types))) for p in self.out_params)
        for p, o in zip(self.out_params, args[n_in:]):
            if not isinstance(o, ndarray) or o.shape != shape:
                raise ValueError(f"{self.name}: output {p.name} must be a device array of shape {shape}")
            if p.dtype is not None and o.dtype != p.dtype:
                raise TypeError(f"Type is mismatched. {p.name} {o.dtype} {p.dtype}")
        n = int(np.prod(shape, dtype=np.int64))
        host, buffers = self._buffers(params, args, types, shape)
        program = self._program(params, [k in host for k in range(len(params))], types)
        standin.kernels.add(("elementwise", self.name, ",".join(t.name for t in types.values())))
        _call(_build(program, self.name), ctypes.c_longlong(n), buffers)
        for k in range(n_in, len(params)):  # the outputs, in parameter order
            args[k]._a[...] = buffers[k].reshape(shape)
        outs = args[n_in:]
        return outs[0] if len(outs) == 1 and not self.return_tuple else outs

    def _buffers(self, params, args, types, shape):
        """({k: argument k's array as the kernel sees it}, a C-ordered copy of each argument): a scalar
        as a one-element array of its C type; an argument with the same buffer as an earlier one is
        that one's copy."""
        host, buffers = {}, []
        for k, (p, a) in enumerate(zip(params, args)):
            dtype = self._dtype(p, types)
            if not isinstance(a, ndarray):  # a scalar, cast to its C type as CuPy casts it
                buffers.append(np.asarray(a).astype(dtype).reshape(1))
                continue
            host[k] = a._a if p.raw else np.broadcast_to(a._a, shape)
            alias = next((j for j in host if j < k and _same(host[j], host[k])), -1)
            buffers.append(buffers[alias] if alias >= 0 else np.array(host[k], dtype=dtype, order="C"))
        return host, buffers

    @staticmethod
    def _dtype(p, types):
        return types[p.type] if p.dtype is None else p.dtype

    def _types(self, args):
        """placeholder -> dtype: from the device arrays bound to it (and NumPy scalars, which must
        agree, as CuPy's 'Type is mismatched' says); Python scalars take the placeholder's type."""
        types = {}
        for p, a in zip(self.in_params + self.out_params, args):
            if p.dtype is None and isinstance(a, ndarray | np.generic):
                if p.type in types and types[p.type] != a.dtype:
                    raise TypeError(f"Type is mismatched. {p.name} {p.type} {types[p.type]} {a.dtype}")
                types[p.type] = a.dtype
        for p in self.in_params + self.out_params:
            if p.dtype is None and p.type not in types:
                raise TypeError(f"{self.name}: cannot decide the type {p.type} of {p.name} from the arguments")
        return types

    def _program(self, params, is_array, types):
        """The C++ library for one set of argument kinds and types: `run(n, args)` runs the
        operation for i = 0..n-1 over the argument buffers args[k] (a scalar's: one element)."""
        head, loop = [], []
        for k, p in enumerate(params):
            c = ELEMENTWISE_TYPES[self._dtype(p, types).name]
            const = "" if p in self.out_params else "const "
            if not is_array[k]:
                head.append(f"const {c} {p.name} = *(const {c} *)_all[{k}];")
            elif p.raw:
                head.append(f"{const}{c} *{p.name} = ({c} *)_all[{k}];")
            else:
                head.append(f"{c} *_p{k} = ({c} *)_all[{k}];")
                loop.append(f"{const}{c} &{p.name} = _p{k}[i];")
        typedefs = "".join(f"typedef {ELEMENTWISE_TYPES[t.name]} {name};\n" for name, t in types.items())
        bf16 = any(self._dtype(p, types).name == precision.BF16 for p in params)
        return "\n".join([_PRELUDE + (_BF16_CLASS if bf16 else "") + typedefs + self.preamble,
                          'extern "C" int run(long long n, void **_all) {',
                          *head, "for (ptrdiff_t i = 0; i < n; ++i) {", *loop, self.operation + ";", "}",
                          "return 0;", "}", ""])

    def __repr__(self):
        return f"<ElementwiseKernel {self.name} (stand-in)>"


def _same(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _build(program, name):
    """The shared library of a program, compiled once and kept by the hash of its text."""
    folder = os.path.join(tempfile.gettempdir(), f"cupy-standin-{os.getuid()}")
    lib = os.path.join(folder, f"{name}-{hashlib.sha256(program.encode()).hexdigest()[:20]}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(folder, exist_ok=True)
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("the CuPy stand-in runs kernels as C++: install g++ or set CXX")
    work = tempfile.mkdtemp(dir=folder)
    try:
        with open(os.path.join(work, "k.cpp"), "w") as f:
            f.write(program)
        # without _FORTIFY_SOURCE: its checked longjmp refuses the jumps between the emulation's fibers
        built = subprocess.run([cxx, "-O1", "-std=c++17", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "k.cpp",
                                "-o", "k.so"], cwd=work, capture_output=True, text=True, check=False)
        if built.returncode:
            raise RuntimeError(f"{name}: does not compile as C++:\n{built.stderr[-2000:]}\n{program}")
        os.replace(os.path.join(work, "k.so"), lib)  # atomic: a process running at the same time sees all or none
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


_loaded = {}


def _call(lib, first, buffers):
    """run(first, pointers to the buffers) of a library from _build, loaded once per process."""
    if lib not in _loaded:
        _loaded[lib] = ctypes.CDLL(lib).run
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*[b.ctypes.data for b in buffers])
    if _loaded[lib](first, pointers):
        raise RuntimeError(f"{os.path.basename(lib)}: the host run failed")


class RawKernel:
    """A RawKernel through minitensor's launch emulation (see the module docstring)."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False, expression=None):
        # expression: a template instance's C++ name (RawModule.get_function), NAME<64, 1>; name is NAME
        self.code, self.name, self.options = code, name, tuple(options)
        self.expression = expression or name
        # a template's explicit instantiations left out: the emulation instantiates the one it calls
        code = "".join(line for line in code.splitlines(keepends=True) if not line.startswith("template __global__"))
        found = re.match(r"typedef (.+?) T;\n(?:typedef .+? ACC;\n)?", code)  # the type names RawSpec.source writes
        self.dtype = precision.dtype_of(ctype_dtype(found.group(1))) if found else np.dtype(np.float32)
        self.body = code[found.end():] if found else code

    def compile(self, log_stream=None):
        standin.kernels.add(("raw", self.name, self.dtype.name))

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        from minitensor.backends import cuda

        host = []
        for a in args:
            if isinstance(a, np.ndarray):
                raise _unsupported(a)
            host.append(a._a if isinstance(a, ndarray) else a)
        self.compile()
        spec = cuda.RawSpec(self.name, options=self.options, inline=self.body)
        cuda.check_launch_args(spec, self.dtype, host)
        dims = np.array([*grid, 1, 1][:3] + [*block, 1, 1][:3], np.uint32)
        if prod(dims[3:]) > 1024 or dims[3] % 32:
            raise ValueError(f"{self.name}: a block of {dims[3:]} threads: at most 1024, x a multiple of 32")
        buffers, owned = _launch_buffers(self.name, cuda.raw_params(spec), host)
        _call(_build(_emulation(spec, self.dtype, self.expression), self.name), dims.ctypes.data_as(ctypes.c_void_p),
              buffers)
        for a, b in owned:  # the arrays updated in place, as on the GPU
            a.reshape(-1)[...] = b


class RawModule:
    """A module of template kernels (`name_expressions`): get_function(expression) is a RawKernel that runs
    the instance `NAME<...>` through the launch emulation, recorded under NAME."""

    def __init__(self, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise NotImplementedError("the stand-in's RawModule takes code, not a path")
        self.code, self.options, self.name_expressions = code, tuple(options), tuple(name_expressions or ())

    def compile(self, log_stream=None):
        for name in self.name_expressions:
            self.get_function(name).compile()

    def get_function(self, name):
        if name not in self.name_expressions:
            raise KeyError(f"{name!r} is not one of the module's name_expressions {self.name_expressions}")
        return RawKernel(self.code, name.split("<")[0].strip(), self.options, expression=name)


def _launch_buffers(name, params, host):
    """A copy of each argument (a scalar: one element of its C type); an array passed twice is one
    buffer, as on the GPU, and arrays that partly overlap are refused. Returns (buffers, [(array,
    its buffer)])."""
    buffers, owned, slots = [], [], {}
    for k, ((_, _, pointer), a) in enumerate(zip(params, host)):
        if not pointer:
            buffers.append(np.asarray(a).reshape(1))
            continue
        key = (a.__array_interface__["data"][0], a.nbytes)
        if key not in slots and any(np.may_share_memory(a, b) for b, _ in owned):
            raise ValueError(f"{name}: argument {k} partly overlaps another one")
        if key not in slots:
            slots[key] = np.array(a, order="C").reshape(-1)
            owned.append((a, slots[key]))
        buffers.append(slots[key])
    return buffers, owned


def _emulation(spec, dtype, expression=None):
    """The C++ library of one RawKernel's launch emulation for one dtype: run(d, args) launches it
    over grid d[0..2] and block d[3..5] on the argument buffers."""
    from minitensor.backends import cuda
    from minitensor.checks import emulation

    call = [f"({base} *)a[{k}]" if pointer else f"*(const {base} *)a[{k}]"
            for k, (_, base, pointer) in enumerate(cuda.raw_params(spec))]
    return "\n".join([emulation.PLAIN_PRELUDE, cuda.type_names(dtype), "namespace k {", spec.code, "}",
                      'extern "C" int run(const unsigned *d, void **a) {',
                      "  launch(dim3{d[0], d[1], d[2]}, dim3{d[3], d[4], d[5]}, [&] {",
                      f"    k::{expression or spec.name}({', '.join(call)});", "  });",
                      "  return 0;", "}", ""])


def ctype_dtype(c):
    """The dtype of a kernel's `typedef <c> T;`: a float type of the policy's (unsigned short: bfloat16)."""
    return {v: k for k, v in precision.C_TYPES.items()}[c]
