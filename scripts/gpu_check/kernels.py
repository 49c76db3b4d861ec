"""Phase 3, kernels: each fused kernel against the generic code at ANDREA-120M's shapes, on the device.

First the start-up self-check (minitensor.backends.selection: which fused pieces agree with the generic
path; the attention's at ANDREA-120M's head size, 64), then every case of every fused piece's record
(kernels/NAME.py: the kernel's wrapper against the Ops code, float32, tolerance 1e-5 norm-wise),
cuBLAS's own calls against CuPy's, and the flash kernels as training runs them, their float32
products on TF32 tensor cores at head size 64, and their bf16 instances (train.precision=bf16) on
bfloat16 inputs, against a float64 reference (tolerances below): the max error (computed on the device:
~800 M elements are compared, two scalars come back) and time of each.
"""

import contextlib
import math
import time

import numpy as np
from gpu_check.common import first_line, free_pool, gpu_here, log, mean_seconds, normwise, verdict

TOLERANCE = 1e-5  # float32 against float32: summation orders differ, formulas must not
# TF32 keeps 10 of float32's 23 mantissa bits: cvt.rna rounds each operand to within 2**-11 (4.9e-4)
# relative, so one product of two rounded operands is within ~2**-10 (9.8e-4) of the exact one. The
# flash forward chains two products (q k^T, then P v), the backward three (dy v^T, then dS k or dS^T q),
# so its outputs are within ~3 x 9.8e-4 = 2.9e-3 of float64's relative to their scale, float32
# accumulation adding ~1e-6. 5e-3 (the self-check's FLASH_RTOL) holds that with room, and refuses a
# wrong fragment layout, mask or tile, whose errors are of the outputs' own size.
TF32_TOLERANCE = 5e-3
# bf16 keeps 8 significant bits: unit roundoff u = 2**-8 = 3.9e-3. The inputs are bf16 values, which the
# float64 reference takes exactly, so only the kernels' own roundings count: the forward rounds the
# probabilities to bf16 for P v (u) and its output (u); the backward rounds P and dS = P (dP - D) to bf16
# as operands (u each) and each gradient it stores (u), float32 sums adding ~1e-6: at most ~3u = 1.2e-2 of
# the outputs' scale. 2e-2 holds that with room, and refuses a wrong fragment layout, mask or tile, whose
# errors are of the outputs' own size.
BF16_TOLERANCE = 2e-2


def part_kernels(dry):
    from minitensor.backends import cuda, fused_pieces
    from minitensor.backends.cuda import Sizes
    from minitensor.backends.selection import at_sizes, select_kernels
    from minitensor.checks import kernelcheck

    failed = False
    on_gpu = gpu_here(dry)
    if not on_gpu:
        xp = np
        log(select_kernels("auto", np)[1] + " (dry run: the self-check itself runs only on CuPy)")
        cuda.launch = kernelcheck.emulate_launch
    else:
        import cupy as xp

        start = time.perf_counter()
        checks = {name: at_sizes(piece.sample, None if dry else Sizes()) for name, piece in fused_pieces().items()}
        _, line = select_kernels("auto", xp, checks)
        failed = "generic for" in line  # a fused kernel disagreed with its generic path
        log(f"{verdict(not failed)} self-check in {time.perf_counter() - start:.1f} s (kernels compiled "
            f"included): {line}")
    k = KernelInputs(xp, dry)
    log(f"float32; rows N {k.N}, C {k.C}, mlp {k.F}, scores {k.BH} x {k.T} x {k.T}, vocab {k.V}; times are the mean "
        f"of {k.reps} calls after one, with the device synchronised around them; tolerance {TOLERANCE:g} "
        f"(norm-wise), {TF32_TOLERANCE:g} for TF32 against float64")
    start, compared, disagreed = time.perf_counter(), 0, []
    cases = [(*case, TOLERANCE) for piece in fused_pieces().values() for case in piece_cases(piece, k)]
    cases += [(*case, TOLERANCE) for case in _cublas_cases(k)] + [_flash_tf32_case(k), _flash_bf16_case(k)]
    for name, setup, fused, generic, needs_cupy, tolerance in cases:
        if not on_gpu and needs_cupy:
            log(f"skip {name:<26} (needs CuPy: an ElementwiseKernel, cuBLAS, or a whole piece)")
            continue
        compared += 1
        if not _compare_kernel(xp, name, setup, fused, generic, k.reps, tolerance):
            disagreed.append(name)
        with contextlib.suppress(Exception):  # a broken device is reported already
            free_pool(xp)
    log(f"figure: {compared - len(disagreed)} of {compared} fused kernels within tolerance of the generic code "
        f"in {time.perf_counter() - start:.1f} s" + (f"; FAILED: {', '.join(disagreed)}" if disagreed else ""))
    return failed or bool(disagreed)


