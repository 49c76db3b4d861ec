"""The CUDA side of minitensor: the kernel registry, lazy CuPy builds, launches, and the switch.

The CUDA kernels live in minitensor/backends/kernels/, each piece's .cu beside the .py that declares
its specs, wrappers and record; each is run by a CupyOps method (minitensor/backends/cupy_ops.py: its
own, or one its record names) and checked against the Ops method it replaces. This module holds what
they share:

- the registry `KERNELS` (name -> spec). A spec holds what CuPy needs to build the kernel (built
  lazily, once) and can produce the exact source NVRTC compiles for a dtype, which makes two
  checks possible without a GPU (`python -m minitensor.checks --check | --host-check`, see
  minitensor/checks/kernelcheck.py). The kernels' modules fill it; `minitensor.backends.all_kernels()`
  imports them all (minitensor.backends.kernels.load) and returns it full.
- `launch`, which runs a RawKernel after checking each argument against its C type (CuPy would
  pass a Python int as 64 bits and a Python float as a double, silently), and the argument
  checks of the wrappers.
- the fused pieces' records `PIECES` (name -> FusedPiece: the Ops methods it replaces, each with
  the function that runs it with the kernels; its kernels; how to build its sample inputs),
  declared in minitensor/backends/kernels/NAME.py beside their wrappers, from which CupyOps takes
  its overriding methods and the start-up self-check (minitensor.backends.selection), the tests and
  gpu_check's kernel phase all run (`minitensor.backends.fused_pieces()` returns them all). The
  Ops code is the reference; a CupyOps runs the fused pieces it was built with (get_ops).
- the CUDA sources' loader: each kernel is the section `// @kernel NAME` of a .cu file under
  minitensor/backends/kernels/, read at its first use (`cu_code`).

The exact elementwise sources come from CuPy private APIs, so CuPy's minor version is
pinned by the `kernel-check` extra. Importing this module costs nothing: CuPy is imported only
by the functions that need it.
"""

import argparse
import dataclasses
import functools
import pathlib
import re
import types
from collections.abc import Callable, Mapping

import numpy as np

from minitensor import precision
from minitensor.device import array_module

INSTALL_HINT = "pip install -e '.[kernel-check]'  (CuPy 14.2 with NVRTC; no GPU needed)"
DTYPES = precision.FLOATS  # what every kernel is built for; a RawSpec with bf16 also for bfloat16 (`dtypes`)
ARCHS = ("sm_80", "sm_90")


# ---------------------------------------------------------------------------------------------
# The registry


