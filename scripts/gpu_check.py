"""The Python phases of the GPU check (scripts/gpu_check.sh runs them in its order): the preflight (every
kernel compiled, the self-check timed, one ANDREA-120M step), CuPy's own kernels warmed for the tests,
the fused kernels at model shapes, float32 GPU gradients against NumPy float64, the sanitizer's step, and
ANDREA-120M training throughput in TF32.

    PYTHONPATH=. python scripts/gpu_check.py --parts preflight,warm,kernels,gradients,sanitize,bench
    PYTHONPATH=. python scripts/gpu_check.py --dry-run   # the same code at toy sizes: on NumPy
                                                         # without a GPU, on the GPU if one works
    PYTHONPATH=. python scripts/gpu_check.py --part bench  # one part in this process (gpu_check.sh:
                                                         # its own time limit, SIGINT on a timeout)

Parts (with --parts each in a fresh process with its own time limit, so a CUDA error or a hang in
one does not hide the others; exit status 1 if any failed). Lines starting "figure: " are what
gpu_check.sh copies into its summary.

    preflight  every registered kernel built for float32 and float64 (a RawKernel compiled, an
               ElementwiseKernel run once on one element), then ANDREA-120M built with the start-up
               self-check timing each fused piece against the generic code at 8 x 1024 (the kernels
               line: which pieces, with both times), and one training step of it at 8 x 1024 in TF32,
               timed: the cheapest failures first
    warm       CuPy's own ufunc and reduction kernels warmed: one tiny training step (B 2, T 5, one
               layer) for each of {generic, fused kernels} x {dense, blocked attention core} x
               {float32, float64}, the backends the GPU tests build, so CuPy's on-disk kernel cache
               holds what the tests then use: gpu_check.sh runs it before the GPU tests
    kernels    the start-up self-check (minitensor.checks.selfcheck: which fused pieces agree with the
               generic path), then each fused kernel against the generic xp code of its layer at
               ANDREA-120M shapes (float32; the cases of each fused piece's record, kernels/NAME.py):
               max error (computed on the device: ~800 M elements are compared) and time of each
    gradients  a small ANDREA (4 layers, d 128; the dry run: 1 layer, T = 64, 2 steps) at T = 256 trained 3
               steps on CuPy in float32,
               once as training runs (dense attention core, self-checked fused kernels) and once
               with the generic kernels and the blocked core (two query blocks of 128), each
               against NumPy float64 from the same seed: per-step losses, step-0 gradients
    sanitize   one training step of a 1-layer model with every fused kernel (dense core with the
               probabilities kept, then the blocked core recomputing them), CuPy's memory pool off
               so that each array is its own allocation: the workload gpu_check.sh runs under
               compute-sanitizer (memcheck, racecheck)
    bench      ANDREA-120M, batch 8 x 1024, AdamW, tf32: true (set through CuPy's API), the
               fused kernels self-checked and timed: tokens/s, MFU, peak GPU memory; mma.sync's TF32
               rate measured (what the step model takes as 1.59 SM clocks a step); PyTorch's GPT-2 of
               the same shape on the same device (andrea/interop/torch_reference.py, TF32 as andrea's,
               scaled_dot_product_attention): tokens/s and the ratio; the step model's estimate beside
               the measured step

Everything printed also goes to gpu_check_results.txt in $OUT if set, else the current directory
(unless gpu_check.sh already keeps it).
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

PEAK_FP32 = 67e12  # H200 dense FP32 FLOP/s (NVIDIA's datasheet)
PEAK_TF32 = 495e12  # H200 dense TF32 FLOP/s
# seconds each, at most (gpu_check.sh allows a little more)
PARTS = {"preflight": 115, "warm": 60, "kernels": 22, "gradients": 16, "sanitize": 18, "bench": 50}
DRY_TIME_SCALE = 6  # a dry run's limits are 6 times these: it runs on a CPU, maybe under the CuPy stand-in
RESULTS = os.path.join(os.environ.get("OUT") or ".", "gpu_check_results.txt")


def log(*lines):
    for line in lines:
        print(line, flush=True)
        if not os.environ.get("GPU_CHECK_TEED"):
            with open(RESULTS, "a") as f:
                f.write(line + "\n")


def normwise(got, want):
    """max |got - want| / max |want| in float64, where the arrays are (on the device for CuPy's:
    two scalars come back, not the arrays)."""
    xp = _module_of(got, want)
    got, want = xp.asarray(got).astype(np.float64), xp.asarray(want).astype(np.float64)
    if not want.size:
        return 0.0
    scale, err = float(xp.max(xp.abs(want))), float(xp.max(xp.abs(got - want)))
    return err / scale if scale else err


def _module_of(*arrays):
    """CuPy if any of them is a CuPy array (cupy.get_array_module), else NumPy."""
    cupy = sys.modules.get("cupy")
    return cupy.get_array_module(*arrays) if cupy is not None else np


def verdict(ok):
    return "ok  " if ok else "FAIL"


def gpu_here(dry):
    """Whether the parts run on CuPy: always for the real check, in a dry run only if a GPU works."""
    if not dry:
        return True
    from minitensor.device import gpu_available

    return gpu_available()


# --- compile: every kernel built before anything is timed -----------------------------------------


def part_preflight(dry):
    """Every kernel built, the self-check with its timings at the run's sizes, one training step."""
    failed = _compile_kernels(dry)
    failed |= _one_step(dry)
    return failed


