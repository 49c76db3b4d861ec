"""What each CUDA kernel asks of an H200, counted without one: `python -m minitensor.checks --counts`.

For every registered kernel, float32 (the training path), sm_90:

- from ptxas (through NVRTC, as CuPy compiles it, in the dtype its model call launches it in: float32,
  bfloat16 for the *_bf16 kernels; `resources`): registers per thread, spill stores and
  loads, stack, static shared memory; and the occupancy they allow (`occupancy_of`: resident blocks and
  warps per SM by the rules of the CUDA Programming Guide's compute-capability tables and the CUDA
  toolkit's cuda_occupancy.h: 65536 registers per SM allocated 256 per warp, at most 64 warps and 32
  blocks per SM, 228 KB of shared memory per SM in 128-byte units with 1 KB reserved per block);
- for each RawKernel, from its launches at ANDREA-120M's step (8 x 1024 tokens, d 768, 12 heads of
  64, MLP 3072, vocab 8449 padded to 8576: `MODEL`), run in the host emulation's counting mode
  (minitensor.checks.traffic.count_launch): shared-memory requests and the wavefronts the banks
  serve them in, the worst conflict degree of one request, the 32-byte global-memory sectors its
  requests touch, the mma.sync steps its warps issue and its special-function calls. A kernel runs
  only the blocks its spec names (`RawSpec.count_blocks`: blocks that do the same work stand for each
  other, with weights), so that a launch of thousands of blocks counts in seconds.

- from its sm_90 SASS (nvdisasm on the same cubin; minitensor.checks.sass), for the instance the model
  launches: instructions, HMMAs, branches inside the mma loop and how far ahead of its HMMA each
  operand's shared-memory load is issued.

Each RawSpec declares the largest conflict degree it may have (`RawSpec.conflicts`, 1 unless it says
why) and the warps per SM it must reach (`RawSpec.warps_per_sm`); `problems` lists a kernel over its
declaration, one under its occupancy, one that spills in float32, and one with HMMAs whose mma loop
holds a branch or is not pipelined (median load-ahead under sass.PIPELINED): `--counts` then exits 1,
and CI runs it. Nothing here runs a GPU: NVRTC compiles, the host runs.
"""

import contextlib
import dataclasses
import re
import time

import numpy as np

from minitensor.backends import all_kernels, cuda
from minitensor.checks import sass, traffic


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """What one streaming multiprocessor of a compute-capability-9.0 GPU holds (CUDA Programming Guide,
    "Compute Capabilities", tables of technical specifications; cuda_occupancy.h of CUDA 13.0)."""
    registers: int = 65536
    register_unit: int = 256          # registers are allocated per warp in units of 256
    max_registers: int = 255          # per thread
    max_warps: int = 64
    max_blocks: int = 32
    shared: int = 228 * 1024          # bytes of shared memory per SM (the largest carveout)
    shared_unit: int = 128
    shared_reserved: int = 1024       # per block, by the CUDA driver
    static_shared_max: int = 48 * 1024  # a block's static shared memory; more needs dynamic memory, opted in


SM90 = SMLimits()


@dataclasses.dataclass
class Resources:
    """What ptxas reports for one kernel: registers per thread, bytes of stack, spill stores and loads,
    static shared memory."""
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int


def resources(spec, dtype=None, arch="sm_90", instance=()):
    """The Resources of spec (a template's instance; none named: the one its model call launches) for dtype
    (None: the first it is built in, kernelcheck.dtypes_of: float32, bfloat16 for the bf16 kernels), from
    ptxas's report (-v) of NVRTC compiling the exact source CuPy compiles
    (minitensor.checks.kernelcheck.compile_source)."""
    from minitensor.checks.kernelcheck import compile_source, dtypes_of

    dtype = dtype or dtypes_of(spec)[0]
    if getattr(spec, "template", ()) and not instance:
        instance = sass.instance_for(spec, model_launches(spec)[0][4])

    _, log = compile_source(spec.source(dtype), spec.name, spec.options, arch)
    return _parse_ptxas(_entry_report(log, sass.mangled(spec.name, instance)), spec.name)


