"""Checks of the registered CUDA kernels that need no GPU, behind `python -m minitensor.checks`.

    --check       `check_kernels`: NVRTC compiles every kernel x dtype x arch as CuPy would
                  (`compile_source`), for an arch given rather than queried from a GPU
    --host-check  `host_check`: g++ runs each elementwise operation on the CPU and compares it
                  with its NumPy reference (spec.reference)

and `emulate_launch` runs a RawKernel's code on the CPU as C++ (a fiber per CUDA thread): the
tests put it in place of `minitensor.backends.cuda.launch` to compare the row kernels with their formulas
without a GPU.

The compile check uses CuPy private APIs, so CuPy's minor version is pinned by the
`kernel-check` extra. The registry it checks is `minitensor.backends.all_kernels()` (the GPU
backend imported); CuPy is imported only when a compile check runs.
"""

import atexit
import dataclasses
import functools
import math
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from minitensor.backends import all_kernels, cuda

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
    """NVRTC-compiles `source` to a cubin with the options CuPy would use; returns the cubin.
    Raises cupy.cuda.compiler.CompileException with NVRTC's log on an error."""
    tc = cuda.toolchain()
    opts = tc.core.assemble_cupy_compiler_options(tuple(options))
    opts += ("-ftz=true", f"-arch={arch}", "--device-as-default-execution-space")
    cubin, _ = tc.compiler._NVRTCProgram(source, f"{name}.cu", method="cubin").compile(opts)
    return cubin


def check_kernels(specs=None, dtypes=cuda.DTYPES, archs=cuda.ARCHS):
    """Compiles every spec x dtype x arch; yields a CheckResult for each as it finishes."""
    tc = cuda.toolchain()
    for spec in all_kernels().values() if specs is None else specs:
        for dtype in dtypes:
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
template <class U> U rsqrt(U v) { return U(1) / sqrt(v); }
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
# The host emulation of a RawKernel: its CUDA code compiled as C++, each CUDA thread a fiber of
# one OS thread (its own stack, made by makecontext), the blocks one after another. A block runs in
# rounds: each of its fibers in turn runs to its next __syncthreads (or its end) and hands back, so
# no thread passes a barrier before all have reached it; a warp shuffle is two barriers (every
# thread of a block must shuffle together, as full-warp shuffles in a 1-D block of whole warps
# do). A switch is a _setjmp/_longjmp pair, tens of nanoseconds with no system call, where an OS
# thread per CUDA thread cost a scheduler round trip per thread and barrier (BENCHMARKS.md, "The
# CPU kernels"). Blind to what only a GPU shows (races
# between blocks, the launch itself), but it runs the kernel's indexing, masks and reductions.