def _compile_kernels(dry):
    from minitensor.backends import all_kernels, cuda

    if not gpu_here(dry):
        log("dry run on NumPy: no CUDA kernels to compile (the NVRTC compile check is "
            "`python -m minitensor.checks --check`)")
        return False
    import cupy

    start, failed, count = time.perf_counter(), False, 0
    for spec in all_kernels().values():
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
    seconds = time.perf_counter() - start
    log(f"compiled {count} kernels (every kernel x float32, float64) in {seconds:.1f} s")
    cupy.cuda.get_current_stream().synchronize()
    log(f"figure: {count} project kernels compiled in {seconds:.1f} s" + ("; some FAILED" if failed else ""))
    return failed


def _one_step(dry):
    """ANDREA-120M (the dry run: tiny, one layer) built as training builds it, its kernels self-checked and
    timed at the step's sizes, then one training step, timed."""
    import dataclasses

    from andrea.config import load_config
    from andrea.model.transformer import ANDREA
    from andrea.run.perf import synchronize
    from minitensor.device import set_tf32
    from minitensor.optim import AdamW

    full = load_config("tiny" if dry else "120m")
    cfg = dataclasses.replace(full.model, n_layer=1) if dry else full.model
    B, T = (2, 32) if dry else (8, 1024)
    start = time.perf_counter()
    model = ANDREA(cfg, device="gpu" if gpu_here(dry) else "cpu", dtype="float32", seed=0,
                   kernels=full.train.kernels, batch=B)
    log(f"model built and its kernels chosen in {time.perf_counter() - start:.1f} s", set_tf32(model.xp, True),
        f"figure: {model.ops.kernels_line}")
    training = _TrainingSteps(model, AdamW(model, lr=6e-4), B, T)
    start = time.perf_counter()
    loss = float(training.step(0))
    synchronize(model.xp)
    log(f"figure: one {'tiny' if dry else 'ANDREA-120M'} training step at {B} x {T} (TF32, CuPy's kernels "
        f"compiled as it ran) in {time.perf_counter() - start:.2f} s, loss {loss:.4f}")
    return not np.isfinite(loss)


def part_warm(dry):
    if not gpu_here(dry):
        log("dry run on NumPy: no CuPy kernels to warm")
        return False
    warmed, warm_seconds = _warm_cupy_kernels()
    log(f"figure: CuPy's own kernels warmed by {WARM_STEPS} tiny training steps in {warm_seconds:.1f} s "
        f"({_cache_line(warmed)})")
    return warmed is None


WARM_STEPS = 8  # {generic, fused} x {dense, blocked core} x {float32, float64}
KEEP_PROBS = 16 << 20  # CausalSelfAttention.keep_probs_max_bytes as the layer has it