@dataclasses.dataclass(frozen=True)
class ElementwiseSpec:
    """A `cupy.ElementwiseKernel`, described without CuPy.

    Its operation is the section `// @kernel <name>` of kernels/<file> (read at the first use); a
    spec made in a test may give it `inline` instead (with a file, the headers of its section of that
    name stay). A `#include "x.cuh"` at the section's top becomes its preamble.
    `reference(**inputs)` is the NumPy form the kernel must equal (one output array, or a tuple
    for several): the layer's generic code (GELU's, AdamW's update) on flat arrays as the kernel
    sees them, or, where a flat index stands for a row and a column, a few lines that gather by it
    (the cross-entropy's and the causal softmax's).
    `scalars` names the in-params passed as host scalars, each with a sample value for the host
    check; every other param is an array. Only the type placeholder `T`.
    """

    name: str
    in_params: str
    out_params: str
    file: str = ""  # the .cu file under minitensor/backends/kernels/ holding the operation
    reference: Callable = dataclasses.field(default=None, compare=False)
    options: tuple = ()
    scalars: tuple = ()  # ((name, sample value), ...)
    # ((name, fn), ...): fn maps the host check's samples of an input into its domain (v >= 0, ...)
    domains: tuple = dataclasses.field(default=(), compare=False)
    inline: str = ""  # the operation itself, for a kernel that has no file (a test's)
    # whether one of its outputs is a bfloat16 array's bits (`uint16`, the array's .view(uint16)): its
    # piece is then called with that bfloat16 argument, not sent to the generic code for it
    writes_bf16: bool = False

    @property
    def operation(self):
        return self.inline or cu_code(self.file, self.name)[1]

    @property
    def preamble(self):
        if self.inline:  # a changed operation keeps the headers of its file's section of that name, if any
            return _cu_file(self.file).get(self.name, ("",))[0] if self.file else ""
        return cu_code(self.file, self.name)[0]

    @property
    def dtypes(self):
        """The dtypes it is built for: float32 and float64 (CuPy's type machinery; no bfloat16)."""
        return precision.kernel_dtypes()

    def kernel(self, dtype=None):
        """The CuPy kernel; one object serves every dtype."""
        return _elementwise_kernel(self)

    def source(self, dtype):
        """The exact source CuPy hands NVRTC for contiguous arguments of `dtype`."""
        return _elementwise_source(self, np.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class RawSpec:
    """A `cupy.RawKernel` whose code is written against the type names `T`, what its arrays are stored
    in, and `ACC`, what it sums in (one build per dtype: `type_names`). `bf16`: the code keeps the two
    apart (loads through widen(), writes a T as to_stored<T>(v), sums in ACC: kernels/bf16.cuh), so it
    is also built for bfloat16 (T unsigned short, ACC float); `dtypes` lists what it is built for, as
    the precision policy says (minitensor.precision.kernel_dtypes).

    Its code is the section `// @kernel <name>` of kernels/<file> (read at the first use), the
    headers it `#include`s pasted in; a spec made in a test may give it `inline` instead.
    `traffic(**args) -> (bytes read, bytes written)`: what one launch with these arguments (named
    as the kernel's parameters) moves to and from device memory, for the step model
    (andrea/run/stepmodel.py); None: every `const` pointer read once, every other pointer written
    once (`bytes_moved`). `flops(**args)`: the floating-point operations of the inner products of one
    launch, declared by a kernel whose float32 products run on tensor cores; None: 0.

    What `python -m minitensor.checks --counts` (minitensor.checks.counts) reads: `model(sizes)` launches
    the kernel through its wrapper at the model's sizes (a Sizes; the launch is captured,
    not run); `count_blocks(grid, block, args) -> [(linear block index, weight), ...]` names the blocks
    the emulation runs to count a launch, each standing for `weight` blocks of the grid (None: every
    block does the same work but the last); `conflicts` is the largest shared-memory conflict degree one
    of its requests may have there (1: none).

    A kernel specialised at compile time is a function template, `template <int A, int B> __global__ void
    NAME(...)`, whose template arguments are the values of some of its own parameters: `template` names
    them in order (("hs", "tf32"): NAME<hs, tf32>), `instances(dtype)` lists the tuples of values it is
    compiled for. `source(dtype)` then ends with the explicit instantiation of each (one translation unit
    that nvcc or NVRTC compiles exactly as it runs), a launch runs the instance its arguments name
    (`instance_of`), taken from the module that source builds (every instance, one compile).
    `warps_per_sm`: the warps per SM its registers and shared memory must let an SM hold (0: none
    declared), which `--counts` checks on the sm_90 code (minitensor.checks.sass)."""

    name: str
    file: str = ""  # the .cu file under minitensor/backends/kernels/ holding the kernel
    options: tuple = ()
    traffic: Callable = dataclasses.field(default=None, compare=False)
    inline: str = ""  # the code itself, for a kernel that has no file (a test's)
    flops: Callable = dataclasses.field(default=None, compare=False)
    model: Callable = dataclasses.field(default=None, compare=False)
    count_blocks: Callable = dataclasses.field(default=None, compare=False)
    conflicts: int = dataclasses.field(default=1, compare=False)
    template: tuple = ()
    instances: Callable = dataclasses.field(default=None, compare=False)
    warps_per_sm: int = dataclasses.field(default=0, compare=False)
    bf16: bool = False

    @property
    def dtypes(self):
        built = precision.kernel_dtypes(self.bf16)
        if not self.template:
            return built
        return tuple(d for d in built if self.instances_of(precision.dtype_of(d)))  # those it has instances in

    @property
    def code(self):
        if self.inline:
            return self.inline
        headers, body = cu_code(self.file, self.name)
        return f"{headers}\n{body}\n"

    def kernel(self, dtype, instance=()):
        return _raw_kernel(self, np.dtype(dtype), tuple(instance))

    def bytes_moved(self, args):
        """(bytes read, bytes written) of a launch with args (arrays with .nbytes, scalars)."""
        params = raw_params(self)
        if self.traffic is not None:
            return self.traffic(**{name: a for (name, _, _), a in zip(params, args)})
        signature = signature_of(self.code, self.name)
        const = {p.split("*")[-1].strip() for p in signature.split(",") if "const" in p and "*" in p}
        read = sum(a.nbytes for (name, _, ptr), a in zip(params, args) if ptr and name in const)
        written = sum(a.nbytes for (name, _, ptr), a in zip(params, args) if ptr and name not in const)
        return read, written

    def flops_of(self, args):
        """The floating-point operations of a launch with args (0 where the spec declares none)."""
        if self.flops is None:
            return 0
        return self.flops(**{name: a for (name, _, _), a in zip(raw_params(self), args)})

    def instance_of(self, args):
        """The template arguments a launch with args runs (() for a kernel that is no template)."""
        names = [name for name, _, _ in raw_params(self)]
        return tuple(int(args[names.index(t)]) for t in self.template)

    def instances_of(self, dtype):
        """The template argument tuples the kernel is compiled for in dtype (((),) for a plain kernel in the
        dtypes it is built in, `dtypes`; none in another)."""
        if not self.template:
            return ((),) if precision.name_of(dtype) in self.dtypes else ()
        return tuple(tuple(int(v) for v in i) for i in self.instances(np.dtype(dtype)))

    def expression(self, instance=()):
        """The C++ name of one instance, `NAME<64, 1>` (NAME itself for a plain kernel)."""
        return f"{self.name}<{', '.join(map(str, instance))}>" if self.template else self.name

    def source(self, dtype, instances=None):
        """The translation unit NVRTC compiles for dtype: `typedef ... T; typedef ... ACC;` (type_names), the
        code, and for a template the explicit instantiation of each of `instances` (None: every one it is
        compiled for)."""
        text = f"{type_names(dtype)}\n{self.code}"
        if not self.template:
            return text
        params = " ".join(signature_of(self.code, self.name).split())  # one line per instantiation
        chosen = self.instances_of(dtype) if instances is None else instances
        return text + "".join(f"template __global__ void {self.expression(i)}({params});\n" for i in chosen)


def type_names(dtype):
    """A RawKernel's type names for dtype, as the precision policy says: `T` the C type its arrays are
    stored in, `ACC` the one it sums in (float for bfloat16; T itself for float32 and float64)."""
    return f"typedef {precision.c_type(dtype)} T;\ntypedef {precision.c_type(precision.accumulate_of(dtype))} ACC;"


# ---------------------------------------------------------------------------------------------
# The CUDA sources: .cu files under kernels/, read at the first use

KERNEL_DIR = pathlib.Path(__file__).with_name("kernels")
MARK = "// @kernel "


def cu_code(file, name):
    """(headers, body) of the section `// @kernel <name>` of kernels/<file>: the section runs to the
    next such line; its opening // comment lines are the reader's; each `#include "x.cuh"` after
    them is that header's text (its opening comment dropped) for the headers, "\n" around each;
    the rest, blank lines trimmed, is the body (a RawKernel's code, an ElementwiseKernel's operation)."""
    sections = _cu_file(file)
    if name not in sections:
        raise KeyError(f"{KERNEL_DIR / file} has no section '{MARK}{name}' (it has: {', '.join(sections)})")
    return sections[name]


@functools.cache
def _cu_file(file):
    if not file:
        raise ValueError("a kernel spec needs its .cu file (or inline code)")
    sections, lines = {}, None
    for line in (KERNEL_DIR / file).read_text().splitlines():
        if line.startswith(MARK):
            lines = sections.setdefault(line[len(MARK):].split()[0], [])
            if lines:
                raise ValueError(f"{KERNEL_DIR / file}: two sections named {line[len(MARK):].split()[0]!r}")
        elif lines is not None:
            lines.append(line)
    return {name: _section(lines) for name, lines in sections.items()}


def _section(lines):
    lines = list(lines)
    while lines and lines[0].startswith("//"):
        lines.pop(0)
    headers = ""
    while lines and lines[0].startswith('#include "'):
        headers += f"\n{_header(lines.pop(0).split(chr(34))[1])}\n"
    return headers, "\n".join(lines).strip("\n")


@functools.cache
def _header(file):
    lines = (KERNEL_DIR / file).read_text().splitlines()
    while lines and lines[0].startswith("//"):
        lines.pop(0)
    return "\n".join(lines).strip("\n")


# name -> spec, for every CUDA kernel in the project. A spec has `name`, `options` (passed to
# NVRTC before CuPy's own), `source(dtype)` (the exact source NVRTC compiles) and `kernel(dtype)`
# (the CuPy kernel, built once); a ReductionKernel spec would add its generated source likewise.
KERNELS = {}
C_TYPES = {**precision.C_TYPES, "int32": "int", "int64": "long long", "bool": "bool",
           "uint16": "unsigned short"}  # uint16: a bfloat16 array's bits (adamw_step_copy)


def register(spec):
    """Adds spec to KERNELS; the same spec again (a module run as __main__ and also imported) is
    the one already there, another kernel under a taken name is refused."""
    if spec.name in KERNELS and KERNELS[spec.name] != spec:
        raise ValueError(f"a kernel named {spec.name!r} is already registered")
    return KERNELS.setdefault(spec.name, spec)


class _Fallback:
    def __repr__(self):
        return "cuda.FALLBACK"


# What a fused piece's function returns for arguments its kernels do not take (a dtype, a size, the
# cache of another attention core): CupyOps then runs the method as it is without the piece.
FALLBACK = _Fallback()


@dataclasses.dataclass(frozen=True)
class FusedPiece:
    """One fused piece of CupyOps, declared once (minitensor/backends/kernels/NAME.py, beside its
    wrappers and NAME.cu); CupyOps, the start-up self-check, the tests and gpu_check's kernel phase
    all read it.

    name      what CupyOps(fused=...), the kernels line and train.kernels call it
    replaces  {Ops method name: fn}: the methods the piece overrides, each with the function that runs
              it with the kernels, fn(ops, *the method's own arguments) (ops the CupyOps), returning what
              the method returns, or FALLBACK where the kernels do not take these arguments. A CupyOps
              built with the piece binds each fn over its method (minitensor.backends.cupy_ops); where
              fn returns FALLBACK, or the piece is not in use, the method runs as it is without the
              piece (Ops', CupyOps' own, or another piece's)
    kernels   its kernel specs, registered in KERNELS with the piece
    sample    sample(ops, rng) -> outputs: the piece's layer forward and backward through the backend
              `ops` on small random float32 inputs drawn from the NumPy Generator rng (moved to
              ops.xp: `draw` below); the self-check runs it with the piece off and on and compares
              (minitensor.backends.selection). A sample whose shapes matter to its kernels takes a
              keyword `sizes` (a Sizes, or None): given the run's, it runs at them where they count
              (the attention's: the run's head size)
    cases     None, or cases(k) -> [(name, setup, fused, generic, uses an ElementwiseKernel), ...]:
              gpu_check's comparisons of each kernel's wrapper with the Ops code at ANDREA-120M
              shapes (k: the sizes and inputs of scripts/gpu_check/kernels.py's KernelInputs); without
              them gpu_check compares `sample` off and on
    rtol      the self-check's tolerance where it is not its own (minitensor.backends.selection.RTOL):
              a piece whose float32 products run on TF32 tensor cores
    timed     timed(ops, sizes) -> run(): inputs at a run's Sizes made once, and a call that runs the
              piece's forward and backward through `ops` on them: the start-up self-check times it with
              the piece off and on at the run's sizes and keeps the faster (minitensor.backends.selection)
    """

    name: str
    replaces: Mapping = dataclasses.field(compare=False)
    kernels: tuple
    sample: Callable = dataclasses.field(compare=False)
    cases: Callable = dataclasses.field(default=None, compare=False)
    rtol: float = None
    timed: Callable = dataclasses.field(default=None, compare=False)


# name -> FusedPiece, in the order they were imported (minitensor.backends.fused_pieces(): by name)
PIECES = {}


def fused_piece(name, replaces, kernels, sample, cases=None, rtol=None, timed=None):
    """Registers a fused piece and its kernels; returns the piece."""
    if not isinstance(replaces, Mapping) or not replaces or not all(
            isinstance(method, str) and callable(fn) for method, fn in replaces.items()):
        raise ValueError(f"fused piece {name!r}: replaces must map each Ops method it overrides to the function "
                         f"that runs it, fn(ops, *args); got {replaces!r}")
    if name in PIECES and PIECES[name].kernels != tuple(kernels):
        raise ValueError(f"a fused piece named {name!r} is already registered")
    piece = FusedPiece(name, types.MappingProxyType(dict(replaces)), tuple(register(k) for k in kernels), sample,
                       cases, rtol, timed)
    return PIECES.setdefault(name, piece)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of a run that the kernels are counted (minitensor.checks.counts) and timed
    (minitensor.backends.selection) at: B sequences of T tokens, width C, n_head heads, an MLP of F, a
    vocabulary of V, P parameters. The defaults are ANDREA-120M's training step at 8 x 1024 tokens.
    precision: the run's train.precision (a bf16 run's self-check runs the bf16 kernels too)."""
    B: int = 8
    T: int = 1024
    C: int = 768
    n_head: int = 12
    F: int = 3072
    V: int = 8449
    P: int = 92_331_264
    precision: str = "float32"

    @property
    def N(self):
        return self.B * self.T

    @property
    def BH(self):
        return self.B * self.n_head

    @property
    def hs(self):
        return self.C // self.n_head

    @property
    def V_padded(self):
        return -(-self.V // 128) * 128


def draw(xp, rng, *shape, scale=1.0, shift=0.0):
    """shift + scale * standard normals of `shape` from the NumPy Generator rng, float32, moved to xp:
    the inputs of a record's sample."""
    return xp.asarray((shift + scale * rng.standard_normal(shape)).astype(np.float32))


