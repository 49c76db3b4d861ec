"""Checks of the registered CUDA kernels that need no GPU, behind `python -m minitensor.checks`.

    --check       `check_kernels`: NVRTC compiles every kernel x dtype x arch as CuPy would
                  (`compile_source`), for an arch given rather than queried from a GPU; the dtypes a
                  kernel is built for are the precision policy's (spec.dtypes: float32, float64, and
                  bfloat16 for a RawSpec written for it)
    --host-check  `host_check`: g++ runs each elementwise operation on the CPU and compares it
                  with its NumPy reference (spec.reference)

and minitensor/checks/emulation.py runs a RawKernel's code on the CPU as C++ (a fiber per CUDA
thread; `emulate_launch`, which the tests put in place of `minitensor.backends.cuda.launch`), and counts
what its memory requests would cost a GPU (`count_launch`).

The compile check uses CuPy private APIs, so CuPy's minor version is pinned by the
`kernel-check` extra. The registry it checks is `minitensor.backends.all_kernels()` (the GPU
backend imported); CuPy is imported only when a compile check runs.
"""

import dataclasses
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from minitensor import precision
from minitensor.backends import all_kernels, cuda
from minitensor.checks.emulation import emulate_launch  # noqa: F401  (the checks' other entry point)

# ---------------------------------------------------------------------------------------------
# The compile check: NVRTC, as CuPy calls it, for an arch given rather than queried from a GPU


@dataclasses.dataclass
class CheckResult:
    name: str
    dtype: str
    arch: str
    seconds: float
    error: str = ""  # the first error line; empty when it compiled

    @property
    def ok(self):
        return not self.error

    def line(self, width=0):
        status = "ok  " if self.ok else "FAIL"
        text = f"{status} {self.name:<{width}} {self.dtype} {self.arch}  ({self.seconds:.2f} s)"
        return text + (f"  {self.error}" if self.error else "")


def compile_source(source, name, options=(), arch="sm_90"):
    """NVRTC-compiles `source` to a cubin with the options CuPy would use; returns (the cubin, ptxas's
    report of its registers, spills and shared memory). Raises cupy.cuda.compiler.CompileException with
    NVRTC's log on an error. A compile is kept on disk (the temporary directory), keyed by the source,
    the options and NVRTC's version: the same kernel asked again (the compile check, then the counts, then
    the tests) is read back, not compiled again."""
    tc = cuda.toolchain()
    opts = nvrtc_options(options, arch) + ("--ptxas-options=-v",)
    key = hashlib.sha256(repr((source, opts, tc.nvrtc_version)).encode()).hexdigest()[:32]
    folder = os.path.join(tempfile.gettempdir(), f"minitensor-nvrtc-{os.getuid()}")
    kept = os.path.join(folder, key)
    if os.path.exists(kept + ".log"):
        with open(kept + ".cubin", "rb") as f, open(kept + ".log") as g:
            return f.read(), g.read()
    from cupy_backends.cuda.libs import nvrtc

    program = tc.compiler._NVRTCProgram(source, f"{name}.cu", method="cubin")
    cubin, _ = program.compile(opts)
    log = nvrtc.getProgramLog(program.ptr)
    os.makedirs(folder, exist_ok=True)
    for suffix, data, mode in ((".cubin", cubin, "wb"), (".log", log, "w")):  # the log last: it marks a whole entry
        with open(f"{kept}.{os.getpid()}{suffix}", mode) as f:
            f.write(data)
        os.replace(f"{kept}.{os.getpid()}{suffix}", kept + suffix)
    return cubin, log


def nvrtc_options(options=(), arch="sm_90"):
    """NVRTC's options as CuPy assembles them, for an arch given rather than queried from a GPU."""
    tc = cuda.toolchain()
    return tc.core.assemble_cupy_compiler_options(tuple(options)) + (
        "-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")