def _entry_report(log, symbol):
    """The part of ptxas's report about the entry function `symbol` (a prefix of its mangled name), or the
    whole report where it names no entry function."""
    chunks = re.split(r"(?=ptxas info\s*: Compiling entry function)", log)
    mine = [c for c in chunks if re.search(rf"Compiling entry function '{re.escape(symbol)}", c)]
    return mine[0] if mine else log


def _parse_ptxas(log, name):
    found = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0  # noqa: E731
    if "registers" not in log:
        raise RuntimeError(f"{name}: no resource usage in ptxas's report:\n{log}")
    return Resources(found(r"Used (\d+) registers"), found(r"(\d+) bytes stack frame"),
                     found(r"(\d+) bytes spill stores"), found(r"(\d+) bytes spill loads"),
                     found(r"(\d+) bytes smem"))


@dataclasses.dataclass
class Occupancy:
    blocks: int      # resident blocks per SM
    warps: int       # resident warps per SM
    limiter: str     # what stops one more block: registers, shared memory, warps or blocks


def _occupancy(registers, threads, shared, limits=SM90):
    """Resident blocks per SM for blocks of `threads` threads using `registers` per thread and `shared`
    bytes of shared memory (static and dynamic), by the occupancy calculator's rules."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // limits.register_unit) * limits.register_unit
    per_block = -(-(shared + limits.shared_reserved) // limits.shared_unit) * limits.shared_unit
    bounds = {"registers": limits.registers // (per_warp * warps) if registers else limits.max_blocks,
              "shared memory": limits.shared // per_block,
              "warps": limits.max_warps // warps, "blocks": limits.max_blocks}
    limiter = min(bounds, key=bounds.get)
    return Occupancy(bounds[limiter], bounds[limiter] * warps, limiter)


MODEL = cuda.Sizes()  # ANDREA-120M's training step at 8 x 1024 tokens


@contextlib.contextmanager
def captured_launches():
    """Within the block, cuda.launch records each launch (spec, dtype, grid, block, args) in the list
    yielded instead of running it: the wrappers' outputs are left as they were allocated."""
    launches, saved = [], cuda.launch

    def capture(spec, dtype, grid, block, args):
        cuda.check_launch_args(spec, dtype, args)
        launches.append((spec, np.dtype(dtype), tuple(grid), tuple(block), tuple(args)))

    cuda.launch = capture
    try:
        yield launches
    finally:
        cuda.launch = saved


def model_launches(spec, sizes=MODEL):
    """The launches of spec that its declared model call (RawSpec.model) makes at `sizes`."""
    if spec.model is None:
        raise ValueError(f"{spec.name}: its RawSpec declares no model call (RawSpec.model)")
    with captured_launches() as launches, np.errstate(all="ignore"):  # outputs never computed: any values
        spec.model(sizes)
    mine = [launch for launch in launches if launch[0].name == spec.name]
    if not mine:
        raise ValueError(f"{spec.name}: its model call did not launch it")
    return mine


def default_blocks(grid, block, args):
    """Blocks that stand for the whole grid when every block does the same work but the last (a
    partial row chunk, say): the first for all the others, and the last."""
    total = int(np.prod(grid))
    return [(0, total)] if total == 1 else [(0, total - 1), (total - 1, 1)]


@dataclasses.dataclass
class KernelCounts:
    """One kernel's row of the table."""
    name: str
    kind: str                  # "raw" or "elementwise"
    resources: Resources
    threads: int               # per block (an ElementwiseKernel: CuPy's 128)
    occupancy: Occupancy
    declared: int              # the conflict degree the spec allows (0: no shared memory counted)
    counts: traffic.Counts = None   # summed over its launches at the model sizes (raw kernels)
    launches: int = 0
    seconds: float = 0.0       # to count
    code: sass.Sass = None     # its sm_90 SASS (the instance the model launches)
    warps_declared: int = 0    # RawSpec.warps_per_sm
    dtype: str = "float32"     # what it is compiled and counted in (the bf16 kernels: bfloat16)

    def wavefronts_per_request(self):
        c = self.counts
        return c.wavefronts / c.shared_requests if c and c.shared_requests else 0.0


