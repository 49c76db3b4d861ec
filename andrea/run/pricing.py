"""An op's time on an H200 or an H100 SXM, from what can be counted: each card's rates and latencies
(each with its source), the work each project kernel was counted to do at ANDREA-120M's shapes
(andrea/run/kernel_counts.json, written by `python -m andrea.run.stepmodel --count-kernels` from
minitensor.checks.counts: its mma.sync steps, shared-memory wavefronts, special functions, L2 sectors,
and the registers and shared memory ptxas gives it), and how an op of the step model's record is
priced with them (op_seconds). andrea/run/stepmodel.py records the ops.

- a project kernel: the larger of its resource time (the largest of its counted resources' times on the
  SM that holds the most of its blocks) and its latency bound: per mma.sync step, the shared-memory load
  latency not hidden by loads issued ahead (the kernel's `loads_ahead`) plus the mma latency, times the
  steps of that SM, over the warps resident on it (its occupancy, from its registers and shared memory)
  that hide one another's waits (latency_seconds);
- a cuBLAS GEMM: by shape, in waves of CTA tiles over the SMs, each wave at cuBLAS's per-tile rate
  for its operands' dtype: TF32's for float32, bf16's for bfloat16 (gemm_seconds);
- everything else at its bytes (HBM), a host<->device copy at PCIe; a launch cost each.

Counts are kept per dtype: a bf16 step prices each project kernel by the counts of its bfloat16
instance (its m16n8k16 mma steps, its wavefronts, registers and loads ahead read from its own SASS),
counted and kept as the float32 ones are; where a kernel has none yet, `kernel_work` says so (None)
and the step model names it (missing_counts).
"""

import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
import statistics
from pathlib import Path

from minitensor.precision import BF16, dtype_of


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    tf32_peak: float          # FLOP/s, dense tensor cores on TF32 operands: what a float32 step's MFU divides by
    bf16_peak: float          # FLOP/s, dense tensor cores on bfloat16 operands: what a bf16 step's MFU divides by
    sms: int                  # streaming multiprocessors
    clock: float              # Hz, the clock the tensor peak is quoted at (latencies in cycles of it)
    mma_clocks: float         # SM clocks per mma.sync step (m16n8k8 TF32, m16n8k16 bf16), warps of the SM together
    wavefronts_per_clock: float  # shared-memory wavefronts an SM serves per clock
    sfu_per_clock: float      # special-function results (exp, log, rcp) per SM per clock
    l2_bandwidth: float       # bytes/s of L2 hits
    shared_latency: float     # cycles from a shared-memory load's issue to its value's use
    mma_latency: float        # cycles from an mma.sync's issue to a product that depends on it
    gemm_tile_efficiency: float  # the share of an SM's TF32 peak one cuBLAS CTA tile runs at
    gemm_tile_efficiency_bf16: float  # the same share of its bf16 peak, from cuBLAS's measured bf16 GEMMs
    unaligned: float          # the factor on that for a GEMM with a leading dimension not a multiple of 16 bytes
    bandwidth: float          # bytes/s that memory-bound launches achieve
    launch_s: float           # seconds each launch costs beyond its work
    copy_latency_s: float     # a host<->device copy's fixed cost
    pcie: float               # bytes/s of a copy between host and device
    memory: int               # bytes of device memory (the dense attention core's budget reads it)

    def peak(self, compute="float32"):
        """FLOP/s of the dense tensor cores for GEMM operands stored in `compute` (a dtype's name): the bf16
        peak for bfloat16, the TF32 peak otherwise. What a step's MFU divides by."""
        return self.bf16_peak if compute == BF16 else self.tf32_peak

    def gemm_rate(self, compute="float32"):
        """FLOP/s one SM-wave of cuBLAS CTA tiles runs at, all SMs together, for operands of `compute`."""
        return self.peak(compute) * (self.gemm_tile_efficiency_bf16 if compute == BF16 else self.gemm_tile_efficiency)


