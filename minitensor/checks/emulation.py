"""A RawKernel run on the CPU: its CUDA code compiled as C++, each CUDA thread a fiber.

    emulate_launch(spec, dtype, grid, block, args)      the arrays updated in place, as on a GPU

Each CUDA thread is a fiber of one OS thread (its own stack, made by makecontext); the blocks run one
after another. A fiber runs until it reaches a barrier, then hands back:

- `__syncthreads()` waits for every thread of the block;
- a warp-level step (`__shfl_sync`, `__shfl_xor_sync`, `__syncwarp`, the `mma.sync` below) waits
  for the 32 lanes of its warp only, as on the GPU: one warp may run mma steps while another waits at
  the block's barrier, so a kernel may skip a warp's work where the warp has none (a causal tile above
  the diagonal). A warp whose lanes wait at different kinds of barrier is a deadlock, reported.

A switch is a _setjmp/_longjmp pair, tens of nanoseconds. The emulation runs the kernel's indexing,
masks and reductions; it is blind to races between blocks and to timing.

`mma_tf32` (PTX mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32) is emulated in the fragment
layout of the PTX ISA ("Matrix Fragments for mma.m16n8k8", .tf32): lane = 4 g + t holds
a = A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4); b = B(t, g), B(t + 4, g);
c = C(g, 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8, 2t + 1); sums in float in k order (the hardware's
order and internal precision are its own). `to_tf32` is cvt.rna.tf32.f32: to nearest, ties away
from zero, 10 mantissa bits. `mma_bf16` (mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, the bf16
flash kernels') likewise in the layout of "Matrix Fragments for mma.m16n8k16 with floating point type"
(.bf16): two bfloat16 to a 32-bit register, the lower index in the low half; a = A(g, 2t..2t+1),
A(g + 8, 2t..2t+1), A(g, 2t+8..2t+9), A(g + 8, 2t+8..2t+9); b = B(2t..2t+1, g), B(2t+8..2t+9, g); c as
m16n8k8's; each product of two bfloat16 exact in float, summed in float in k order. `emu_ldsm_x4_trans` is
ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16, each lane's 16-byte row read counted as the kernel's. A bf16 kernel runs
on NumPy arrays of ml_dtypes.bfloat16 (T is `unsigned short`, ACC `float`: cuda.type_names).

The counting build of the same program, whose hooks see every memory access, is minitensor/checks/traffic.py.
"""

import atexit
import functools
import os
import shutil
import subprocess
import tempfile

import numpy as np

from minitensor import precision
from minitensor.backends import all_kernels, cuda

