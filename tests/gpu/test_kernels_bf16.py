"""The row kernels in bfloat16 (issue 47 item 1), emulated on the host through their wrappers, against the
float64 formulas on the same (bfloat16) inputs.

The kernels store in T = bfloat16 (held as its 16 bits) and sum in ACC = float32 (the precision policy's
accumulate_of). The bound: each bfloat16 output is a float32 value rounded once to nearest, so it is
within the unit roundoff U = 2^-8 (8 significant bits) of the float32 value, relative; the float32
arithmetic before it adds ~1e-7 of the row's scale, well inside FLOAT32 = 1e-5 of it. So
|got - want| <= U |want| + FLOAT32 scale, elementwise. What the kernels keep in ACC (the statistics,
the losses, the log-sum-exp, the weight gradients) is float32 and held to FLOAT32 alone. A kernel that
truncated instead of rounding (up to 2U), or carried its sums in bfloat16, is refused by that bound
(the planted tests at the end).
"""

import dataclasses
import shutil

import numpy as np
import pytest
import reference as F

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.kernels import causal_softmax, embedding, layernorm, rmsnorm, softmax_xent
from minitensor.backends.ops import Ops
from minitensor.checks import kernelcheck

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (the bf16 extra)")

BF16 = np.dtype(ml_dtypes.bfloat16)
U = 2.0 ** -8   # bfloat16's unit roundoff: 8 significant bits
FLOAT32 = 1e-5  # float32 arithmetic against float64, relative to the scale (about 80 float32 epsilons)


@pytest.fixture
def emulated(monkeypatch):
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    monkeypatch.setattr(cuda, "launch", kernelcheck.emulate_launch)


def bf16(rng, shape, scale=1.0, shift=0.0):
    return (shift + scale * rng.standard_normal(shape)).astype(BF16)


def f64(a):
    return np.asarray(a).astype(np.float64)


def worst(got, want, scale=None):
    """max |got - want| / (U |want| + FLOAT32 scale) for a bfloat16 result (<= 1 passes); scale: max |want|
    unless given."""
    assert got.dtype == BF16, got.dtype
    want = np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) if scale is None else scale
    return float(np.max(np.abs(f64(got) - want) / (U * np.abs(want) + FLOAT32 * max(scale, 1e-30))))


def assert_bf16_close(got, want, scale=None):
    assert got.shape == np.shape(want)
    assert worst(got, want, scale) <= 1.0, f"worst error {worst(got, want, scale):.3g} x the bfloat16 bound"


def assert_f32_close(got, want, scale=None):
    """An ACC result: float32, norm-wise within FLOAT32 of the scale."""
    assert got.dtype == np.float32, got.dtype
    want = np.asarray(want, np.float64).reshape(got.shape)
    scale = max(float(np.max(np.abs(want))), scale or 0.0, 1e-30)
    assert float(np.max(np.abs(f64(got) - want))) <= FLOAT32 * scale


def test_the_policy_builds_the_row_kernels_for_bfloat16():
    for spec in (layernorm.LAYERNORM_FWD, layernorm.LAYERNORM_BWD, layernorm.LAYERNORM_BWD_PARAMS,
                 rmsnorm.RMSNORM_FWD, rmsnorm.RMSNORM_BWD, rmsnorm.RMSNORM_BWD_PARAMS, softmax_xent.SOFTMAX_XENT_FWD,
                 causal_softmax.CAUSAL_SOFTMAX_FWD, causal_softmax.CAUSAL_SOFTMAX_BWD, embedding.SCATTER_ADD_ROWS):
        assert spec.dtypes == precision.kernel_dtypes(bf16=True), spec.name
        source = spec.source("bfloat16")
        assert source.startswith("typedef unsigned short T;\ntypedef float ACC;\n"), spec.name
    assert layernorm.LAYERNORM_FWD.source("float32").startswith("typedef float T;\ntypedef float ACC;\n")
    assert softmax_xent.SOFTMAX_XENT_BWD.dtypes == precision.FLOATS  # an ElementwiseKernel: CuPy's types