def _compare_kernel(xp, name, setup, fused, generic, reps, tolerance=TOLERANCE):
    """Logs how far the fused kernel's outputs are from the generic code's (each from a fresh setup)
    and how long each takes; True when within `tolerance` norm-wise. An exception (a CUDA error, say)
    is reported as a failure, so that the other kernels still run."""
    try:
        errs = [normwise(f, g) for f, g in zip(fused(setup()), generic(setup()))]
        ok = max(errs) <= tolerance
        if tolerance != TOLERANCE:
            log(f"figure: {verdict(ok).strip()} {name}: max error {max(errs):.1e} (tolerance {tolerance:g})")
        t_fused, t_generic = mean_seconds(xp, fused, setup(), reps), mean_seconds(xp, generic, setup(), reps)
        log(f"{verdict(ok)} {name:<26} max error {max(errs):.1e}   fused {1e3 * t_fused:8.3f} ms   generic "
            f"{1e3 * t_generic:8.3f} ms   ({t_generic / t_fused:.2f}x)")
    except Exception as e:
        ok = False
        log(f"FAIL {name:<26} {first_line(e)}")
    return ok


class KernelInputs:
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


def piece_cases(piece, k):
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



def _flash_tf32_case(k):
    """The flash core's forward and backward as training runs them (float32 products on TF32 tensor
    cores) at head size 64, against Ops' dense core in float64 on the same inputs: (name, setup, fused,
    reference, needs CuPy, tolerance). On NumPy (a dry run) the kernels run in the launch emulation."""
    from minitensor.backends.kernels.attention import flash_attention_backward_gpu, flash_attention_forward_gpu

    BH, T, hs = k.BH, k.T, 64
    scale = 1.0 / math.sqrt(hs)

    def setup():
        k.reseed()
        return dict(q=k.rand(BH, T, hs), k=k.rand(BH, T, hs), v=k.rand(BH, T, hs), dy=k.rand(BH, T, hs))

    def fused(d):
        y, lse = flash_attention_forward_gpu(d["q"], d["k"], d["v"], scale, tf32=True)
        return (y, *flash_attention_backward_gpu(d["q"], d["k"], d["v"], y, d["dy"], lse, scale, tf32=True))

    return ("flash TF32 hs 64 vs float64", setup, fused, _dense_float64(k), False, TF32_TOLERANCE)


def _flash_bf16_case(k):
    """The flash core's bf16 kernels (mma.sync m16n8k16, float32 sums) at head size 64, forward and backward
    on bfloat16 q, k, v, dy through the same wrappers, against Ops' dense core in float64 on the same
    (bf16-exact) inputs; on NumPy (a dry run) in the launch emulation."""
    from minitensor import precision
    from minitensor.backends.kernels.attention import flash_attention_backward_gpu, flash_attention_forward_gpu

    BH, T, hs = k.BH, k.T, 64
    scale = 1.0 / math.sqrt(hs)

    def setup():  # drawn and rounded to bf16 on the host, copied over as bf16
        rng = np.random.default_rng(5)
        return {name: k.xp.asarray(rng.standard_normal((BH, T, hs), dtype=np.float32).astype(precision.bfloat16()))
                for name in ("q", "k", "v", "dy")}

    def fused(d):
        y, lse = flash_attention_forward_gpu(d["q"], d["k"], d["v"], scale)
        return (y, *flash_attention_backward_gpu(d["q"], d["k"], d["v"], y, d["dy"], lse, scale))

    return ("flash bf16 hs 64 vs float64", setup, fused, _dense_float64(k), False, BF16_TOLERANCE)


def _dense_float64(k):
    """(y, dq, dk, dv) of Ops' dense attention core in float64 on a case's q, k, v, dy (BH, T, hs)."""

    def reference(d):
        d = {name: a.astype(np.float64) for name, a in d.items()}
        BH, T, hs = d["q"].shape
        y4 = k.xp.empty((BH, 1, T, hs), np.float64)
        cache = k.ref.attention_forward([d[n][:, None] for n in "qkv"], None, y4, dense=True)
        grads = [k.xp.empty((BH, 1, T, hs), np.float64) for _ in range(3)]
        k.ref.attention_backward(d["dy"][:, None], cache, grads)
        return (y4[:, 0], *(g[:, 0] for g in grads))

    return reference