# cuBLAS's TF32 GEMMs on Hopper, by CTA tile (M x N of C per thread block): the kernels it runs are named
# sm90_xmma_gemm_f32f32_tf32f32_f32_{tn,nt}_n_tilesize128x128x32_warpgroupsize1x1x1 and
# ..._tilesize256x128x32_warpgroupsize2x1x1 in the Nsight Systems profiles of PyTorch runs on H100s
# (profiles quoted in public repositories, found by searching for the kernel's name), with execute_segment_k
# variants that split K. One CTA per SM: a Hopper GEMM's pipeline stages fill most of the 228 KB of shared
# memory (CUTLASS's sm90 collective mainloops size their stages to it). The model lets cuBLAS pick the tile
# (128 x 128, 256 x 128 or 128 x 256) and a split of K into 1-8 segments, whichever finishes first, as its
# heuristics aim to; split partial sums cost their bytes (written and read once more: CUTLASS's
# "Parallelized Reductions: Split K" in media/docs/efficient_gemm.md).
GEMM_TILES = ((128, 128), (256, 128), (128, 256))
GEMM_SPLITS = range(1, 9)

# cuBLAS TF32 on an H100 SXM, measured at large shapes (M, N, K, FLOP/s): 8192^3 at 412 TFLOP/s
# (github.com/waynehacking8/blackwell-tensorcore-kernels, results/bench_sm90a.csv) and at 372
# (github.com/zzc0721/torch-performance-test-data, issue 79); 4096 x 8192 x 16384 at 320 (a public
# "CUDA Performance Study - NVIDIA H100 SXM5", CUDA 12.8). Each is its waves' utilisation times a
# per-tile rate: the per-tile rate is their median once the utilisation is divided out (tile_efficiency).
GEMM_MEASURED = ((8192, 8192, 8192, 412e12), (8192, 8192, 8192, 372e12), (4096, 8192, 16384, 319.7e12))
TF32_PEAK = 495e12

# cuBLAS bf16 (bfloat16 operands, float32 accumulation) on an H100 SXM, measured at large shapes, the same rule
# giving its per-tile rate: 8192^3 at 797.8 TFLOP/s and 6144^3 at 741.1 (github.com/pranjalssh/fast.cu,
# README.md, "Kernel 0: simple cuBLAS call", run on an H100 SXM), and 8192^3 at 518.6 on another H100 with
# CUDA 12.4 (pranjalssh/fast.cu issue 13). The dense bf16 peak: 989 TFLOP/s on the H100 SXM and the H200 alike
# (NVIDIA's H100 and H200 datasheets give 1,979 "with sparsity", twice the dense rate; = 132 SMs x 4096 FLOP
# per SM per clock x 1.83 GHz: twice TF32's per clock; deepseek-ai/FlashMLA issue 75 and karpathy/nanoGPT pull
# request 464 read the datasheet so).
GEMM_MEASURED_BF16 = ((8192, 8192, 8192, 797.8e12), (6144, 6144, 6144, 741.1e12), (8192, 8192, 8192, 518.6e12))
BF16_PEAK = 989e12


def tile_efficiency(measured=GEMM_MEASURED, peak=TF32_PEAK, sms=132):
    """The share of the peak one CTA tile runs at: the median over the measured GEMMs of their FLOP/s over
    what their waves of tiles (the best tile, unsplit) would reach at the full peak."""
    return statistics.median(rate / (peak * max(_utilisation(m, n, tile, sms) for tile in GEMM_TILES))
                             for m, n, _k, rate in measured)


def _utilisation(m, n, tile, sms, batch=1, split=1):
    """The share of the SM-waves of a GEMM's tiles that hold a tile: tiles / (waves x SMs)."""
    tiles = batch * math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * split
    return tiles / (math.ceil(tiles / sms) * sms)


