"""The stand-in's user kernels: the project's CUDA source, run on the CPU.

ElementwiseKernel: the operation is compiled as C++ (g++) inside the loop CuPy generates around
it, `for (ptrdiff_t i = 0; i < n; ++i)`, with each non-raw parameter bound by reference to its
element (`const T &x = _raw_x[i]`, `T &y = _raw_y[i]`, as CuPy 14.2 binds them: an output that is
also an input is one buffer), raw parameters as pointers to their C-order elements, scalars as
constants of their C type. Each (operation, types) is built once; the programs are kept under the
system's temporary folder by the hash of their text, so later processes reuse them.

RawKernel: minitensor's own launch emulation (`minitensor.kernelcheck.emulate_launch`: the CUDA
code as C++, a fiber per CUDA thread), for the kernels written against the type name `T`
(`typedef <type> T;` first, as minitensor.cuda.RawSpec.source writes them).
"""

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from cupy import standin
from cupy._array import _unsupported, ndarray

C_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "uint32": "unsigned int",
           "bool": "bool", "int8": "signed char", "uint8": "unsigned char"}

_PRELUDE = """#include <math.h>  /* C++: the float overloads too, as CUDA's math has them */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
template <class U> U rsqrt(U v) { return U(1) / sqrt(v); }
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
        self.dtype = np.dtype(self.type) if self.type in C_TYPES else None


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
        n = int(np.prod(shape, dtype=np.int64))
        # each array argument: -1 and its data, or the index of an earlier argument with the same buffer
        blob, host, alias = [np.int64(n).tobytes()], {}, {}
        for k, (p, a) in enumerate(zip(params, args)):
            dtype = self._dtype(p, types)
            if not isinstance(a, ndarray):  # a scalar, cast to its C type as CuPy casts it
                blob.append(np.asarray(a).astype(dtype).tobytes())
                continue
            host[k] = a._a if p.raw else np.broadcast_to(a._a, shape)
            alias[k] = next((j for j in host if j < k and _same(host[j], host[k])), -1)
            blob.append(np.int64(alias[k]).tobytes())
            if alias[k] < 0:
                data = np.ascontiguousarray(host[k], dtype=dtype)
                blob += [np.int64(data.size).tobytes(), data.tobytes()]
        program = self._program(params, [k in host for k in range(len(params))], types)
        standin.kernels.add(("elementwise", self.name, ",".join(t.name for t in types.values())))
        ran = subprocess.run([_build(program, self.name)], input=b"".join(blob), capture_output=True, check=False)
        if ran.returncode:
            raise RuntimeError(f"{self.name}: the host run failed (exit {ran.returncode}): "
                               f"{ran.stderr.decode()[-500:]}")
        offset = 0  # the program wrote each output's buffer, in parameter order
        for k in range(n_in, len(params)):
            dtype = self._dtype(params[k], types)
            args[k]._a[...] = np.frombuffer(ran.stdout, dtype, n, offset).reshape(shape)
            offset += n * dtype.itemsize
        outs = args[n_in:]
        return outs[0] if len(outs) == 1 and not self.return_tuple else outs

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
        """The C++ program for one set of argument kinds and types: reads n and the arguments from
        stdin, runs the operation for i = 0..n-1, writes the outputs' buffers to stdout."""
        head, loop, tail = ["long long n, alias, count;", "if (fread(&n, 8, 1, stdin) != 1) return 1;"], [], []
        for k, p in enumerate(params):
            c = C_TYPES[self._dtype(p, types).name]
            if not is_array[k]:
                head.append(f"{c} _s{k}; if (fread(&_s{k}, sizeof _s{k}, 1, stdin) != 1) return 1;")
                head.append(f"const {c} {p.name} = _s{k};")
                continue
            head.append(f"{c} *_p{k}; if (fread(&alias, 8, 1, stdin) != 1) return 1;\n"
                        f"if (alias >= 0) _p{k} = ({c} *)_all[alias]; else {{\n"
                        f"  if (fread(&count, 8, 1, stdin) != 1) return 1;\n"
                        f"  _p{k} = ({c} *)malloc(count * sizeof({c}) + 1);\n"
                        f"  if (fread(_p{k}, sizeof({c}), count, stdin) != (size_t)count) return 1;\n}}\n"
                        f"_all[{k}] = _p{k};")
            if p.raw:
                head.append(f"{'' if p in self.out_params else 'const '}{c} *{p.name} = _p{k};")
            elif p in self.out_params:
                loop.append(f"{c} &{p.name} = _p{k}[i];")
                tail.append(f"fwrite(_p{k}, sizeof({c}), n, stdout);")
            else:
                loop.append(f"const {c} &{p.name} = _p{k}[i];")
        typedefs = "".join(f"typedef {C_TYPES[t.name]} {name};\n" for name, t in types.items())
        return "\n".join([_PRELUDE + typedefs + self.preamble, "int main() {",
                          f"void *_all[{len(params)}] = {{0}};", *head,
                          "for (ptrdiff_t i = 0; i < n; ++i) {", *loop, self.operation + ";", "}", *tail,
                          "return 0;", "}", ""])

    def __repr__(self):
        return f"<ElementwiseKernel {self.name} (stand-in)>"


def _same(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _build(program, name):
    """The executable of a program, compiled once and kept by the hash of its text."""
    folder = os.path.join(tempfile.gettempdir(), f"cupy-standin-{os.getuid()}")
    exe = os.path.join(folder, f"{name}-{hashlib.sha256(program.encode()).hexdigest()[:20]}")
    if os.path.exists(exe):
        return exe
    os.makedirs(folder, exist_ok=True)
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("the CuPy stand-in runs kernels as C++: install g++ or set CXX")
    work = tempfile.mkdtemp(dir=folder)
    try:
        with open(os.path.join(work, "k.cpp"), "w") as f:
            f.write(program)
        built = subprocess.run([cxx, "-O1", "-std=c++17", "k.cpp", "-o", "k"], cwd=work, capture_output=True,
                               text=True, check=False)
        if built.returncode:
            raise RuntimeError(f"{name}: does not compile as C++:\n{built.stderr[-2000:]}\n{program}")
        os.replace(os.path.join(work, "k"), exe)  # atomic: a process running at the same time sees all or none
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exe


class RawKernel:
    """A RawKernel through minitensor's launch emulation (see the module docstring)."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, jitify=False):
        self.code, self.name, self.options = code, name, tuple(options)
        found = re.match(r"typedef (.+?) T;\n", code)
        self.dtype = np.dtype(ctype_dtype(found.group(1))) if found else np.dtype(np.float32)
        self.body = code[found.end():] if found else code

    def compile(self, log_stream=None):
        standin.kernels.add(("raw", self.name, self.dtype.name))

    def __call__(self, grid, block, args, *, shared_mem=0, enable_cooperative_groups=False):
        from minitensor import cuda, kernelcheck

        host = []
        for a in args:
            if isinstance(a, np.ndarray):
                raise _unsupported(a)
            host.append(a._a if isinstance(a, ndarray) else a)
        self.compile()
        kernelcheck.emulate_launch(cuda.RawSpec(self.name, self.body, self.options), self.dtype, tuple(grid),
                                   tuple(block), host)


def ctype_dtype(c):
    return {v: k for k, v in C_TYPES.items()}[c]