PRELUDE = r"""#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <setjmp.h>
#include <string.h>
#include <ucontext.h>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) float2 { float x, y; };
struct __attribute__((aligned(16))) double2 { double x, y; };
static dim3 blockIdx, blockDim, gridDim;
static dim3 *fiber_thread_idx;
static unsigned current_fiber;
#define threadIdx (fiber_thread_idx[current_fiber])
static jmp_buf scheduler, *fibers;
enum { READY = 0, AT_BLOCK = 1, AT_WARP = 2, DONE = 3 };
static char *fiber_state;
static void (*fiber_body)(void *);
static char *emu_stacks_lo, *emu_stacks_hi;  /* the fibers' stacks: their locals are registers on a GPU */
static void *fiber_arg;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#ifndef EMU_SHARED
#define EMU_SHARED
#endif
#define __shared__ static EMU_SHARED
/* the emulation's own functions: not instrumented when counting (their accesses are not the kernel's) */
#define EMU_OWN __attribute__((no_sanitize_thread))
EMU_OWN static void wait_at(char barrier) {
  fiber_state[current_fiber] = barrier;
  if (!_setjmp(fibers[current_fiber])) _longjmp(scheduler, 1);
}
EMU_OWN static void __syncthreads() { wait_at(AT_BLOCK); }
EMU_OWN static void __syncwarp(unsigned = 0xffffffffu) { wait_at(AT_WARP); }
EMU_OWN static unsigned thread_rank() {
  return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
}
static double shuffle_slots[1024];
template <class U> EMU_OWN static U shuffle_from(U v, unsigned src) {
  const unsigned me = thread_rank();
  shuffle_slots[me] = (double)v;
  __syncwarp();
  const U other = (U)shuffle_slots[(me & ~31u) + (src & 31u)];
  __syncwarp();
  return other;
}
template <class U> EMU_OWN static U __shfl_xor_sync(unsigned, U v, int lane_mask) {
  return shuffle_from(v, (thread_rank() & 31u) ^ (unsigned)lane_mask);
}
template <class U> EMU_OWN static U __shfl_sync(unsigned, U v, int src_lane) {
  return shuffle_from(v, (unsigned)src_lane);
}
EMU_OWN static unsigned to_tf32(float v) {
  unsigned u;
  memcpy(&u, &v, sizeof u);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}
static unsigned long long emu_mma_steps;
static unsigned mma_a[1024][4], mma_b[1024][2];
static float mma_c[1024][4];
EMU_OWN static void mma_tf32(float *c, const unsigned *a, const unsigned *b) {
  const unsigned me = thread_rank();
  const unsigned base = me & ~31u, g = (me & 31u) >> 2, t = me & 3u;
  if ((me & 31u) == 0) ++emu_mma_steps;
  for (int i = 0; i < 4; ++i) mma_a[me][i] = a[i], mma_c[me][i] = c[i];
  mma_b[me][0] = b[0], mma_b[me][1] = b[1];
  __syncwarp();
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
  __syncwarp();  /* every lane has read the slots before the next mma writes them */
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
/* mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: a (16 x 16) and b (16 x 8) bfloat16, two to a register
   (the lower index in the low half); c float */
EMU_OWN static void mma_bf16(float *c, const unsigned *a, const unsigned *b) {
  const unsigned me = thread_rank();
  const unsigned base = me & ~31u, g = (me & 31u) >> 2, t = me & 3u;
  if ((me & 31u) == 0) ++emu_mma_steps;
  for (int i = 0; i < 4; ++i) mma_a[me][i] = a[i], mma_c[me][i] = c[i];
  mma_b[me][0] = b[0], mma_b[me][1] = b[1];
  __syncwarp();
  float A[16][16], B[16][8], C[16][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const unsigned lg = lane >> 2, lt = lane & 3, o = base + lane;
    const unsigned ai[4][2] = {{lg, 2 * lt}, {lg + 8, 2 * lt}, {lg, 2 * lt + 8}, {lg + 8, 2 * lt + 8}};
    for (int i = 0; i < 4; ++i)
      for (unsigned e = 0; e < 2; ++e) {
        const unsigned bits = (mma_a[o][i] >> (16 * e)) << 16;
        memcpy(&A[ai[i][0]][ai[i][1] + e], &bits, 4);
      }
    for (int i = 0; i < 2; ++i)
      for (unsigned e = 0; e < 2; ++e) {
        const unsigned bits = (mma_b[o][i] >> (16 * e)) << 16;
        memcpy(&B[2 * lt + 8 * i + e][lg], &bits, 4);
      }
    C[lg][2 * lt] = mma_c[o][0], C[lg][2 * lt + 1] = mma_c[o][1];
    C[lg + 8][2 * lt] = mma_c[o][2], C[lg + 8][2 * lt + 1] = mma_c[o][3];
  }
  const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float d[4];
  for (int i = 0; i < 4; ++i) {
    float acc = C[rows[i]][cols[i]];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];  /* each product exact in float */
    d[i] = acc;
  }
  __syncwarp();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
}
/* ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8 i + j give row j of matrix i (8 values of 16 bits);
   lane 4 g + t receives, of matrix i, (2t, g) in the low half of r[i] and (2t + 1, g) in the high half. Each
   lane's 16-byte row read is the kernel's own (emu_load16: counted at the call's site) */
static void emu_load16(const void *address, void *pc);
static const unsigned short *ldsm_rows[1024];
EMU_OWN static void emu_ldsm_x4_trans(unsigned *r, const void *row, void *pc) {
  const unsigned me = thread_rank(), base = me & ~31u, g = (me & 31u) >> 2, t = me & 3u;
  ldsm_rows[me] = (const unsigned short *)row;
  emu_load16(row, pc);
  __syncwarp();
  for (unsigned i = 0; i < 4; ++i)
    r[i] = (unsigned)ldsm_rows[base + 8 * i + 2 * t][g] | (unsigned)ldsm_rows[base + 8 * i + 2 * t + 1][g] << 16;
  __syncwarp();  /* every lane has read the rows before the next ldmatrix names its own */
}
static float __int_as_float(int v) { float f; memcpy(&f, &v, sizeof f); return f; }
static float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, sizeof f); return f; }
static unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, sizeof u); return u; }
static double __longlong_as_double(long long v) { double f; memcpy(&f, &v, sizeof f); return f; }
EMU_OWN static void fiber_main() {
  fiber_body(fiber_arg);
  fiber_state[current_fiber] = DONE;
  _longjmp(scheduler, 1);
}
/* a kernel argument's buffer: zeros, 256-byte aligned as CuPy's allocations are (the pages of a large
   one are mapped only where touched) */
EMU_OWN static void *emu_buffer(size_t bytes) {
  char *raw = (char *)calloc(bytes + 512, 1);
  return raw + 256 - (size_t)raw % 256;
}
static void emu_block_start(unsigned n);
static void emu_block_end(unsigned n);
EMU_OWN static void run_ready(unsigned n, char *started, ucontext_t *contexts) {
  for (volatile unsigned t = 0; t < n; ++t)
    if (fiber_state[t] == READY) {
      current_fiber = t;
      if (!_setjmp(scheduler)) {
        if (started[t]) _longjmp(fibers[t], 1);
        started[t] = 1;
        setcontext(&contexts[t]);
      }
    }
}
/* releases what may go on: each warp whose live lanes all wait at a warp-level step; else, when every
   live thread waits at __syncthreads, all of them. 0 when every thread is done. */
EMU_OWN static int release(unsigned n) {
  int released = 0, live = 0, at_block = 0;
  for (unsigned w = 0; w < n; w += 32) {
    int waiting = 0, alive = 0;
    for (unsigned t = w; t < w + 32 && t < n; ++t)
      if (fiber_state[t] != DONE) ++alive, waiting += fiber_state[t] == AT_WARP;
    if (alive && waiting == alive) {
      for (unsigned t = w; t < w + 32 && t < n; ++t)
        if (fiber_state[t] != DONE) fiber_state[t] = READY;
      released = 1;
    }
  }
  if (released) return 1;
  for (unsigned t = 0; t < n; ++t) live += fiber_state[t] != DONE, at_block += fiber_state[t] == AT_BLOCK;
  if (!live) return 0;
  if (at_block != live) {
    fprintf(stderr, "emulation: a warp's lanes wait at different barriers (a warp-level step in divergent code)\n");
    exit(3);
  }
  for (unsigned t = 0; t < n; ++t)
    if (fiber_state[t] == AT_BLOCK) fiber_state[t] = READY;
  return 1;
}
template <class F> EMU_OWN static void launch(dim3 grid, dim3 block, F body, const unsigned *only = nullptr,
                                      unsigned n_only = 0) {
  const size_t stack = 64 * 1024;  /* pages are touched only as far as a kernel's frames reach */
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  std::vector<ucontext_t> contexts(n);
  std::vector<jmp_buf> jumps(n);
  std::vector<dim3> index(n);
  std::vector<char> state(n), started(n);
  char *stacks = (char *)malloc(n * stack);
  emu_stacks_lo = stacks, emu_stacks_hi = stacks + n * stack;
  fibers = jumps.data();
  fiber_thread_idx = index.data();
  fiber_state = state.data();
  fiber_body = [](void *f) { (*(F *)f)(); };
  fiber_arg = &body;
  const unsigned total = grid.x * grid.y * grid.z, count = only ? n_only : total;
  for (unsigned i = 0; i < count; ++i) {
    const unsigned b = only ? only[i] : i;
    blockIdx = dim3{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
    for (unsigned t = 0; t < n; ++t) {
      index[t] = dim3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
      state[t] = READY;
      started[t] = 0;
      getcontext(&contexts[t]);
      contexts[t].uc_stack.ss_sp = stacks + t * stack;
      contexts[t].uc_stack.ss_size = stack;
      contexts[t].uc_link = nullptr;  /* fiber_main never returns: it jumps back */
      makecontext(&contexts[t], fiber_main, 0);
    }
    emu_block_start(n);
    do run_ready(n, started.data(), contexts.data());
    while (release(n));
    emu_block_end(n);
  }
  free(stacks);
}
"""