def _warm_cupy_kernels():
    """One tiny forward + backward + AdamW step per backend mode the GPU tests build, so that the
    ufunc and reduction kernels they need are compiled here (NVRTC, on the host, the first time) and found in CuPy's
    on-disk cache by the tests' process. float32 and float64 need disjoint kernels: each dtype warms
    in a process of its own, the two at once (NVRTC runs on the host's cores). (the kernel files
    added, or None if a step failed; seconds)"""
    from minitensor.backends import cuda

    before, start = _cache_files(), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--warm", dtype]) for dtype in cuda.DTYPES]
    ok = not any([proc.wait() for proc in procs])  # their lines go straight to this part's output
    after = _cache_files()
    added = (after - before if before is not None and after is not None else 0) if ok else None
    return added, time.perf_counter() - start


def warm_steps(dtype):
    """The warm-up steps of one dtype (`--warm DTYPE`, run by _warm_cupy_kernels): True if all ran."""
    import dataclasses

    from andrea.config import load_config
    from minitensor.layers.attention import CausalSelfAttention

    cfg = dataclasses.replace(load_config("tiny").model, n_layer=1, context_length=8, vocab_size=37)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6))
    ok = True
    for kernels in ("generic", "fused"):
        for dense in (True, False):
            CausalSelfAttention.dense = dense  # the blocked core also recomputing its probabilities
            CausalSelfAttention.keep_probs_max_bytes = KEEP_PROBS if dense else 0
            try:
                _train(cfg, "gpu", dtype, [x], kernels)
            except Exception as e:  # the others still warm; the tests will show the failure
                ok = False
                log(f"FAIL warm-up step, kernels {kernels}, dense core {dense}, {dtype}: "
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    CausalSelfAttention.dense, CausalSelfAttention.keep_probs_max_bytes = None, KEEP_PROBS
    return ok


def _cache_files():
    """How many kernel binaries CuPy's on-disk cache holds (None where there is none to count)."""
    d = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
    return sum(len(files) for _, _, files in os.walk(d)) if os.path.isdir(d) else None


def _cache_line(added):
    if added is None:
        return "a warm-up step FAILED"
    d = os.environ.get("CUPY_CACHE_DIR") or "~/.cupy/kernel_cache"
    return f"{added} kernel binaries added to {d}" if _cache_files() is not None else f"no {d} here"


def _build(cupy, spec, dtype):
    """Builds one kernel for dtype on the device: a RawKernel compiled, an ElementwiseKernel run on
    one element (CuPy compiles it at its first call, for the argument types of that call)."""
    from minitensor.backends import cuda

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
    from minitensor.device import set_tf32
    from minitensor.layers.attention import CausalSelfAttention

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
        log(f"figure: {verdict(ok).strip()} {variant}: losses {loss_err:.1e}, gradients {errs[worst]:.1e} ({worst})")
        log(f"{verdict(ok)} {'CuPy' if on_gpu else 'NumPy'} float32, {variant} ({kernels_line}): losses within "
            f"{loss_err:.2e} relative (tolerance 1e-4); step-0 gradients within {errs[worst]:.2e} norm-wise "
            f"(worst tensor {worst}; median {statistics.median(errs.values()):.2e}; tolerance 1e-3)")
    CausalSelfAttention.dense = None
    return failed


def _train(cfg, device, dtype, data, kernels=None):
    """Per-step losses, the step-0 gradients {name: float64 NumPy array} (clipping at norm 1) and
    the line that says which kernels ran."""
    from andrea.model.transformer import ANDREA
    from minitensor.device import to_numpy
    from minitensor.optim import AdamW

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


# --- sanitize: the step compute-sanitizer checks ------------------------------------------------


def part_sanitize(dry):
    """One training step with every fused kernel in float32 on a 1-layer model, with the dense core
    (probabilities kept) and with the blocked core recomputing them, then AdamW: every project
    kernel launched, at a T that is not a multiple of anything (13). CuPy's memory pool is off, so
    an access past an array's end leaves its allocation and memcheck sees it."""
    import dataclasses

    from andrea.config import load_config
    from minitensor.backends import fused_pieces
    from minitensor.layers.attention import CausalSelfAttention

    on_gpu, pool = gpu_here(dry), "no CuPy"
    if on_gpu:
        import cupy

        pool = "CuPy's pool on: this CuPy has no cupy.cuda.set_allocator"  # the stand-in has none
        if hasattr(cupy.cuda, "set_allocator"):
            cupy.cuda.set_allocator(None)
            pool = "CuPy's pool off"
    cfg = dataclasses.replace(load_config("tiny").model, n_layer=1, context_length=16, vocab_size=61)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14))
    start, losses = time.perf_counter(), []
    for dense in (True, False):
        CausalSelfAttention.dense = dense
        CausalSelfAttention.keep_probs_max_bytes = KEEP_PROBS if dense else 0
        step_losses, _, line = _train(cfg, "gpu" if on_gpu else "cpu", "float32", [x, x], "fused" if on_gpu else None)
        losses.append(step_losses)
    CausalSelfAttention.dense, CausalSelfAttention.keep_probs_max_bytes = None, KEEP_PROBS
    if on_gpu:
        cupy.cuda.runtime.deviceSynchronize()  # a kernel's fault is reported here at the latest
    finite = all(np.isfinite(v) for v in sum(losses, []))
    log(f"figure: {'CuPy' if on_gpu else 'NumPy'} 1-layer step x 2, dense and blocked core ({line}; "
        f"{len(fused_pieces())} fused pieces; {pool}): losses {', '.join(f'{v:.4f}' for v in sum(losses, []))} "
        f"in {time.perf_counter() - start:.1f} s")
    return not finite


