"""A launch's memory requests as a GPU serves them, counted on the CPU: `count_launch`.

The emulation's program (minitensor/checks/emulation.py: a fiber per CUDA thread, the blocks in turn)
compiled without optimisation and with
GCC's ThreadSanitizer instrumentation, whose hooks (`__tsan_read4`, ...) are defined here instead of
its runtime: every load and store the kernel's source makes calls a hook with its address and the
address of the instruction. Shared arrays live in one linker section (`__shared__` becomes a static
in section emu_shared), so a hook tells shared memory from the kernel's argument buffers (global
memory) and from the fibers' stacks (registers, ignored). A warp's request is the k-th execution of
one instruction by its lanes (lanes that skip it are the masked-off ones), and is priced as the
hardware serves it:

- shared memory: 32 banks of 4 bytes; an access of w bytes per lane is served in phases of 128 / w
  lanes (a 64-bit access in half-warps, a 128-bit one in quarter-warps); a phase takes as many
  wavefronts as the largest number of distinct 4-byte words any one bank holds among its lanes'
  addresses (lanes reading the same word share it). The request's ideal is one wavefront per phase
  that has an active lane; its conflict degree is wavefronts / ideal.
- global memory: the distinct 32-byte sectors a request touches (what the L2 serves).

It also counts the mma.sync steps each warp issues (m16n8k8 tf32 and m16n8k16 bf16 alike: one each) and
the float special-function calls (expf, logf, tanhf, rsqrtf, ...: the GPU's SFU, MUFU) its lanes make.
"""

import dataclasses
import shutil
import subprocess

import numpy as np

from minitensor.checks import emulation