def normals(xp, *shape, scale=1.0):
    """scale * standard normals of `shape`, float32, drawn on the device where it can (a timed piece's
    inputs at a run's sizes: hundreds of MB are not drawn on the host)."""
    if hasattr(xp, "random") and hasattr(xp.random, "standard_normal"):
        return (scale * xp.random.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return draw(xp, np.random.default_rng(0), *shape, scale=scale)


# ---------------------------------------------------------------------------------------------
# CuPy: lazy builds and exact sources


class ToolchainMissing(ImportError):
    """CuPy (with NVRTC) is not importable here; the message says how to install it."""


@functools.cache
def toolchain():
    """CuPy's modules that the builds and the compile check use, with NVRTC proven loadable."""
    try:
        import cupy
        from cupy._core import _carray, _kernel, _scalar, core
        from cupy.cuda import compiler
        from cupy_backends.cuda.libs import nvrtc

        nvrtc_version = nvrtc.getVersion()  # loads libnvrtc: fails here if it is missing
    except Exception as e:
        raise ToolchainMissing(f"CuPy with NVRTC is not importable ({type(e).__name__}: {e}); "
                               f"install it with: {INSTALL_HINT}") from e
    return argparse.Namespace(cupy=cupy, carray=_carray, kernel=_kernel, scalar=_scalar, core=core,
                              compiler=compiler, nvrtc_version=nvrtc_version)


@functools.cache
def _elementwise_kernel(spec):
    import cupy

    return cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation, spec.name,
                                  preamble=spec.preamble, options=spec.options)