# --- kernels: fused against generic, at model shapes ----------------------------------------------


def part_kernels(dry):
    from minitensor.backends import cuda, fused_pieces
    from minitensor.checks import kernelcheck
    from minitensor.checks.selfcheck import select_kernels

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
    k = _KernelInputs(xp, dry)
    log(f"float32; rows N {k.N}, C {k.C}, mlp {k.F}, scores {k.BH} x {k.T} x {k.T}, vocab {k.V}; times are the mean "
        f"of {k.reps} calls after one, with the device synchronised around them; tolerance 1e-5 (norm-wise)")
    start, compared, disagreed = time.perf_counter(), 0, []
    cases = [case for piece in fused_pieces().values() for case in _piece_cases(piece, k)] + _cublas_cases(k)
    for name, setup, fused, generic, needs_cupy in cases:
        if not on_gpu and needs_cupy:
            log(f"skip {name:<26} (needs CuPy: an ElementwiseKernel, cuBLAS, or a whole piece)")
            continue
        compared += 1
        if not _compare_kernel(xp, name, setup, fused, generic, k.reps):
            disagreed.append(name)
        with contextlib.suppress(Exception):  # a broken device is reported already
            _free(xp)
    log(f"figure: {compared - len(disagreed)} of {compared} fused kernels within 1e-5 of the generic code "
        f"in {time.perf_counter() - start:.1f} s" + (f"; FAILED: {', '.join(disagreed)}" if disagreed else ""))
    return failed or bool(disagreed)


