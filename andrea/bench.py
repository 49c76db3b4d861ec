"""Benchmark: training speed, MFU, peak memory and KV-cache generation speed, per config.

    python -m andrea.bench                          # tiny, small, 120m on the CPU; a table and bench.json
    python -m andrea.bench --configs tiny --torch   # and PyTorch eager on the identical model, side by side
    python -m andrea.bench --configs 120m --profile # where a step's time goes, per layer
    python -m andrea.bench --components             # each component against PyTorch's; bench-components.json
    python -m andrea.bench --device gpu --model h200  # no measuring: the step model's table and estimate for an
                                                    # H200 (andrea/run/stepmodel.py), 120m at 8 x 1024 by default

Each config runs in a fresh process, so its peak resident memory is its own. A training step is
forward + backward + AdamW on random token batches at the shapes the performance bars are set
at (BENCHMARKS.md: tiny 16 x 128, small 8 x 256, 120m 1 x 1024), timed after warm-up; tokens/s is
reported as the median with min and max. MFU divides the model's FLOP/s (6 N + 12 L d T per token) by the best of a few
4096^3 float32 matmuls measured in the same process (on a GPU, 8192^3 in event-timed loops, in the
config's TF32 mode; the fused kernels are self-checked first, as training does).

Each config's gradient all-reduce (one flat float32 buffer of all its parameters, once per
optimizer step in data-parallel training) is timed too: between 2 MPI processes on the CPU
(`mpiexec` from the mpi extra), with NCCL on a GPU (`--device gpu`, one rank: NCCL's local pass).
"""

import os

if __name__ == "__main__":  # before NumPy loads OpenBLAS: its threads sleep after each GEMM (BENCHMARKS.md)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import argparse  # after the setting above, on purpose
import importlib.util
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.config import load_config
from andrea.errors import UserError
from andrea.model.sizes import flops_per_token
from andrea.model.transformer import ANDREA
from andrea.run import preflight
from andrea.run.perf import matmul_peak_flops, peak_label, peak_rss_bytes, synchronize
from minitensor.device import set_tf32
from minitensor.memory import keep_freed_memory
from minitensor.optim import AdamW

SHAPES = {"tiny": (16, 128), "small": (8, 256), "120m": (1, 1024)}
STEPS = {"tiny": (3, 15), "small": (2, 8), "120m": (1, 4)}          # (warm-up, timed)
GEN_CONTEXTS = {"tiny": (16, 64, 120), "small": (16, 128, 250), "120m": (16, 256, 1000)}


def _timed(xp, fn, *args):
    synchronize(xp)
    t = time.perf_counter()
    out = fn(*args)
    synchronize(xp)
    return out, time.perf_counter() - t


def bench_training(model, opt, B, T, warmup, steps, seed=0):
    """Median/min/max tokens/s over `steps` timed steps and the forward/backward/optimizer split."""
    xp = model.xp
    rng = np.random.default_rng(seed)
    V = model.cfg.vocab_size
    ops = model.ops
    splits = defaultdict(list)
    for i in range(warmup + steps):
        x = rng.integers(0, V, (B, T + 1))
        _, f = _timed(xp, model.loss, x[:, :-1], x[:, 1:])
        _, b = _timed(xp, lambda: (model.zero_grad(), model.backward()))
        _, o = _timed(xp, lambda: opt.step(grad_scale=ops.clip_scale(ops.global_norm(model.params.grads), 1.0, 0.0)[0]))
        if i >= warmup:
            splits["forward"].append(f)
            splits["backward"].append(b)
            splits["optimizer"].append(o)
    step = np.array(splits["forward"]) + np.array(splits["backward"]) + np.array(splits["optimizer"])
    tps = B * T / step
    return {
        "tokens_per_s_median": float(np.median(tps)), "tokens_per_s_min": float(tps.min()),
        "tokens_per_s_max": float(tps.max()), "step_s_median": float(np.median(step)),
        "split_s": {k: float(np.median(v)) for k, v in splits.items()},
    }