@functools.cache
def _raw_kernel(spec, dtype, instance=()):
    """The CuPy kernel of spec (a template's instance) for dtype; a template's without an instance: the
    module of all of them (its compile() builds them)."""
    import cupy

    if not spec.template:
        return cupy.RawKernel(spec.source(dtype), spec.name, options=spec.options)
    if not instance:
        return _raw_module(spec, dtype)
    if instance not in spec.instances_of(dtype):
        raise ValueError(f"{spec.name} is not compiled for {dict(zip(spec.template, instance))} in {dtype}: its "
                         f"instances are {spec.instances_of(dtype)}")
    return _raw_module(spec, dtype).get_function(spec.expression(instance))


@functools.cache
def _raw_module(spec, dtype):
    """A template kernel's module for dtype: its whole source(dtype), every instance, one compile (and one
    entry in CuPy's cache, which the first GPU check's preflight fills)."""
    import cupy

    return cupy.RawModule(code=spec.source(dtype), options=spec.options,
                          name_expressions=tuple(spec.expression(i) for i in spec.instances_of(dtype)))


# Values of CuPy's `_ArgKind` enum (cupy/_core/_kernel.pxd), not exported to Python.
_ARG_NDARRAY, _ARG_INDEXER, _ARG_SCALAR = 1, 2, 3


