"""Phase 1, preflight: every compile of the check, once, into the shared cache, then one ANDREA-120M step.

Every project kernel built for each dtype it is built for (float32, float64, and bfloat16 for the bf16
RawKernels; a RawKernel compiled, an ElementwiseKernel run once on one element); CuPy's own ufunc and reduction kernels warmed by one tiny training step (B 2,
T 5, one layer) for each of {generic, fused kernels} x {dense, blocked attention core} x {float32,
float64}, the backends the GPU tests build; then ANDREA-120M built as training builds it (the start-up
self-check, each fused piece timed against the generic code at 8 x 1024: the kernels line) and one
training step of it at 8 x 1024 in TF32, timed. CuPy keeps what it compiles in CUPY_CACHE_DIR, which
gpu_check.sh sets once for every phase: the later phases find their kernels there and compile
nothing of their own (gpu_check.sh counts the cache's files around each phase: its summary says what
each phase added).
"""

import os
import subprocess
import sys
import time

import numpy as np
from gpu_check.bench import mma_probe_spec
from gpu_check.common import KEEP_PROBS, first_line, gpu_here, log
from gpu_check.steps import TrainingSteps, train

PACKAGE = os.path.dirname(os.path.abspath(__file__))  # `python scripts/gpu_check` runs this package


def part_preflight(dry):
    """Every kernel built, CuPy's warmed, the self-check with its timings at the run's sizes, one step."""
    failed = _compile_kernels(dry)
    failed |= _warm(dry)
    failed |= _one_step(dry)
    return failed


def _compile_kernels(dry):
    from minitensor import precision
    from minitensor.backends import all_kernels

    if not gpu_here(dry):
        log("dry run on NumPy: no CUDA kernels to compile (the NVRTC compile check is "
            "`python -m minitensor.checks --check`)")
        return False
    import cupy

    start, failed, count = time.perf_counter(), False, 0
    builds = [(spec, dtype) for spec in all_kernels().values() for dtype in _dtypes_of(spec)]
    for spec, dtype in builds + [(mma_probe_spec(), "float32")]:  # the bench's probe too: no compile after this
        t0 = time.perf_counter()
        try:
            _build(cupy, spec, precision.dtype_of(dtype))
            count += 1
        except Exception as e:  # every kernel is tried; the failures are listed
            failed = True
            log(f"FAIL compile {spec.name} {dtype}: {first_line(e)}")
            continue
        log(f"ok   compiled {spec.name:<26} {dtype}  {time.perf_counter() - t0:.2f} s")
    seconds = time.perf_counter() - start
    log(f"compiled {count} kernels (every kernel x each dtype it is built for, bfloat16 too where ml_dtypes is "
        f"here, and the bench's mma.sync probe) in {seconds:.1f} s")
    cupy.cuda.get_current_stream().synchronize()
    log(f"figure: {count} project kernels compiled in {seconds:.1f} s" + ("; some FAILED" if failed else ""))
    return failed


def _dtypes_of(spec):
    """The dtypes a kernel is built for (the precision policy's: float32, float64, and bfloat16 for a bf16
    RawKernel, which the bf16 phase launches), bfloat16 only where ml_dtypes gives it."""
    from minitensor import precision

    try:
        precision.bfloat16()
    except ImportError:
        log(f"{spec.name}: no ml_dtypes here, so no bfloat16 build (the bf16 extra installs it)")
        return [d for d in spec.dtypes if d != precision.BF16]
    return list(spec.dtypes)


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
    training = TrainingSteps(model, AdamW(model, lr=6e-4), B, T)
    start = time.perf_counter()
    loss = float(training.step(0))
    synchronize(model.xp)
    log(f"figure: one {'tiny' if dry else 'ANDREA-120M'} training step at {B} x {T} (TF32, CuPy's kernels "
        f"compiled as it ran) in {time.perf_counter() - start:.2f} s, loss {loss:.4f}")
    return not np.isfinite(loss)


def _warm(dry):
    if not gpu_here(dry):
        log("dry run on NumPy: no CuPy kernels to warm")
        return False
    warmed, warm_seconds = _warm_cupy_kernels()
    log(f"figure: CuPy's own kernels warmed by {WARM_STEPS} tiny training steps in {warm_seconds:.1f} s "
        f"({_cache_line(warmed)})")
    return warmed is None


WARM_STEPS = 8  # {generic, fused} x {dense, blocked core} x {float32, float64}


def _warm_cupy_kernels():
    """One tiny forward + backward + AdamW step per backend mode the GPU tests build, so that the
    ufunc and reduction kernels they need are compiled here (NVRTC, on the host, the first time) and found in CuPy's
    on-disk cache by the tests' process. float32 and float64 need disjoint kernels: each dtype warms
    in a process of its own, the two at once (NVRTC runs on the host's cores). (the kernel files
    added, or None if a step failed; seconds)"""
    from minitensor.backends import cuda

    before, start = _cache_files(), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, PACKAGE, "--warm", dtype]) for dtype in cuda.DTYPES]
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
                train(cfg, "gpu", dtype, [x], kernels)
            except Exception as e:  # the others still warm; the tests will show the failure
                ok = False
                log(f"FAIL warm-up step, kernels {kernels}, dense core {dense}, {dtype}: {first_line(e)}")
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