def bench_generation(model, contexts, new_tokens=16, seed=0):
    """Tokens/s generating `new_tokens` one at a time with the KV cache already holding L positions."""
    rng = np.random.default_rng(seed)
    out = {}
    for L in contexts:
        L = min(L, model.cfg.context_length - new_tokens)
        cache = model.new_kv_cache(1)
        model.forward_kv(rng.integers(0, model.cfg.vocab_size, (1, L)), cache, 0)
        ids = rng.integers(0, model.cfg.vocab_size, new_tokens)
        _, dt = _timed(model.xp, _generate_steps, model, ids, cache, L)
        out[str(L)] = new_tokens / dt
    return out


def _generate_steps(model, ids, cache, pos):
    for i in range(len(ids)):
        model.forward_kv(ids[None, i:i + 1], cache, pos + i)


def _forward_backward(model, x):
    model.loss(x[:, :-1], x[:, 1:])
    model.zero_grad()
    model.backward()


def _timers(xp, totals):
    """timer(fn, key): fn timed into totals[key] (seconds, the device synchronized around it); a call made
    while another under the same key is being timed counts once, in the outer one (a norm's forward_joined
    or backward_and_sum_skip through its forward or backward)."""
    active = set()

    def timer(fn, key):
        def timed(*a, **k):
            if key in active:
                return fn(*a, **k)
            active.add(key)
            try:
                return measured(*a, **k)
            finally:
                active.discard(key)

        def measured(*a, **k):
            synchronize(xp)
            t = time.perf_counter()
            r = fn(*a, **k)
            synchronize(xp)
            totals[key] += time.perf_counter() - t
            return r
        return timed
    return timer


def profile_step(model, opt, B, T, steps=3, seed=0):
    """Seconds per step by layer kind and pass, from timers wrapped around every layer's forward and
    backward, and around the backend's attention core and GELU (model.ops, restored afterwards)."""
    xp = model.xp
    totals = defaultdict(float)
    timer = _timers(xp, totals)

    def wrap(layer, label):
        for pass_name in ("forward", "backward"):
            setattr(layer, pass_name, timer(getattr(layer, pass_name), (label, pass_name)))
        for method, pass_name in (("forward_joined", "forward"), ("backward_and_sum_skip", "backward")):
            if hasattr(layer, method):  # a norm's: the residual join, the skip's sums, in its own pass
                setattr(layer, method, timer(getattr(layer, method), (label, pass_name)))

    for blk in model.blocks:
        wrap(blk.ln_1, "layernorm")
        wrap(blk.ln_2, "layernorm")
        wrap(blk.attn, "attention (whole)")
        wrap(blk.mlp, "mlp (whole)")
    wrap(model.ln_f, "layernorm")
    wrap(model.head, "tied head")
    wrap(model.loss_fn, "cross-entropy")
    wrap(model.wte, "embeddings")
    wrap(model.wpe, "embeddings")
    ops = model.ops
    pieces = {"attention_forward": ("attention core", "forward"), "attention_backward": ("attention core", "backward"),
              "attention_backward_and_bias": ("attention core", "backward"),  # c_attn's bias gradient with it
              "bias_gelu_forward": ("gelu", "forward"), "bias_gelu_backward": ("gelu", "backward")}
    kept = {name: vars(ops).get(name) for name in pieces}  # an instance's own (a gradient writer's count)
    for name, key in pieces.items():
        setattr(ops, name, timer(getattr(ops, name), key))
    try:
        rng = np.random.default_rng(seed)
        step_total = 0.0
        opt_total = 0.0
        for _ in range(steps):
            x = rng.integers(0, model.cfg.vocab_size, (B, T + 1))
            _, dt = _timed(xp, _forward_backward, model, x)
            _, do = _timed(xp, opt.step)
            step_total += dt + do
            opt_total += do
    finally:
        for name, own in kept.items():                       # the methods as they were
            if own is None:
                delattr(ops, name)
            else:
                setattr(ops, name, own)
    rows = {f"{k[0]} {k[1]}": v / steps for k, v in totals.items()}
    for pass_name in ("forward", "backward"):  # each composite's own products = whole minus its timed core
        whole = rows.pop(f"attention (whole) {pass_name}", 0.0)
        rows[f"attention c_attn + c_proj (linear) {pass_name}"] = whole - rows.get(f"attention core {pass_name}", 0.0)
        whole = rows.pop(f"mlp (whole) {pass_name}", 0.0)
        rows[f"mlp c_fc + c_proj (linear) {pass_name}"] = whole - rows.get(f"gelu {pass_name}", 0.0)
    rows["adamw step"] = opt_total / steps
    rows["other (residual adds, zero_grad, glue)"] = step_total / steps - sum(rows.values())
    return {"step_s": step_total / steps, "rows": dict(sorted(rows.items(), key=lambda kv: -kv[1]))}