@pytest.mark.parametrize("shape", [(3, 1), (2, 3, 70), (40, 300)])
def test_layernorm_bf16_emulated(emulated, shape):
    rng = np.random.default_rng(15)
    C = shape[-1]
    x, dy, r = bf16(rng, shape, 2.0, 0.5), bf16(rng, shape), bf16(rng, shape)
    w, b = bf16(rng, C, 0.5, 1.0), bf16(rng, C)
    x2, dy2 = f64(x).reshape(-1, C), f64(dy).reshape(-1, C)
    y, mean, rstd = layernorm.layernorm_forward_gpu(x, w, b, 1e-5)
    y_ref, mean_ref, rstd_ref = F.layernorm_forward(x2, f64(w), f64(b))
    assert_bf16_close(y.reshape(-1, C), y_ref)
    assert_f32_close(mean, mean_ref, scale=1.0)
    assert_f32_close(rstd, rstd_ref)

    dw, db = np.full(C, 0.5, np.float32), np.full(C, -0.5, np.float32)  # float32 gradients, accumulated
    dx = layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db)
    dx_ref, dw_ref, db_ref = F.layernorm_backward(dy2, x2, f64(w), mean_ref, rstd_ref)
    scale = float(np.max(np.abs(dy2 * f64(w) * rstd_ref)))
    assert_bf16_close(dx.reshape(-1, C), dx_ref, scale)
    assert_f32_close(dw, 0.5 + dw_ref, scale=1.0)
    assert_f32_close(db, -0.5 + db_ref, scale=1.0)

    # the residual join: x becomes x + r rounded to bfloat16 once, and is normalised as stored
    xs = x.copy()
    y2, _, _ = layernorm.layernorm_forward_gpu(xs, w, b, 1e-5, residual=r, out=xs)
    joined = (x.astype(np.float32) + r.astype(np.float32)).astype(BF16)
    y2_ref = F.layernorm_forward(f64(joined).reshape(-1, C), f64(w), f64(b))[0]
    assert_bf16_close(y2.reshape(-1, C), y2_ref)
    # with the sublayer's bias too: x becomes (x + bias) + r, Ops.add_epilogue's bits, then is normalised
    bias, xb, want = bf16(rng, C), x.copy(), x.reshape(-1, C).copy()
    y3, _, _ = layernorm.layernorm_forward_gpu(xb, w, b, 1e-5, residual=r, bias=bias)
    Ops(np).add_epilogue(want, bias, r.reshape(-1, C))
    assert np.array_equal(xb.reshape(-1, C).view(np.uint16), want.view(np.uint16))
    assert_bf16_close(y3.reshape(-1, C), F.layernorm_forward(f64(want), f64(w), f64(b))[0])
    kept, kept_db = r.copy(), np.full(C, 0.5, np.float32)  # residual + dx: summed in float32, rounded once
    total = layernorm.layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, residual=kept, res_db=kept_db)
    assert np.array_equal(kept, r)
    assert_bf16_close(total.reshape(-1, C), f64(r).reshape(-1, C) + dx_ref, scale)
    # the residual's column sums (c_proj's bias gradient), of its bfloat16 values in float32, accumulated
    assert_f32_close(kept_db, 0.5 + f64(r).reshape(-1, C).sum(axis=0), scale=1.0)


@pytest.mark.parametrize("shape", [(3, 1), (2, 3, 70), (40, 300)])
def test_rmsnorm_bf16_emulated(emulated, shape):
    rng = np.random.default_rng(16)
    C = shape[-1]
    x, dy, r = bf16(rng, shape, 2.0, 0.5), bf16(rng, shape), bf16(rng, shape)
    w = bf16(rng, C, 0.5, 1.0)
    x2, dy2 = f64(x).reshape(-1, C), f64(dy).reshape(-1, C)
    y, rstd = rmsnorm.rmsnorm_forward_gpu(x, w, 1e-5)
    y_ref, rstd_ref = Ops(np).rmsnorm_forward(x2, f64(w), 1e-5)
    assert_bf16_close(y.reshape(-1, C), y_ref)
    assert_f32_close(rstd, rstd_ref)
    dw, dw_ref = np.full(C, 0.5, np.float32), np.full(C, 0.5)
    dx = rmsnorm.rmsnorm_backward_gpu(dy, x, w, rstd, dw)
    dx_ref = Ops(np).rmsnorm_backward(dy2, x2, rstd_ref, f64(w), dw_ref)
    scale = float(np.max(np.abs(dy2 * f64(w) * rstd_ref)))
    assert_bf16_close(dx.reshape(-1, C), dx_ref, scale)
    assert_f32_close(dw, dw_ref, scale=1.0)
    total = rmsnorm.rmsnorm_backward_gpu(dy, x, w, rstd, np.zeros(C, np.float32), residual=r.copy())
    assert_bf16_close(total.reshape(-1, C), f64(r).reshape(-1, C) + dx_ref, scale)