# Without counting, the block hooks do nothing: the prelude of a plain emulation (the CuPy stand-in's too).
_PLAIN_HOOKS = ("static void emu_block_start(unsigned) {}\nstatic void emu_block_end(unsigned) {}\n"
                "static void emu_load16(const void *, void *) {}\n")
PLAIN_PRELUDE = PRELUDE + _PLAIN_HOOKS

def emulate_launch(spec, dtype, grid, block, args):
    """Runs a RawSpec kernel on the CPU over NumPy arguments, as `minitensor.backends.cuda.launch` does on
    the GPU: the arrays are updated in place, and an array passed twice is one buffer, as on the
    GPU."""
    blob, owned = _launch_blob(spec, dtype, grid, block, args)
    raw = _run(_program(_specs_for(spec), np.dtype(dtype).name), spec, blob)
    offset = 0
    for a in owned:
        a.reshape(-1)[...] = np.frombuffer(raw, a.dtype, a.size, offset)
        offset += a.nbytes


def _specs_for(spec):
    """One program per dtype serves every registered RawKernel (each g++ build takes seconds)."""
    registered = tuple(s for s in all_kernels().values() if isinstance(s, cuda.RawSpec))
    return registered if spec in registered else (spec,)


def _entries(specs, dtype_name):
    """[(spec, instance), ...]: what a program runs, each template kernel once per instance it is compiled
    for in the dtype (minitensor.backends.cuda.RawSpec.instances_of), in the order of its runners."""
    return [(spec, instance) for spec in specs if dtype_name in spec.dtypes  # those built for the dtype
            for instance in spec.instances_of(dtype_name)]


