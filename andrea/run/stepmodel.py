"""The step model: every launch of an ANDREA training step on a GPU, counted, and its time on an H200 and
an H100 SXM priced.

    python -m andrea.run.stepmodel                     # ANDREA-120M, 8 x 1024: the table by layer, the estimate, MFU,
                                                       # then TF32 and bf16 side by side beside llm.c's tokens/s
    python -m andrea.run.stepmodel --precision bf16    # the table of the bf16 step (train.precision=bf16)
    python -m andrea.run.stepmodel --gpu h100          # one card only
    python -m andrea.run.stepmodel --scale-out         # 8 GPUs on NVLink, 64 on InfiniBand: the reduction priced
    python -m andrea.run.stepmodel --what-if flash_attention_fwd:registers=124,loads_ahead=8
                                                       # a kernel's figures as a change expects them
    python -m andrea.bench --device gpu --model h200   # the same table
    estimate_step_seconds()          # seconds of one bench step (1 micro-batch + AdamW), for gpu_check
    step_mfu(pricing.H100)           # the MFU of ANDREA-120M's step at 8 x 1024 on a card, against the 40% bar
    step_mfu(pricing.H100, precision="bf16")   # the bf16 step's, against the bf16 peak and the 45% bar
    pricing.kernel_prices(hw)        # one launch of each project kernel priced, for gpu_check

Recorded, not guessed: the training step (andrea.run.trainer.Trainer.train_step: zero_grad, forward and
backward over the micro-batches, the gradient norm, the clipping scale, the one host read, AdamW)
runs with the GPU backend (`kernels='fused'`) on the CuPy stand-in in its recording mode
(minitensor/checks/cupy_standin/cupy/_record.py, shipped with the package: minitensor.checks.standin):
arrays of the real size that are never computed nor touched, each CuPy launch recorded with its
shapes, its GEMM FLOPs, its grid and the bytes it reads and writes.
The launch count, the paths taken (the flash attention core for ANDREA's heads of 64) and every shape
are those of the real step; only time is modelled, per launch, from what can be counted:

- a cuBLAS GEMM, by its shape: its CTA tiles (128 x 128, 256 x 128 or 128 x 256, K split or not,
  whichever finishes first) in waves over the 132 SMs, each wave one tile's time at cuBLAS's measured
  per-tile rate; or its bytes at the memory bandwidth where they take longer; + a launch;
- a project RawKernel (the flash attention kernels, LayerNorm, the cross-entropy, ...): the larger of
  its resource time and its latency bound, + a launch. The resource time is the largest of the times
  its counted work takes on the SM that holds the most of its blocks, each at a rate of the hardware:
  its mma.sync steps (tensor cores), its shared-memory wavefronts (banks), its special-function calls
  (SFU), its 32-byte L2 sectors (L2 bandwidth), its bytes to and from device memory (HBM). The latency
  bound is that SM's mma steps times each step's dependency chain (the shared-memory load's latency
  not hidden by loads issued ahead, plus the mma's latency) over the warps resident to hide it (its
  occupancy, from the registers and shared memory ptxas gives it). The counts are the host emulation's
  at ANDREA-120M's shapes (minitensor.checks.counts: every shared-memory request priced in wavefronts
  as the banks serve it, every global request in sectors), scaled to the recorded launch by its FLOPs
  (or bytes);
- everything else CuPy launches (elementwise, reductions, copies): its bytes at the memory bandwidth +
  a launch; host<->device copies that the host waits for at a latency plus PCIe time, an asynchronous
  one (`cupy.asarray` of host data) at its PCIe time plus a launch.

A bf16 step (train.precision=bf16) is recorded the same way, as that setting trains: its activations
and GEMM operands are bfloat16 arrays, so every launch's bytes are the bf16 step's own, while the
float32 master weights, gradients and AdamW's state keep theirs; its GEMMs are priced at the bf16 rate
(the 989 TFLOP/s dense bf16 peak times cuBLAS's measured bf16 per-tile share) and its project kernels by
the counts of their bfloat16 instances (kernel_counts.json keeps each dtype's); a kernel without them is
priced by its float32 counts and named, and that figure is said not to be final.

The rates and latencies are each card's, each with its source (andrea/run/pricing.py: `H200`, `H100`).
The table names, for each part of the step, the bound that drives its time (a resource, or the latency
bound) and the count it prices. MFU is the bench's: (6 N + 12 L d T) FLOPs per token (flops_per_token)
over the step time and the dense peak of the step's precision (TF32's, or bf16's). The model cannot
see: kernels overlapping, a kernel's resources overlapping one another less than perfectly, latency
outside the flash kernels' mma loops, cuBLAS's actual choice of kernel per shape, clocks under power
limits, the host falling behind when launches are short (CuPy's Python costs ~5-10 us a call on the
host; launches are queued asynchronously, so the host hides behind long kernels only). gpu_check
prints this estimate beside the measured step, and each kernel's priced time beside its measured one,
when a GPU is lent: the first real run calibrates it.
"""

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import types
from collections import defaultdict
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.errors import UserError
from andrea.model.sizes import flops_per_token
from andrea.model.transformer import ANDREA
from andrea.run.pricing import (COUNTED_BY, COUNTED_DTYPES, COUNTS, DRIVERS, H100, H200, LAUNCHES, PROFILES,
                                kernel_prices, missing_counts, op_seconds, priced_how, write_counts)