# H200 SXM and H100 SXM: both GH100 with 132 SMs at the same clocks (the H200 is the H100 with 141 GB of
# HBM3e at 4.8 TB/s, NVIDIA's H200 datasheet; the H100 SXM 80 GB of HBM3 at 3.35 TB/s, NVIDIA's H100
# datasheet; L2 50 MB on both):
# - 495 TFLOP/s dense TF32 (989 with sparsity, the datasheets) = 132 SMs x 2048 FLOP per SM per clock
#   (four tensor cores of 256 TF32 FMAs) x 1.83 GHz, the clock NVIDIA quotes tensor peaks at (openxla/xla,
#   cuda_core_info_table.cc; llm.c's llmc/mfu.h: 528 tensor cores at 1830 MHz; the boost clock reaches
#   1.98 GHz, which the peak does not count). One mma.m16n8k8 step is 2048 FLOP: one SM clock at peak.
# - 989 TFLOP/s dense bf16 (above): 4096 FLOP per SM per clock, so one bf16 mma.m16n8k16 step (4096 FLOP) is
#   also one SM clock at its peak, and the same share of it (below) prices both.
# - mma.sync reaches ~63-65% of the tensor peak on Hopper, where wgmma reaches ~96% (instruction-level
#   microbenchmarks, Luo et al. 2025, arXiv:2501.12084, as cited by github.com/waynehacking8/
#   blackwell-tensorcore-kernels; FlashAttention-2, an mma.sync kernel, reaches ~35% of the H100 in
#   full, FlashAttention-3 paper, arXiv:2407.08608): 1 / 0.63 = 1.59 SM clocks per step. The first
#   lent GPU measures it (scripts/gpu_check.py's mma probe).
# - shared memory: 32 banks of 4 bytes, one wavefront (128 bytes) per SM per clock (CUDA C++ Programming
#   Guide, "Shared Memory"; FlashAttention-3 table 1: 31 TB/s for the H100 = 128 B x 132 x 1.83 GHz).
# - 16 special-function results per SM per clock (CUDA C++ Programming Guide's throughput table, as
#   FlashAttention-3 footnote 5 reads it).
# - L2: 9.6 TB/s, measured on an H200 for working sets of 10-40 MB (github.com/RRZE-HPC/gpu-benches,
#   gpu-l2-cache/h200.txt); the H100 SXM has the same L2 and clocks (an H100 PCIe, 114 SMs at lower
#   clocks, measured ~5.5 TB/s: Chips and Cheese, "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023).
# - a shared-memory load's latency to its use: 28.6 cycles, a pointer chase through shared memory on an
#   H100 SXM5 at 1.98 GHz (the "CUDA Performance Study - NVIDIA H100 SXM5" above, micro_benchmarks/
#   latency.cu: each load's address the previous load's value); Volta's was 19 (Jia et al. 2018,
#   "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", arXiv:1804.06826), Hopper's
#   pipeline is deeper (that study: 29 cycles for a dependent FADD chain, loop included).
# - an mma.sync's latency to a dependent product: 33 cycles, the serial latency of chained LDSMs measured
#   on sm_120, which that study reports as comparable to its chained HMMAs' (github.com/florianmattana/
#   sass-king, pull requests 28 and 32, RTX 5070 Ti, CUDA 13.2). No Hopper measurement of mma.sync's
#   latency was found: this is the model's least certain constant (at 16 cycles today's step would price
#   ~4 MFU points higher), and the first lent GPU should measure it.
# - GEMM: per CTA tile, tile_efficiency() of the peak (77% by the measurements above); bf16 GEMMs by the same
#   rule on cuBLAS's measured bf16 rates, tile_efficiency(GEMM_MEASURED_BF16, BF16_PEAK) of the bf16 peak.
# - half that for a GEMM with a leading dimension that is not a multiple of 16 bytes: Hopper's fast GEMM
#   kernels load tiles with TMA, whose global strides must be multiples of 16 bytes (CUDA driver API,
#   cuTensorMapEncodeTiled), so cuBLAS falls back to Ampere-style kernels; an align1 kernel ran at 74% of
#   the aligned one on an RTX 4090 (github.com/pytorch/pytorch issue 181718). No GEMM of the step has
#   one (the head's rows are padded to 8576), so no figure of the table rests on it.
# - memory achieved by streaming kernels: 4.0 TB/s on the H200, 83% of the 4.8 nominal (a device-to-device
#   copy measured ~4.3 TB/s on the lent H200, SPEC.md section 5); the same 83% of the H100's 3.35: 2.8 TB/s.
# - 4 us per launch: back-to-back launches measured 3.8 us each on a V100 (NVIDIA's blog "Getting
#   Started with CUDA Graphs") and ~2.1 us on an H100 (Hazy Research, "Look Ma, No Bubbles!", 2025):
#   the slower figure, rounded up.
# - host<->device: ~10 us per copy that the host waits for (a read back; `ndarray.set` from pageable
#   memory) plus ~20 GB/s.
H200 = Hardware("H200", tf32_peak=TF32_PEAK, bf16_peak=BF16_PEAK, sms=132, clock=1.83e9, mma_clocks=1 / 0.63,
                wavefronts_per_clock=1.0, sfu_per_clock=16.0, l2_bandwidth=9.6e12, shared_latency=28.6,
                mma_latency=33.0,
                gemm_tile_efficiency=tile_efficiency(),
                gemm_tile_efficiency_bf16=tile_efficiency(GEMM_MEASURED_BF16, BF16_PEAK), unaligned=0.5,
                bandwidth=4.0e12, launch_s=4e-6, copy_latency_s=10e-6, pcie=20e9, memory=141 * 10**9)
