"""The Python phases of the GPU check (scripts/gpu_check.sh runs them in its order): every kernel
compiled, the fused kernels, float32 GPU gradients against NumPy float64, and ANDREA-120M training
throughput in TF32.

    PYTHONPATH=. python scripts/gpu_check.py --parts compile,kernels,gradients,bench
    PYTHONPATH=. python scripts/gpu_check.py --dry-run   # the same code at toy sizes: on NumPy
                                                         # without a GPU, on the GPU if one works

Parts (each in a fresh process with its own time limit, so a CUDA error or a hang in one does not
hide the others; exit status 1 if any failed):

    compile    every registered kernel built for float32 and float64 (a RawKernel compiled, an
               ElementwiseKernel run once on one element), so CuPy's kernel cache is warm before
               anything is timed: gpu_check.sh runs it before the GPU tests
    kernels    the start-up self-check (minitensor.selfcheck: which fused pieces agree with the
               generic path), then each fused kernel against the generic xp code of its layer at
               ANDREA-120M shapes (float32): max error and time of each
    gradients  a small ANDREA (4 layers, d 128; the dry run: 1 layer, T = 64, 2 steps) at T = 256 trained 3
               steps on CuPy in float32,
               once as training runs (dense attention core, self-checked fused kernels) and once
               with the generic kernels and the blocked core (two query blocks of 128), each
               against NumPy float64 from the same seed: per-step losses, step-0 gradients
    bench      ANDREA-120M, batch 8 x 1024, AdamW, tf32: true (set through CuPy's API), the
               fused kernels self-checked: tokens/s, MFU, peak GPU memory

Everything printed also goes to gpu_check_results.txt in $OUT if set, else the current directory
(unless gpu_check.sh already keeps it).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

PEAK_FP32 = 67e12  # H200 dense FP32 FLOP/s (NVIDIA's datasheet)
PEAK_TF32 = 495e12  # H200 dense TF32 FLOP/s
# seconds each, at most (gpu_check.sh allows a little more)
PARTS = {"compile": 40, "kernels": 23, "gradients": 23, "bench": 48}
DRY_TIME_SCALE = 4  # a dry run's limits are 4 times these: it runs on a CPU, maybe under the CuPy stand-in
RESULTS = os.path.join(os.environ.get("OUT") or ".", "gpu_check_results.txt")


def log(*lines):
    for line in lines:
        print(line, flush=True)
        if not os.environ.get("GPU_CHECK_TEED"):
            with open(RESULTS, "a") as f:
                f.write(line + "\n")


def normwise(got, want):
    """max |got - want| / max |want|, on the host, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    return err / scale if scale else err


def verdict(ok):
    return "ok  " if ok else "FAIL"


def gpu_here(dry):
    """Whether the parts run on CuPy: always for the real check, in a dry run only if a GPU works."""
    if not dry:
        return True
    from minitensor.backend import gpu_available

    return gpu_available()


# --- compile: every kernel built before anything is timed -----------------------------------------