_EMU_PRELUDE = r"""#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <setjmp.h>
#include <string.h>
#include <ucontext.h>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 blockIdx, blockDim, gridDim;
static dim3 *fiber_thread_idx;
static unsigned current_fiber;
#define threadIdx (fiber_thread_idx[current_fiber])
static jmp_buf scheduler, *fibers;
static char *fiber_done;
static void (*fiber_body)(void *);
static void *fiber_arg;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static void __syncthreads() {
  if (!_setjmp(fibers[current_fiber])) _longjmp(scheduler, 1);
}
static double shuffle_slots[1024];
template <class U> static U __shfl_xor_sync(unsigned, U v, int lane_mask) {
  const unsigned me = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  shuffle_slots[me] = (double)v;
  __syncthreads();
  const U other = (U)shuffle_slots[me ^ (unsigned)lane_mask];
  __syncthreads();
  return other;
}
/* __syncwarp as a barrier of the whole block: faithful where every warp calls it alike */
static void __syncwarp(unsigned = 0xffffffffu) { __syncthreads(); }
/* PTX cvt.rna.tf32.f32: to TF32 (10 mantissa bits), to nearest, ties away from zero */
static unsigned to_tf32(float v) {
  unsigned u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}
/* PTX mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, d = a b + c over the calling warp, each lane
   holding its fragments in the layout of the PTX ISA ("Matrix Fragments for mma.m16n8k8", .tf32):
   lane = 4 g + t has a = A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4); b = B(t, g), B(t + 4, g);
   c = C(g, 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8, 2t + 1). The lanes exchange their fragments
   through the block's barrier, so every warp of the block must issue it alike (as the shuffles);
   the sums are float in k order (the hardware's order and internal precision are its own). */
static unsigned mma_a[1024][4], mma_b[1024][2];
static float mma_c[1024][4];
static void mma_tf32(float *c, const unsigned *a, const unsigned *b) {
  const unsigned me = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const unsigned base = me & ~31u, g = (me & 31u) >> 2, t = me & 3u;
  for (int i = 0; i < 4; ++i) mma_a[me][i] = a[i], mma_c[me][i] = c[i];
  mma_b[me][0] = b[0], mma_b[me][1] = b[1];
  __syncthreads();
  float A[16][8], B[8][8], C[16][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const unsigned lg = lane >> 2, lt = lane & 3, o = base + lane;
    const unsigned ai[4][2] = {{lg, lt}, {lg + 8, lt}, {lg, lt + 4}, {lg + 8, lt + 4}};
    for (int i = 0; i < 4; ++i) memcpy(&A[ai[i][0]][ai[i][1]], &mma_a[o][i], 4);
    memcpy(&B[lt][lg], &mma_b[o][0], 4);
    memcpy(&B[lt + 4][lg], &mma_b[o][1], 4);
    C[lg][2 * lt] = mma_c[o][0], C[lg][2 * lt + 1] = mma_c[o][1];
    C[lg + 8][2 * lt] = mma_c[o][2], C[lg + 8][2 * lt + 1] = mma_c[o][3];
  }
  const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float d[4];
  for (int i = 0; i < 4; ++i) {
    float acc = C[rows[i]][cols[i]];
    for (int k = 0; k < 8; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    d[i] = acc;
  }
  __syncthreads();  /* every lane has read the slots before the next mma writes them */
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
static float __int_as_float(int v) { float f; memcpy(&f, &v, sizeof f); return f; }
static double __longlong_as_double(long long v) { double f; memcpy(&f, &v, sizeof f); return f; }
static void fiber_main() {
  fiber_body(fiber_arg);
  fiber_done[current_fiber] = 1;
  _longjmp(scheduler, 1);
}
template <class F> static void launch(dim3 grid, dim3 block, F body) {
  const size_t stack = 64 * 1024;  /* pages are touched only as far as a kernel's frames reach */
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  std::vector<ucontext_t> contexts(n);
  std::vector<jmp_buf> jumps(n);
  std::vector<dim3> index(n);
  std::vector<char> done(n), started(n);
  char *stacks = (char *)malloc(n * stack);
  fibers = jumps.data();
  fiber_thread_idx = index.data();
  fiber_done = done.data();
  fiber_body = [](void *f) { (*(F *)f)(); };
  fiber_arg = &body;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3{bx, by, bz};
        for (unsigned t = 0; t < n; ++t) {
          index[t] = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
          done[t] = started[t] = 0;
          getcontext(&contexts[t]);
          contexts[t].uc_stack.ss_sp = stacks + t * stack;
          contexts[t].uc_stack.ss_size = stack;
          contexts[t].uc_link = nullptr;  /* fiber_main never returns: it jumps back */
          makecontext(&contexts[t], fiber_main, 0);
        }
        for (volatile bool running = true; running;) {  /* a round: every fiber to its next barrier */
          running = false;
          for (volatile unsigned t = 0; t < n; ++t)
            if (!done[t]) {
              current_fiber = t;
              if (!_setjmp(scheduler)) {
                if (started[t]) _longjmp(fibers[t], 1);
                started[t] = 1;
                setcontext(&contexts[t]);
              }
              running = running || !done[t];
            }
        }
      }
  free(stacks);
}
"""


def emulate_launch(spec, dtype, grid, block, args):
    """Runs a RawSpec kernel on the CPU over NumPy arguments, as `minitensor.backends.cuda.launch` does on
    the GPU: the arrays are updated in place, and an array passed twice is one buffer, as on the
    GPU."""
    cuda.check_launch_args(spec, dtype, args)
    dims = [*grid, 1, 1][:3] + [*block, 1, 1][:3]
    if np.prod(dims[3:]) > 1024 or dims[3] % 32:
        raise ValueError(f"{spec.name}: a block of {dims[3:]} threads: at most 1024, x a multiple of 32")
    # one program per dtype serves every registered RawKernel (each g++ build takes seconds)
    registered = tuple(s for s in all_kernels().values() if isinstance(s, cuda.RawSpec))
    specs = registered if spec in registered else (spec,)
    blob, owned, slots = [np.array([specs.index(spec), *dims], np.uint32).tobytes()], [], {}
    for k, ((_, _, pointer), a) in enumerate(zip(cuda.raw_params(spec), args)):
        if not pointer:
            blob.append(a.tobytes())
            continue
        key = (a.__array_interface__["data"][0], a.nbytes)
        if key not in slots and any(np.may_share_memory(a, b) for b in owned):
            raise ValueError(f"{spec.name}: argument {k} partly overlaps another one")
        blob.append(np.int64(slots.get(key, -1)).tobytes())
        if key not in slots:
            slots[key] = k
            owned.append(a)
            blob += [np.int64(a.size).tobytes(), a.tobytes()]
    raw = subprocess.run([_emulator(specs, np.dtype(dtype).name)], input=b"".join(blob), capture_output=True,
                         check=True).stdout
    offset = 0
    for a in owned:
        a.reshape(-1)[...] = np.frombuffer(raw, a.dtype, a.size, offset)
        offset += a.nbytes