# The counting build's hooks: ThreadSanitizer's entry points, called by every instrumented access.
COUNT_HOOKS = r"""
#include <map>
extern "C" char __start_emu_shared[], __stop_emu_shared[];
static char emu_section_anchor[16] __attribute__((section("emu_shared"), used));  /* the section, even unused */
static std::vector<std::pair<char *, char *>> emu_global;  /* the kernel's argument buffers */
static unsigned long long emu_mufu;
struct EmuAccess { char *address; void *pc; unsigned fiber, k; unsigned char size, write, global; };
static std::vector<EmuAccess> emu_log;  /* the block's shared and global accesses, in execution order */
static bool emu_counting, emu_inside;   /* the hooks' own containers are instrumented too: not the kernel's */
struct EmuSite {
  unsigned long long requests = 0, wavefronts = 0, ideal = 0, worst = 0, sectors = 0;
  int size = 0, write = 0, global = 0;
};
static std::map<void *, EmuSite> emu_sites;
EMU_OWN static void emu_record(void *address, int size, int write, void *pc) {
  char *a = (char *)address;
  if (!emu_counting || emu_inside || (a >= emu_stacks_lo && a < emu_stacks_hi)) return;  /* registers */
  emu_inside = true;
  int global = 0;
  const int shared = a >= __start_emu_shared && a < __stop_emu_shared;
  if (!shared) {
    const std::pair<char *, char *> *r = emu_global.data();
    for (size_t i = 0, n = emu_global.size(); i < n; ++i) global |= a >= r[i].first && a < r[i].second;
  }
  if (shared || global) emu_log.push_back({a, pc, current_fiber, 0, (unsigned char)size, (unsigned char)write,
                                           (unsigned char)global});
  emu_inside = false;
}
/* one request: the lanes of one warp executing one instruction for the k-th time */
static void emu_close(const EmuAccess *first, const EmuAccess *end) {
  EmuSite &s = emu_sites[first->pc];
  const unsigned size = first->size;
  s.size = size, s.write = first->write, s.global = first->global;
  s.requests += 1;
  if (first->global) {
    std::vector<unsigned long long> sectors;
    for (const EmuAccess *l = first; l != end; ++l)
      for (unsigned long long x = (unsigned long long)l->address >> 5;
           x <= ((unsigned long long)l->address + size - 1) >> 5; ++x)
        sectors.push_back(x);
    std::sort(sectors.begin(), sectors.end());
    s.sectors += std::unique(sectors.begin(), sectors.end()) - sectors.begin();
    return;
  }
  const unsigned per_phase = size >= 4 ? 128u / size : 32u;
  unsigned long long total = 0, ideal = 0;
  for (unsigned phase = 0; phase < 32u / per_phase; ++phase) {
    std::vector<unsigned long long> words;  /* bank * 2^40 + word */
    for (const EmuAccess *l = first; l != end; ++l) {
      if ((l->fiber & 31u) / per_phase != phase) continue;
      const unsigned long long lo = (unsigned long long)(l->address - __start_emu_shared) >> 2;
      const unsigned long long hi = (unsigned long long)(l->address - __start_emu_shared + size - 1) >> 2;
      for (unsigned long long w = lo; w <= hi; ++w) words.push_back(((w % 32) << 40) | w);
    }
    if (words.empty()) continue;
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    unsigned long long most = 0, run = 0;
    for (size_t i = 0; i < words.size(); ++i) {
      run = i && (words[i] >> 40) == (words[i - 1] >> 40) ? run + 1 : 1;
      most = run > most ? run : most;
    }
    total += most;
    ideal += 1;
  }
  s.wavefronts += total;
  s.ideal += ideal;
  const unsigned long long degree = ideal ? (total + ideal - 1) / ideal : 0;
  s.worst = degree > s.worst ? degree : s.worst;
}
static void emu_block_start(unsigned) {
  emu_log.clear();
  emu_counting = true;
}
static void emu_block_end(unsigned) {
  emu_counting = false;
  std::vector<EmuAccess> &log = emu_log;
  /* k: how many times the lane had executed the instruction before (the order of the log, per lane) */
  std::stable_sort(log.begin(), log.end(), [](const EmuAccess &x, const EmuAccess &y) {
    return x.fiber != y.fiber ? x.fiber < y.fiber : x.pc < y.pc;
  });
  for (size_t i = 0; i < log.size(); ++i)
    log[i].k = i && log[i].fiber == log[i - 1].fiber && log[i].pc == log[i - 1].pc ? log[i - 1].k + 1 : 0;
  std::sort(log.begin(), log.end(), [](const EmuAccess &x, const EmuAccess &y) {
    if (x.fiber >> 5 != y.fiber >> 5) return x.fiber >> 5 < y.fiber >> 5;
    if (x.pc != y.pc) return x.pc < y.pc;
    return x.k != y.k ? x.k < y.k : x.fiber < y.fiber;
  });
  for (size_t i = 0, j; i < log.size(); i = j) {
    for (j = i + 1; j < log.size() && log[j].fiber >> 5 == log[i].fiber >> 5 && log[j].pc == log[i].pc &&
                    log[j].k == log[i].k; ++j) {}
    emu_close(&log[i], &log[0] + j);
  }
  log.clear();
}
/* a lane's 16-byte row of an ldmatrix (the emulation's emu_ldsm_x4_trans), at the kernel's call site */
static void emu_load16(const void *address, void *pc) { emu_record((void *)address, 16, 0, pc); }
extern "C" {
#define EMU_AT __builtin_return_address(0)  /* the instrumented access's own address: its instruction */
#define EMU_HOOK(n) \
  EMU_OWN void __tsan_read##n(void *p) { emu_record(p, n, 0, EMU_AT); } \
  EMU_OWN void __tsan_write##n(void *p) { emu_record(p, n, 1, EMU_AT); } \
  EMU_OWN void __tsan_unaligned_read##n(void *p) { emu_record(p, n, 0, EMU_AT); } \
  EMU_OWN void __tsan_unaligned_write##n(void *p) { emu_record(p, n, 1, EMU_AT); }
EMU_HOOK(1) EMU_HOOK(2) EMU_HOOK(4) EMU_HOOK(8) EMU_HOOK(16)
EMU_OWN void __tsan_read_range(void *p, unsigned long n) { emu_record(p, (int)n, 0, EMU_AT); }
EMU_OWN void __tsan_write_range(void *p, unsigned long n) { emu_record(p, (int)n, 1, EMU_AT); }
void __tsan_func_entry(void *) {}
void __tsan_func_exit() {}
void __tsan_init() {}
void __tsan_vptr_update(void **, void *) {}
void __tsan_vptr_read(void **) {}
}
/* the float special functions, counted: the kernels' code below is compiled after these macros */
static float emu_sfu(float v) { ++emu_mufu; return v; }
#define expf(x) emu_sfu(::expf(x))
#define exp2f(x) emu_sfu(::exp2f(x))
#define logf(x) emu_sfu(::logf(x))
#define log2f(x) emu_sfu(::log2f(x))
#define tanhf(x) emu_sfu(::tanhf(x))
#define rsqrtf(x) emu_sfu(1.0f / ::sqrtf(x))
#define sqrtf(x) emu_sfu(::sqrtf(x))
"""


