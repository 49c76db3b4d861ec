"""Phase 8, bench: ANDREA-120M's training throughput in TF32, each project kernel's time, PyTorch beside it.

ANDREA-120M, batch 8 x 1024, AdamW, tf32: true (set through CuPy's API), the fused kernels self-checked
and timed: tokens/s, MFU, peak GPU memory; one step again with each project kernel's launches timed
alone (measured_kernel_seconds), printed beside the step model's price of each where it gives one
(priced_kernel_seconds: the hook for andrea.run.pricing's per-kernel prices); mma.sync's TF32 rate
measured (what the step model takes as 1.59 SM clocks a step); PyTorch's GPT-2 of the same shape on
the same device (andrea/interop/torch_reference.py, TF32 as andrea's, scaled_dot_product_attention):
tokens/s and the ratio; the step model's estimate beside the measured step.
"""

import json
import statistics
import time

import numpy as np
from gpu_check.common import PEAK_FP32, PEAK_TF32, first_line, free_pool, gpu_here, log, mean_seconds
from gpu_check.steps import TrainingSteps


def part_bench(dry):
    import dataclasses

    from andrea.config import load_config
    from andrea.model.transformer import ANDREA
    from andrea.run.perf import synchronize
    from minitensor.device import set_tf32
    from minitensor.optim import AdamW

    full = load_config("tiny" if dry else "120m")
    cfg = dataclasses.replace(full.model, n_layer=1) if dry else full.model
    B, T = (2, 32) if dry else (8, 1024)
    warmup, steps = (1, 2) if dry else (3, 5)
    model = ANDREA(cfg, device="gpu" if gpu_here(dry) else "cpu", dtype="float32", seed=0, kernels=full.train.kernels)
    xp = model.xp
    log(f"{'tiny' if dry else 'ANDREA-120M'} at {B} x {T}, {warmup} warm-up steps then {steps} timed",
        set_tf32(xp, full.train.tf32), model.ops.kernels_line)
    training = TrainingSteps(model, AdamW(model, lr=6e-4), B, T)
    start = time.perf_counter()
    for i in range(warmup):
        training.step(i)
    synchronize(xp)
    log(f"warm-up (kernel compilation included): {time.perf_counter() - start:.1f} s")
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = training.step(i)
        synchronize(xp)
        times.append(time.perf_counter() - t0)
    training.step(0, timed_split=True)
    final_loss = float(loss)
    result = _bench_result(training, cfg, "tf32" if full.train.tf32 else "float32", times, final_loss, dry)
    _log_bench(result, cfg, xp, full.train.tf32)
    print("RESULT " + json.dumps(result), flush=True)
    log(f"figure: andrea {result['tokens_per_s']:,.0f} tokens/s, step {result['step_ms_median']:.1f} ms median, "
        f"MFU {100 * result['mfu_tf32_peak']:.1f}% of the TF32 peak"
        + (f", pool peak {result['pool_used_peak_gib']:.2f} GiB" if "pool_used_peak_gib" in result else ""))
    card = card_name(xp)
    log_kernel_seconds(measured_kernel_seconds(training), priced_kernel_seconds(card))
    del training, model
    free_pool(xp)
    probe_failed = _mma_probe(xp, dry)
    torch_failed = _bench_torch(cfg, B, T, warmup, steps, full.train.tf32, result["tokens_per_s"], dry)
    _log_step_model(result, dry, card)  # last: were it slow, every measured figure is out already
    return not np.isfinite(final_loss) or torch_failed or probe_failed


def measured_kernel_seconds(training):
    """{kernel name: (launches, seconds)} over one more training step, every launch of a project
    RawKernel (minitensor.backends.cuda.launch) timed alone, the device synchronised before and after
    it: the kernel's own time plus one launch's latency (~5 us), not its share of an overlapped step."""
    from andrea.run.perf import synchronize
    from minitensor.backends import cuda

    launch, seconds, xp = cuda.launch, {}, training.xp

    def timed_launch(spec, dtype, grid, block, args):
        synchronize(xp)
        start = time.perf_counter()
        launch(spec, dtype, grid, block, args)
        synchronize(xp)
        n, total = seconds.get(spec.name, (0, 0.0))
        seconds[spec.name] = (n + 1, total + time.perf_counter() - start)

    cuda.launch = timed_launch
    try:
        training.step(0)
    finally:
        cuda.launch = launch
    return seconds


def card_name(xp):
    """The CUDA device's name ("NVIDIA H100 80GB HBM3"); "" on NumPy (the dry run's CPU)."""
    try:
        name = xp.cuda.runtime.getDeviceProperties(0)["name"]
    except AttributeError:
        return ""
    return name.decode() if isinstance(name, bytes) else str(name)