def part_compile(dry):
    from minitensor import cuda

    if not gpu_here(dry):
        log("dry run on NumPy: no CUDA kernels to compile (the NVRTC compile check is "
            "`python -m minitensor.kernels --check`)")
        return False
    import cupy

    start, failed, count = time.perf_counter(), False, 0
    for spec in cuda.all_kernels().values():
        for dtype in cuda.DTYPES:
            t0 = time.perf_counter()
            try:
                _build(cupy, spec, np.dtype(dtype))
                count += 1
            except Exception as e:  # every kernel is tried; the failures are listed
                failed = True
                log(f"FAIL compile {spec.name} {dtype}: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
                continue
            log(f"ok   compiled {spec.name:<26} {dtype}  {time.perf_counter() - t0:.2f} s")
    log(f"compiled {count} kernels (every kernel x float32, float64) in {time.perf_counter() - start:.1f} s")
    return failed


def _build(cupy, spec, dtype):
    """Builds one kernel for dtype on the device: a RawKernel compiled, an ElementwiseKernel run on
    one element (CuPy compiles it at its first call, for the argument types of that call)."""
    from minitensor import cuda

    if isinstance(spec, cuda.RawSpec):
        spec.kernel(dtype).compile()
        return
    scalars = dict(spec.scalars)
    args = []
    for param in spec.in_params.split(","):
        *_, kind, name = param.split()
        if name in scalars:
            args.append(np.dtype(kind).type(scalars[name]) if kind != "T" else dtype.type(scalars[name]))
        else:
            args.append(cupy.zeros(1, dtype if kind == "T" else np.dtype(kind)))
    spec.kernel()(*args)
    cupy.cuda.get_current_stream().synchronize()


# --- gradients: float32 training on CuPy against NumPy float64, at T = 256 --------------------------


def part_gradients(dry):
    import dataclasses

    from andrea.config import load_config
    from minitensor.attention import CausalSelfAttention
    from minitensor.backend import set_tf32

    cfg = dataclasses.replace(load_config("tiny").model, context_length=256, n_layer=1 if dry else 4)
    B, T, steps = (1, 64, 2) if dry else (2, 256, 3)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, cfg.vocab_size, (B, T + 1)) for _ in range(steps)]
    ref_losses, ref_grads, _ = _train(cfg, "cpu", "float64", data)
    log(f"ANDREA {cfg.n_layer} layers, d {cfg.d_model}, {steps} AdamW steps of {B} x {T} from seed 0; "
        f"NumPy float64 losses: {', '.join(f'{v:.6f}' for v in ref_losses)}")
    on_gpu = gpu_here(dry)
    device = "gpu" if on_gpu else "cpu"
    if on_gpu:
        import cupy

        log(set_tf32(cupy, False))  # float32 GEMMs: TF32 would loosen the comparison to 1e-3
    failed = False
    variants = (("dense core, kernels auto", True), ("blocked core (2 query blocks), generic kernels", False))
    for variant, dense in variants:
        CausalSelfAttention.dense = dense
        losses, grads, kernels_line = _train(cfg, device, "float32", data, "auto" if dense else "generic")
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        errs = {name: normwise(grads[name], ref_grads[name]) for name in ref_grads}
        worst = max(errs, key=errs.get)
        ok = loss_err <= 1e-4 and errs[worst] <= 1e-3
        failed |= not ok
        log(f"{verdict(ok)} {'CuPy' if on_gpu else 'NumPy'} float32, {variant} ({kernels_line}): losses within "
            f"{loss_err:.2e} relative (tolerance 1e-4); step-0 gradients within {errs[worst]:.2e} norm-wise "
            f"(worst tensor {worst}; median {statistics.median(errs.values()):.2e}; tolerance 1e-3)")
    CausalSelfAttention.dense = None
    return failed


def _train(cfg, device, dtype, data, kernels=None):
    """Per-step losses, the step-0 gradients {name: float64 NumPy array} (clipping at norm 1) and
    the line that says which kernels ran."""
    from andrea.model.optim import AdamW
    from andrea.model.transformer import ANDREA
    from minitensor.backend import to_numpy

    model = ANDREA(cfg, device=device, dtype=dtype, seed=0, kernels=kernels)
    ops = model.ops
    opt = AdamW(model, lr=1e-3)
    losses, grads = [], None
    for x in data:
        losses.append(float(model.loss(x[:, :-1], x[:, 1:])))
        model.zero_grad()
        model.backward()
        if grads is None:
            grads = {name: to_numpy(g).astype(np.float64) for name, g in model.named_grads()}
        opt.step(grad_scale=ops.clip_scale(ops.global_norm(model.params.grads), 1.0, 0.0)[0])
    return losses, grads, ops.kernels_line


# --- kernels: fused against generic, at model shapes ----------------------------------------------