H100 = dataclasses.replace(H200, name="H100 SXM", bandwidth=4.0e12 * 3.35 / 4.8, memory=80 * 10**9)
PROFILES = {"h200": H200, "h100": H100}

LAUNCHES = ("gemm", "kernel", "elementwise", "reduction", "copy", "fill", "gather", "scatter", "sort")
TRANSFERS = ("h2d", "d2h", "h2d_async")


# ---------------------------------------------------------------------------------------------
# What each project kernel does at ANDREA-120M's shapes, counted in the host emulation


@dataclasses.dataclass(frozen=True)
class KernelWork:
    """One launch of a RawKernel at the model's shapes, counted (minitensor.checks.counts): its mma.sync
    steps, shared-memory wavefronts, special-function calls, L2 sectors and blocks; what a recorded launch
    is scaled by (its declared FLOPs for a tensor-core kernel, or its bytes) and its bytes to and from
    device memory; its threads per block, and the registers per thread and bytes of shared memory ptxas
    gives it (0 registers: not known, without NVRTC); and how many mma steps ahead of the product that
    uses it each operand's shared-memory load is issued in its compiled code (0: none ahead, each step
    waits out its loads)."""
    mma: float
    wavefronts: float
    sfu: float
    sectors: float
    blocks: float
    per: float
    by_flops: bool
    moved: float = 0.0
    threads: int = 0
    registers: int = 0
    shared: int = 0
    loads_ahead: float = 0.0

    @property
    def resident(self):
        """Blocks one SM holds at once (the occupancy calculator's rules, minitensor.checks.counts); 0 when
        the registers are not known."""
        from minitensor.checks.counts import _occupancy

        return _occupancy(self.registers, self.threads, self.shared).blocks if self.registers else 0

    @property
    def warps(self):
        """Warps per block."""
        return -(-self.threads // 32)


COUNTS = Path(__file__).with_name("kernel_counts.json")  # the counts at ANDREA-120M's shapes, kept in the tree
FIELDS = {f.name for f in dataclasses.fields(KernelWork)}


class NotCounted(Exception):
    """A kernel that cannot be counted in a dtype here: its message says why, in one line."""


class OtherDtype(NotCounted):
    """A kernel whose model call launches it in another dtype: nothing of this one to count."""


def kernel_work(name, dtype="float32"):
    """The KernelWork of the registered RawKernel `name` in dtype (None for another kind, and for a dtype the
    kernel has no counted instance of: one its model call does not launch): from COUNTS where it was counted
    from the kernel's present source in that dtype with the present counting code, else counted now (tens of
    seconds; `python -m andrea.run.stepmodel --count-kernels` writes them all to COUNTS)."""
    return _work_or_why(name, dtype)[0]


@functools.cache
def _work_or_why(name, dtype):
    """(KernelWork, "") or (None, why not, in one line): kernel_work's, kept once a process."""
    from minitensor.backends import all_kernels, cuda

    spec = all_kernels().get(name)
    if not isinstance(spec, cuda.RawSpec) or spec.model is None:
        return None, f"{name} is not a counted RawKernel"
    kept = _kept_works().get(name, {}).get(dtype)
    try:
        if kept is not None and kept["key"] == work_key(spec, dtype) and set(kept["work"]) == FIELDS:
            return KernelWork(**kept["work"]), ""
        return _counted(name, dtype), ""
    except NotCounted as e:
        return None, str(e)


def own_work(name):
    """(dtype, KernelWork) of a RawKernel in the first of COUNTED_DTYPES it is counted in (its model call's
    dtype: float32, or bfloat16 for a bf16-only kernel); (None, None) for another kind."""
    for dtype in COUNTED_DTYPES:
        work = kernel_work(name, dtype)
        if work is not None:
            return dtype, work
    return None, None


def work_in(name, compute):
    """(KernelWork or None, how) a launch of RawKernel `name` in a step of `compute` is priced with: "counted"
    from its counts in that dtype; "scaled" from its float32 counts, for a memory-bound kernel (priced by its
    bytes: its sectors and the rest scaled by the launch's own bytes, which the record holds in `compute`);
    "missing" for a tensor-core kernel (priced by its FLOPs) without counts in `compute`, priced meanwhile by
    its float32 counts if it has any: such a figure is not final."""
    work = kernel_work(name, compute)
    if work is not None:
        return work, "counted"
    fallback = kernel_work(name)
    if fallback is not None and not fallback.by_flops:
        return fallback, "scaled"
    return fallback, "missing"


def missing_counts(names, compute):
    """{kernel name: why} for each of the project kernels `names` a step of `compute` launches whose price is
    not final (work_in's "missing"): a tensor-core kernel without counts in that dtype."""
    return {name: _work_or_why(name, compute)[1] for name, how in priced_how(names, compute).items()
            if how == "missing"}


def priced_how(names, compute):
    """{kernel name: work_in's how} for those of `names` that are counted RawKernels."""
    from minitensor.backends import all_kernels, cuda

    kernels = all_kernels()
    return {name: work_in(name, compute)[1] for name in names
            if isinstance(kernels.get(name), cuda.RawSpec) and kernels[name].model is not None}


@functools.cache
def _kept_works():
    """{kernel name: {dtype: {"key", "work"}}} as COUNTS keeps them."""
    try:
        return json.loads(COUNTS.read_text())
    except (OSError, ValueError):
        return {}


def work_key(spec, dtype="float32"):
    """What a kept count is valid for: the kernel's source in dtype and the code that counts it."""
    from minitensor.checks import counts, emulation, traffic

    key = hashlib.sha256(f"{counts.MODEL}".encode())
    for part in (Path(emulation.__file__), Path(traffic.__file__), Path(counts.__file__)):
        key.update(part.read_bytes())
    try:
        key.update(spec.source(dtype_of(dtype)).encode())
    except (ImportError, KeyError, ValueError, TypeError) as e:  # no kernel type for dtype here, or no instance
        raise NotCounted(f"{spec.name} has no {dtype} source ({type(e).__name__}: {e})") from None
    return key.hexdigest()[:16]


def _model_launches(spec, dtype):
    """The launches of the kernel's model call (minitensor.checks.counts.model_launches; in dtype where it
    takes one), each checked to be a launch of dtype: a model call that launches another dtype (a bf16-only
    kernel's, or a kernel counted in float32 only) counts nothing of dtype."""
    from minitensor.checks import counts

    takes_dtype = "dtype" in inspect.signature(counts.model_launches).parameters
    launches = counts.model_launches(spec, counts.MODEL, **({"dtype": dtype_of(dtype)} if takes_dtype else {}))
    if any(launch[1].name != dtype for launch in launches):
        raise OtherDtype(f"{spec.name}'s model call launches it in {launches[0][1].name}, not {dtype}")
    return launches


@functools.cache
def _counted(name, dtype="float32"):
    from minitensor.backends import all_kernels, cuda
    from minitensor.checks import counts, traffic

    spec = all_kernels()[name]
    work_key(spec, dtype)  # NotCounted where the kernel has no source in dtype
    try:
        launches = _model_launches(spec, dtype)
        c = None  # summed over the launches, each counted in the emulation (counts.count_kernel's sum)
        for _, dt, grid, block, args in launches:
            blocks = (spec.count_blocks or counts.default_blocks)(grid, block, args)
            one = traffic.count_launch(spec, dt, grid, block, args, blocks)
            c = one if c is None else counts._added(c, one)
    except NotCounted:
        raise
    except Exception as e:
        if dtype == "float32":
            raise
        raise NotCounted(f"{name} in {dtype}: {type(e).__name__}: {e}") from None
    try:
        res = counts.resources(spec, dtype, instance=_instance(launches[0][4], spec))
        registers, shared = res.registers, res.shared
    except cuda.ToolchainMissing:
        registers = shared = 0
    _, _, _, block, args = launches[0]
    flops, moved = spec.flops_of(args), float(sum(spec.bytes_moved(args)))
    n = len(launches)
    return KernelWork(c.mma / n, c.wavefronts / n, c.sfu / n, c.sectors / n, c.blocks / n,
                      float(flops or moved), bool(flops), moved, math.prod(block), registers, shared,
                      loads_ahead_of(spec, args, dtype))


def _instance(args, spec):
    from minitensor.checks import sass

    return sass.instance_for(spec, args)


def loads_ahead_of(spec, args=None, dtype="float32"):
    """How many mma steps ahead of its product the kernel's compiled code issues each operand's
    shared-memory load, read from its sm_90 SASS (minitensor.checks.sass, the instance of dtype a launch with
    args runs): the median load-ahead distance in instructions over the instructions per HMMA in its mma
    loop. Where the SASS cannot be read here (no NVRTC or nvdisasm), the figure its RawSpec declares
    (`loads_ahead`), else 0: each load priced as issued just before its HMMA."""
    from minitensor.backends.cuda import ToolchainMissing
    from minitensor.checks import sass

    try:
        code = sass.read(spec, sass.instance_for(spec, args) if args is not None else (), dtype)
    except (ToolchainMissing, sass.NvdisasmMissing):
        return float(getattr(spec, "loads_ahead", 0))
    return code.ahead_median * code.hmma / code.loop if code.hmma else 0.0


COUNTED_DTYPES = ("float32", BF16)  # what --count-kernels counts each kernel in: the training path's, each precision


def write_counts(path=COUNTS):
    """Counts every RawKernel that declares a model call, in each of COUNTED_DTYPES it has an instance of, and
    writes them to path (whole or not at all): ({name: {dtype: {"key", "work"}}}, {(name, dtype): why not}, the
    latter for the dtypes a kernel's model call launches that could not be counted here)."""
    from minitensor.backends import all_kernels, cuda

    works, missing = {}, {}
    for name, spec in all_kernels().items():
        if not isinstance(spec, cuda.RawSpec) or spec.model is None:
            continue
        for dtype in COUNTED_DTYPES:
            try:
                works.setdefault(name, {})[dtype] = {"key": work_key(spec, dtype),
                                                     "work": dataclasses.asdict(_counted(name, dtype))}
            except OtherDtype:
                continue
            except NotCounted as e:
                missing[(name, dtype)] = str(e)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(works, indent=1) + "\n")
    os.replace(tmp, path)
    _kept_works.cache_clear()
    _work_or_why.cache_clear()
    return works, missing


