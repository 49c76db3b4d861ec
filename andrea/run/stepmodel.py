"""The step model: every launch of an ANDREA training step on a GPU, counted, and its time on an H200 estimated.

    python -m andrea.run.stepmodel                     # ANDREA-120M, 8 x 1024: the table by layer, the estimate, MFU
    python -m andrea.bench --device gpu --model h200   # the same table
    estimate_step_seconds()          # seconds of one bench step (1 micro-batch + AdamW), for gpu_check

Recorded, not guessed: the training step (andrea.run.trainer.Trainer.train_step: zero_grad, forward and
backward over the micro-batches, the gradient norm, the clipping scale, the one host read, AdamW)
runs with the GPU backend (`kernels='fused'`) on the CuPy stand-in in its recording mode
(tests/cupy_standin/cupy/_record.py): arrays of the real size that are never computed nor touched,
each CuPy launch recorded with its shapes, its GEMM FLOPs and the bytes it reads and writes (the
project's RawKernels declare theirs: minitensor.backends.cuda.RawSpec.traffic, and the flash
attention kernels their tensor-core FLOPs, RawSpec.flops). The launch count, the paths taken (the
flash attention core for ANDREA's heads of 64) and every shape are those of the real step; only time
is modelled, per launch:

    time = max(GEMM FLOPs / GEMM rate, bytes / memory bandwidth) + launch cost
    (a kernel's declared FLOPs at the rate for a hand-written tensor-core kernel, H200.mma_kernel)

with the H200 figures of `H200` below (each with its reason), and host<->device copies that the host
waits for at a latency plus PCIe time; an asynchronous one (`cupy.asarray` of host data: CuPy 14.2
stages it in pinned memory and copies it on the current stream) at its PCIe time plus a launch's
cost. MFU is the bench's: (6 N + 12 L d T) FLOPs per token (flops_per_token) over the step time and
the dense TF32 peak. The model cannot see: kernels overlapping, cache reuse between
launches, cuBLAS's choice of kernel per shape, clocks under power limits, the host falling behind
when launches are short (CuPy's Python costs ~5-10 us a call on the host; launches are queued
asynchronously, so the host hides behind long kernels only). gpu_check prints this estimate beside
the measured step when a GPU is lent: the first real run calibrates it.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import types
from collections import defaultdict
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.errors import UserError
from andrea.model.transformer import ANDREA, flops_per_token

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "cupy_standin"


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    tf32_peak: float          # FLOP/s, dense tensor cores: what MFU divides by
    gemm_efficiency: float    # the share of it cuBLAS reaches at the step's GEMM shapes
    unaligned: float          # the factor on that for a GEMM with a leading dimension not a multiple of 16 bytes
    bandwidth: float          # bytes/s that memory-bound launches achieve
    launch_s: float           # seconds each launch costs beyond its work
    copy_latency_s: float     # a host<->device copy's fixed cost
    pcie: float               # bytes/s of a copy between host and device
    memory: int               # bytes of device memory (the dense attention core's budget reads it)
    mma_kernel: float         # FLOP/s of the inner products of a hand-written tensor-core kernel (the flash core)


# H200 SXM (GH100: the H100 SXM's 132 SMs and clocks, 141 GB of HBM3e at 4.8 TB/s):
# - 495 TFLOP/s dense TF32 (NVIDIA's datasheet, sparsity excluded; SPEC.md section 4).
# - 70% of it for the GEMMs: cuBLAS TF32 on an H100 SXM measured 335 TFLOP/s at 2048^3 (68%), 402 at
#   4096^3 (81%) and 372 at 8192^3 (75%, clocks capped by power) (github.com/zzc0721/
#   torch-performance-test-data issue 79, PyTorch 2.7 + CUDA 12.8). The step's Linear GEMMs are 10-106
#   GFLOP each (2048^3 is 17, 4096^3 is 137) with one side 768 wide (fewer, smaller tiles than a square
#   product of the same work), so the lower end. The attention core's batched GEMMs (K = 64, or
#   64-wide outputs) fall on the memory side of max() at any efficiency.
# - half that for a GEMM with a leading dimension that is not a multiple of 16 bytes (the tied head's
#   V = 8449 columns): Hopper's fast GEMM kernels load tiles with TMA, whose global strides must be
#   multiples of 16 bytes (CUDA driver API, cuTensorMapEncodeTiled), so cuBLAS falls back to
#   Ampere-style kernels with narrower loads; even without TMA in play, an align1 kernel ran at 74% of
#   the aligned one on an RTX 4090 (github.com/pytorch/pytorch issue 181718). The factor is a guess
#   within that: the first GPU run should measure it.
# - 4.0 TB/s achieved by streaming kernels: 83% of the 4.8 nominal; a device-to-device copy measured
#   ~4.3 TB/s on the lent H200 (SPEC.md section 5), row kernels with block reductions do somewhat worse.
# - 4 us per launch: a kernel's submission through the CUDA runtime costs ~4-6 us of host time
#   (susun-blog.com, "pegainfer (3): From Launch Overhead to CUDA Graph"), which the GPU hides only
#   behind longer kernels; back to back, each kernel also pays its ramp-up and tail (~1-2 us, SMs
#   idle while the last blocks finish). CuPy adds its Python dispatch on the host. 3-5 us is the usual
#   range; the middle is taken.
# - host<->device: ~10 us per copy that the host waits for (a read back; `ndarray.set` from pageable
#   memory) plus ~20 GB/s.
# - 99 TFLOP/s (20% of the TF32 peak) for the inner products of the flash attention kernels
#   (minitensor/backends/kernels/attention.cu, TF32 mma.sync): FlashAttention-2, CUTLASS mma.sync kernels
#   tuned for years, reaches ~35% of the H100's dense FP16 peak in the forward and less in the backward
#   (Shah et al. 2024, "FlashAttention-3", arXiv:2407.08608, figures 5-8: ~330-370 of 989 TFLOP/s at
#   head size 64-128). Ours is a first hand-written kernel: fragments loaded from shared memory element
#   by element (no ldmatrix), no cp.async prefetch of the next tile, 32-row tiles with two barriers per
#   tile, head size 64 (FA2's own figures drop there); a little over half of FA2's share is taken, a
#   guess to be replaced by the first GPU run's measurement. Traffic (RawSpec.traffic) counts every
#   tile a block loads as a device-memory read, though on a GPU most repeats are L2 hits: conservative
#   on that side too.
H200 = Hardware("H200", tf32_peak=495e12, gemm_efficiency=0.70, unaligned=0.5, bandwidth=4.0e12, launch_s=4e-6,
                copy_latency_s=10e-6, pcie=20e9, memory=141 * 10**9, mma_kernel=0.20 * 495e12)

LAUNCHES = ("gemm", "kernel", "elementwise", "reduction", "copy", "fill", "gather", "scatter", "sort")
TRANSFERS = ("h2d", "d2h", "h2d_async")


# ---------------------------------------------------------------------------------------------
# Recording (on the stand-in)


class Unseeded(ANDREA):
    """ANDREA without drawing its initial weights: their values change no launch."""

    def init_weights(self, seed):
        pass


def _scoped(rec, obj, name, label):
    """obj.name wrapped so that what it launches is recorded under label (an instance attribute)."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        with rec.scope(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def _label_layers(rec, model, opt):
    """Scopes for every part of the model and the step, named as the table names them."""
    for i, block in enumerate(model.blocks):
        for name in ("forward", "backward"):
            _scoped(rec, block, name, f"block {i}")
        for part, layer in (("ln_1", block.ln_1), ("attention", block.attn), ("ln_2", block.ln_2), ("mlp", block.mlp)):
            for name in ("forward", "backward"):
                _scoped(rec, layer, name, part)
    for label, layer in (("embeddings", model.wte), ("embeddings", model.wpe), ("ln_f", model.ln_f),
                         ("head", model.head), ("cross-entropy", model.loss_fn)):
        for name in ("forward", "backward"):
            _scoped(rec, layer, name, label)
    for name in ("attention_forward", "attention_backward"):
        _scoped(rec, model.ops, name, "attention core")
    for name in ("global_norm", "clip_scale"):
        _scoped(rec, model.ops, name, "grad norm and clip")
    _scoped(rec, model, "_to_device", "token ids to the device")
    _scoped(rec, model, "zero_grad", "zero_grad")
    _scoped(rec, opt, "step", "adamw")
    counter = {"n": -1}
    loss, backward = model.loss, model.backward

    def counted_loss(*a, **k):
        counter["n"] += 1
        with rec.scope(f"micro-batch {counter['n']}"), rec.scope("forward"):
            return loss(*a, **k)

    def counted_backward(*a, **k):
        with rec.scope(f"micro-batch {counter['n']}"), rec.scope("backward"):
            return backward(*a, **k)

    model.loss, model.backward = counted_loss, counted_backward


