"""The MLP's bias + GELU and the Linear epilogue in bfloat16 (kernels/gelu.cu bias_gelu_fwd16, _bwd16,
_bwd_fwd16; kernels/linear.cu bias_residual_add16): RawKernels over T = bfloat16 stored and ACC = float32
summed, run through their wrappers on the `cupy` fixture (a GPU where there is one, else the stand-in's
launch emulation of the same code), against

- the generic Ops on the same bfloat16 inputs (Ops.summed / Ops.stored: float32 sums, one rounding), the
  reference. The epilogue is bit-equal to it: the same two float32 adds in the same order, then one
  rounding to nearest even, all exact IEEE operations. The GELU is within one bfloat16 step (ulp) of it,
  not bit-equal: the kernels evaluate GELU as h sigmoid(2u) with exp (gelu.cu's form, as the float32
  ElementwiseKernels do) where Ops writes 0.5 h (1 + tanh u), so the float32 values before the rounding
  differ by a few float32 ulps, and where they straddle a bfloat16 rounding boundary (a few in 2^16 of
  the values) the two roundings land on neighbouring bfloat16s. Almost all are bit-equal (asserted);
- float64 formulas of the same inputs, at the bfloat16 bound: each output a float32 value rounded once,
  so within U = 2^-8 (bfloat16's unit roundoff) of it relatively, plus the float32 arithmetic before it
  (FLOAT32 = 1e-5 of |value| for the forward, of the largest |value| for the backward, whose factor
  GELU'(h) crosses zero near h = -0.75, where a relative bound means nothing).

A kernel that rounds the sum x + b to bfloat16 before the GELU (two roundings) is planted and refused by
both checks.
"""

import numpy as np
import pytest

from minitensor import precision
from minitensor.backends import cuda, cupy_ops
from minitensor.backends.kernels import gelu, linear
from minitensor.backends.ops import GELU_A, GELU_C, Ops

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (the bf16 extra)")

BF16 = np.dtype(ml_dtypes.bfloat16)
U = 2.0 ** -8   # bfloat16's unit roundoff: 8 significant bits
FLOAT32 = 1e-5  # float32 arithmetic against float64 (about 80 float32 epsilons)
TINY = 1e-35    # below it a float32 GELU underflows (h < -10: exp overflows, y = -0)
REF = Ops(np)   # the generic Ops, NumPy, on bfloat16 arrays (ml_dtypes)
N, C = 96, 80
KERNELS16 = (gelu.BIAS_GELU_FWD16, gelu.BIAS_GELU_BWD16, gelu.BIAS_GELU_BWD_FWD16, linear.BIAS_RESIDUAL_ADD16)