def _launch_blob(spec, dtype, grid, block, args, only=None, floats=True):
    """(the program's stdin, the arrays it writes back in order): the kernel's index, the launch's
    dimensions, the blocks to run (none: all), then each argument; an array passed twice is one
    buffer, and arrays that partly overlap are refused. Without `floats` the float arrays' values are
    not sent (the program's buffer holds zeros): counting needs only the integers, which may steer an
    access (an id), where no kernel here lets a float value choose an address."""
    cuda.check_launch_args(spec, dtype, args)
    entries, instance = _entries(_specs_for(spec), np.dtype(dtype).name), spec.instance_of(args)
    if (spec, instance) not in entries:
        raise ValueError(f"{spec.name} is not compiled for {dict(zip(spec.template, instance))} in "
                         f"{np.dtype(dtype)}: its instances are {spec.instances_of(dtype)}")
    dims = [*grid, 1, 1][:3] + [*block, 1, 1][:3]
    if np.prod(dims[3:]) > 1024 or dims[3] % 32:
        raise ValueError(f"{spec.name}: a block of {dims[3:]} threads: at most 1024, x a multiple of 32")
    only = [] if only is None else list(only)
    head = np.array([entries.index((spec, instance)), *dims, len(only), *only], np.uint32).tobytes()
    blob, owned, slots = [head], [], {}
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
            send = floats or not precision.is_float(a.dtype, bf16=True)
            blob += [np.int64(a.size).tobytes(), np.int64(send).tobytes()]
            if send:
                blob.append(np.ascontiguousarray(a).tobytes())
    return b"".join(blob), owned