def run_one(name, device, profile):
    """Everything measured for one config, in this process."""
    full = load_config(name)
    cfg = full.model
    B, T = SHAPES[name]
    warmup, steps = STEPS[name]
    model = ANDREA(cfg, device=device, dtype="float32", seed=0, kernels=full.train.kernels)
    opt = AdamW(model, lr=6e-4)
    # the config's TF32 setting and the self-checked kernels, as training would run (GPU only)
    gpu_setup = [set_tf32(model.xp, full.train.tf32), model.ops.kernels_line]
    peak = matmul_peak_flops(model.xp, n=4096, repeats=3)
    result = {"config": name, "device": model.device.name, "batch": B, "seq_len": T,
              "parameters": model.num_parameters(), "gpu_setup": gpu_setup,
              "peak": peak_label(model.xp, full.train.tf32)}
    result.update(bench_training(model, opt, B, T, warmup, steps))
    # the peak is measured again after training and the best kept: on a shared VM one
    # measurement alone can come out low (BENCHMARKS.md), which would inflate MFU
    peak = max(peak, matmul_peak_flops(model.xp, n=4096, repeats=3, fresh=True))
    result["matmul_peak_flops"] = peak
    result["mfu"] = result["tokens_per_s_median"] * flops_per_token(cfg, T, model.num_parameters()) / peak
    result["peak_rss_bytes"] = peak_rss_bytes()
    if profile:
        result["profile"] = profile_step(model, opt, B, T)
    result["generation_tokens_per_s"] = bench_generation(model, GEN_CONTEXTS[name])
    return result