def priced_kernel_seconds(card=""):
    """The priced column: {kernel name: seconds} the step model prices one launch of each project
    kernel at, at ANDREA-120M's shapes, on the profile of the card named (andrea.run.stepmodel:
    profile_for, priced_kernel_seconds), printed beside the measured times; {} where the step model
    cannot be imported (the measured column alone)."""
    try:
        from andrea.run.stepmodel import priced_kernel_seconds as priced, profile_for
    except ImportError:
        return {}
    try:
        return dict(priced(profile_for(card)))
    except Exception as e:  # a broken price is reported, not a failed benchmark
        log(f"step model: priced_kernel_seconds() raised {first_line(e)}")
        return {}


def log_kernel_seconds(measured, priced):
    """One line a kernel, the slowest first: launches, measured ms (and priced ms where priced)."""
    if not measured:
        log("no project kernel launched (the generic code on NumPy): no per-kernel times")
        return
    for name, (n, seconds) in sorted(measured.items(), key=lambda item: -item[1][1]):
        price = priced.get(name)
        log(f"kernel {name:<26} {n:4d} launches {1e3 * seconds:9.3f} ms measured"
            + (f" {1e3 * price:9.3f} ms priced (measured / priced {seconds / price:.2f})" if price else ""))
    total = sum(seconds for _, seconds in measured.values())
    log(f"figure: {len(measured)} project kernels timed launch by launch in one step: {1e3 * total:.1f} ms in all"
        + (f", {len(set(priced) & set(measured))} of them priced" if priced else " (no priced column yet)"))


MMA_PROBE = r"""
extern "C" __global__ void mma_probe(const T *seed, T *out, const int steps) {
  const int lane = threadIdx.x & 31;
  unsigned a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = to_tf32(seed[(4 * lane + i) % 256]);
  for (int i = 0; i < 2; ++i) b[i] = to_tf32(seed[(2 * lane + i + 128) % 256]);
  float c[4][4] = {};
  for (int s = 0; s < steps; ++s)  /* four independent accumulators: mma's latency overlapped */
    for (int j = 0; j < 4; ++j) mma_tf32(c[j], a, b);
  float total = 0;
  for (int j = 0; j < 4; ++j) total += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}
"""


def mma_probe_spec():
    """The probe's kernel, float32 only: flash.cuh's to_tf32 and mma_tf32 around MMA_PROBE (the
    preflight compiles it with the project's kernels)."""
    from minitensor.backends import cuda

    headers = cuda.cu_code("attention.cu", "flash_attention_fwd")[0]  # to_tf32 and mma_tf32 (flash.cuh)
    return cuda.RawSpec("mma_probe", inline=headers + MMA_PROBE)