def record(config="120m", batch=None, seq=None, micro_batches=None, kernels="fused", overrides=(), verify=False):
    """The launches of one training step on the stand-in (which must be the `cupy` imported here):
    a dict with the run's figures and "ops", one [kind, name, flops, read, written, scope] per op.

    overrides: `section.key=value` config overrides; verify: compute too, checking every recorded
    operation's result against NumPy's (small sizes only: the stand-in computes on the CPU)."""
    import cupy

    from andrea.config import load_config
    from andrea.model.optim import AdamW
    from andrea.run.trainer import Trainer
    from minitensor import device
    from minitensor.backends import cupy_ops

    if not getattr(cupy, "STANDIN", False):
        raise UserError("the step model records on the CuPy stand-in (tests/cupy_standin), not on a real CuPy")
    from cupy import _record

    full = load_config(config, overrides)
    cfg, t = full.model, full.train
    B, T = batch or t.batch_size, seq or cfg.context_length
    accum = micro_batches or max(1, t.tokens_per_step // (B * T))
    device.get_backend("gpu")  # the GPU probe computes: before recording
    saved_memory, saved_ones = dict(cupy_ops._gpu_memory_bytes), dict(cupy_ops._ones_kept)
    cupy_ops._gpu_memory_bytes.clear()  # the dense core's budget: the H200's memory, not the stand-in's
    cupy_ops._ones_kept.clear()  # made in every record (its copy counted), its values never kept (not computed)
    try:
        with _record.recording(total_bytes=H200.memory, verify=verify) as rec:
            model = (ANDREA if verify else Unseeded)(cfg, device="gpu", dtype="float32", kernels=kernels)
            opt = AdamW(model, lr=t.lr, weight_decay=t.weight_decay)
            _label_layers(rec, model, opt)
            rng = np.random.default_rng(0)
            batches = types.SimpleNamespace(next_batch=lambda: tuple(rng.integers(0, cfg.vocab_size, (2, B, T))))
            trainer = types.SimpleNamespace(  # what Trainer.train_step reads: one rank, no collective
                model=model, opt=opt, accum=accum, loader=batches, world=types.SimpleNamespace(size=1),
                reducer=types.SimpleNamespace(sum_=lambda grads: None), cfg=full)
            start = len(rec.ops)
            Trainer.train_step(trainer, t.lr)
            ops = rec.ops[start:]
    finally:
        for cache, saved in ((cupy_ops._gpu_memory_bytes, saved_memory), (cupy_ops._ones_kept, saved_ones)):
            cache.clear()
            cache.update(saved)
    n_params = model.num_parameters()
    return {"config": config, "batch": B, "seq": T, "micro_batches": accum, "kernels": kernels,
            "n_layer": cfg.n_layer, "parameters": n_params, "flops_per_token": flops_per_token(cfg, T, n_params),
            "ops": [[op.kind, op.name, op.flops, op.read, op.written, list(op.scope)] for op in ops]}


def record_anywhere(config="120m", batch=None, seq=None, micro_batches=None, kernels="fused"):
    """record(), in this process when `cupy` here is the stand-in, else in a child process that has it."""
    if getattr(sys.modules.get("cupy"), "STANDIN", False):
        return record(config, batch, seq, micro_batches, kernels)
    if not (STANDIN / "cupy" / "_record.py").exists():
        raise UserError(f"the step model records on the CuPy stand-in, which is in the source checkout only: "
                        f"{STANDIN} not found")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, "-m", "andrea.run.stepmodel", "--record", str(out), "--config", config,
               "--kernels", kernels]
        for flag, value in (("--batch", batch), ("--seq", seq), ("--micro-batches", micro_batches)):
            if value:
                cmd += [flag, str(value)]
        env = {k: v for k, v in os.environ.items() if k not in ("ANDREA_DEVICE", "CUPY_STANDIN_REPORT")}
        env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise UserError(f"recording the step failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# The H200's time for a record


def op_seconds(kind, name, flops, read, written, hw=H200):
    """(GEMM s, memory s, launch s) of one op: its work on the side that bounds it, and its launch cost."""
    moved = (read + written) / hw.bandwidth
    if kind == "gemm":
        rate = hw.tf32_peak * hw.gemm_efficiency * (hw.unaligned if "unaligned" in name else 1.0)
        return max(flops / rate, moved), 0.0, hw.launch_s
    if kind == "h2d_async":  # queued on the stream, the host not waiting: its PCIe time and its submission
        return 0.0, read / hw.pcie, hw.launch_s
    if kind in TRANSFERS:
        return 0.0, hw.copy_latency_s + read / hw.pcie, 0.0
    if flops:  # a kernel that declares its inner products (cuda.RawSpec.flops): on the side that bounds it
        compute = flops / hw.mma_kernel
        return (compute, 0.0, hw.launch_s) if compute > moved else (0.0, moved, hw.launch_s)
    return 0.0, moved, hw.launch_s


def part_of(scope):
    """(part, pass) of an op's scope: block parts as "block: <sublayer>", the rest by their label."""
    phase = next((s for s in scope if s in ("forward", "backward")), "step")
    inner = [s for s in scope if not s.startswith(("micro-batch", "block")) and s not in ("forward", "backward")]
    label = inner[-1] if inner else "other (loss sum and scale)"
    if any(s.startswith("block") for s in scope):
        label = f"block: {label}"
    return label, phase


def estimate(rec, hw=H200):
    """The record's time on hw: rows by (micro-batch kind, part, pass), totals, launches per block, MFU."""
    rows = defaultdict(lambda: np.zeros(7))  # launches, GEMM FLOP, bytes, GEMM s, memory s, launch s, total s
    per_block = defaultdict(int)
    total = np.zeros(7)
    last = f"micro-batch {rec['micro_batches'] - 1}"
    for kind, name, flops, read, written, scope in rec["ops"]:
        gemm_s, mem_s, launch_s = op_seconds(kind, name, flops, read, written, hw)
        v = np.array([kind in LAUNCHES, flops if kind in ("gemm", "kernel") else 0, read + written, gemm_s, mem_s,
                      launch_s, gemm_s + mem_s + launch_s])
        mb = next((s for s in scope if s.startswith("micro-batch")), None)
        which = "step" if mb is None else "first" if mb == "micro-batch 0" else "later" if mb == last else "middle"
        rows[(which, *part_of(scope))] += v
        total += v
        block = next((s for s in scope if s.startswith("block")), None)
        if block and kind in LAUNCHES:
            per_block[(which, block)] += 1
    step_s = total[6]
    tokens = rec["batch"] * rec["seq"] * rec["micro_batches"]
    return {"rows": {k: v.tolist() for k, v in rows.items()}, "total": total.tolist(), "step_s": step_s,
            "launches": int(total[0]), "launches_per_block": _per_block(per_block, rec["n_layer"]),
            "tokens": tokens, "mfu": rec["flops_per_token"] * tokens / (step_s * hw.tf32_peak)}


def _per_block(per_block, n_layer):
    """{micro-batch kind: launches of one block}; every block of a micro-batch must launch alike."""
    out = {}
    for which in ("first", "later"):
        counts = {per_block.get((which, f"block {i}"), 0) for i in range(n_layer)} or {0}
        if len(counts) != 1:
            raise AssertionError(f"the blocks of the {which} micro-batch launch differently: {sorted(counts)}")
        out[which] = counts.pop()
    return out


def estimate_step_seconds(config="120m", batch=8, seq=1024, micro_batches=1, kernels="fused"):
    """The model's seconds for one optimizer step of `micro_batches` micro-batches of batch x seq
    (default: the bench's and gpu_check's step, one micro-batch and AdamW) on an H200."""
    return estimate(record_anywhere(config, batch, seq, micro_batches, kernels))["step_s"]


# ---------------------------------------------------------------------------------------------
# The table


def print_table(rec, est, hw=H200):
    mb = rec["micro_batches"]
    print(f"{rec['config']} ({rec['parameters']:,} parameters), {rec['batch']} x {rec['seq']}, kernels "
          f"{rec['kernels']}: one optimizer step of {mb} micro-batch{'es' if mb > 1 else ''} "
          f"({est['tokens']:,} tokens), recorded on the CuPy stand-in")
    print(f"{hw.name} model: GEMMs (TF32) at {100 * hw.gemm_efficiency:.0f}% of {hw.tf32_peak / 1e12:.0f} TFLOP/s "
          f"(x{hw.unaligned:g} with a leading dimension not a multiple of 16 bytes), "
          f"memory {hw.bandwidth / 1e12:.1f} TB/s, {1e6 * hw.launch_s:.0f} us per launch, host<->device copies "
          f"{1e6 * hw.copy_latency_s:.0f} us + {hw.pcie / 1e9:.0f} GB/s; time = max(GEMM, memory) + launch per op")
    head = (f"{'part':<34} {'pass':<8} {'launches':>9} {'GEMM GFLOP':>11} {'GB moved':>9} {'GEMM ms':>8} "
            f"{'memory ms':>9} {'launch ms':>9} {'total ms':>9}")
    which = "later" if mb > 1 else "first"
    print(f"\n{'a later micro-batch' if mb > 1 else 'the micro-batch'} by part (block parts: all "
          f"{rec['n_layer']} blocks)")
    print(head)
    print("-" * len(head))
    micro = np.zeros(7)
    for (w, part, phase), v in sorted(est["rows"].items(), key=lambda kv: (kv[0][2] != "forward", kv[0][1])):
        if w == which:
            print(_row(part, phase, v))
            micro += v
    print(_row(f"{'later micro-batch' if mb > 1 else 'micro-batch'} total", "", micro))
    step = np.zeros(7)
    for (w, _part, _phase), v in est["rows"].items():
        if w == "step":
            step += v
    print(_row("optimizer step (zero_grad, clip, AdamW)", "", step))
    print(_row("whole step", "", np.array(est["total"])))
    lpb = est["launches_per_block"]
    print(f"\nlaunches per block: {lpb['later'] if mb > 1 else lpb['first']}"
          + (f" ({lpb['first']} in the first micro-batch after zero_grad)" if mb > 1 else " (after zero_grad)"))
    print(f"estimated step: {1e3 * est['step_s']:.1f} ms, {1e3 * est['step_s'] / mb:.1f} ms per micro-batch of "
          f"{rec['batch']} x {rec['seq']}; MFU {100 * est['mfu']:.1f}% of the {hw.tf32_peak / 1e12:.0f} TFLOP/s "
          f"TF32 peak ({rec['flops_per_token']:,} FLOPs per token: 6 N + 12 L d T)")


def _row(part, phase, v):
    launches, flops, moved, gemm_s, mem_s, launch_s, total_s = v
    return (f"{part:<34} {phase:<8} {int(launches):>9,} {flops / 1e9:>11,.0f} {moved / 1e9:>9.2f} "
            f"{1e3 * gemm_s:>8.2f} {1e3 * mem_s:>9.2f} {1e3 * launch_s:>9.2f} {1e3 * total_s:>9.2f}")


def _parser():
    ap = ArgumentParser(prog="python -m andrea.run.stepmodel", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="120m", help="a config name or YAML file (default 120m)")
    ap.add_argument("--batch", type=int, help="sequences per micro-batch (default: the config's batch_size)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the config's context length)")
    ap.add_argument("--micro-batches", type=int,
                    help="micro-batches per optimizer step (default: the config's tokens_per_step)")
    ap.add_argument("--kernels", default="fused", choices=["fused", "generic"])
    ap.add_argument("--json", help="also write the estimate there")
    ap.add_argument("--record", help=argparse.SUPPRESS)  # internal: record on the stand-in, write it there
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)
    for name in ("batch", "seq", "micro_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.record:
        rec = record(args.config, args.batch, args.seq, args.micro_batches, args.kernels)
        Path(args.record).write_text(json.dumps(rec))
        return 0
    rec = record_anywhere(args.config, args.batch, args.seq, args.micro_batches, args.kernels)
    est = estimate(rec)
    print_table(rec, est)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in est.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    run_cli(main)