# ---------------------------------------------------------------------------------------------
# A card's time for a record

# The bounds an op's time can have, in the table's words, and the count each prices.
DRIVERS = ("GEMM", "HBM", "mma.sync", "shared memory", "L2", "SFU", "latency", "PCIe")
COUNTED_BY = {"GEMM": "FLOPs, in waves of CTA tiles", "HBM": "bytes", "mma.sync": "mma.sync steps",
              "shared memory": "wavefronts", "L2": "32-byte sectors", "SFU": "special-function calls",
              "latency": "mma steps x (unhidden load + mma latency) / resident warps", "PCIe": "bytes"}


def op_seconds(kind, name, flops, read, written, blocks=0, hw=H200, shape=(), works=None, compute="float32"):
    """(seconds of work, what bounds it, launch seconds) of one op of a step whose GEMM operands and
    activations are stored in `compute` (float32, or bfloat16 for a bf16 step). shape: a GEMM's output shape
    (its tiles); works: {kernel name: KernelWork} to price instead of the counted ones. A project kernel is
    priced by its counts in `compute`, or as work_in says where it has none (a tensor-core kernel without
    them is named by missing_counts, and the step model says that figure is not final)."""
    moved = (read + written) / hw.bandwidth
    if kind == "gemm":
        return (*gemm_seconds(flops, shape, read + written, hw, "unaligned" in name, compute), hw.launch_s)
    if kind == "h2d_async":  # queued on the stream, the host not waiting: its PCIe time and its submission
        return read / hw.pcie, "PCIe", hw.launch_s
    if kind in TRANSFERS:
        return hw.copy_latency_s + read / hw.pcie, "PCIe", 0.0
    work = None
    if kind == "kernel":
        work = (works or {}).get(name) or work_in(name, compute)[0]
    if work is None:
        return moved, "HBM", hw.launch_s
    return (*counted_seconds(work, flops if work.by_flops else read + written, blocks, moved, hw), hw.launch_s)