def _compare_kernel(xp, name, setup, fused, generic, reps):
    """Logs how far the fused kernel's outputs are from the generic code's (each from a fresh setup)
    and how long each takes; True when within 1e-5 norm-wise. An exception (a CUDA error, say) is
    reported as a failure, so that the other kernels still run."""
    try:
        errs = [normwise(f, g) for f, g in zip(fused(setup()), generic(setup()))]
        ok = max(errs) <= 1e-5
        t_fused, t_generic = _time(xp, fused, setup(), reps), _time(xp, generic, setup(), reps)
        log(f"{verdict(ok)} {name:<26} max error {max(errs):.1e}   fused {1e3 * t_fused:8.3f} ms   generic "
            f"{1e3 * t_generic:8.3f} ms   ({t_generic / t_fused:.2f}x)")
    except Exception as e:
        ok = False
        log(f"FAIL {name:<26} {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    return ok


class _KernelInputs:
    """The sizes the kernels are compared at (ANDREA-120M's: N rows of C, an MLP of F, BH score
    matrices of T x T, V logits; toy ones in a dry run), the generic Ops every kernel replaces, and
    the random inputs of each case's setup."""

    def __init__(self, xp, dry):
        from andrea.config import load_config
        from andrea.model.sizes import param_shapes
        from minitensor.backends.blocked import BlockedOps

        if dry:
            self.N, self.C, self.F, self.BH, self.T, self.V = 6, 40, 64, 2, 20, 50
            self.shapes, self.reps = {"w": (50, 40), "b": (40,)}, 1
        else:
            self.N, self.C, self.F, self.BH, self.T, self.V = 8 * 1024, 768, 3072, 8 * 12, 1024, 8449
            self.shapes, self.reps = param_shapes(load_config("120m").model), 10
        self.xp, self.dtype = xp, np.float32
        self.ref = BlockedOps(xp)  # the generic side: the maths every kernel replaces (Ops, and its blocked core)
        self._drawn, self._k = {}, 0

    def reseed(self):
        """Starts a setup's draws again, so that the fused and the generic run see equal inputs."""
        self._k = 0

    def rand(self, *shape, scale=1.0, shift=0.0):
        """A fresh device copy of the k-th draw of this setup, drawn once on the host: cupy.random
        needs cuRAND, which a machine may lack."""
        self._k += 1
        key = (self._k, shape, scale, shift)
        if key not in self._drawn:
            self._drawn[key] = shift + scale * np.random.default_rng(self._k).standard_normal(shape, dtype=self.dtype)
        return self.xp.array(self._drawn[key])

    def zeros(self, *shape):
        return self.xp.zeros(shape, self.dtype)


def _piece_cases(piece, k):
    """One fused piece's comparisons, from its record (minitensor.backends.fused_pieces()):
    [(name, setup, fused, generic, needs CuPy (skipped on NumPy)), ...], setup() making the inputs,
    fused(d) and generic(d) returning the outputs compared. The record's `cases`, or, for a piece
    without them, its self-check's sample run with the piece on and off."""
    if piece.cases is not None:
        return piece.cases(k)
    from minitensor.backends.cupy_ops import CupyOps

    def run(names):
        return lambda _: piece.sample(CupyOps(k.xp, fused=names), np.random.default_rng(0))

    return [(piece.name, lambda: None, run((piece.name,)), run(()), True)]


def _cublas_cases(k):
    """cuBLAS's own calls (minitensor.backends.cublas: the column-major operands, transpose flags and
    beta the stand-in emulates) against CuPy's matmul and sum at the step's shapes: a weight gradient
    accumulated (beta 1), a bias gradient (the GEMV dy^T ones), the head's dx from the first V columns
    of padded rows, the attention scores q k^T strided batched (k^T by the flag)."""
    from minitensor.backends import cublas, cupy_ops

    hs, Vp = 64, -(-k.V // 128) * 128

    def setup():
        k.reseed()
        return dict(x=k.rand(k.N, k.C), dy=k.rand(k.N, k.F), dW=k.rand(k.C, k.F), db=k.rand(k.F),
                    dl=k.rand(k.N, Vp), W=k.rand(k.V, k.C, scale=0.1), q=k.rand(k.BH, k.T, hs),
                    kk=k.rand(k.BH, k.T, hs))

    def weight(d):
        assert cublas.gemm(d["x"].T, d["dy"], d["dW"], 1.0)
        return (d["dW"],)

    def bias(d):
        assert cublas.colsum(d["dy"], d["db"], cupy_ops._ones(k.xp, k.N, k.dtype), 1.0)
        return (d["db"],)

    def head(d):
        dx = k.xp.empty((k.N, k.C), k.dtype)
        assert cublas.gemm(d["dl"][:, :k.V], d["W"], dx)
        return (dx,)

    def scores(d):
        s = k.xp.empty((k.BH, k.T, k.T), k.dtype)
        assert cublas.gemm(d["q"], d["kk"].transpose(0, 2, 1), s)
        return (s,)

    return [
        ("cublas dW += x^T dy", setup, weight, lambda d: (d["dW"] + d["x"].T @ d["dy"],), True),
        ("cublas db += dy^T ones", setup, bias, lambda d: (d["db"] + d["dy"].sum(axis=0),), True),
        ("cublas head dx", setup, head, lambda d: (k.xp.ascontiguousarray(d["dl"][:, :k.V]) @ d["W"],), True),
        ("cublas batched q k^T", setup, scores, lambda d: (k.xp.matmul(d["q"], d["kk"].transpose(0, 2, 1)),), True),
    ]


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
    training = _TrainingSteps(model, AdamW(model, lr=6e-4), B, T)
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
    del training, model
    _free(xp)
    probe_failed = _mma_probe(xp, dry)
    torch_failed = _bench_torch(cfg, B, T, warmup, steps, full.train.tf32, result["tokens_per_s"], dry)
    _log_step_model(result, dry)  # last: were it slow, every measured figure is out already
    return not np.isfinite(final_loss) or torch_failed or probe_failed


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


def _mma_probe(xp, dry):
    """mma.sync.m16n8k8 (TF32) throughput, measured: 8 warps a block, 4 blocks an SM, four independent
    accumulators a warp, random operands. The step model takes it as 1.59 SM clocks a step (63% of the
    dense peak, arXiv:2501.12084): this is the figure that replaces that assumption, not a verdict."""
    from minitensor.backends import cuda

    if xp is np:
        log("dry run on NumPy: no mma.sync to measure")
        return False
    headers = cuda.cu_code("attention.cu", "flash_attention_fwd")[0]  # to_tf32 and mma_tf32 (flash.cuh)
    spec = cuda.RawSpec("mma_probe", inline=headers + MMA_PROBE)
    sms = xp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    blocks, threads, steps = (1, 32, 2) if dry else (4 * sms, 256, 1 << 14)
    seed = xp.asarray(np.random.default_rng(0).standard_normal(256).astype(np.float32))
    args = (seed, xp.empty(blocks * threads, np.float32), np.int32(steps))
    try:
        seconds = _time(xp, lambda _: cuda.launch(spec, np.float32, (blocks,), (threads,), args), None,
                        1 if dry else 5)
    except Exception as e:
        log(f"FAIL mma.sync probe: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        return True
    rate = 2048 * 4 * steps * blocks * (threads // 32) / seconds
    log(f"figure: mma.sync m16n8k8 TF32: {rate / 1e12:.1f} TFLOP/s = {100 * rate / PEAK_TF32:.0f}% of the dense TF32 "
        f"peak ({blocks} blocks of {threads // 32} warps, 4 accumulators a warp; the step model takes 63%)"
        + (" (dry run: the CPU emulation's time, not a rate)" if dry else ""))
    return False


def _log_step_model(result, dry):
    """The hook for the H200 step model: its estimate beside the measured step, where
    andrea.run.stepmodel exists (nothing is said where it does not)."""
    try:
        from andrea.run.stepmodel import estimate_step_seconds
    except ImportError:
        return
    try:
        estimate = estimate_step_seconds()  # ANDREA-120M at 8 x 1024 on an H200, in seconds
    except Exception as e:  # a broken model is reported, not a failed benchmark
        log(f"step model: estimate_step_seconds() raised {type(e).__name__}: {e}")
        return
    log(f"figure: step model {1e3 * estimate:.1f} ms estimated (ANDREA-120M, 8 x 1024, H200), "
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
            log(f"FAIL PyTorch {name}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            continue
        peak = f", peak {r['cuda_peak_bytes'] / 2**30:.2f} GiB" if "cuda_peak_bytes" in r else ""
        log(f"figure: PyTorch {r['torch_version']} {name} on {device}{' (TF32)' if r['tf32'] else ''}: "
            f"{r['tokens_per_s_median']:,.0f} tokens/s, step {1e3 * r['step_s_median']:.1f} ms{peak}; "
            f"andrea / PyTorch {andrea_tokens_per_s / r['tokens_per_s_median']:.2f}")
        print("RESULT " + json.dumps({"mode": f"torch-{name}", **r}), flush=True)
        if device != "cpu":
            ref.torch.cuda.empty_cache()
    return failed


class _TrainingSteps:
    """Training steps of `model` as the training loop runs them, on two batches of B x T random ids,
    recording the memory pool's peak use (after forward and backward) and, when asked, one step's
    forward / backward / optimizer split."""

    def __init__(self, model, opt, B, T):
        self.model, self.opt, self.xp, self.B, self.T = model, opt, model.xp, B, T
        rng = np.random.default_rng(0)
        # token ids stay on the host, as the training loader's do: the model checks them there and
        # copies them over; ids on the device would be read back, two host reads a step
        self.batches = [rng.integers(0, model.cfg.vocab_size, (B, T + 1)) for _ in range(2)]
        self.pool = None if self.xp is np else self.xp.get_default_memory_pool()
        self.used = 0  # the pool's peak use, in bytes
        self.split = {"forward": [], "backward": [], "optimizer": []}

    def step(self, i, timed_split=False):
        model, x = self.model, self.batches[i % 2]
        marks = [time.perf_counter()]
        loss = model.loss(x[:, :-1], x[:, 1:])
        self._phase_done(marks, timed_split, memory=True)
        model.zero_grad()
        model.backward()
        self._phase_done(marks, timed_split, memory=True)
        scale, finite = model.ops.clip_scale(model.ops.global_norm(model.params.grads), 1.0, loss)
        if bool(finite):  # the one host read of a training step
            self.opt.step(grad_scale=scale)
        self._phase_done(marks, timed_split)
        if timed_split:
            for key, a, b in zip(self.split, marks, marks[1:]):
                self.split[key].append(b - a)
        return loss

    def _phase_done(self, marks, timed_split, memory=False):
        from andrea.run.perf import synchronize

        if memory and self.pool is not None:
            self.used = max(self.used, self.pool.used_bytes())
        if timed_split:
            synchronize(self.xp)
            marks.append(time.perf_counter())


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


# --- the driver -------------------------------------------------------------------------------------


def run_part(name, dry):
    parts = {"preflight": part_preflight, "warm": part_warm, "kernels": part_kernels, "gradients": part_gradients,
             "sanitize": part_sanitize, "bench": part_bench}
    return parts[name](dry)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes, on NumPy when no GPU works: exercises this script without a GPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # internal: part compile's warm-up steps of one dtype
    ap.add_argument("--part", choices=list(PARTS), help="one part, in this process, with no time limit of its own")
    args = ap.parse_args(argv)
    # Ctrl-C and gpu_check.sh's timeout (SIGINT) raise KeyboardInterrupt where the part is, so its
    # traceback says what was running, even where the caller had SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.warm:
        return 0 if warm_steps(args.warm) else 1
    if args.part:
        return 1 if run_part(args.part, args.dry_run) else 0
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    summary, results = [], []
    for name in args.parts.split(","):
        log(f"== {name}")
        status, seconds = _run_part_process(name, args.dry_run, results)
        summary.append((name, status, seconds))
    return _log_summary(summary, results)


def _run_part_process(name, dry, results):
    """Runs one part in a fresh process under its time limit, logs what it printed (its stderr's
    tail if it failed) and appends its RESULT lines to `results`: (exit status or why none, seconds)."""
    env = dict(os.environ, GPU_CHECK_TEED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name] + (["--dry-run"] if dry else [])
    start = time.perf_counter()
    try:
        limit = PARTS[name] * (DRY_TIME_SCALE if dry else 1)
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
    return status, seconds


def _log_summary(summary, results):
    """The verdict of each part and the benchmark's figures; the exit status, 1 if any part failed."""
    log("== summary")
    for name, status, seconds in summary:
        log(f"{verdict(status == 0)} {name:<14} {seconds:6.1f} s" + (f"  (exit status {status})" if status else ""))
    for r in results:
        if r["mode"].startswith("torch"):
            log(f"     {r['mode']:<12} {r['tokens_per_s_median']:>10,.0f} tokens/s on {r['device']}")
            continue
        log(f"     {r['mode']:<12} {r['tokens_per_s']:>10,.0f} tokens/s  MFU {100 * r['mfu_fp32_peak']:.1f}% of FP32 "
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