def part_kernels(dry):
    from andrea.config import load_config
    from andrea.model.transformer import param_shapes
    from minitensor import cuda, cupy_ops, kernelcheck
    from minitensor.layernorm import LayerNorm
    from minitensor.loss import SoftmaxCrossEntropy
    from minitensor.ops import Ops
    from minitensor.optim import AdamW
    from minitensor.params import Params
    from minitensor.selfcheck import select_kernels

    failed = False
    on_gpu = gpu_here(dry)
    if not on_gpu:
        xp = np
        log(select_kernels("auto", np)[1] + " (dry run: the self-check itself runs only on CuPy)")
        cuda.launch = kernelcheck.emulate_launch
    else:
        import cupy as xp

        start = time.perf_counter()
        _, line = select_kernels("auto", xp)
        failed = "generic for" in line  # a fused kernel disagreed with its generic path
        log(f"{verdict(not failed)} self-check in {time.perf_counter() - start:.1f} s (kernels compiled "
            f"included): {line}")
    if dry:
        N, C, F, BH, T, V = 6, 40, 64, 2, 20, 50
        shapes, reps = {"w": (50, 40), "b": (40,)}, 1
    else:
        N, C, F, BH, T, V = 8 * 1024, 768, 3072, 8 * 12, 1024, 8449
        shapes, reps = param_shapes(load_config("120m").model), 10
    dtype = np.float32
    drawn, state = {}, {}
    ref = Ops(xp)  # the generic side: the maths every kernel replaces

    def reseed():  # every setup gets the same inputs, so the fused and the generic run see equal ones
        state["k"] = 0

    def rand(*shape, scale=1.0, shift=0.0):
        """A fresh device copy of the k-th draw of this setup, drawn once on the host: cupy.random
        needs cuRAND, which a machine may lack."""
        state["k"] += 1
        key = (state["k"], shape, scale, shift)
        if key not in drawn:
            drawn[key] = shift + scale * np.random.default_rng(state["k"]).standard_normal(shape, dtype=dtype)
        return xp.array(drawn[key])

    def layernorm_setup():
        reseed()
        x, dy, w, b = rand(N, C, shift=0.3), rand(N, C), rand(C, scale=0.2, shift=1.0), rand(C, scale=0.1)
        layer = LayerNorm(w, xp.zeros(C, dtype), b, xp.zeros(C, dtype), ops=ref)
        layer.forward(x)
        return dict(x=x, dy=dy, w=w, b=b, r=rand(N, C), layer=layer, cache=layer._cache,
                    dw=xp.zeros(C, dtype), db=xp.zeros(C, dtype))

    def ln_generic_fwd(d):
        y = d["layer"].forward(d["x"])
        return y, d["layer"]._cache.mean, d["layer"]._cache.rstd

    def ln_generic_bwd(d, add_to=None):
        layer = d["layer"]
        layer._save(d["cache"])
        dx = layer.backward(d["dy"])
        if add_to is not None:
            dx += add_to
        return dx, layer.dw, layer.db

    def ln_generic_res(d):
        d["x"] += d["r"]
        return d["layer"].forward(d["x"]), d["x"]

    def gelu_setup():
        reseed()
        a, b = rand(N, F, scale=2.0), rand(F, scale=0.1)
        return dict(a=a, b=b, h=a + b, dy=rand(N, F), db=xp.zeros(F, dtype), hb=xp.empty_like(a))

    def gelu_generic_fwd(d):
        xp.add(d["a"], d["b"], out=d["hb"])  # the Linear adds its bias into the matmul output
        return (ref.gelu_forward(d["hb"]),)

    def gelu_generic_bwd(d):
        dh = ref.gelu_backward(d["h"], d["dy"])
        d["db"] += dh.sum(axis=0)
        return dh, d["db"]

    def softmax_setup():
        reseed()
        s = rand(BH, T, T, scale=2.0)
        p, lse = s.copy(), xp.empty((BH, T, 1), dtype)
        ref.block_softmax(p[None], 0, lse[None])
        return dict(s=s, p=p, lse=lse, dp=rand(BH, T, T), lse_out=xp.empty((BH, T, 1), dtype))

    def softmax_generic_fwd(d):
        ref.block_softmax(d["s"][None], 0, d["lse_out"][None])
        return d["s"], d["lse_out"]

    def softmax_generic_bwd(d):
        D = (d["dp"] * d["p"]).sum(axis=-1, keepdims=True)
        ref.block_softmax_backward(d["dp"][None], d["p"][None], D[None])
        return (d["dp"],)

    # the layer keeps softmax / N (its backward's scale folded in); the fused kernels take and give
    # plain probabilities, so the generic side is compared times N
    def xent_setup():
        reseed()
        z = rand(N, V, scale=2.0)
        t = xp.asarray(np.random.default_rng(0).integers(0, V, N))
        scaled = z.copy()
        loss_fn = SoftmaxCrossEntropy(ops=ref)
        loss_fn.forward(scaled, t, inplace=True)
        return dict(z=z, t=t, probs=scaled * N, cache=loss_fn._cache, loss_fn=loss_fn)

    def xent_generic_fwd(d):
        return d["loss_fn"].forward(d["z"], d["t"], inplace=True), d["z"] * N

    def xent_generic_bwd(d):
        d["loss_fn"]._save(d["cache"])
        return (d["loss_fn"].backward(1.0),)

    hyper = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def adamw_setup():
        reseed()
        params = Params(shapes, xp=xp, dtype=dtype, ops=ref)
        params.data[...] = rand(params.size, scale=0.02)
        params.grads[...] = rand(params.size, scale=1e-3)
        opt = AdamW(params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"])
        return dict(params=params, opt=opt, mask=params.mask(opt.decays))

    def adamw_generic(d):
        d["opt"].step(grad_scale=0.5)
        return d["params"].data, d["opt"].m, d["opt"].v

    def adamw_fused(d):
        p, opt = d["params"], d["opt"]
        cupy_ops.adamw_step_gpu(p.data, p.grads, opt.m, opt.v, d["mask"], t=1, grad_scale=0.5, **hyper)
        return p.data, opt.m, opt.v

    cases = [  # name, setup, fused, generic, uses an ElementwiseKernel (skipped on NumPy)
        ("layernorm fwd", layernorm_setup, lambda d: cupy_ops.layernorm_forward_gpu(d["x"], d["w"], d["b"]),
         ln_generic_fwd, False),
        ("layernorm bwd", layernorm_setup,
         lambda d: (cupy_ops.layernorm_backward_gpu(d["dy"], d["x"], d["w"], d["cache"].mean, d["cache"].rstd,
                                                    d["dw"], d["db"]), d["dw"], d["db"]), ln_generic_bwd, False),
        ("layernorm fwd + residual", layernorm_setup,
         lambda d: (cupy_ops.layernorm_forward_gpu(d["x"], d["w"], d["b"], residual=d["r"])[0], d["x"]),
         ln_generic_res, False),
        ("layernorm bwd + residual", layernorm_setup,
         lambda d: (cupy_ops.layernorm_backward_gpu(d["dy"], d["x"], d["w"], d["cache"].mean, d["cache"].rstd,
                                                    d["dw"], d["db"], add_to=d["r"]), d["dw"], d["db"]),
         lambda d: ln_generic_bwd(d, add_to=d["r"]), False),
        ("bias + gelu fwd", gelu_setup, lambda d: (cupy_ops.bias_gelu_forward_gpu(d["a"], d["b"]),), gelu_generic_fwd,
         True),
        ("bias + gelu bwd", gelu_setup, lambda d: (cupy_ops.bias_gelu_backward_gpu(d["a"], d["b"], d["dy"], db=d["db"]),
                                                   d["db"]), gelu_generic_bwd, True),
        ("causal softmax fwd", softmax_setup,
         lambda d: (cupy_ops.causal_softmax_forward_gpu(d["s"], lse=d["lse_out"], out=d["s"]), d["lse_out"]),
         softmax_generic_fwd, False),
        ("causal softmax bwd", softmax_setup,
         lambda d: (cupy_ops.causal_softmax_backward_gpu(d["dp"], d["p"], out=d["dp"]),), softmax_generic_bwd, False),
        ("causal softmax recompute", softmax_setup,
         lambda d: (cupy_ops.causal_softmax_recompute_gpu(d["s"], d["lse"], out=d["s"]),),
         lambda d: (ref.block_probs_again(d["s"][None], 0, d["lse"][None])[0],), True),
        ("cross-entropy fwd", xent_setup, lambda d: (cupy_ops.softmax_xent_forward_gpu(d["z"], d["t"])[0], d["z"]),
         xent_generic_fwd, False),
        ("cross-entropy bwd", xent_setup, lambda d: (cupy_ops.softmax_xent_backward_gpu(d["probs"], d["t"]),),
         xent_generic_bwd, True),
        ("adamw step", adamw_setup, adamw_fused, adamw_generic, True),
    ]
    log(f"float32; rows N {N}, C {C}, mlp {F}, scores {BH} x {T} x {T}, vocab {V}; times are the mean of {reps} "
        f"calls after one, with the device synchronised around them; tolerance 1e-5 (norm-wise)")
    for name, setup, fused, generic, elementwise in cases:
        if not on_gpu and elementwise:
            log(f"skip {name:<26} (an ElementwiseKernel: needs CuPy)")
            continue
        try:
            errs = [normwise(_host(xp, f), _host(xp, g)) for f, g in zip(fused(setup()), generic(setup()))]
            ok = max(errs) <= 1e-5
            t_fused, t_generic = _time(xp, fused, setup(), reps), _time(xp, generic, setup(), reps)
            log(f"{verdict(ok)} {name:<26} max error {max(errs):.1e}   fused {1e3 * t_fused:8.3f} ms   generic "
                f"{1e3 * t_generic:8.3f} ms   ({t_generic / t_fused:.2f}x)")
        except Exception as e:  # one case failing (a CUDA error, say) is reported, the others still run
            ok = False
            log(f"FAIL {name:<26} {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        failed |= not ok
        with contextlib.suppress(Exception):  # a broken device is reported above already
            _free(xp)
    return failed


def _host(xp, a):
    return a.get() if xp is not np and hasattr(a, "get") else np.asarray(a)


def _time(xp, fn, inputs, reps):
    from andrea.run.perf import synchronize

    fn(inputs)
    synchronize(xp)
    start = time.perf_counter()
    for _ in range(reps):
        fn(inputs)
    synchronize(xp)
    return (time.perf_counter() - start) / reps


def _free(xp):
    if xp is not np:
        xp.get_default_memory_pool().free_all_blocks()


# --- bench: ANDREA-120M at 8 x 1024 --------------------------------------------------------------


def part_bench(dry):
    import dataclasses

    from andrea.config import load_config
    from andrea.model.optim import AdamW
    from andrea.model.transformer import ANDREA, flops_per_token
    from andrea.run.perf import matmul_peak_flops, peak_label, peak_rss_bytes, synchronize
    from minitensor.backend import set_tf32

    full = load_config("tiny" if dry else "120m")
    cfg = dataclasses.replace(full.model, n_layer=1) if dry else full.model
    B, T = (2, 32) if dry else (8, 1024)
    warmup, steps = (1, 2) if dry else (3, 5)
    model = ANDREA(cfg, device="gpu" if gpu_here(dry) else "cpu", dtype="float32", seed=0, kernels=full.train.kernels)
    opt = AdamW(model, lr=6e-4)
    xp = model.xp
    mode = "tf32" if full.train.tf32 else "float32"
    log(f"{'tiny' if dry else 'ANDREA-120M'} at {B} x {T}, {warmup} warm-up steps then {steps} timed",
        set_tf32(xp, full.train.tf32), model.ops.kernels_line)
    rng = np.random.default_rng(0)
    # token ids stay on the host, as the training loader's do: the model checks them there and
    # copies them over; ids on the device would be read back, two host reads a step
    batches = [rng.integers(0, cfg.vocab_size, (B, T + 1)) for _ in range(2)]
    pool = None if xp is np else xp.get_default_memory_pool()
    used = [0]
    split = {"forward": [], "backward": [], "optimizer": []}

    def step(i, timed_split=False):
        x = batches[i % 2]
        marks = [time.perf_counter()]
        loss = model.loss(x[:, :-1], x[:, 1:])
        if pool is not None:
            used[0] = max(used[0], pool.used_bytes())
        if timed_split:
            synchronize(xp)
            marks.append(time.perf_counter())
        model.zero_grad()
        model.backward()
        if pool is not None:
            used[0] = max(used[0], pool.used_bytes())
        if timed_split:
            synchronize(xp)
            marks.append(time.perf_counter())
        scale, finite = model.ops.clip_scale(model.ops.global_norm(model.params.grads), 1.0, loss)
        if bool(finite):  # the one host read of a training step
            opt.step(grad_scale=scale)
        if timed_split:
            synchronize(xp)
            marks.append(time.perf_counter())
            for key, a, b in zip(split, marks, marks[1:]):
                split[key].append(b - a)
        return loss

    start = time.perf_counter()
    for i in range(warmup):
        step(i)
    synchronize(xp)
    log(f"warm-up (kernel compilation included): {time.perf_counter() - start:.1f} s")
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = step(i)
        synchronize(xp)
        times.append(time.perf_counter() - t0)
    step(0, timed_split=True)
    final_loss = float(loss)
    tokens_per_s = B * T / statistics.median(times)
    n_params = model.num_parameters()
    achieved = tokens_per_s * flops_per_token(cfg, T, n_params)
    measured = matmul_peak_flops(xp, n=256 if dry else 8192, repeats=3)
    result = {"mode": mode, "batch": B, "seq_len": T, "parameters": n_params, "tokens_per_s": tokens_per_s,
              "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
              "step_ms_max": 1e3 * max(times), "achieved_tflops": achieved / 1e12,
              "mfu_fp32_peak": achieved / PEAK_FP32, "mfu_tf32_peak": achieved / PEAK_TF32,
              "matmul_peak_tflops": measured / 1e12, "mfu_measured_peak": achieved / measured,
              "split_ms": {k: 1e3 * v[0] for k, v in split.items()}, "loss": final_loss}
    if pool is not None:
        free, total = xp.cuda.runtime.memGetInfo()
        result.update(pool_used_peak_gib=used[0] / 2**30, pool_total_gib=pool.total_bytes() / 2**30,
                      device_used_gib=(total - free) / 2**30,
                      device=xp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    else:
        result["peak_rss_gib"] = peak_rss_bytes() / 2**30
    log(f"{tokens_per_s:,.0f} tokens/s (step {result['step_ms_median']:.1f} ms median, {result['step_ms_min']:.1f}-"
        f"{result['step_ms_max']:.1f}); {achieved / 1e12:.1f} TFLOP/s achieved "
        f"({flops_per_token(cfg, T, n_params) / 1e6:.0f} MFLOP/token, {n_params:,} parameters)",
        f"MFU {100 * result['mfu_fp32_peak']:.1f}% of the FP32 peak (67 TFLOP/s), "
        f"{100 * result['mfu_tf32_peak']:.1f}% of the TF32 dense peak (495 TFLOP/s), "
        f"{100 * result['mfu_measured_peak']:.1f}% of the {peak_label(xp, full.train.tf32)} measured here "
        f"({result['matmul_peak_tflops']:.1f} TFLOP/s)",
        "one step split (synchronised): " + ", ".join(f"{k} {v:.1f} ms" for k, v in result["split_ms"].items()))
    if pool is not None:
        log(f"memory: memory pool peak in use {result['pool_used_peak_gib']:.2f} GiB (sampled after forward and "
            f"backward), pool holds {result['pool_total_gib']:.2f} GiB, device in use "
            f"{result['device_used_gib']:.2f} GiB ({result['device']}); loss after the steps {final_loss:.4f}")
    print("RESULT " + json.dumps(result), flush=True)
    return not np.isfinite(final_loss)


# --- the driver -------------------------------------------------------------------------------------


def run_part(name, dry):
    parts = {"compile": part_compile, "kernels": part_kernels, "gradients": part_gradients, "bench": part_bench}
    return parts[name](dry)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes, on NumPy when no GPU works: exercises this script without a GPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    ap.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    args = ap.parse_args(argv)
    if args.part:
        return 1 if run_part(args.part, args.dry_run) else 0
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    summary, results = [], []
    for name in args.parts.split(","):
        env = dict(os.environ, GPU_CHECK_TEED="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--part", name] + (["--dry-run"] if args.dry_run else [])
        log(f"== {name}")
        start = time.perf_counter()
        try:
            limit = PARTS[name] * (DRY_TIME_SCALE if args.dry_run else 1)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
            out, err, status = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, err, status = _text(e.stdout), _text(e.stderr), f"timed out after {limit} s"
        seconds = time.perf_counter() - start
        for line in out.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT "):]))
            else:
                log(line)
        if status != 0:
            log(*(f"  stderr: {line}" for line in err.strip().splitlines()[-15:]))
        summary.append((name, status, seconds))
    log("== summary")
    for name, status, seconds in summary:
        log(f"{verdict(status == 0)} {name:<14} {seconds:6.1f} s" + (f"  (exit status {status})" if status else ""))
    for r in results:
        log(f"     {r['mode']:<8} {r['tokens_per_s']:>10,.0f} tokens/s  MFU {100 * r['mfu_fp32_peak']:.1f}% of FP32 "
            f"peak, {100 * r['mfu_tf32_peak']:.1f}% of TF32 peak  "
            + (f"pool peak {r['pool_used_peak_gib']:.2f} GiB" if "pool_used_peak_gib" in r else ""))
    failed = [name for name, status, _ in summary if status != 0]
    log("all parts passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    sys.exit(main())