def _elementwise_source(spec, dtype):
    """Rebuilds what `ElementwiseKernel.__call__` compiles for C-contiguous arrays of fewer than
    2**31 elements (reduced to 1-D, 32-bit indexing), and what `compile_with_cache` prepends."""
    tc = toolchain()
    kern = spec.kernel()
    scalars = {name for name, _ in spec.scalars}
    in_dtypes = tuple(None if p.name in scalars else p.dtype or dtype for p in kern.in_params)
    in_types, out_types, type_map = kern._decide_params_type(in_dtypes, ())

    def arg(p, t):
        if p.name in scalars:
            return tc.kernel._ArgInfo(_ARG_SCALAR, tc.scalar.CScalar, t, 0, True, True)
        return tc.kernel._ArgInfo(_ARG_NDARRAY, tc.cupy.ndarray, t, 1, True, True)

    arginfos = tuple(arg(p, t) for p, t in zip(kern.in_params + kern.out_params, in_types + out_types))
    arginfos += (tc.kernel._ArgInfo(_ARG_INDEXER, tc.carray.Indexer, None, 1, True, True),)
    code = tc.kernel._get_elementwise_kernel_code(arginfos, type_map, kern.params, kern.operation,
                                                  kern.name, kern.preamble, **kern.kwargs)
    if f"void {spec.name}(" not in code or "CIndexer<1, 1> _ind" not in code:
        raise RuntimeError(f"CuPy {tc.cupy.__version__} generated unexpected code for {spec.name}: its "
                           f"private kernel-code API changed; {INSTALL_HINT}")
    header = "".join(f"#include <{h}>\n" for h in tc.core._cupy_header_list)
    return header + code