def dtypes_of(spec, dtypes=None):
    """The dtypes spec is built in (spec.dtypes, as the precision policy says: the bf16 flash kernels in
    bfloat16 alone), of those only `dtypes` where given."""
    return tuple(d for d in spec.dtypes if dtypes is None or d in dtypes)


def check_kernels(specs=None, dtypes=None, archs=cuda.ARCHS):
    """Compiles every spec x dtype it is built for (dtypes_of) x arch; yields a CheckResult for each as
    it finishes."""
    tc = cuda.toolchain()
    for spec in all_kernels().values() if specs is None else specs:
        for dtype in dtypes_of(spec, dtypes):
            for arch in archs:
                start = time.perf_counter()
                try:
                    compile_source(spec.source(dtype), spec.name, spec.options, arch)
                    error = ""
                except (tc.compiler.CompileException, RuntimeError) as e:
                    error = _first_error_line(e)
                yield CheckResult(spec.name, dtype, arch, time.perf_counter() - start, error)


def _first_error_line(e):
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [type(e).__name__])[0]


# ---------------------------------------------------------------------------------------------
# The host check: an elementwise operation compiled as plain C++ and compared with its reference

_HOST_PRELUDE = """#include <math.h>  /* in C++, also the float overloads: tanh(float) stays float */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
template <class U> U rsqrt(U v) { return U(1) / sqrt(v); }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, sizeof f); return f; }
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, sizeof u); return u; }
"""


@dataclasses.dataclass
class HostCheckResult:
    name: str
    dtype: str
    worst: float  # max over elements of |kernel - formula| / tolerance: <= 1 passes

    @property
    def ok(self):
        return self.worst <= 1.0

    def line(self, width=0):
        status = "ok  " if self.ok else "FAIL"
        return f"{status} {self.name:<{width}} {self.dtype}  worst error {self.worst:.3g} x tolerance"


def host_check(spec, dtype, n=4096, seed=0):
    """Runs `spec.operation` as C++ (T = float or double) over sample inputs and compares it with
    `spec.reference` in float64, elementwise: |got - want| <= rtol (1 + |want|) prod(1 + |input|),
    rtol 1e-12 for float64, 16 float32 epsilons for float32."""
    dtype = np.dtype(dtype)
    ins, outs = _parse_params(spec.in_params), _parse_params(spec.out_params)
    scalars = dict(spec.scalars)
    domains = dict(spec.domains)
    arrays = {name: domains.get(name, np.asarray)(_sample(np.random.default_rng([seed, i]), n, _param_dtype(t, dtype)))
              for i, (_, t, name) in enumerate(ins) if name not in scalars}
    program = _host_program(spec, dtype, ins, outs, scalars)
    blob = b"".join(arrays[name].tobytes() for _, _, name in ins if name in arrays)
    raw = _run_host_program(program, n, blob)
    got, offset = [], 0
    for _, t, _ in outs:
        dt = _param_dtype(t, dtype)
        got.append(np.frombuffer(raw, dt, n, offset).astype(np.float64))
        offset += n * dt.itemsize
    want = spec.reference(**{k: v.astype(np.float64) for k, v in arrays.items()},
                         **{k: float(v) for k, v in scalars.items()})
    want = want if isinstance(want, tuple) else (want,)
    rtol = 1e-12 if dtype == np.float64 else 16 * float(np.finfo(np.float32).eps)
    scale = np.prod([1.0 + np.abs(a.astype(np.float64)) for a in arrays.values()], axis=0)
    worst = max(float(np.max(np.abs(g - w) / (rtol * (1.0 + np.abs(w)) * scale))) for g, w in zip(got, want))
    return HostCheckResult(spec.name, dtype.name, worst if np.isfinite(worst) else math.inf)


def _parse_params(params):
    """'T x, raw T y' -> [(raw, type, name), ...]"""
    parsed = []
    for p in params.split(","):
        *mods, t, name = p.split()
        parsed.append(("raw" in mods, t, name))
    return parsed