def gemm_seconds(flops, shape, nbytes, hw=H200, unaligned=False, compute="float32"):
    """(seconds, "GEMM" or "HBM") of a cuBLAS GEMM of `flops` on operands of `compute` writing an output of
    `shape` (batch..., M, N; a GEMV's a vector) and moving nbytes: its tiles in waves over the SMs, each
    wave one tile's time at the per-tile rate of that dtype (hw.gemm_rate: TF32's or bf16's), for the tile
    and split of K that finish first (GEMM_TILES, GEMM_SPLITS), or its bytes at the memory bandwidth where
    they take longer. Without a shape: the FLOPs at the per-tile rate, as if the waves were full."""
    rate = hw.gemm_rate(compute) * (hw.unaligned if unaligned else 1.0)
    if not shape or not flops:
        return max((flops / rate, "GEMM"), (nbytes / hw.bandwidth, "HBM"))
    M, N = (shape[-2], shape[-1]) if len(shape) > 1 else (shape[-1], 1)
    batch = math.prod(shape[:-2])
    K = flops / (2 * batch * M * N)
    best = None
    for tile in GEMM_TILES:
        for split in GEMM_SPLITS:
            tiles = batch * math.ceil(M / tile[0]) * math.ceil(N / tile[1]) * split
            compute = math.ceil(tiles / hw.sms) * 2 * tile[0] * tile[1] * K / split / (rate / hw.sms)
            partials = 8 * batch * M * N * split if split > 1 else 0  # each segment's sums written, read back
            t = max((compute, "GEMM"), ((nbytes + partials) / hw.bandwidth, "HBM"))
            best = t if best is None or t[0] < best[0] else best
    return best