from minitensor import precision
from minitensor.checks.standin import standin_env

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


# the methods a step calls on a layer, scoped alike: a block's forward_open, a norm's forward_joined and
# backward_and_sum_skip (the residual join and the skip's column sums in the norm's own pass)
PASSES = ("forward", "backward", "forward_open", "forward_joined", "backward_and_sum_skip")


def _scope_passes(rec, layer, label):
    for name in PASSES:
        if hasattr(layer, name):
            _scoped(rec, layer, name, label)


def _label_layers(rec, model, opt):
    """Scopes for every part of the model and the step, named as the table names them."""
    for i, block in enumerate(model.blocks):
        _scope_passes(rec, block, f"block {i}")
        for part, layer in (("ln_1", block.ln_1), ("attention", block.attn), ("ln_2", block.ln_2), ("mlp", block.mlp)):
            _scope_passes(rec, layer, part)
    for label, layer in (("embeddings", model.wte), ("embeddings", model.wpe), ("ln_f", model.ln_f),
                         ("head", model.head), ("cross-entropy", model.loss_fn)):
        _scope_passes(rec, layer, label)
    for name in ("attention_forward", "attention_backward", "attention_backward_and_bias"):
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


def record(config="120m", batch=None, seq=None, micro_batches=None, kernels="fused", overrides=(), verify=False,
           precision="float32"):
    """The launches of one training step on the stand-in (which must be the `cupy` imported here):
    a dict with the run's figures and "ops", one [kind, name, flops, read, written, scope] per op.

    overrides: `section.key=value` config overrides; verify: compute too, checking every recorded
    operation's result against NumPy's (small sizes only: the stand-in computes on the CPU); precision:
    train.precision's value, the step as `--set train.precision=...` trains it (bf16: its bfloat16
    activations and GEMM operands recorded at their own bytes, the float32 masters, gradients and AdamW
    state at theirs)."""
    import cupy

    from andrea.config import load_config
    from andrea.run.overlap import GradientReduction
    from andrea.run.reducer import Identity
    from andrea.run.trainer import Trainer
    from minitensor import device
    from minitensor.backends import cupy_ops
    from minitensor.optim import AdamW

    if not getattr(cupy, "STANDIN", False):
        raise UserError("the step model records on the CuPy stand-in (minitensor.checks.standin), not on a real CuPy")
    from cupy import _record

    if precision != "float32":
        overrides = (*overrides, f"train.precision={precision}")
    full = load_config(config, overrides)
    cfg, t = full.model, full.train
    built_in = {"precision": precision} if precision != "float32" else {}  # as the trainer builds the model
    B, T = batch or t.batch_size, seq or cfg.context_length
    accum = micro_batches or max(1, t.tokens_per_step // (B * T))
    device.get_device("gpu")  # the GPU probe computes: before recording
    saved_memory, saved_ones = dict(cupy_ops._gpu_memory_bytes), dict(cupy_ops._ones_kept)
    cupy_ops._gpu_memory_bytes.clear()  # the dense core's budget: the H200's memory, not the stand-in's
    cupy_ops._ones_kept.clear()  # made in every record (its copy counted), its values never kept (not computed)
    try:
        with _record.recording(total_bytes=H200.memory, verify=verify) as rec:
            model = (ANDREA if verify else Unseeded)(cfg, device="gpu", dtype="float32", kernels=kernels, **built_in)
            opt = AdamW(model, lr=t.lr, weight_decay=t.weight_decay)
            _label_layers(rec, model, opt)
            rng = np.random.default_rng(0)
            batches = types.SimpleNamespace(next_batch=lambda: tuple(rng.integers(0, cfg.vocab_size, (2, B, T))))
            reduction = GradientReduction(model, Identity())  # one rank: no collective, nothing launched
            trainer = types.SimpleNamespace(  # what Trainer.train_step reads
                model=model, opt=opt, accum=accum, loader=batches, world=types.SimpleNamespace(size=1),
                gradient_reduction=lambda: reduction, cfg=full)
            start = len(rec.ops)
            Trainer.train_step(trainer, t.lr)
            ops = rec.ops[start:]
    finally:
        for cache, saved in ((cupy_ops._gpu_memory_bytes, saved_memory), (cupy_ops._ones_kept, saved_ones)):
            cache.clear()
            cache.update(saved)
    n_params = model.num_parameters()
    return {"config": config, "batch": B, "seq": T, "micro_batches": accum, "kernels": kernels, "precision": precision,
            "n_layer": cfg.n_layer, "parameters": n_params, "flops_per_token": flops_per_token(cfg, T, n_params),
            "ops": [[op.kind, op.name, op.flops, op.read, op.written, list(op.scope), op.blocks,
                     list(op.shapes[-1]) if op.kind == "gemm" and op.shapes else []] for op in ops]}


def record_anywhere(config="120m", batch=None, seq=None, micro_batches=None, kernels="fused", precision="float32"):
    """record(), in this process when `cupy` here is the stand-in, else in a child process that has it."""
    if getattr(sys.modules.get("cupy"), "STANDIN", False):
        return record(config, batch, seq, micro_batches, kernels, precision=precision)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, "-m", "andrea.run.stepmodel", "--record", str(out), "--config", config,
               "--kernels", kernels, "--precision", precision]
        for flag, value in (("--batch", batch), ("--seq", seq), ("--micro-batches", micro_batches)):
            if value:
                cmd += [flag, str(value)]
        proc = subprocess.run(cmd, env=standin_env(), capture_output=True, text=True)
        if proc.returncode:
            raise UserError(f"recording the {precision} step failed: "
                            f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(out.read_text())


def part_of(scope):
    """(part, pass) of an op's scope: block parts as "block: <sublayer>", the rest by their label."""
    phase = next((s for s in scope if s in ("forward", "backward")), "step")
    inner = [s for s in scope if not s.startswith(("micro-batch", "block")) and s not in ("forward", "backward")]
    label = inner[-1] if inner else "other (loss sum and scale)"
    if any(s.startswith("block") for s in scope):
        label = f"block: {label}"
    return label, phase


def estimate(rec, hw=H200, works=None):
    """The record's time on hw: rows by (micro-batch kind, part, pass) of [launches, tensor FLOP, bytes,
    work seconds, launch seconds, total seconds, seconds bound by each of DRIVERS], totals, launches per
    block, MFU against the dense peak of the record's precision (TF32's for float32, bf16's for bf16);
    "missing": {kernel: why} for the tensor-core kernels the record launches without counts in its compute
    dtype (priced by their float32 counts meanwhile, if any: a figure that is not final); "scaled": the
    memory-bound kernels priced by their float32 counts scaled by the launch's own bytes (pricing.work_in).
    works: {kernel name: KernelWork} priced instead of the counted ones (a what-if)."""
    compute = policy_of(rec).compute
    width = 6 + len(DRIVERS)
    rows = defaultdict(lambda: np.zeros(width))
    per_block = defaultdict(int)
    total = np.zeros(width)
    last = f"micro-batch {rec['micro_batches'] - 1}"
    for kind, name, flops, read, written, scope, *rest in rec["ops"]:
        blocks, shape = (rest[0] if rest else 0), tuple(rest[1] if len(rest) > 1 else ())
        work_s, driver, launch_s = op_seconds(kind, name, flops, read, written, blocks, hw, shape, works, compute)
        v = np.zeros(width)
        v[:6] = [kind in LAUNCHES, flops if kind in ("gemm", "kernel") else 0, read + written, work_s, launch_s,
                 work_s + launch_s]
        v[6 + DRIVERS.index(driver)] = work_s
        mb = next((s for s in scope if s.startswith("micro-batch")), None)
        which = "step" if mb is None else "first" if mb == "micro-batch 0" else "later" if mb == last else "middle"
        rows[(which, *part_of(scope))] += v
        total += v
        block = next((s for s in scope if s.startswith("block")), None)
        if block and kind in LAUNCHES:
            per_block[(which, block)] += 1
    step_s = total[5]
    tokens = rec["batch"] * rec["seq"] * rec["micro_batches"]
    return {"rows": {k: v.tolist() for k, v in rows.items()}, "total": total.tolist(), "step_s": step_s,
            "launches": int(total[0]), "launches_per_block": _per_block(per_block, rec["n_layer"]),
            "tokens": tokens, "mfu": rec["flops_per_token"] * tokens / (step_s * hw.peak(compute)),
            "peak": hw.peak(compute), "precision": policy_of(rec).name, **_not_counted(rec, compute, works),
            "bound_by": {d: total[6 + i] for i, d in enumerate(DRIVERS)}}


def _not_counted(rec, compute, works):
    """{"missing": {kernel: why}, "scaled": [kernel, ...]}: the record's project kernels without counts in
    `compute` (pricing.work_in), those a what-if prices left out."""
    if compute == "float32":
        return {"missing": {}, "scaled": []}
    kernels = sorted({op[1] for op in rec["ops"] if op[0] == "kernel"} - set(works or ()))
    return {"missing": missing_counts(kernels, compute),
            "scaled": sorted(name for name, how in priced_how(kernels, compute).items() if how == "scaled")}


def policy_of(rec):
    """The precision policy a record was made in (minitensor.precision; float32 for a record without one)."""
    return precision.get(rec.get("precision", "float32"))


def _per_block(per_block, n_layer):
    """{micro-batch kind: launches of one block}; every block of a micro-batch must launch alike."""
    out = {}
    for which in ("first", "later"):
        counts = {per_block.get((which, f"block {i}"), 0) for i in range(n_layer)} or {0}
        if len(counts) != 1:
            raise AssertionError(f"the blocks of the {which} micro-batch launch differently: {sorted(counts)}")
        out[which] = counts.pop()
    return out


def estimate_step_seconds(config="120m", batch=8, seq=1024, micro_batches=1, kernels="fused", hw=H200,
                          precision="float32"):
    """The model's seconds for one optimizer step of `micro_batches` micro-batches of batch x seq
    (default: the bench's and gpu_check's step, one micro-batch and AdamW) on hw (pricing.H200 or
    pricing.H100), in train.precision `precision`."""
    return estimate(record_anywhere(config, batch, seq, micro_batches, kernels, precision), hw)["step_s"]


def profile_for(device_name):
    """The pricing profile of a card by its CUDA device name ("NVIDIA H100 80GB HBM3" -> pricing.H100),
    the H200's for any other card (named so in what prints it)."""
    return H100 if "H100" in str(device_name).upper() else H200


def priced_kernel_seconds(hw=H200):
    """{kernel name: seconds} of one launch of each project kernel at ANDREA-120M's shapes on hw, its
    work and the launch's cost (pricing.kernel_prices): the column gpu_check prints beside the
    measured times, so that the first lent GPU calibrates the model kernel by kernel."""
    return {name: price.seconds + price.launch_s for name, price in kernel_prices(hw).items()}


def step_mfu(hw=H200, works=None, config="120m", precision="float32"):
    """The MFU this pricing gives a config's training step (default ANDREA-120M at 8 x 1024, 8
    micro-batches, fused kernels) on hw, with the kept kernel counts or `works` in their place (what_if),
    against the dense peak of `precision`: the figure the bars are read against (float32: >= 40% of the
    TF32 peak; bf16: >= 45% of the bf16 peak)."""
    return estimate(record_anywhere(config, precision=precision), hw, works)["mfu"]


# llm.c's published tokens/s for GPT-2 (124M) by card, per GPU: llm.c of 2024-10-13 on 8 x H100 80GB HBM3 (SXM)
# as karpathy/llm.c discussion 481 runs it, "the median per-step time was 139ms" (KellerJordan/modded-nanogpt,
# records/101324_llmc/README.md), each step 524,288 tokens: 64 x 1024 per GPU (llm.c's scripts/run_gpt2_124M.sh:
# -b 64 -t 1024 -d 524288, bf16, cuDNN flash attention, ZeRO-1), the reduction over 8 GPUs inside the step.
# No published llm.c figure for an H200 was found: none is given for it.
LLMC_PER_GPU = {H100.name: (64 * 1024 / 0.139, "llm.c, 8 x H100 SXM, 64 x 1024 per GPU, 139 ms a step of 524,288 "
                                             "tokens (modded-nanogpt records/101324_llmc)")}


def precision_rows(rec_by_precision, gpus, works=None):
    """The lines that price the step in each precision beside the other on each card: step time,
    tokens/s, MFU against that precision's dense peak, and llm.c's published tokens/s per GPU on the card
    (or that none was found). rec_by_precision: {precision: record, or the UserError line that says why it
    could not be recorded}; a figure resting on a kernel without counts in its dtype says so."""
    first = next(r for r in rec_by_precision.values() if isinstance(r, dict))
    mb = first["micro_batches"]
    lines = [f"\nprecisions side by side: {first['config']}, {first['batch']} x {first['seq']}, one optimizer step "
             f"of {mb} micro-batch{'es' if mb > 1 else ''} (priced, not measured)",
             f"{'card':<9} {'precision':<10} {'step ms':>8} {'tokens/s':>10} {'MFU':>6}  {'of the dense peak':<20} "
             f"llm.c GPT-2 124M (published, per GPU)"]
    notes = []
    for gpu in gpus:
        hw = PROFILES[gpu]
        llmc = LLMC_PER_GPU.get(hw.name)
        for name, rec in rec_by_precision.items():
            if not isinstance(rec, dict):
                continue
            est = estimate(rec, hw, works)
            label = "bf16" if est["precision"] == "bf16" else "TF32"
            final = "" if not est["missing"] else " (not final)"
            tokens_s = est["tokens"] / est["step_s"]
            lines.append(f"{hw.name:<9} {label:<10} {1e3 * est['step_s']:>8.1f} {tokens_s:>10,.0f} "
                         f"{100 * est['mfu']:>5.1f}%  {est['peak'] / 1e12:>4.0f} TFLOP/s {label:<6}{final:<12}"
                         + (f"{llmc[0]:,.0f} tokens/s ({llmc[1]})" if llmc else "none published for this card found"))
            if est["missing"] and gpu == gpus[0]:
                notes.append(f"{name}: not final: no {policy_of(rec).compute} counts for "
                             f"{', '.join(est['missing'])} (priced by their float32 counts where they have "
                             f"any); {next(iter(est['missing'].values()))}")
            if est["scaled"] and gpu == gpus[0]:
                notes.append(f"{name}: {', '.join(est['scaled'])} priced by their float32 counts scaled by their "
                             f"{policy_of(rec).compute} launches' bytes (memory-bound: their sectors follow "
                             f"their bytes)")
    notes += [f"{name}: not priced: {why}" for name, why in rec_by_precision.items() if not isinstance(why, dict)]
    return lines + notes


# ---------------------------------------------------------------------------------------------
# The table


def print_table(rec, est, hw=H200):
    mb = rec["micro_batches"]
    print(f"{rec['config']} ({rec['parameters']:,} parameters), {rec['batch']} x {rec['seq']}, kernels "
          f"{rec['kernels']}: one optimizer step of {mb} micro-batch{'es' if mb > 1 else ''} "
          f"({est['tokens']:,} tokens), recorded on the CuPy stand-in")
    compute = policy_of(rec).compute
    label = "bf16" if compute == precision.BF16 else "TF32"
    efficiency = hw.gemm_rate(compute) / hw.peak(compute)
    print(f"{hw.name} model: cuBLAS GEMMs ({label}) in waves of CTA tiles over {hw.sms} SMs, each tile at "
          f"{100 * efficiency:.0f}% of an SM's share of {hw.peak(compute) / 1e12:.0f} TFLOP/s; project kernels "
          f"from their counts at ANDREA-120M's shapes: mma.sync at {hw.mma_clocks:.2f} SM clocks a step, "
          f"{hw.wavefronts_per_clock:g} shared-memory wavefront and {hw.sfu_per_clock:g} special functions per SM "
          f"clock, L2 at {hw.l2_bandwidth / 1e12:.1f} TB/s, or their latency bound (per mma step "
          f"{hw.shared_latency:g} cycles of shared-memory load not hidden by loads issued ahead + {hw.mma_latency:g} "
          f"of mma, over the resident warps) where larger; {hw.clock / 1e9:.2f} GHz; memory "
          f"{hw.bandwidth / 1e12:.2f} TB/s; {1e6 * hw.launch_s:.0f} us per launch")
    head = (f"{'part':<34} {'pass':<8} {'launches':>9} {'tensor GFLOP':>12} {'GB moved':>9} {'work ms':>8} "
            f"{'launch ms':>9} {'total ms':>9}  driven by")
    which = "later" if mb > 1 else "first"
    print(f"\n{'a later micro-batch' if mb > 1 else 'the micro-batch'} by part (block parts: all "
          f"{rec['n_layer']} blocks)")
    print(head)
    print("-" * (len(head) + 24))
    micro = np.zeros(6 + len(DRIVERS))
    for (w, part, phase), v in sorted(est["rows"].items(), key=lambda kv: (kv[0][2] != "forward", kv[0][1])):
        if w == which:
            print(_row(part, phase, np.array(v)))
            micro += v
    print(_row(f"{'later micro-batch' if mb > 1 else 'micro-batch'} total", "", micro))
    step = np.zeros(6 + len(DRIVERS))
    for (w, _part, _phase), v in est["rows"].items():
        if w == "step":
            step += v
    print(_row("optimizer step (zero_grad, clip, AdamW)", "", step))
    print(_row("whole step", "", np.array(est["total"])))
    lpb = est["launches_per_block"]
    print("driven by: the two largest bounds of the row's ops, in ms; each prices a count: "
          + "; ".join(f"{d}: {COUNTED_BY[d]}" for d in DRIVERS))
    print(f"\nlaunches per block: {lpb['later'] if mb > 1 else lpb['first']}"
          + (f" ({lpb['first']} in the first micro-batch after zero_grad)" if mb > 1 else " (after zero_grad)"))
    print(f"estimated step on an {hw.name}: {1e3 * est['step_s']:.1f} ms, {1e3 * est['step_s'] / mb:.1f} ms per "
          f"micro-batch of {rec['batch']} x {rec['seq']}; MFU {100 * est['mfu']:.1f}% of the "
          f"{est['peak'] / 1e12:.0f} TFLOP/s {label} peak ({rec['flops_per_token']:,} FLOPs per token: 6 N + 12 L d T)"
          + (" (not final: no bf16 counts for " + ", ".join(est["missing"]) + ")" if est["missing"] else ""))


def _row(part, phase, v):
    launches, flops, moved, work_s, launch_s, total_s = v[:6]
    bound = sorted(((v[6 + i], d) for i, d in enumerate(DRIVERS) if v[6 + i] > 0), reverse=True)
    drivers = ", ".join(f"{d} {1e3 * t:.2f}" for t, d in bound[:2])
    return (f"{part:<34} {phase:<8} {int(launches):>9,} {flops / 1e9:>12,.0f} {moved / 1e9:>9.2f} "
            f"{1e3 * work_s:>8.2f} {1e3 * launch_s:>9.2f} {1e3 * total_s:>9.2f}  {drivers}")


def what_if(specs):
    """{kernel name: KernelWork} from `NAME:field=value,...` strings: the kernel's counted work with the
    figures named replaced (registers, shared, threads, loads_ahead), to price a change before it exists."""
    from andrea.run.pricing import kernel_work

    works = {}
    for spec in specs:
        name, _, fields = spec.partition(":")
        work = works.get(name) or kernel_work(name)
        if work is None:
            raise UserError(f"--what-if {spec}: {name!r} is not a counted project kernel (see andrea/run/{COUNTS.name})")
        try:
            changes = {key: type(getattr(work, key))(float(value)) for key, value in
                       (item.split("=") for item in fields.split(",")) if key in WHAT_IF}
        except ValueError:
            changes = None
        if not changes or len(changes) != len(fields.split(",")):
            raise UserError(f"--what-if {spec}: write NAME:field=number,... with fields among {', '.join(WHAT_IF)}")
        works[name] = dataclasses.replace(work, **changes)
    return works


WHAT_IF = ("registers", "shared", "threads", "loads_ahead")
# train.precision's values (the policies with float32 masters): the command prices the step in each, side by side
PRECISIONS = tuple(name for name, policy in precision.POLICIES.items() if policy.master == "float32")


def print_scale_out(args):
    """The scale-out table (andrea.run.scaleout) on each card asked for: one micro-batch per GPU recorded."""
    from andrea.config import load_config
    from andrea.run import scaleout

    rec = record_anywhere(args.config, args.batch, args.seq, 1, args.kernels)
    cfg = load_config(args.config).model
    out = {}
    for i, gpu in enumerate(dict.fromkeys(args.gpu)):
        parts = scaleout.parts_from_estimate(estimate(rec, PROFILES[gpu]), cfg)
        print("\n" * (i > 0) + "\n".join(scaleout.table(parts, rec["batch"] * rec["seq"], PROFILES[gpu].name)))
        out[gpu] = dataclasses.asdict(parts)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _parser():
    ap = ArgumentParser(prog="python -m andrea.run.stepmodel", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="120m", help="a config name or YAML file (default 120m)")
    ap.add_argument("--batch", type=int, help="sequences per micro-batch (default: the config's batch_size)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the config's context length)")
    ap.add_argument("--micro-batches", type=int,
                    help="micro-batches per optimizer step (default: the config's tokens_per_step)")
    ap.add_argument("--kernels", default="fused", choices=["fused", "generic"])
    ap.add_argument("--precision", default="float32", choices=PRECISIONS,
                    help="train.precision of the step the table prices (default float32: TF32 GEMMs); the "
                         "precisions' step times side by side follow the table either way")
    ap.add_argument("--gpu", nargs="+", default=["h200", "h100"], choices=sorted(PROFILES),
                    help="the cards to price the step on (default: both)")
    ap.add_argument("--what-if", action="append", default=[], metavar="NAME:FIELD=N,...",
                    help=f"price kernel NAME with figures a change expects instead of its counted ones "
                         f"({', '.join(WHAT_IF)}), e.g. flash_attention_fwd:registers=124,loads_ahead=8; repeatable")
    ap.add_argument("--scale-out", action="store_true",
                    help="price the gradient reduction of 8 GPUs over NVLink and 64 over InfiniBand, with and "
                         "without overlap and ZeRO-1, for one micro-batch per GPU (andrea.run.scaleout)")
    ap.add_argument("--json", help="also write the estimate there (one entry per card)")
    ap.add_argument("--count-kernels", action="store_true",
                    help=f"count every project kernel at ANDREA-120M's shapes in the host emulation and keep the "
                         f"counts in andrea/run/{COUNTS.name} (what the table prices them from)")
    ap.add_argument("--record", help=argparse.SUPPRESS)  # internal: record on the stand-in, write it there
    return ap


def main(argv=None):
    args = _parser().parse_args(argv)
    for name in ("batch", "seq", "micro_batches"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.json:
        from andrea.run.paths import check_output_file

        check_output_file(args.json, "--json")  # before seconds of recording, not after
    if args.count_kernels:
        works, missing = write_counts()
        print(f"counted {len(works)} kernels into {COUNTS}: "
              + "; ".join(f"{dtype} {sum(dtype in w for w in works.values())}" for dtype in COUNTED_DTYPES))
        for (name, dtype), why in missing.items():
            print(f"not counted in {dtype}: {why}")
        return 0
    if args.record:
        rec = record(args.config, args.batch, args.seq, args.micro_batches, args.kernels, precision=args.precision)
        Path(args.record).write_text(json.dumps(rec))
        return 0
    if args.scale_out:
        return print_scale_out(args)
    works = what_if(args.what_if)
    recs = {}
    for name in dict.fromkeys((args.precision, *PRECISIONS)):
        try:
            recs[name] = record_anywhere(args.config, args.batch, args.seq, args.micro_batches, args.kernels, name)
        except UserError as e:  # the table's own precision must record; the other one says why not
            if name == args.precision:
                raise
            recs[name] = str(e)
    rec, gpus = recs[args.precision], list(dict.fromkeys(args.gpu))
    recs = {name: recs[name] for name in PRECISIONS}  # side by side in one order, whichever the table prices
    out = {}
    for i, gpu in enumerate(gpus):
        est = estimate(rec, PROFILES[gpu], works)
        print("\n" * (i > 0) + ("what-if: " + "; ".join(args.what_if) + "\n" if works else ""), end="")
        print_table(rec, est, PROFILES[gpu])
        out[gpu] = {k: v for k, v in est.items() if k != "rows"}
    print("\n".join(precision_rows(recs, gpus, works)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    run_cli(main)