@pytest.mark.parametrize("shape", [(3, 1, 1), (2, 5, 5), (1, 40, 40)])
def test_causal_softmax_bf16_emulated(emulated, shape):
    rng = np.random.default_rng(17)
    s, dp = bf16(rng, shape, 3.0), bf16(rng, shape)
    lse = np.full((*shape[:-1], 1), np.nan, np.float32)  # the log-sum-exp is float32 (ACC)
    p = causal_softmax.causal_softmax_forward_gpu(s, 0.3, lse=lse)
    p_ref, lse_ref = F.causal_softmax(f64(s), 0.3)
    assert_bf16_close(p, p_ref)
    upper = np.triu_indices(shape[-1], 1)
    assert np.all(f64(p)[..., upper[0], upper[1]] == 0)
    assert_f32_close(lse, lse_ref, scale=1.0)
    # the backward of the probabilities as stored (bfloat16)
    ds = causal_softmax.causal_softmax_backward_gpu(dp, p, 0.3)
    assert_bf16_close(ds, F.causal_softmax_backward(f64(dp), f64(p), 0.3), float(np.max(np.abs(f64(dp)))))
    assert np.array_equal(causal_softmax.causal_softmax_forward_gpu(s, 0.3), p)  # without lse: the same p


@pytest.mark.parametrize("V", [2, 7, 100])
def test_cross_entropy_bf16_emulated(emulated, V):
    rng = np.random.default_rng(18)
    logits = bf16(rng, (2, 3, V), 4.0, 10.0)
    targets = rng.integers(0, V, (2, 3))
    z = logits.copy()
    loss, losses = softmax_xent.softmax_xent_forward_gpu(z, targets)
    loss_ref, probs_ref, losses_ref = F.softmax_xent_forward(f64(logits), targets)
    assert_f32_close(losses, losses_ref, scale=1.0)
    assert_bf16_close(z, np.reshape(probs_ref, z.shape))
    probs = z.copy()  # the backward, in place over the bfloat16 probabilities (softmax_xent_bwd16)
    assert softmax_xent.softmax_xent_backward_gpu(z, targets, 0.5) is z
    assert_bf16_close(z, F.softmax_xent_backward(f64(probs), targets, 0.5))


def test_scatter_add_rows_bf16_rows_into_a_float32_gradient(emulated):
    rng = np.random.default_rng(19)
    V, C, n = 11, 70, 40
    ids = rng.integers(0, V, n)
    rows = bf16(rng, (n, C))
    dW = rng.standard_normal((V, C)).astype(np.float32)
    want = f64(dW)
    np.add.at(want, ids, f64(rows))
    embedding.scatter_add_rows_gpu(dW, ids, rows)
    assert_f32_close(dW, want, scale=1.0)


def test_a_kernel_is_refused_a_dtype_it_is_not_built_for():
    x = np.zeros((2, 4), BF16)
    with pytest.raises(ValueError, match="float32 or float64"):
        cuda.rows("f", x)  # no kernel named: the policy's FLOATS
    assert cuda.rows("f", x, layernorm.LAYERNORM_FWD) == (2, 4)
    with pytest.raises(TypeError, match="built for float32, float64, not bfloat16"):
        cuda.launch(softmax_xent.SOFTMAX_XENT_BWD, BF16, (1,), (32,), ())


# --- The bound refuses what bfloat16 arithmetic done wrong would give -------------------------------


def _causal_softmax_bwd_with(old, new, shape=(2, 40, 40)):
    """causal_softmax_bwd with `old` in its code (headers included) replaced by `new`, emulated in bfloat16
    on one case; returns the worst error against the formula, in bounds."""
    spec = causal_softmax.CAUSAL_SOFTMAX_BWD
    assert old in spec.code
    slipped = dataclasses.replace(spec, inline=spec.code.replace(old, new))
    rng = np.random.default_rng(20)
    s, dp = rng.standard_normal(shape), bf16(rng, shape)
    p = F.causal_softmax(3.0 * s, 0.3)[0].astype(BF16)
    ds = np.zeros(shape, BF16)
    rows, T = shape[0] * shape[1], shape[-1]
    kernelcheck.emulate_launch(slipped, BF16, (rows,), (64,), (dp, p, ds, np.int32(T), np.float32(0.3)))
    return worst(ds, F.causal_softmax_backward(f64(dp), f64(p), 0.3), float(np.max(np.abs(f64(dp)))))


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")
def test_the_bound_passes_the_kernel_and_refuses_truncation_and_bfloat16_sums():
    assert _causal_softmax_bwd_with("ACC dot = 0;", "ACC dot = 0;") <= 1.0
    # narrow_bf16 truncating (dropping the low 16 bits) instead of rounding to nearest
    truncated = _causal_softmax_bwd_with("return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);",
                                         "return (unsigned short)(u >> 16);")
    # the row's dot product carried in bfloat16 (each partial sum rounded), not in float32
    summed = _causal_softmax_bwd_with("dot += widen(dpr[j]) * widen(pr[j]);",
                                      "dot = widen(narrow_bf16(dot + widen(dpr[j]) * widen(pr[j])));")
    assert truncated > 1.0 and summed > 1.0, (truncated, summed)