def counted_seconds(work, size, blocks, moved, hw=H200):
    """(seconds, what bounds them) of a RawKernel launch of `size` (its FLOPs or bytes) over `blocks`
    blocks: the largest of kernel_times."""
    return max((t, d) for d, t in kernel_times(work, size, blocks, moved, hw).items())


def kernel_times(work, size, blocks, moved, hw=H200):
    """{bound: seconds} of a RawKernel launch of `size` over `blocks` blocks, from its counted work at the
    model's shapes scaled by size: each resource's time on the SM that holds the most blocks (sm_share),
    its bytes at the memory bandwidth (moved, in seconds), and its latency bound on that SM."""
    scale = size / work.per if work.per else 1.0
    blocks = blocks or max(1.0, work.blocks * scale)
    share = sm_share(blocks, work.resident, hw.sms)
    clocks = hw.clock / share  # one SM's clocks a second, over the share of the work it holds
    return {"HBM": moved, "mma.sync": scale * work.mma * hw.mma_clocks / clocks,
            "shared memory": scale * work.wavefronts / (hw.wavefronts_per_clock * clocks),
            "SFU": scale * work.sfu / (hw.sfu_per_clock * clocks),
            "L2": scale * work.sectors * 32 / hw.l2_bandwidth,
            "latency": latency_seconds(work, scale * work.mma * share, share * max(1, round(blocks)), hw)}


