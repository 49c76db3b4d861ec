"""AdamW's bfloat16 copy of the weights (kernels/adamw.cu, adamw_step_copy): written by the update's own
pass, rounded to nearest even with ml_dtypes' bits, NaN, infinities, subnormals and ties included.

The tests that take the `cupy` fixture run the kernel on a GPU where there is one (NVRTC's build), on
the stand-in elsewhere (the same operation as C++ on the host); both must give ml_dtypes' bits.
"""

import numpy as np
import pytest

from minitensor import precision
from minitensor.backends.kernels.adamw import adamw_step_gpu
from minitensor.backends.ops import Ops

BF16 = precision.bfloat16()
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, t=3)


def edge_bits():
    """float32 bit patterns at every edge of the rounding to bfloat16 (the low 16 bits dropped)."""
    highs = [0x3F80, 0x3F81, 0x4049, 0x7F7F, 0x0000, 0x0001, 0x007F, 0x0080, 0x00FF, 0x7F80]  # even / odd last bits
    lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # exact, below a tie, the tie, above it, the top
    patterns = [(h << 16) | lo for h in highs for lo in lows]
    patterns += [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF,                  # the largest floats: inf, inf, max bf16
                 0x7F800000, 0x7F800001, 0x7FA12345, 0x7FC00000, 0x7FFFFFFF,  # inf, signalling and quiet NaNs
                 0x00000001, 0x00008000, 0x00018000, 0x00010000, 0x0000FFFF]  # subnormals: ties to 0 and 2
    patterns = np.array(patterns, np.uint32)
    return np.concatenate([patterns, patterns | np.uint32(0x80000000)])  # and each negated


def step(xp, p, copy, lr):
    """One AdamW step of adamw_step_gpu over p (host float32) with g = 0 (so lr 0 leaves p as it is)."""
    n = p.size
    P, G, M, V = xp.asarray(p), xp.zeros(n, np.float32), xp.zeros(n, np.float32), xp.zeros(n, np.float32)
    adamw_step_gpu(P, G, M, V, xp.ones(n, np.float32), **{**HYPER, "lr": lr}, copy=copy)
    return P


def test_the_copy_is_ml_dtypes_rounding_bit_for_bit_at_every_edge(cupy):
    """With lr 0 the update leaves p as it is (p (1 - 0) - 0 (0 / (0 + eps))), so the copy is the kernel's
    rounding of exactly these floats: ties to even both ways, just below and above a tie, the largest
    floats rounding to infinity or to bfloat16's largest, infinities, NaNs of any payload (to the quiet
    NaN of their sign, 0x7fc0 / 0xffc0), subnormals; and 2^16 random bit patterns. Each equals
    ml_dtypes' astype of the p the kernel left, bit for bit."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([edge_bits(), rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32)])
    p = bits.view(np.float32)
    copy = cupy.asarray(np.full(p.size, 7, np.uint16).view(BF16))
    after = step(cupy, p, copy, lr=0.0).get()
    finite = np.isfinite(p)
    assert np.array_equal(after.view(np.uint32)[finite], bits[finite])  # p itself unchanged where finite
    with np.errstate(invalid="ignore"):
        want = after.astype(BF16).view(np.uint16)
    got = copy.get().view(np.uint16)
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, [(hex(b), hex(g), hex(w))
                             for b, g, w in zip(bits[wrong][:5], got[wrong][:5], want[wrong][:5])]
    ties = (bits & 0xFFFF) == 0x8000
    assert np.any(ties & ((bits >> 16) & 1 == 0)) and np.any(ties & ((bits >> 16) & 1 == 1))  # both kinds ran


def test_the_copy_step_is_the_plain_step_and_the_generic_ops_copy(cupy):
    """A step with copy leaves p, m, v bit for bit as the step without it, and the copy is p rounded by
    ml_dtypes; the generic Ops.adamw_step(copy=...) agrees (its p within a few float32 ulps: the folded
    form of the kernel), its copy p's own rounding."""
    rng = np.random.default_rng(1)
    n = 4099
    p, g = rng.standard_normal(n).astype(np.float32), (1e-2 * rng.standard_normal(n)).astype(np.float32)
    m, v = (1e-3 * rng.standard_normal(n)).astype(np.float32), (1e-4 * rng.random(n)).astype(np.float32)
    decayed = (rng.random(n) < 0.7).astype(np.float32)
    runs = []
    for copy in (None, cupy.zeros(n, BF16)):
        P, M, V = cupy.asarray(p), cupy.asarray(m), cupy.asarray(v)
        adamw_step_gpu(P, cupy.asarray(g), M, V, cupy.asarray(decayed), grad_scale=cupy.asarray(0.5, np.float32),
                       copy=copy, **HYPER)
        runs.append((P.get(), M.get(), V.get(), None if copy is None else copy.get()))
    (p0, m0, v0, _), (p1, m1, v1, c1) = runs
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in ((p0, p1), (m0, m1), (v0, v1)))
    assert np.array_equal(c1.view(np.uint16), p1.astype(BF16).view(np.uint16))
    P, M, V, C = cupy.asarray(p), cupy.asarray(m), cupy.asarray(v), cupy.zeros(n, BF16)
    Ops(cupy).adamw_step(P, cupy.asarray(g), M, V, cupy.asarray(decayed), HYPER["lr"], HYPER["beta1"],
                         HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], HYPER["t"], grad_scale=0.5, copy=C)
    np.testing.assert_allclose(P.get(), p1, rtol=4e-7, atol=1e-7)
    assert np.array_equal(C.get().view(np.uint16), P.get().astype(BF16).view(np.uint16))