def bf16(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(BF16)


def inputs(seed=0):
    """x (N, C), its bias b and dy, bfloat16; x wide enough (scale 4) for GELU's tails, exp's overflow included."""
    rng = np.random.default_rng(seed)
    return bf16(rng, N, C, scale=4.0), bf16(rng, C), bf16(rng, N, C)


def steps_apart(got, want):
    """How many bfloat16 values lie between got and want, elementwise (0: bit-equal; -0 and +0 equal)."""
    def ordered(a):
        bits = np.asarray(a).view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    assert got.dtype == BF16 and want.dtype == BF16, (got.dtype, want.dtype)
    return np.abs(ordered(got) - ordered(want))


def assert_like_ops(got, want, exact=None, cancelled=None):
    """Within one bfloat16 step of the Ops, and bit-equal on all but 1% of the values where the Ops' float32
    form is sound (at least 30% of them); except, with `exact`
    (float64) and `cancelled` (the absolute error bound of the Ops' own float32 form), where the two differ
    by no more than `cancelled` and the kernel is the closer to `exact`: the tails, where Ops' 1 + tanh u
    and 1 - tanh^2 u cancel (tanh u within a float32 epsilon of -1 or 1) and its float32 value keeps only
    a few epsilons absolute, (1 + |h|)^3 |dy| times, of a tiny value."""
    apart = steps_apart(got, want)
    off = apart > 1
    if exact is not None and off.any():
        g, w, e = (np.asarray(a, np.float64)[off] for a in (got, want, exact))
        assert np.all(np.abs(g - w) <= cancelled[off]), "apart from the Ops beyond its float32 cancellation"
        assert np.all(np.abs(g - e) <= np.abs(w - e)), "apart from the Ops, and not closer to float64"
    else:
        assert not off.any(), f"{int(apart.max())} bfloat16 steps from the Ops at {np.unravel_index(apart.argmax(), apart.shape)}"
    # bit-equal counted where the Ops' float32 form is sound: its error bound under an 8th of a bfloat16 step
    sound = np.ones(apart.shape, bool) if cancelled is None else cancelled <= U / 8 * np.abs(np.asarray(want, np.float64))
    assert sound.mean() >= 0.3 and np.mean(apart[sound] == 0) >= 0.99, (
        f"only {np.mean(apart[sound] == 0):.2%} bit-equal to the Ops (of {sound.mean():.0%} of the values)")


def cancellation(x, b, dy=None):
    """The absolute error bound of Ops' float32 GELU form in the tails: 8 float32 epsilons x (1 + |h|)^3 |dy|."""
    h = np.abs(h64(x, b))
    return 8 * 2.0 ** -23 * (1.0 + h) ** 3 * (1.0 if dy is None else np.abs(dy.astype(np.float64)))


def bound_ratio(got, want, scale=None):
    """max |got - want| / (U |want| + FLOAT32 (scale or |want|) + TINY) over the values (<= 1 passes)."""
    want = np.asarray(want, np.float64)
    err = np.abs(np.asarray(got).astype(np.float64) - want)
    floor = FLOAT32 * (np.abs(want) if scale is None else scale)
    return float(np.max(err / (U * np.abs(want) + floor + TINY)))


def sig64(h):
    """sigmoid(2u) = 0.5 (1 + tanh u) in float64, written as 1 / (1 + exp(-2u)): no cancellation in the tails
    (where 0.5 (1 + tanh u) loses even float64's digits: h below about -12)."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-2.0 * GELU_C * (h + GELU_A * h ** 3)))


def gelu64(h):
    return h * sig64(h)


def dgelu64(h, dy):
    """dy GELU'(h) = dy sig (1 + (1 - sig) h 2 du/dh), du/dh = sqrt(2/pi) (1 + 3 * 0.044715 h^2)."""
    s = sig64(h)
    return dy * s * (1.0 + (1.0 - s) * h * 2.0 * GELU_C * (1.0 + 3.0 * GELU_A * h * h))


def h64(x, b):
    return x.astype(np.float64) + b.astype(np.float64)


def test_the_policy_builds_the_bf16_pieces_for_bfloat16():
    for spec in KERNELS16:
        assert precision.BF16 in spec.dtypes, spec.name
        assert spec.source("bfloat16").startswith("typedef unsigned short T;\ntypedef float ACC;\n"), spec.name
        assert cuda.KERNELS[spec.name] is spec, spec.name  # registered: NVRTC compiles it in --check
    piece = cuda.PIECES["bias_gelu"]
    assert {gelu.BIAS_GELU_FWD16, gelu.BIAS_GELU_BWD16, gelu.BIAS_GELU_BWD_FWD16} <= set(piece.kernels)
    assert precision.BF16 not in gelu.BIAS_GELU_FWD.dtypes  # the float kernels stay ElementwiseKernels


def test_bias_gelu_forward_in_bf16_is_the_ops_within_one_rounding(cupy):
    x, b, _ = inputs()
    got = gelu.bias_gelu_forward_gpu(cupy.asarray(x), cupy.asarray(b)).get()
    exact = gelu64(h64(x, b))
    assert_like_ops(got, REF.bias_gelu_forward(x, b), exact, cancellation(x, b))
    assert bound_ratio(got, exact) <= 1.0


def test_bias_gelu_backward_in_bf16_is_the_ops_within_one_rounding(cupy):
    x, b, dy = inputs(1)
    X, B, DY = cupy.asarray(x), cupy.asarray(b), cupy.asarray(dy)
    want = dgelu64(h64(x, b), dy.astype(np.float64))
    dh = gelu.bias_gelu_backward_gpu(X, B, DY).get()
    assert_like_ops(dh, REF.bias_gelu_backward(x, b, dy), want, cancellation(x, b, dy))
    assert bound_ratio(dh, want, scale=np.max(np.abs(want))) <= 1.0
    in_place = gelu.bias_gelu_backward_gpu(X, B, DY, out=DY)  # dy overwritten by dh: each read before its write
    assert in_place is DY and np.array_equal(DY.get().view(np.uint16), dh.view(np.uint16))


def test_the_backward_with_the_output_recomputed_in_bf16_is_the_ops_within_one_rounding(cupy):
    x, b, dy = inputs(2)
    X, B, DY = cupy.asarray(x), cupy.asarray(b), cupy.asarray(dy)
    dh, y = (a.get() for a in gelu.bias_gelu_backward_recompute_gpu(X, B, DY))
    dh_ops, y_ops = REF.bias_gelu_backward(x, b, dy, recompute_output=True)
    want = dgelu64(h64(x, b), dy.astype(np.float64))
    assert_like_ops(dh, dh_ops, want, cancellation(x, b, dy))
    assert_like_ops(y, y_ops, gelu64(h64(x, b)), cancellation(x, b))
    assert bound_ratio(dh, want, scale=np.max(np.abs(want))) <= 1.0
    assert bound_ratio(y, gelu64(h64(x, b))) <= 1.0
    # the one pass gives the two kernels' values bit for bit
    assert np.array_equal(dh.view(np.uint16), gelu.bias_gelu_backward_gpu(X, B, DY).get().view(np.uint16))
    assert np.array_equal(y.view(np.uint16), gelu.bias_gelu_forward_gpu(X, B).get().view(np.uint16))


@pytest.mark.parametrize("chunk_rows", [64, 7])  # 2 chunks of rows (the last partly); 14, more than the 8 adders
def test_the_recomputing_backward_sums_the_bias_gradient_in_its_pass(cupy, monkeypatch, chunk_rows):
    """With db, bias_gelu_bwd_fwd16 also sums each column of dh as stored over its chunk of rows and
    column_sums_add adds the chunks into db (float32, accumulated): dh and y the same bits as without, db
    the float64 column sums of those bfloat16 dh within float32's rounding, the same bits on a second run,
    and the Ops' own db (add_bias_grad over its dh) within its rounding. Through CupyOps' piece too."""
    monkeypatch.setattr(gelu, "GELU16_CHUNK_ROWS", chunk_rows)
    x, b, dy = inputs(5)
    X, B, DY = cupy.asarray(x), cupy.asarray(b), cupy.asarray(dy)
    dh, y = (a.get() for a in gelu.bias_gelu_backward_recompute_gpu(X, B, DY))
    DB = cupy.asarray(np.full(C, 0.5, np.float32))
    dh2, y2 = (a.get() for a in gelu.bias_gelu_backward_recompute_gpu(X, B, DY, DB))
    assert np.array_equal(dh2.view(np.uint16), dh.view(np.uint16))
    assert np.array_equal(y2.view(np.uint16), y.view(np.uint16))
    sums = dh.astype(np.float64).sum(axis=0)
    scale = np.abs(dh.astype(np.float64)).sum(axis=0)
    db = DB.get()
    assert db.dtype == np.float32 and np.all(np.abs(db - (0.5 + sums)) <= 1e-6 * (1.0 + scale))
    again = cupy.asarray(np.full(C, 0.5, np.float32))
    gelu.bias_gelu_backward_recompute_gpu(X, B, DY, again)
    assert np.array_equal(again.get().view(np.uint32), db.view(np.uint32))  # a fixed order: the same bits
    ops_db = np.full(C, 0.5, np.float32)
    REF.bias_gelu_backward(x, b, dy, recompute_output=True, db=ops_db)
    assert np.all(np.abs(db - ops_db) <= 2 ** -8 * scale + 1e-6)  # the Ops' dh within a bf16 step of these
    ops, OPS_DB = cupy_ops.CupyOps(cupy, fused=("bias_gelu",)), cupy.asarray(np.full(C, 0.5, np.float32))
    ops.bias_gelu_backward(X, B, DY, recompute_output=True, db=OPS_DB)
    assert np.array_equal(OPS_DB.get().view(np.uint32), db.view(np.uint32))
    with pytest.raises(ValueError, match="db must be a contiguous float32 vector"):
        gelu.bias_gelu_backward_recompute_gpu(X, B, DY, cupy.asarray(np.zeros(C, BF16)))


@pytest.mark.parametrize("with_residual", [True, False])
def test_the_epilogue_in_bf16_is_the_ops_bit_for_bit(cupy, with_residual):
    rng = np.random.default_rng(3)
    y, b, r = bf16(rng, N, C, scale=3.0), bf16(rng, C), bf16(rng, N, C, scale=10.0)
    want = y.copy()
    REF.add_epilogue(want, b, r if with_residual else None)
    Y = cupy.asarray(y)
    linear.bias_residual_add16_gpu(Y, cupy.asarray(b), cupy.asarray(r) if with_residual else None)
    assert np.array_equal(Y.get().view(np.uint16), want.view(np.uint16))
    exact = y.astype(np.float64) + b.astype(np.float64) + (r.astype(np.float64) if with_residual else 0.0)
    assert bound_ratio(Y.get(), exact) <= 1.0


def test_cupy_ops_runs_the_bf16_kernels_on_bfloat16_arrays(cupy, monkeypatch):
    """The fused piece bias_gelu and add_epilogue take the bf16 kernels on bfloat16 arrays (not the Ops' many
    launches); float32 keeps the ElementwiseKernels (no RawKernel launched)."""
    launched = []
    launch = cuda.launch
    monkeypatch.setattr(cuda, "launch", lambda spec, *a: (launched.append(spec.name), launch(spec, *a))[1])
    ops = cupy_ops.CupyOps(cupy, fused=("bias_gelu",))
    x, b, dy = inputs(4)
    X, B, DY = cupy.asarray(x), cupy.asarray(b), cupy.asarray(dy)
    y = ops.bias_gelu_forward(X, B)
    dh, y2 = ops.bias_gelu_backward(X, B, DY, recompute_output=True)
    ops.add_epilogue(y2, B, DY)
    assert launched == ["bias_gelu_fwd16", "bias_gelu_bwd_fwd16", "bias_residual_add16"]
    assert_like_ops(y.get(), REF.bias_gelu_forward(x, b), gelu64(h64(x, b)), cancellation(x, b))
    assert_like_ops(dh.get(), REF.bias_gelu_backward(x, b, dy), dgelu64(h64(x, b), dy.astype(np.float64)),
                    cancellation(x, b, dy))
    launched.clear()
    strided = cupy.asarray(np.stack([x, x], axis=-1).reshape(N, 2 * C))[:, ::2]  # x, strided: Ops' code runs it
    assert_like_ops(ops.bias_gelu_forward(strided, B).get(), REF.bias_gelu_forward(x, b), gelu64(h64(x, b)),
                    cancellation(x, b))  # its float32 GELU on CupyOps' own gelu_fwd
    assert launched == []
    X32, B32 = cupy.asarray(x.astype(np.float32)), cupy.asarray(b.astype(np.float32))
    ops.bias_gelu_forward(X32, B32)
    ops.add_epilogue(X32, B32, cupy.asarray(dy.astype(np.float32)))
    assert launched == []


PLANTED = cuda.RawSpec("bias_gelu_fwd16", bf16=True, inline="""#include "bf16.cuh"
extern "C" __global__ void bias_gelu_fwd16(const T *x, const T *b, T *y, const int C, const int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const ACC h = widen(to_stored<T>(widen(x[i]) + widen(b[(unsigned int)i % (unsigned int)C])));  /* rounded: the bug */
  y[i] = to_stored<T>(h / ((ACC)1 + exp(h * (h * h * (ACC)-0.07135481627260025 + (ACC)-1.5957691216057308))));
}
""".replace('#include "bf16.cuh"', cuda.cu_code("gelu.cu", "bias_gelu_fwd16")[0]))


def test_a_sum_rounded_to_bf16_before_the_gelu_is_refused(cupy, monkeypatch):
    x, b, _ = inputs()
    X, B = cupy.asarray(x), cupy.asarray(b)
    right = gelu.bias_gelu_forward_gpu(X, B).get()
    monkeypatch.setattr(gelu, "BIAS_GELU_FWD16", PLANTED)
    planted = gelu.bias_gelu_forward_gpu(X, B).get()
    exact = gelu64(h64(x, b))
    with pytest.raises(AssertionError, match="from the Ops|bit-equal to the Ops"):
        assert_like_ops(planted, REF.bias_gelu_forward(x, b), exact, cancellation(x, b))
    assert bound_ratio(planted, gelu64(h64(x, b))) > 1.0
    assert bound_ratio(right, gelu64(h64(x, b))) <= 1.0