# ---------------------------------------------------------------------------------------------
# Shared by the wrappers of the layers' kernels


def threads(n, most):
    """Threads per block for rows of n elements: a multiple of 32, at most `most`."""
    return min(most, 32 * max(1, -(-n // 32)))


def like(fn, name, a, ref, contiguous=True):
    if (type(a) is not type(ref) or a.shape != ref.shape or a.dtype != ref.dtype
            or (contiguous and not a.flags.c_contiguous)):
        raise ValueError(f"{fn}: {name} must be a {'contiguous ' if contiguous else ''}{type(ref).__name__} "
                         f"of shape {ref.shape} and dtype {ref.dtype}; got {type(a).__name__} "
                         f"{getattr(a, 'shape', '')} {getattr(a, 'dtype', '')}")


def rows(fn, x, spec=None):
    """(N, C) of a contiguous float array x (..., C), of a dtype the kernel `spec` is built for (None:
    float32 or float64)."""
    dtypes = precision.kernel_dtypes() if spec is None else spec.dtypes
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype.name not in dtypes or x.ndim < 1 or not x.flags.c_contiguous:
        raise ValueError(f"{fn}: x must be a contiguous {' or '.join(dtypes)} array (..., C), got "
                         f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
    if x.shape[-1] < 1:
        raise ValueError(f"{fn}: x has rows of length 0")
    return x.size // x.shape[-1], x.shape[-1]


def vector(fn, name, a, x, summed=False):
    """a: one value per column of x, in x's dtype (a weight), or with `summed` in what x is summed in (a
    weight's gradient: float32 for bfloat16 x)."""
    want = precision.accumulate_of(x.dtype) if summed else x.dtype
    if a.shape != x.shape[-1:] or a.dtype != want or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be a contiguous {want} vector of shape {x.shape[-1:]}, "
                         f"got {a.dtype} {a.shape}")


def square_rows(fn, s, spec=None):
    if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
        raise ValueError(f"{fn}: expected (..., T, T) scores, got shape {s.shape}")
    return rows(fn, s, spec)


def out_like(fn, x, out):
    if out is None:
        return array_module(x).empty_like(x)
    like(fn, "out", out, x)
    return out


def row_values(fn, name, a, x, rows):
    """a: one value per row of x, in what x is summed in (a row's statistic: a mean, a log-sum-exp)."""
    want = precision.accumulate_of(x.dtype)
    if a.size != rows or a.dtype != want or not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must hold {rows} contiguous {want} values (one per row), got "
                         f"{a.dtype} {a.shape}")


def on_cupy(fn, x, numpy_alternative):
    if isinstance(x, np.ndarray):
        raise TypeError(f"{fn} runs on CuPy arrays; on NumPy use {numpy_alternative}")


def launch(spec, dtype, grid, block, args):
    """Runs a RawSpec kernel on CuPy arrays after checking each argument against its C type; a dtype
    the kernel is not built for (spec.dtypes, as the precision policy says) is refused."""
    if precision.name_of(dtype) not in spec.dtypes:
        raise TypeError(f"{spec.name} is built for {', '.join(spec.dtypes)}, not {precision.name_of(dtype)}")
    check_launch_args(spec, dtype, args)
    if any(isinstance(a, np.ndarray) for a in args):
        raise TypeError(f"{spec.name} runs on CuPy arrays; on NumPy its layer's generic code computes the same")
    spec.kernel(dtype, spec.instance_of(args))(grid, block, args)


def signature_of(code, name):
    """The parameter list of the kernel `name` in code: `extern "C" __global__ void NAME(...)`, or a
    template's `template <...> __global__ void [__launch_bounds__(...)] NAME(...)`."""
    found = re.search(rf'__global__ void\s+(?:__launch_bounds__\([^()]*\)\s*)?{name}\(([^)]*)\)', code)
    if not found:
        raise ValueError(f"no __global__ kernel named {name!r} in its code")
    return found.group(1)


@functools.cache
def raw_params(spec):
    """[(name, C base type, is_pointer), ...] of the kernel's parameters, parsed from its code."""
    params = []
    for p in signature_of(spec.code, spec.name).split(","):
        words = p.replace("*", " * ").split()
        params.append((words[-1], " ".join(w for w in words[:-1] if w not in ("const", "*")), "*" in words))
    return params


_ARG_TYPES = {"int": np.dtype(np.int32), "long long": np.dtype(np.int64)}


def check_launch_args(spec, dtype, args):
    """Each argument against its C type: T the dtype's, ACC what the dtype is summed in (the precision
    policy's accumulate_of), int and long long."""
    params = raw_params(spec)
    if len(args) != len(params):
        raise TypeError(f"{spec.name} takes {len(params)} arguments, got {len(args)}")
    kinds = {"T": precision.dtype_of(dtype), "ACC": precision.accumulate_of(dtype)}
    for (name, base, pointer), a in zip(params, args):
        want = kinds[base] if base in kinds else _ARG_TYPES[base]
        if pointer:
            ok = getattr(a, "dtype", None) == want and a.flags.c_contiguous
        else:
            ok = type(a) is want.type
        if not ok:
            kind = "a contiguous array" if pointer else "a NumPy scalar"
            raise TypeError(f"{spec.name}: argument {name} must be {kind} of {want}, got {type(a).__name__} "
                            f"{getattr(a, 'dtype', '')}")



def check_operands(fn, x, out, dy=None, bf16=False):
    """x a float NumPy/CuPy array (bfloat16 too with bf16: the caller has a kernel for it), dy and out like x."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not precision.is_float(dtype, bf16):
        raise TypeError(f"{fn}: x must be a {' or '.join(precision.kernel_dtypes(bf16))} NumPy/CuPy array, got "
                        f"{type(x).__name__}" + (f" of {dtype}" if dtype is not None else ""))
    if not isinstance(x, np.ndarray) and type(x).__module__.split(".")[0] != "cupy":
        raise TypeError(f"{fn}: x must be a NumPy or CuPy array, got {type(x).__name__}")
    for name, a in (("dy", dy), ("out", out)):
        if a is not None and (type(a) is not type(x) or a.shape != x.shape or a.dtype != x.dtype):
            raise ValueError(f"{fn}: {name} must be a {type(x).__name__} of shape {x.shape} and dtype "
                             f"{x.dtype}, like x; got {type(a).__name__} {getattr(a, 'shape', '')} "
                             f"{getattr(a, 'dtype', '')}")