def test_the_fused_piece_passes_copy_through(cupy):
    """CupyOps with the adamw piece runs adamw_step(..., copy=) through the kernel (the copy written in its
    pass); without the piece, Ops' code writes it; both give p's own rounding."""
    from minitensor.backends.cupy_ops import CupyOps

    rng = np.random.default_rng(2)
    n = 1000
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for fused in ((), ("adamw",)):
        P, C = cupy.asarray(p), cupy.zeros(n, BF16)
        CupyOps(cupy, fused=fused).adamw_step(P, cupy.asarray(g), cupy.zeros(n, np.float32), cupy.zeros(n, np.float32),
                                              cupy.ones(n, np.float32), 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, copy=C)
        assert np.array_equal(C.get().view(np.uint16), P.get().astype(BF16).view(np.uint16)), fused
        assert not np.array_equal(P.get(), p)


def test_a_wrong_copy_is_refused_in_one_line(cupy):
    n = 8
    for p, copy, what in ((cupy.zeros(n, np.float32), cupy.zeros(n, np.float32), "float32"),
                          (cupy.zeros(n, np.float32), cupy.zeros(n + 1, BF16), r"\(9,\)"),
                          (cupy.zeros(n, np.float64), cupy.zeros(n, BF16), "beside float64"),
                          (cupy.zeros(n, np.float32), cupy.zeros(2 * n, BF16)[::2], "bfloat16")):
        with pytest.raises(ValueError, match=rf"adamw_step_gpu: copy must be a contiguous bfloat16 array .*{what}"):
            adamw_step_gpu(p, p.copy(), p.copy(), p.copy(), p.copy(), copy=copy, **HYPER)


def test_the_copy_kernel_runs_the_plain_kernels_lines_unchanged():
    """adamw_step_copy's operation is adamw_step's, line for line, then the copy: one update formula,
    whatever either section's edits (the float32 and float64 kernel itself is untouched by bf16)."""
    from minitensor.backends.kernels.adamw import ADAMW_STEP, ADAMW_STEP_COPY

    assert ADAMW_STEP_COPY.operation == ADAMW_STEP.operation + "\ncopy = narrow_bf16(p1);"
    assert "narrow_bf16" in ADAMW_STEP_COPY.preamble and ADAMW_STEP.preamble == ""