@dataclasses.dataclass
class Site:
    """One instruction's memory requests over the blocks counted (weighted)."""
    line: str          # the source line that makes it
    memory: str        # "shared" or "global"
    size: int          # bytes per lane
    write: bool
    requests: float
    wavefronts: float  # shared: what the banks served
    ideal: float       # shared: one wavefront per active phase
    worst: int         # shared: the largest degree of one request (wavefronts / ideal, rounded up)
    sectors: float     # global: distinct 32-byte sectors


@dataclasses.dataclass
class Counts:
    """What a launch's blocks ask of the GPU, counted in the emulation and scaled to the whole grid."""
    sites: list
    mma: float         # warp-level mma.sync steps
    sfu: float         # float special-function calls (per thread)
    blocks: int        # blocks in the grid

    def shared(self):
        return [s for s in self.sites if s.memory == "shared"]

    @property
    def wavefronts(self):
        return sum(s.wavefronts for s in self.shared())

    @property
    def shared_requests(self):
        return sum(s.requests for s in self.shared())

    @property
    def ideal(self):
        return sum(s.ideal for s in self.shared())

    @property
    def worst(self):
        return max((s.worst for s in self.shared()), default=0)

    @property
    def sectors(self):
        return sum(s.sectors for s in self.sites if s.memory == "global")


def count_launch(spec, dtype, grid, block, args, blocks=None):
    """The Counts of a launch: the blocks given as [(linear block index, weight), ...] run (weight: how
    many blocks of the grid each stands for; default every block once), the others skipped."""
    grid = [*grid, 1, 1][:3]
    total = int(np.prod(grid))
    blocks = [(b, 1) for b in range(total)] if blocks is None else list(blocks)
    if not blocks or any(not 0 <= b < total for b, _ in blocks):
        raise ValueError(f"{spec.name}: blocks to count must be within the grid's {total}")
    blob, _ = emulation._launch_blob(spec, dtype, grid, block, args, only=[b for b, _ in blocks], floats=False)
    exe = emulation._program(emulation._specs_for(spec), np.dtype(dtype).name, COUNT_HOOKS)
    out = emulation._run(exe, spec, blob).decode().splitlines()
    weights = np.array([w for _, w in blocks], float)
    return _parse_counts(out, weights, exe, total)


def _parse_counts(lines, weights, exe, total):
    """Counts from the counting program's output: one 'block mma sfu' line per block, then one
    'site pc memory size write requests wavefronts ideal worst sectors' line per site and block."""
    per_block, sites = {}, {}
    for line in lines:
        words = line.split()
        if words[0] == "block":
            per_block[int(words[1])] = (float(words[2]), float(words[3]))
        elif words[0] == "site":
            pc, w = int(words[2], 16), weights[int(words[1])]
            size, write, glob, req, wf, ideal, worst, sectors = (int(x) for x in words[3:])
            s = sites.setdefault(pc, Site("", "global" if glob else "shared", size, bool(write), 0, 0, 0, 0, 0))
            s.requests += w * req
            s.wavefronts += w * wf
            s.ideal += w * ideal
            s.sectors += w * sectors
            s.worst = max(s.worst, worst)
    lines_of = _source_lines(exe, list(sites))
    for pc, s in sites.items():
        s.line = lines_of.get(pc, "?")
    mma = sum(weights[b] * m for b, (m, _) in per_block.items())
    sfu = sum(weights[b] * f for b, (_, f) in per_block.items())
    return Counts(sorted(sites.values(), key=lambda s: -(s.wavefronts + s.sectors)), mma, sfu, total)


def _source_lines(exe, pcs):
    """{pc: the source text of the line holding the access} through addr2line (the build has -g)."""
    tool = shutil.which("addr2line")
    if not tool or not pcs:
        return {}
    proc = subprocess.run([tool, "-e", exe, *[hex(pc - 1) for pc in pcs]], capture_output=True, text=True)
    with open(exe + ".cpp") as f:
        source = f.read().splitlines()
    found = {}
    for pc, where in zip(pcs, proc.stdout.splitlines()):
        number = where.rsplit(":", 1)[-1].split()[0]
        if number.isdigit() and 0 < int(number) <= len(source):
            found[pc] = " ".join(source[int(number) - 1].split())
    return found


