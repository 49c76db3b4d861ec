"""An op's time on an H200, from what can be counted: the GPU's rates (each with its source), the work
each project kernel was counted to do at ANDREA-120M's shapes (andrea/run/kernel_counts.json, written by
`python -m andrea.run.stepmodel --count-kernels` from minitensor.checks.counts), and how an op of the
step model's record is priced with them (op_seconds). andrea/run/stepmodel.py records the ops.
"""

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    tf32_peak: float          # FLOP/s, dense tensor cores: what MFU divides by
    sms: int                  # streaming multiprocessors
    clock: float              # Hz, the clock the tensor peak is quoted at
    mma_clocks: float         # SM clocks per mma.sync.m16n8k8 (TF32) step, warps of the SM together
    wavefronts_per_clock: float  # shared-memory wavefronts an SM serves per clock
    sfu_per_clock: float      # special-function results (exp, log, rcp) per SM per clock
    l2_bandwidth: float       # bytes/s of L2 hits
    gemm_efficiency: float    # the share of the TF32 peak cuBLAS reaches at the step's GEMM shapes
    unaligned: float          # the factor on that for a GEMM with a leading dimension not a multiple of 16 bytes
    bandwidth: float          # bytes/s that memory-bound launches achieve
    launch_s: float           # seconds each launch costs beyond its work
    copy_latency_s: float     # a host<->device copy's fixed cost
    pcie: float               # bytes/s of a copy between host and device
    memory: int               # bytes of device memory (the dense attention core's budget reads it)


# H200 SXM (GH100: the H100 SXM's 132 SMs and clocks, 141 GB of HBM3e at 4.8 TB/s):
# - 495 TFLOP/s dense TF32 = 132 SMs x 2048 FLOP per SM per clock (four tensor cores of 256 TF32 FMAs)
#   x 1.83 GHz, the clock NVIDIA quotes tensor peaks at (openxla/xla, cuda_core_info_table.cc; llm.c's
#   llmc/mfu.h: 528 tensor cores at 1830 MHz). One mma.m16n8k8 step is 2048 FLOP: one SM clock at peak.
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
#   gpu-l2-cache/h200.txt; an H100 PCIe measured ~5.5 TB/s at its slower clocks and 114 SMs, Chips and
#   Cheese, "Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023).
# - 70% of the TF32 peak for the GEMMs: cuBLAS TF32 on an H100 SXM measured 319, 399 and 412 TFLOP/s
#   at 2048^3, 4096^3 and 8192^3 (64%, 81%, 83%: waynehacking8/blackwell-tensorcore-kernels,
#   results/bench_sm90a.csv), 335, 402 and 372 in another (github.com/zzc0721/torch-performance-test-data
#   issue 79). The step's Linear GEMMs are 10-106 GFLOP each (2048^3 is 17, 4096^3 is 137) with one side
#   768 wide, so the lower end. The attention core's batched GEMMs (K = 64, or 64-wide outputs) fall on
#   the memory side of max() at any efficiency.
# - half that for a GEMM with a leading dimension that is not a multiple of 16 bytes: Hopper's fast GEMM
#   kernels load tiles with TMA, whose global strides must be multiples of 16 bytes (CUDA driver API,
#   cuTensorMapEncodeTiled), so cuBLAS falls back to Ampere-style kernels; an align1 kernel ran at 74% of
#   the aligned one on an RTX 4090 (github.com/pytorch/pytorch issue 181718). No GEMM of the step has
#   one (the head's rows are padded to 8576), so no figure of the table rests on it.
# - 4.0 TB/s achieved by streaming kernels: 83% of the 4.8 nominal; a device-to-device copy measured
#   ~4.3 TB/s on the lent H200 (SPEC.md section 5).
# - 4 us per launch: back-to-back launches measured 3.8 us each on a V100 (NVIDIA's blog "Getting
#   Started with CUDA Graphs") and ~2.1 us on an H100 (Hazy Research, "Look Ma, No Bubbles!", 2025):
#   the slower figure, rounded up.
# - host<->device: ~10 us per copy that the host waits for (a read back; `ndarray.set` from pageable
#   memory) plus ~20 GB/s.
H200 = Hardware("H200", tf32_peak=495e12, sms=132, clock=1.83e9, mma_clocks=1 / 0.63, wavefronts_per_clock=1.0,
                sfu_per_clock=16.0, l2_bandwidth=9.6e12, gemm_efficiency=0.70, unaligned=0.5, bandwidth=4.0e12,
                launch_s=4e-6, copy_latency_s=10e-6, pcie=20e9, memory=141 * 10**9)

LAUNCHES = ("gemm", "kernel", "elementwise", "reduction", "copy", "fill", "gather", "scatter", "sort")
TRANSFERS = ("h2d", "d2h", "h2d_async")


# ---------------------------------------------------------------------------------------------
# What each project kernel does at ANDREA-120M's shapes, counted in the host emulation


@dataclasses.dataclass(frozen=True)
class KernelWork:
    """One launch of a RawKernel at the model's shapes, counted (minitensor.checks.counts): its mma.sync
    steps, shared-memory wavefronts, special-function calls, L2 sectors and blocks, the blocks of it one
    SM holds (0: not known here, without NVRTC), and what a recorded launch is scaled by: its declared
    FLOPs (a tensor-core kernel) or its bytes."""
    mma: float
    wavefronts: float
    sfu: float
    sectors: float
    blocks: float
    resident: int
    per: float
    by_flops: bool