def _mma_probe(xp, dry):
    """mma.sync.m16n8k8 (TF32) throughput, measured: 8 warps a block, 4 blocks an SM, four independent
    accumulators a warp, random operands. The step model takes it as 1.59 SM clocks a step (63% of the
    dense peak, arXiv:2501.12084): this is the figure that replaces that assumption, not a verdict."""
    from minitensor.backends import cuda

    if xp is np:
        log("dry run on NumPy: no mma.sync to measure")
        return False
    spec = mma_probe_spec()
    sms = xp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    blocks, threads, steps = (1, 32, 2) if dry else (4 * sms, 256, 1 << 14)
    seed = xp.asarray(np.random.default_rng(0).standard_normal(256).astype(np.float32))
    args = (seed, xp.empty(blocks * threads, np.float32), np.int32(steps))
    try:
        seconds = mean_seconds(xp, lambda _: cuda.launch(spec, np.float32, (blocks,), (threads,), args), None,
                        1 if dry else 5)
    except Exception as e:
        log(f"FAIL mma.sync probe: {first_line(e)}")
        return True
    rate = 2048 * 4 * steps * blocks * (threads // 32) / seconds
    log(f"figure: mma.sync m16n8k8 TF32: {rate / 1e12:.1f} TFLOP/s = {100 * rate / PEAK_TF32:.0f}% of the dense TF32 "
        f"peak ({blocks} blocks of {threads // 32} warps, 4 accumulators a warp; the step model takes 63%)"
        + (" (dry run: the CPU emulation's time, not a rate)" if dry else ""))
    return False


def _log_step_model(result, dry, card=""):
    """The step model's estimate on the card's profile (an H100's or the H200's) beside the measured
    step, where andrea.run.stepmodel exists (nothing is said where it does not)."""
    try:
        from andrea.run.stepmodel import estimate_step_seconds, profile_for
    except ImportError:
        return
    hw = profile_for(card)
    try:
        estimate = estimate_step_seconds(hw=hw)  # ANDREA-120M at 8 x 1024 on the card, in seconds
    except Exception as e:  # a broken model is reported, not a failed benchmark
        log(f"step model: estimate_step_seconds() raised {type(e).__name__}: {e}")
        return
    log(f"figure: step model {1e3 * estimate:.1f} ms estimated (ANDREA-120M, 8 x 1024, {hw.name}), "
        f"{result['step_ms_median']:.1f} ms measured{' (dry run: the toy model)' if dry else ''}: "
        f"measured / estimated {result['step_ms_median'] / (1e3 * estimate):.2f}")


def _bench_torch(cfg, B, T, warmup, steps, tf32, andrea_tokens_per_s, dry):
    """PyTorch's GPT-2 of the same shape, on the same device (the GPU; in a dry run the CPU torch
    at toy size), eager and with scaled_dot_product_attention: tokens/s and andrea / PyTorch.
    True if it failed (in a dry run a missing torch is skipped)."""
    from andrea.interop import torch_reference as ref

    if ref.torch is None:
        log(f"{'skip' if dry else 'FAIL'} PyTorch side by side: {ref.TORCH_MISSING}")
        return not dry
    device = "cuda" if ref.torch.cuda.is_available() else "cpu"
    if device == "cpu" and not dry:
        log(f"FAIL PyTorch side by side: torch {ref.torch.__version__} sees no CUDA device")
        return True
    failed = False
    for name, sdpa in (("sdpa", True),):  # PyTorch's faster attention: the fair comparison, and half the time
        try:
            r = ref.benchmark(cfg, B, T, steps, warmup, sdpa=sdpa, device=device, tf32=tf32 and device != "cpu")
        except Exception as e:  # the other variant still runs
            failed = True
            log(f"FAIL PyTorch {name}: {first_line(e)}")
            continue
        peak = f", peak {r['cuda_peak_bytes'] / 2**30:.2f} GiB" if "cuda_peak_bytes" in r else ""
        log(f"figure: PyTorch {r['torch_version']} {name} on {device}{' (TF32)' if r['tf32'] else ''}: "
            f"{r['tokens_per_s_median']:,.0f} tokens/s, step {1e3 * r['step_s_median']:.1f} ms{peak}; "
            f"andrea / PyTorch {andrea_tokens_per_s / r['tokens_per_s_median']:.2f}")
        print("RESULT " + json.dumps({"mode": f"torch-{name}", **r}), flush=True)
        if device != "cpu":
            ref.torch.cuda.empty_cache()
    return failed


def _bench_result(training, cfg, mode, times, final_loss, dry):
    """The benchmark's figures: speed, FLOP/s and MFU against the datasheet peaks and the measured
    matmul peak, the step split, and memory (the GPU's pool and device, or the process's RSS)."""
    from andrea.model.sizes import flops_per_token
    from andrea.run.perf import matmul_peak_flops, peak_rss_bytes

    xp, pool = training.xp, training.pool
    B, T = training.B, training.T
    tokens_per_s = B * T / statistics.median(times)
    n_params = training.model.num_parameters()
    achieved = tokens_per_s * flops_per_token(cfg, T, n_params)
    measured = matmul_peak_flops(xp, n=256 if dry else 8192, repeats=3)
    result = {"mode": mode, "batch": B, "seq_len": T, "parameters": n_params, "tokens_per_s": tokens_per_s,
              "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
              "step_ms_max": 1e3 * max(times), "achieved_tflops": achieved / 1e12,
              "mfu_fp32_peak": achieved / PEAK_FP32, "mfu_tf32_peak": achieved / PEAK_TF32,
              "matmul_peak_tflops": measured / 1e12, "mfu_measured_peak": achieved / measured,
              "split_ms": {k: 1e3 * v[0] for k, v in training.split.items()}, "loss": final_loss}
    if pool is not None:
        free, total = xp.cuda.runtime.memGetInfo()
        result.update(pool_used_peak_gib=training.used / 2**30, pool_total_gib=pool.total_bytes() / 2**30,
                      device_used_gib=(total - free) / 2**30,
                      device=xp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    else:
        result["peak_rss_gib"] = peak_rss_bytes() / 2**30
    return result


def _log_bench(result, cfg, xp, tf32):
    from andrea.model.sizes import flops_per_token
    from andrea.run.perf import peak_label

    T, n_params = result["seq_len"], result["parameters"]
    log(f"{result['tokens_per_s']:,.0f} tokens/s (step {result['step_ms_median']:.1f} ms median, "
        f"{result['step_ms_min']:.1f}-{result['step_ms_max']:.1f}); {result['achieved_tflops']:.1f} TFLOP/s achieved "
        f"({flops_per_token(cfg, T, n_params) / 1e6:.0f} MFLOP/token, {n_params:,} parameters)",
        f"MFU {100 * result['mfu_fp32_peak']:.1f}% of the FP32 peak (67 TFLOP/s), "
        f"{100 * result['mfu_tf32_peak']:.1f}% of the TF32 dense peak (495 TFLOP/s), "
        f"{100 * result['mfu_measured_peak']:.1f}% of the {peak_label(xp, tf32)} measured here "
        f"({result['matmul_peak_tflops']:.1f} TFLOP/s)",
        "one step split (synchronised): " + ", ".join(f"{k} {v:.1f} ms" for k, v in result["split_ms"].items()))
    if "pool_used_peak_gib" in result:
        log(f"memory: memory pool peak in use {result['pool_used_peak_gib']:.2f} GiB (sampled after forward and "
            f"backward), pool holds {result['pool_total_gib']:.2f} GiB, device in use "
            f"{result['device_used_gib']:.2f} GiB ({result['device']}); loss after the steps {result['loss']:.4f}")