@functools.cache
def _emulator(specs, dtype_name):
    """The compiled emulation program of the kernels `specs` for one dtype: it reads the kernel's
    index, the launch dimensions and the arguments from stdin, and writes the arrays back."""
    parts = [_EMU_PRELUDE, f"typedef {cuda.C_TYPES[dtype_name]} T;"]
    codes = {}  # a namespace per source: the kernels share helper names; one file may hold several kernels
    for index, spec in enumerate(specs):
        if spec.code not in codes:
            codes[spec.code] = len(codes)
            parts += [f"namespace k{codes[spec.code]} {{", spec.code, "}"]
        parts.append(_emulator_runner(index, spec, codes[spec.code]))
    cases = "\n".join(f"case {i}: return run{i}(d);" for i in range(len(specs)))
    parts += ["int main() {", "unsigned d[7];", "if (fread(d, sizeof d[0], 7, stdin) != 7) return 1;",
              f"switch (d[0]) {{\n{cases}\n}}", "return 1;", "}", ""]
    exe = os.path.join(_emulator_dir(), f"emulator{len(os.listdir(_emulator_dir()))}_{dtype_name}")
    with open(exe + ".cpp", "w") as f:
        f.write("\n".join(parts))
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("the emulation needs a C++17 compiler: install g++ or set CXX")
    # without _FORTIFY_SOURCE: its checked longjmp refuses the jumps between the fibers' stacks
    built = subprocess.run([cxx, "-O1", "-std=c++17", "-U_FORTIFY_SOURCE", exe + ".cpp", "-o", exe],
                           capture_output=True, text=True, check=False)
    if built.returncode:
        raise RuntimeError(f"{', '.join(s.name for s in specs)}: does not compile as C++ for the emulation:\n"
                           f"{built.stderr}")
    return exe


def _emulator_runner(index, spec, space):
    """C++ `int run<index>(d)`: reads spec's arguments, launches it (from namespace k<space>), writes its
    arrays back."""
    params = cuda.raw_params(spec)
    n = len(params)
    read, call, write = [], [], []
    for k, (_, base, pointer) in enumerate(params):
        if pointer:
            read.append(f"if (fread(&alias, 8, 1, stdin) != 1) return 1;\n"
                        f"if (alias >= 0) buf[{k}] = buf[alias]; else {{\n"
                        f"  own[{k}] = 1;\n"
                        f"  if (fread(&count[{k}], 8, 1, stdin) != 1) return 1;\n"
                        f"  buf[{k}] = malloc(count[{k}] * sizeof({base}) + 1);\n"
                        f"  if (fread(buf[{k}], sizeof({base}), count[{k}], stdin) != (size_t)count[{k}])"
                        " return 1;\n}")
            call.append(f"({base} *)buf[{k}]")
            write.append(f"if (own[{k}]) fwrite(buf[{k}], sizeof({base}), count[{k}], stdout);")
        else:
            read.append(f"{base} arg{k};\nif (fread(&arg{k}, sizeof arg{k}, 1, stdin) != 1) return 1;")
            call.append(f"arg{k}")
    return "\n".join([
        f"static int run{index}(const unsigned *d) {{", f"void *buf[{n}] = {{0}};",
        f"long long count[{n}] = {{0}}, alias = -1;", f"int own[{n}] = {{0}};", *read,
        "launch(dim3{d[1], d[2], d[3]}, dim3{d[4], d[5], d[6]}, [&] {",
        f"  k{space}::{spec.name}({', '.join(call)});", "});",
        *write, "return 0;", "}"])


@functools.cache
def _emulator_dir():
    path = tempfile.mkdtemp(prefix="minitensor-emulator-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


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
            for dtype in cuda.DTYPES:
                result = host_check(spec, dtype)
                failed += not result.ok
                print(result.line(width), flush=True)
    if archs is not None:
        try:
            tc = cuda.toolchain()
        except cuda.ToolchainMissing as e:
            print(f"cannot run the compile check: {e}")
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