COUNTS = Path(__file__).with_name("kernel_counts.json")  # the counts at ANDREA-120M's shapes, kept in the tree


def kernel_work(name):
    """The KernelWork of the registered RawKernel `name` (None for another kind): from COUNTS where it
    was counted from the kernel's present source with the present counting code, else counted now
    (tens of seconds; `python -m andrea.run.stepmodel --count-kernels` writes them all to COUNTS)."""
    from minitensor.backends import all_kernels, cuda

    spec = all_kernels().get(name)
    if not isinstance(spec, cuda.RawSpec) or spec.model is None:
        return None
    kept = _kept_works().get(name)
    if kept is not None and kept["key"] == work_key(spec):
        return KernelWork(**kept["work"])
    return _counted(name)


@functools.cache
def _kept_works():
    try:
        return json.loads(COUNTS.read_text())
    except (OSError, ValueError):
        return {}


def work_key(spec):
    """What a kept count is valid for: the kernel's source and the code that counts it."""
    from minitensor.checks import counts, emulation, traffic

    key = hashlib.sha256(f"{counts.MODEL}".encode())
    for part in (Path(emulation.__file__), Path(traffic.__file__), Path(counts.__file__)):
        key.update(part.read_bytes())
    key.update(spec.source("float32").encode())
    return key.hexdigest()[:16]


@functools.cache
def _counted(name):
    from minitensor.backends import all_kernels, cuda
    from minitensor.checks import counts

    spec = all_kernels()[name]
    kc = counts.count_kernel(spec, occupancy=False)
    try:
        resident = counts.occupancy_of(spec).blocks
    except cuda.ToolchainMissing:
        resident = 0
    _, _, _, _, args = counts.model_launches(spec)[0]
    flops = spec.flops_of(args)
    c, n = kc.counts, kc.launches
    return KernelWork(c.mma / n, c.wavefronts / n, c.sfu / n, c.sectors / n, c.blocks / n, resident,
                      float(flops or sum(spec.bytes_moved(args))), bool(flops))


def write_counts(path=COUNTS):
    """Counts every RawKernel that declares a model call and writes them to path (whole or not at all)."""
    from minitensor.backends import all_kernels, cuda

    works = {name: {"key": work_key(spec), "work": dataclasses.asdict(_counted(name))}
             for name, spec in all_kernels().items() if isinstance(spec, cuda.RawSpec) and spec.model is not None}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(works, indent=1) + "\n")
    os.replace(tmp, path)
    _kept_works.cache_clear()
    return works


# ---------------------------------------------------------------------------------------------
# The H200's time for a record

# The resources an op's time can be bound by, in the table's words.
DRIVERS = ("GEMM", "HBM", "mma.sync", "shared memory", "L2", "SFU", "PCIe")


def op_seconds(kind, name, flops, read, written, blocks=0, hw=H200):
    """(seconds of work, what bounds it, launch seconds) of one op."""
    moved = (read + written) / hw.bandwidth
    if kind == "gemm":
        rate = hw.tf32_peak * hw.gemm_efficiency * (hw.unaligned if "unaligned" in name else 1.0)
        return max((flops / rate, "GEMM"), (moved, "HBM")) + (hw.launch_s,)
    if kind == "h2d_async":  # queued on the stream, the host not waiting: its PCIe time and its submission
        return read / hw.pcie, "PCIe", hw.launch_s
    if kind in TRANSFERS:
        return hw.copy_latency_s + read / hw.pcie, "PCIe", 0.0
    work = kernel_work(name) if kind == "kernel" else None
    if work is None:
        return moved, "HBM", hw.launch_s
    return (*counted_seconds(work, flops if work.by_flops else read + written, blocks, moved, hw), hw.launch_s)


def counted_seconds(work, size, blocks, moved, hw=H200):
    """(seconds, what bounds them) of a RawKernel launch of `size` (its FLOPs or bytes) over `blocks`
    blocks, from its counted work at the model's shapes scaled by size: each resource's time on the SM
    that holds the most blocks (sm_share), the largest of them."""
    scale = size / work.per if work.per else 1.0
    share = sm_share(blocks or max(1.0, work.blocks * scale), work.resident, hw.sms)
    clocks = hw.clock / share  # one SM's clocks a second, over the share of the work it holds
    times = [(moved, "HBM"), (scale * work.mma * hw.mma_clocks / clocks, "mma.sync"),
             (scale * work.wavefronts / (hw.wavefronts_per_clock * clocks), "shared memory"),
             (scale * work.sfu / (hw.sfu_per_clock * clocks), "SFU"),
             (scale * work.sectors * 32 / hw.l2_bandwidth, "L2")]
    return max(times)


def sm_share(blocks, resident, sms):
    """The share of a launch's blocks the busiest SM runs: in waves of sms x resident blocks (resident:
    the blocks one SM holds at once, its occupancy; 0 when unknown: one wave), the last wave's blocks
    spread one SM at a time. 1 / sms when the blocks divide evenly."""
    blocks = max(1, int(round(blocks)))
    per_wave = sms * resident if resident else blocks
    waves = -(-blocks // per_wave)
    last = blocks - (waves - 1) * per_wave
    return ((waves - 1) * (resident or 0) + -(-last // sms)) / blocks