def chain_cycles(work, hw=H200):
    """Cycles one warp takes per mma.sync step when nothing else hides its waits: the shared-memory
    load's latency less what loads issued `loads_ahead` steps earlier hide (each step at least an mma
    latency), plus the mma's latency to the next product."""
    return max(0.0, hw.shared_latency - work.loads_ahead * hw.mma_latency) + hw.mma_latency


def resident_warps(work, blocks_on_sm):
    """Warps resident on an SM that runs blocks_on_sm of the launch's blocks in all: its occupancy's blocks
    (or fewer, where it gets fewer) times the warps of a block."""
    return work.warps * max(1, min(work.resident, math.ceil(blocks_on_sm)))


def latency_seconds(work, steps, blocks_on_sm, hw=H200):
    """The latency bound of an SM that runs `steps` mma.sync steps of the kernel over blocks_on_sm blocks:
    each step's dependency chain (chain_cycles), hidden only by the other resident warps (its schedulers
    issue one warp's step while the others wait). 0 for a kernel without mma steps or whose registers are
    not known (its occupancy unknown: no latency priced)."""
    if not work.mma or not work.registers:
        return 0.0
    return steps * chain_cycles(work, hw) / resident_warps(work, blocks_on_sm) / hw.clock


def sm_share(blocks, resident, sms):
    """The share of a launch's blocks the busiest SM runs: in waves of sms x resident blocks (resident:
    the blocks one SM holds at once, its occupancy; 0 when unknown: one wave), the last wave's blocks
    spread one SM at a time. 1 / sms when the blocks divide evenly."""
    blocks = max(1, int(round(blocks)))
    per_wave = sms * resident if resident else blocks
    waves = -(-blocks // per_wave)
    last = blocks - (waves - 1) * per_wave
    return ((waves - 1) * (resident or 0) + -(-last // sms)) / blocks


@dataclasses.dataclass(frozen=True)
class KernelPrice:
    """One launch of a project kernel at ANDREA-120M's shapes, priced on a card."""
    name: str
    seconds: float            # work seconds: the largest of `times`
    launch_s: float           # the launch's own cost, beside
    bound: str                # what `seconds` is: a resource of DRIVERS or "latency"
    times: dict               # {bound: seconds} for every resource and the latency bound
    resident_warps: int       # warps an SM holds at once (0: registers not known)
    chain_cycles: float       # one warp's cycles per mma step, unhidden (0: no mma steps)
    flops: float              # the launch's declared tensor FLOPs (0: not a tensor-core kernel)


def kernel_prices(hw=H200, works=None, dtype=None):
    """{kernel name: KernelPrice} of one launch of every project RawKernel counted at ANDREA-120M's
    shapes (the launch `python -m minitensor.checks --counts` counts: work.per FLOPs or bytes over
    work.blocks blocks, work.moved bytes), priced on hw as the step model prices it in a step.

    For gpu_check, which times the same launches on the lent GPU and prints measured against priced,
    kernel by kernel: `seconds + launch_s` is the priced time of one launch, `bound` what it rests on.
    works: {name: KernelWork} to price instead of the kept counts (e.g. registers a change expects); dtype:
    the instances priced (None: each kernel in the dtype its model call launches, own_work; bfloat16: those
    counted in bf16 only)."""
    from minitensor.backends import all_kernels, cuda

    counted = [name for name, spec in all_kernels().items() if isinstance(spec, cuda.RawSpec) and spec.model]
    works = {**{name: own_work(name)[1] if dtype is None else kernel_work(name, dtype) for name in counted},
             **(works or {})}
    works = {name: work for name, work in works.items() if work is not None}
    prices = {}
    for name, work in works.items():
        times = kernel_times(work, work.per, work.blocks, work.moved / hw.bandwidth, hw)
        seconds, bound = max((t, d) for d, t in times.items())
        share = sm_share(work.blocks, work.resident, hw.sms)
        prices[name] = KernelPrice(name, seconds, hw.launch_s, bound, times,
                                   resident_warps(work, share * work.blocks) if work.registers else 0,
                                   chain_cycles(work, hw) if work.mma else 0.0, work.per if work.by_flops else 0.0)
    return prices