ELEMENTWISE_THREADS = 128  # CuPy's block size for an ElementwiseKernel


def count_kernel(spec, sizes=MODEL, dtype="float32", occupancy=True):
    """The KernelCounts of one registered kernel at `sizes`; without `occupancy`, only what the emulation
    counts (no NVRTC needed: resources, occupancy and SASS left None)."""
    if isinstance(spec, cuda.ElementwiseSpec):
        res = resources(spec, dtype) if occupancy else None
        occ = _occupancy(res.registers, ELEMENTWISE_THREADS, res.shared) if res else None
        code = sass.read(spec, (), dtype) if occupancy else None
        return KernelCounts(spec.name, "elementwise", res, ELEMENTWISE_THREADS, occ, 0, code=code)
    start, total = time.perf_counter(), None
    launches = model_launches(spec, sizes)
    dtype = launches[0][1].name  # the dtype its model call launches it in (bfloat16: the bf16 kernels)
    instance = sass.instance_for(spec, launches[0][4])
    res = resources(spec, dtype, instance=instance) if occupancy else None
    code = sass.read(spec, instance, dtype) if occupancy else None
    for _, dt, grid, block, args in launches:
        blocks = (spec.count_blocks or default_blocks)(grid, block, args)
        counts = traffic.count_launch(spec, dt, grid, block, args, blocks)
        total = counts if total is None else _added(total, counts)
    threads = int(np.prod(launches[0][3]))
    occ = _occupancy(res.registers, threads, res.shared) if res else None
    return KernelCounts(spec.name, "raw", res, threads, occ, spec.conflicts, total, len(launches),
                        time.perf_counter() - start, code, spec.warps_per_sm, dtype)


def occupancy_of(spec, sizes=MODEL):
    """The Occupancy of a RawKernel's blocks at `sizes` (its registers and shared memory from ptxas, for the
    instance and dtype the model launches)."""
    launch = model_launches(spec, sizes)[0]
    res = resources(spec, launch[1].name, instance=sass.instance_for(spec, launch[4]))
    return _occupancy(res.registers, int(np.prod(launch[3])), res.shared)


def _added(a, b):
    sites = {}
    for s in a.sites + b.sites:
        key = (s.line, s.memory, s.size, s.write)
        if key in sites:
            t = sites[key]
            t.requests, t.wavefronts, t.ideal = t.requests + s.requests, t.wavefronts + s.wavefronts, t.ideal + s.ideal
            t.sectors, t.worst = t.sectors + s.sectors, max(t.worst, s.worst)
        else:
            sites[key] = dataclasses.replace(s)
    return traffic.Counts(list(sites.values()), a.mma + b.mma, a.sfu + b.sfu, a.blocks + b.blocks)


def count_all(sizes=MODEL, names=None):
    """KernelCounts of every registered kernel (or those named), in the registry's order."""
    kernels = all_kernels()
    unknown = set(names or ()) - set(kernels)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}: choose from {', '.join(kernels)}")
    return [count_kernel(spec, sizes) for name, spec in kernels.items() if not names or name in names]