def _param_dtype(t, dtype):
    return dtype if t == "T" else np.dtype(t)


def _sample(rng, n, dtype):
    special = np.array([0.0, 1e-3, -1e-3, 1.0, -1.0, 5.0, -5.0, 12.0, -12.0])
    values = np.concatenate([special, 3.0 * rng.standard_normal(n)])[:n]
    return values.astype(dtype)


def _host_program(spec, dtype, ins, outs, scalars):
    def c(t):
        return "T" if t == "T" else cuda.C_TYPES[np.dtype(t).name]

    decl, read, bind, write = [], [], [], []
    for raw, t, name in ins:
        if name in scalars:
            decl.append(f"const {c(t)} {name} = ({c(t)}){scalars[name]!r};")
            continue
        decl.append(f"{c(t)} *_raw_{name} = ({c(t)} *)malloc(n * sizeof({c(t)}));")
        read.append(f"if (fread(_raw_{name}, sizeof({c(t)}), n, stdin) != (size_t)n) return 1;")
        bind.append(f"const {c(t)} *{name} = _raw_{name};" if raw else f"const {c(t)} &{name} = _raw_{name}[i];")
    for raw, t, name in outs:
        decl.append(f"{c(t)} *_raw_{name} = ({c(t)} *)malloc(n * sizeof({c(t)}));")
        write.append(f"fwrite(_raw_{name}, sizeof({c(t)}), n, stdout);")
        bind.append(f"{c(t)} *{name} = _raw_{name};" if raw else f"{c(t)} &{name} = _raw_{name}[i];")
    body = "\n".join([*decl, *read, "for (long i = 0; i < n; ++i) {", *bind, spec.operation + ";", "}", *write])
    return (f"{_HOST_PRELUDE}typedef {cuda.C_TYPES[dtype.name]} T;\n{spec.preamble}\n"
            f"int main(int argc, char **argv) {{\nconst long n = atol(argv[1]);\n{body}\nreturn 0;\n}}\n")


def _run_host_program(program, n, stdin_bytes):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("the host check needs a C++ compiler: install g++ or set CXX")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "op.cpp"), os.path.join(tmp, "op")
        with open(src, "w") as f:
            f.write(program)
        built = subprocess.run([cxx, "-O1", "-std=c++17", src, "-o", exe], capture_output=True, text=True,
                               check=False)
        if built.returncode:
            raise RuntimeError(f"the operation does not compile as C++:\n{built.stderr}\n{program}")
        ran = subprocess.run([exe, str(n)], input=stdin_bytes, capture_output=True, check=True)
    return ran.stdout


# ---------------------------------------------------------------------------------------------
# Command line (`minitensor.checks.main` parses it)


def run(host, archs):
    """Prints a line per check: the host check of each elementwise kernel if `host`, then the
    compile check of every kernel for `archs` unless it is None. Returns the exit status: 0 when
    all passed, 1 when one failed, 2 when the compile check cannot run here."""
    width = max(map(len, all_kernels()), default=0)
    failed = 0
    if host:
        for spec in (s for s in all_kernels().values() if isinstance(s, cuda.ElementwiseSpec)):
            for dtype in spec.dtypes:
                result = host_check(spec, dtype)
                failed += not result.ok
                print(result.line(width), flush=True)
    if archs is not None:
        try:
            tc = cuda.toolchain()
        except cuda.ToolchainMissing as e:
            print(f"error: cannot run the compile check: {e}", file=sys.stderr)
            return 2
        start, count = time.perf_counter(), 0
        for result in check_kernels(archs=archs):
            count += 1
            failed += not result.ok
            print(result.line(width), flush=True)
        nvrtc = ".".join(map(str, tc.nvrtc_version))
        print(f"{count} compiled in {time.perf_counter() - start:.1f} s with NVRTC {nvrtc}, "
              f"CuPy {tc.cupy.__version__}")
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0