def _run(exe, spec, blob):
    proc = subprocess.run([exe], input=blob, capture_output=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{spec.name}: the emulation failed (status {proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace').strip()[-500:]}")
    return proc.stdout


@functools.cache
def _program(specs, dtype_name, hooks=None):
    """The compiled emulation program of the kernels `specs` for one dtype: it reads the kernel's
    index, the launch and the arguments from stdin, and writes the arrays back; with `hooks` (the
    counting build's, minitensor.checks.traffic), instrumented, writing the counts instead."""
    counting = hooks is not None
    parts = ['#define EMU_SHARED __attribute__((section("emu_shared"), aligned(16)))\n#include <algorithm>'
             if counting else "", PRELUDE, hooks if counting else _PLAIN_HOOKS,
             cuda.type_names(dtype_name)]  # T and ACC, as the precision policy says
    codes = {}  # a namespace per source: the kernels share helper names; one file may hold several kernels
    entries = _entries(specs, dtype_name)
    for index, (spec, instance) in enumerate(entries):
        if spec.code not in codes:
            codes[spec.code] = len(codes)
            parts += [f"namespace k{codes[spec.code]} {{", spec.code, "}"]
        parts.append(_runner(index, spec, codes[spec.code], counting, instance))
    cases = "\n".join(f"case {i}: return run{i}(d);" for i in range(len(entries)))
    parts += ["int main() {", "unsigned d[8];", "if (fread(d, sizeof d[0], 8, stdin) != 8) return 1;",
              f"switch (d[0]) {{\n{cases}\n}}", "return 1;", "}", ""]
    folder = _work_dir()
    exe = os.path.join(folder, f"emulator{len(os.listdir(folder))}_{dtype_name}{'_count' if counting else ''}")
    with open(exe + ".cpp", "w") as f:
        f.write("\n".join(parts))
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("the emulation needs a C++17 compiler: install g++ or set CXX")
    # without _FORTIFY_SOURCE: its checked longjmp refuses the jumps between the fibers' stacks. Counting:
    # every access as the source makes it (-O0), through ThreadSanitizer's hooks (defined above, its
    # runtime not linked), at fixed addresses for addr2line (-no-pie)
    flags = (["-O0", "-g", "-fsanitize=thread", "-no-pie", "-fno-pie"] if counting else ["-O1"])
    built = subprocess.run([cxx, *flags, "-std=c++17", "-U_FORTIFY_SOURCE", "-c", exe + ".cpp", "-o", exe + ".o"],
                           capture_output=True, text=True, check=False)
    if not built.returncode:
        built = subprocess.run([cxx, *(["-no-pie"] if counting else []), exe + ".o", "-o", exe],
                               capture_output=True, text=True, check=False)
    if built.returncode:
        raise RuntimeError(f"{', '.join(s.name for s in specs)}: does not compile as C++ for the emulation:\n"
                           f"{built.stderr[-3000:]}")
    return exe


def _runner(index, spec, space, counting, instance=()):
    """C++ `int run<index>(d)`: reads spec's arguments, launches it (from namespace k<space>; a template's
    `instance`) over the blocks listed (all when none), writes its arrays back, or, counting, the counts."""
    params = cuda.raw_params(spec)
    n = len(params)
    read, call, write = [], [], []
    for k, (_, base, pointer) in enumerate(params):
        if pointer:
            read.append(f"if (fread(&alias, 8, 1, stdin) != 1) return 1;\n"
                        f"if (alias >= 0) buf[{k}] = buf[alias]; else {{\n"
                        f"  own[{k}] = 1;\n"
                        f"  if (fread(&count[{k}], 8, 1, stdin) != 1 || fread(&sent, 8, 1, stdin) != 1) return 1;\n"
                        f"  buf[{k}] = emu_buffer(count[{k}] * sizeof({base}));\n"
                        f"  if (sent && fread(buf[{k}], sizeof({base}), count[{k}], stdin) != (size_t)count[{k}])"
                        " return 1;\n"
                        + (f"  emu_global.push_back({{(char *)buf[{k}], "
                           f"(char *)buf[{k}] + count[{k}] * sizeof({base})}});\n" if counting else "") + "}")
            call.append(f"({base} *)buf[{k}]")
            write.append(f"if (own[{k}]) fwrite(buf[{k}], sizeof({base}), count[{k}], stdout);")
        else:
            read.append(f"{base} arg{k};\nif (fread(&arg{k}, sizeof arg{k}, 1, stdin) != 1) return 1;")
            call.append(f"arg{k}")
    blocks = ["std::vector<unsigned> only(d[7]);",
              "if (d[7] && fread(only.data(), 4, d[7], stdin) != d[7]) return 1;"]
    if counting:
        body = ["for (unsigned i = 0; i < d[7]; ++i) {",
                "  emu_mma_steps = emu_mufu = 0; emu_sites.clear();",
                "  launch(dim3{d[1], d[2], d[3]}, dim3{d[4], d[5], d[6]}, [&] {",
                f"    k{space}::{spec.expression(instance)}({', '.join(call)});", "  }, &only[i], 1);",
                '  printf("block %u %llu %llu\\n", i, emu_mma_steps, emu_mufu);',
                "  for (auto &s : emu_sites)",
                '    printf("site %u %p %d %d %d %llu %llu %llu %llu %llu\\n", i, s.first, s.second.size, '
                "s.second.write, s.second.global, s.second.requests, s.second.wavefronts, s.second.ideal, "
                "s.second.worst, s.second.sectors);",
                "}"]
    else:
        body = ["launch(dim3{d[1], d[2], d[3]}, dim3{d[4], d[5], d[6]}, [&] {",
                f"  k{space}::{spec.expression(instance)}({', '.join(call)});", "}, d[7] ? only.data() : nullptr, d[7]);",
                *write]
    return "\n".join([
        f"static int run{index}(const unsigned *d) {{", f"void *buf[{n}] = {{0}};",
        f"long long count[{n}] = {{0}}, alias = -1, sent = 1;", f"int own[{n}] = {{0}};", *blocks, *read, *body,
        "return 0;", "}"])


@functools.cache
def _work_dir():
    path = tempfile.mkdtemp(prefix="minitensor-emulator-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