def problems(rows):
    """What breaks a kernel's declaration, in words: a spill in float32, a request more conflicted than
    its spec allows, fewer warps per SM than it declares, a branch in its mma loop or a loop whose loads
    are not issued ahead of its HMMAs."""
    found = []
    for r in rows:
        if r.occupancy and r.occupancy.warps < r.warps_declared:
            found.append(f"{r.name}: {r.occupancy.warps} warps per SM ({r.resources.registers} registers, "
                         f"{r.resources.shared} B of shared memory), under the {r.warps_declared} its spec declares")
        if r.code and r.code.hmma and r.code.branches:
            found.append(f"{r.name}: {r.code.branches} branches inside its mma loop (sm_90 SASS, {r.code.function})")
        if r.code and r.code.hmma and not r.code.pipelined:
            found.append(f"{r.name}: its mma loop is not pipelined: HMMA operands loaded a median "
                         f"{r.code.ahead_median:g} instructions ahead, under {sass.PIPELINED} (sm_90 SASS)")
        if r.resources.spill_stores or r.resources.spill_loads:
            found.append(f"{r.name}: spills {r.resources.spill_stores} bytes of stores and "
                         f"{r.resources.spill_loads} of loads in {r.dtype} (ptxas, sm_90)")
        if r.counts and r.counts.worst > r.declared:
            worst = max((s for s in r.counts.shared()), key=lambda s: s.worst)
            found.append(f"{r.name}: a shared-memory request {r.counts.worst}-way conflicted, more than the "
                         f"{r.declared} its spec declares, at `{worst.line}`")
    return found


def table(rows, sizes=MODEL):
    """The table `--counts` prints, as lines."""
    out = [f"every kernel, float32 (the *_bf16 kernels bfloat16), sm_90 (ptxas through NVRTC); RawKernels counted in the host emulation at "
           f"ANDREA-120M's step: {sizes.B} x {sizes.T} tokens, d {sizes.C}, {sizes.n_head} heads of {sizes.hs}, "
           f"MLP {sizes.F}, vocab {sizes.V} ({sizes.V_padded} padded)", "",
           f"{'kernel':<28} {'regs':>4} {'spill':>5} {'smem B':>6} {'threads':>7} {'blocks/SM':>9} "
           f"{'warps/SM':>8} {'limit':<9} {'smem req':>10} {'wavefronts':>11} {'wf/req':>6} {'worst':>5} "
           f"{'declared':>8} {'L2 sectors':>11} {'mma.sync':>10} {'sfu':>10}"]
    for r in rows:
        res, occ, c = r.resources, r.occupancy, r.counts
        line = (f"{r.name:<28} {res.registers:>4} {res.spill_stores + res.spill_loads:>5} {res.shared:>6} "
                f"{r.threads:>7} {occ.blocks:>9} {occ.warps:>8} {occ.limiter[:9]:<9}")
        if c is not None:
            line += (f" {c.shared_requests:>10,.0f} {c.wavefronts:>11,.0f} {r.wavefronts_per_request():>6.2f} "
                     f"{c.worst:>5} {r.declared:>8} {c.sectors:>11,.0f} {c.mma:>10,.0f} {c.sfu:>10,.0f}")
        else:
            line += f" {'(elementwise: no shared memory)':>52}"
        out.append(line)
    return out + ["", *sass_table(rows)]


def sass_table(rows):
    """The SASS half of the table: per kernel (the instance the model launches), its instructions, HMMAs,
    the mma loop's length and branches, the load-ahead of its HMMA operands, its warps per SM against the
    declared ones."""
    out = [f"sm_90 SASS (nvdisasm); the mma loop: first HMMA to last; load-ahead: instructions from an HMMA "
           f"operand's shared-memory load to the HMMA (pipelined: median >= {sass.PIPELINED})", "",
           f"{'kernel':<28} {'instrs':>7} {'HMMA':>5} {'mma loop':>8} {'branches':>8} {'ahead min':>9} "
           f"{'median':>6} {'warps/SM':>8} {'declared':>8}"]
    for r in rows:
        code = r.code
        if code is None:
            continue
        loop = (f"{code.loop:>8} {code.branches:>8} {code.ahead_min:>9} {code.ahead_median:>6g}" if code.hmma
                else f"{'-':>8} {'-':>8} {'-':>9} {'-':>6}")
        out.append(f"{r.name:<28} {code.instructions:>7} {code.hmma:>5} {loop} {r.occupancy.warps:>8} "
                   f"{r.warps_declared or '-':>8}")
    return out