def _subprocess_json(cmd, env=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_allreduce(parameters, device):
    """The gradient all-reduce for `parameters` float32 values: 2 MPI processes, or NCCL on a GPU."""
    cmd = [sys.executable, "-m", "andrea.run.allreduce", "--bench", str(parameters)]
    if device == "gpu":
        return _subprocess_json([*cmd, "--gpu"])
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if importlib.util.find_spec("mpi4py") is None or not mpiexec.exists():
        return {"error": "no mpi4py and mpiexec beside this Python (pip install -e '.[mpi]')"}
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")
    return _subprocess_json([str(mpiexec), "-n", "2", *cmd], env=env)


def bench_reduce_wait(name, batch, seq):
    """How long a step of config `name` at batch x seq waits on its gradient reduction between 2 MPI
    processes, after the backward and overlapped with it (andrea.run.allreduce --step-wait)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if importlib.util.find_spec("mpi4py") is None or not mpiexec.exists():
        return {"error": "no mpi4py and mpiexec beside this Python (pip install -e '.[mpi]')"}
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")
    return _subprocess_json([str(mpiexec), "-n", "2", sys.executable, "-m", "andrea.run.allreduce", "--step-wait",
                             name, "--batch", str(batch), "--seq", str(seq)], env=env)


def print_table(results):
    """The table of the configs' results; PyTorch's columns only when --torch measured them."""
    torch = any("torch" in r for r in results)
    head = (f"{'config':<7} {'B x T':>9} {'tokens/s (min-max)':>24} {'MFU':>6} {'peak RSS':>9} {'fwd/bwd/opt ms':>18}"
            + (f" {'torch tok/s':>11} {'torch RSS':>9} {'ratio':>6}" if torch else ""))
    print(head)
    print("-" * len(head))
    for r in results:
        print(_table_row(r, torch))
    print()
    for r in results:
        if r.get("peak"):
            print(f"{r['config']:<7} MFU against the {r['peak']}: {r['matmul_peak_flops'] / 1e12:.2f} TFLOP/s; "
                  + "; ".join(r.get("gpu_setup", [])))
    for r in results:
        _print_notes(r)


def _table_row(r, torch):
    """One config's line of the table: its speed, MFU, memory and split, then PyTorch's when measured."""
    if "error" in r:
        return f"{r['config']:<7} error: {r['error']}"
    s = r["split_s"]
    line = (f"{r['config']:<7} {r['batch']:>3} x {r['seq_len']:<4} "
            f"{r['tokens_per_s_median']:>9,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})"
            f"{100 * r['mfu']:>6.1f}% {r['peak_rss_bytes'] / 2**30:>7.2f}Gi "
            f"{1e3 * s['forward']:>6.0f}/{1e3 * s['backward']:.0f}/{1e3 * s['optimizer']:.0f}")
    t = r.get("torch", {})
    if "tokens_per_s_median" in t:
        ratio = r["tokens_per_s_median"] / t["tokens_per_s_median"]
        line += f"{t['tokens_per_s_median']:>12,.0f} {t['peak_rss_bytes'] / 2**30:>7.2f}Gi {ratio:>6.2f}"
    elif torch:
        line += f" {'torch: ' + t.get('error', 'not measured')}"
    return line


def _print_notes(r):
    """The lines under the table for one config: its all-reduce, generation speed and profile."""
    a = r.get("allreduce")
    if a and "error" in a:
        print(f"{r['config']:<7} gradient all-reduce: {a['error']}")
    elif a:
        step = r["batch"] * r["seq_len"] / r["tokens_per_s_median"] if "tokens_per_s_median" in r else None
        share = f", {100 * a['seconds'] / step:.1f}% of the measured step" if step else ""
        print(f"{r['config']:<7} gradient all-reduce: {a['bytes'] / 1e6:.1f} MB over {a['processes']} "
              f"{a['transport']} rank(s) in {1e3 * a['seconds']:.1f} ms{share}")
    w = r.get("reduce_wait")
    if w and "error" in w:
        print(f"{r['config']:<7} step's wait on the reduction: {w['error']}")
    elif w:
        print(f"{r['config']:<7} step's wait on the gradient reduction past the backward, {w['processes']} "
              f"{w['transport']} ranks: {1e3 * w['after']['waited_s']:.1f} ms after the backward, "
              f"{1e3 * w['overlap']['waited_s']:.1f} ms overlapped with it (train.overlap; backward "
              f"{1e3 * w['overlap']['backward_s']:.0f} ms)")
    if "generation_tokens_per_s" in r:
        gen = ", ".join(f"{v:,.0f} tok/s at {k}" for k, v in r["generation_tokens_per_s"].items())
        print(f"{r['config']:<7} generation with the KV cache: {gen}")
    if "profile" in r:
        print(f"\n{r['config']} profile: {1e3 * r['profile']['step_s']:.0f} ms per step")
        for k, v in r["profile"]["rows"].items():
            print(f"  {k:<40} {1e3 * v:>9.1f} ms  {100 * v / r['profile']['step_s']:>5.1f}%")


def _parser():
    ap = ArgumentParser(prog="python -m andrea.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", help="comma-separated: tiny, small, 120m (default all three; 120m with --model)")
    ap.add_argument("--device", choices=["cpu", "gpu", "auto"], help="default: $ANDREA_DEVICE, else cpu")
    ap.add_argument("--profile", action="store_true", help="also time every layer's forward and backward")
    ap.add_argument("--torch", action="store_true",
                    help="also run PyTorch eager (2 threads) on the identical model, with explicit and with "
                         "fused (scaled_dot_product_attention) attention; the table shows the faster")
    ap.add_argument("--components", action="store_true",
                    help="time each non-GEMM component (forward + backward, 120m shapes) against PyTorch's own "
                         "kernel in this process, interleaved (andrea.interop.components); with --torch, after "
                         "the configs")
    ap.add_argument("--repeats", type=int, default=7, help="runs per engine and component with --components")
    ap.add_argument("--no-allreduce", action="store_true", help="skip timing the gradient all-reduce")
    ap.add_argument("--json", help="where to write the results (default bench.json; bench-components.json for "
                                    "--components alone, so that it keeps the plain benchmark's file)")
    ap.add_argument("--model", choices=["h200"],
                    help="measure nothing: print the step model of a training step on this GPU (with --device gpu), "
                         "every launch of the config's step at its batch_size x context length recorded on the CuPy "
                         "stand-in and timed by andrea/run/stepmodel.py")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one config in this process
    ap.add_argument("--debug", action="store_true")
    return ap


def main(argv=None):
    keep_freed_memory()  # an entry point's choice: see minitensor/memory.py
    args = _parser().parse_args(argv)
    args.device = preflight.choose_device(args.device, fallback="cpu")
    if args.one:
        print(json.dumps(run_one(args.one, args.device, args.profile)))
        return 0
    if args.model:
        return _step_model(args)
    names = _check_request(args)  # every mistake before minutes of measuring, not after
    if args.components and not args.torch:
        return _write(args.json, [{"components": _components(args.repeats)}])
    results = [measure_config(name, args) for name in names]
    print_table(results)
    if args.components:  # after the configs: a child's peak RSS starts from its parent's at the fork
        print()
        results.append({"components": _components(args.repeats)})
    return _write(args.json, results)


def _check_request(args):
    """The config names to measure, once --json (defaulted here), --configs and --repeats are checked."""
    args.json = args.json or ("bench-components.json" if args.components and not args.torch else "bench.json")
    preflight.check_output_file(args.json, "--json")
    names = [n.strip() for n in (args.configs or "tiny,small,120m").split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise UserError(f"unknown config {unknown[0]!r} for the benchmark: use {', '.join(SHAPES)}")
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    return names


def _step_model(args):
    """--model: the step model's table for each config (its own batch and micro-batches), nothing measured."""
    from andrea.run import stepmodel

    if args.device != "gpu":
        raise UserError(f"--model {args.model} models a GPU step: add --device gpu")
    names = [n.strip() for n in (args.configs or "120m").split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise UserError(f"unknown config {unknown[0]!r} for the benchmark: use {', '.join(SHAPES)}")
    results = []
    for name in names:
        rec = stepmodel.record_anywhere(name)
        est = stepmodel.estimate(rec)
        stepmodel.print_table(rec, est)
        print()
        results.append({"config": name, "model": args.model, **{k: v for k, v in est.items() if k != "rows"}})
    return _write(args.json, results) if args.json else 0


def measure_config(name, args):
    """One config measured in a fresh process, then its gradient all-reduce and PyTorch's run of it."""
    print(f"measuring {name} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "andrea.bench", "--one", name, "--device", args.device]
    r = _subprocess_json(cmd + (["--profile"] if args.profile else []))
    r.setdefault("config", name)
    if not args.no_allreduce and "parameters" in r:
        r["allreduce"] = bench_allreduce(r["parameters"], r.get("device", args.device))
        if r.get("device", args.device) == "cpu":
            r["reduce_wait"] = bench_reduce_wait(name, *SHAPES[name])
    if args.torch:
        r["torch"] = bench_torch(name)
    return r


def bench_torch(name):
    """PyTorch eager on the identical model, with explicit and with fused attention: the faster of the
    two, with both kept under "variants"."""
    B, T = SHAPES[name]
    warmup, steps = STEPS[name]
    variants = {}
    for variant, flags in (("explicit", []), ("sdpa", ["--sdpa"])):
        variants[variant] = _subprocess_json(
            [sys.executable, "-m", "andrea.interop.torch_reference", "--config", name, "--batch", str(B),
             "--seq", str(T), "--steps", str(steps), "--warmup", str(warmup), "--threads", "2", *flags])
    ok = {k: v for k, v in variants.items() if "tokens_per_s_median" in v}
    best = max(ok, key=lambda k: ok[k]["tokens_per_s_median"]) if ok else "explicit"
    return {**variants[best], "attention": best, "variants": variants}


def _components(repeats):
    from andrea.interop import components
    from minitensor.backends import numba_jit

    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("--components compares with PyTorch, which is not installed: "
                        "pip install -e '.[reference]'") from None

    print("measuring the components ...", file=sys.stderr, flush=True)
    table = components.measure(repeats=repeats)
    components.print_table(table, numba_jit.mode())
    print()
    return table


def _write(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
