"""The generic Ops' bf16 semantics (minitensor.backends.ops), the reference every bf16 kernel must equal.

Given bfloat16 arrays a piece sums in float32 and stores what it returns for the next layer in
bfloat16, rounded once; statistics, the loss and weight gradients stay float32. Each piece runs on
bfloat16 inputs and is compared with float64 computed from the same values (bfloat16 values are exact
in float64), at the bound of ONE rounding to bfloat16:

    |y - y64| <= u |y64| + 1e-5 max|y64|,    u = 2^-8 (bfloat16 keeps 8 significant bits)

the second term float32's own error in the sums (a few 2^-24 per term: far below it). A float32 result
(mean, rstd, the loss, dW) is held to 1e-5 relative to its largest entry: summing in bfloat16 would be
off by ~u. `test_the_bound_catches_a_layernorm_rounded_at_every_operation` shows the bound failing for
a LayerNorm that rounds every intermediate to bfloat16.

NumPy holds bfloat16 arrays (ml_dtypes) and the generic code runs on them (Ops(numpy)), so these run
on the CPU too; the training path refuses bf16 on NumPy only because it would be slow
(minitensor.precision.for_arrays). On the CuPy stand-in the same pieces go through CupyOps, whose
overrides fall back to the Ops code for bfloat16 (its fused pieces, the kernels of others, not used
here: kernels "generic").
"""

import numpy as np
import pytest

from minitensor import precision
from minitensor.backends import get_ops
from minitensor.backends.ops import Ops
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.optim import AdamW

U = 2.0 ** -8
BF16 = precision.bfloat16()


def ops_for(xp):
    return Ops(np) if xp is np else get_ops(xp, "generic")


def bf16(xp, rng, *shape, scale=1.0):
    """(a bfloat16 device array, its values in float64 on the host)."""
    a = (scale * rng.standard_normal(shape)).astype(BF16)
    return xp.asarray(a), a.astype(np.float64)


def host(a):
    return np.asarray(to_numpy(a)).astype(np.float64)


def assert_one_rounding(y, y64, what):
    assert np.dtype(y.dtype) == BF16, f"{what}: {y.dtype}, not bfloat16"
    err = np.abs(host(y) - y64)
    bound = U * np.abs(y64) + 1e-5 * np.abs(y64).max()
    assert np.all(err <= bound), f"{what}: worst error {np.max(err / bound):.2f} x the one-rounding bound"


def assert_float32(y, y64, what, rtol=1e-5):
    assert np.dtype(y.dtype) == np.float32, f"{what}: {y.dtype}, not float32"
    np.testing.assert_allclose(host(y), y64, rtol=0, atol=rtol * np.abs(y64).max(), err_msg=what)


def layernorm64(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    return (x - mean) * rstd * w + b, mean, rstd


def test_float32_and_float64_arrays_pass_through_untouched():
    a = np.ones(3, np.float32)
    assert Ops.summed(a) is a and Ops.stored(a, a.dtype) is a
    d = np.ones(3, np.float64)
    assert Ops.summed(a, None, d) == (a, None, d)
    w = Ops.summed(a.astype(BF16))
    assert w.dtype == np.float32 and Ops.stored(w, BF16).dtype == BF16


def test_layernorm_sums_in_float32_and_rounds_once(xp):
    ops, rng = ops_for(xp), np.random.default_rng(0)
    (x, x64), (w, w64), (b, b64) = bf16(xp, rng, 24, 80, scale=3.0), bf16(xp, rng, 80), bf16(xp, rng, 80)
    y, mean, rstd = ops.layernorm_forward(x + 5.0, w, b, 1e-5)  # an offset mean: the float32 sums matter
    y64, mean64, rstd64 = layernorm64(host(x + 5.0), w64, b64)
    assert_one_rounding(y, y64, "layernorm y")
    assert_float32(mean, mean64, "mean")
    assert_float32(rstd, rstd64, "rstd")

    (dy, dy64), (skip, skip64) = bf16(xp, rng, 24, 80), bf16(xp, rng, 24, 80)
    dw, db = xp.zeros(80, np.float32), xp.zeros(80, np.float32)
    dx = ops.layernorm_backward(dy, x + 5.0, mean, rstd, w, dw, db, skip)
    xhat = (host(x + 5.0) - mean64) * rstd64
    g = dy64 * w64
    dx64 = rstd64 * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) + skip64
    assert_one_rounding(dx, dx64, "layernorm dx")
    assert_float32(dw, (dy64 * xhat).sum(0), "dw")
    assert_float32(db, dy64.sum(0), "db")


def test_the_bound_catches_a_layernorm_rounded_at_every_operation():
    rng = np.random.default_rng(0)
    x = (3.0 * rng.standard_normal((24, 80)) + 5.0).astype(BF16)
    mean = x.mean(-1, keepdims=True)             # ml_dtypes: every operation rounds to bfloat16
    xc = x - mean
    y = xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + BF16.type(1e-5))
    y64, _, _ = layernorm64(x.astype(np.float64), 1.0, 0.0)
    with pytest.raises(AssertionError, match="one-rounding bound"):
        assert_one_rounding(y, y64, "a bfloat16-throughout layernorm")


def test_products_sum_in_float32(xp):
    ops, rng = ops_for(xp), np.random.default_rng(1)
    (a, a64), (b, b64) = bf16(xp, rng, 32, 512), bf16(xp, rng, 512, 48)
    assert_one_rounding(ops.matmul(a, b), a64 @ b64, "matmul")
    out = xp.empty((32, 48), BF16)
    ops.gemm(a, b, out)
    assert_one_rounding(out, a64 @ b64, "gemm into bfloat16")
    (dy, dy64) = bf16(xp, rng, 32, 48)
    dW, db = xp.zeros((512, 48), np.float32), xp.zeros(48, np.float32)
    ops.linear_weight_grads(a, dy, dW, db)
    ops.linear_weight_grads(a, dy, dW, db)       # accumulated, in float32
    assert_float32(dW, 2 * a64.T @ dy64, "dW")
    assert_float32(db, 2 * dy64.sum(0), "db")
    (bias, bias64), (r, r64) = bf16(xp, rng, 48), bf16(xp, rng, 32, 48)
    y = ops.matmul(a, b)
    y64 = host(y)
    ops.add_epilogue(y, bias, r)
    assert_one_rounding(y, y64 + bias64 + r64, "bias and residual")


def test_gelu_and_its_bias_pass_round_once(xp):
    ops, rng = ops_for(xp), np.random.default_rng(2)
    (x, x64), (b, b64), (dy, dy64) = bf16(xp, rng, 16, 64, scale=2.0), bf16(xp, rng, 64), bf16(xp, rng, 16, 64)
    h = x64 + b64
    t = np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))
    assert_one_rounding(ops.bias_gelu_forward(x, b), 0.5 * h * (1 + t), "gelu")
    du = np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h ** 2)
    dx, g = ops.bias_gelu_backward(x, b, dy, recompute_output=True)
    assert_one_rounding(dx, dy64 * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * du), "gelu dx")
    assert_one_rounding(g, 0.5 * h * (1 + t), "gelu recomputed")


def test_cross_entropy_in_float32(xp):
    ops, rng = ops_for(xp), np.random.default_rng(3)
    (z, z64) = bf16(xp, rng, 12, 40, scale=4.0)
    t = rng.integers(0, 40, 12)
    loss, saved = ops.softmax_xent_forward(z, xp.asarray(t))
    p64 = np.exp(z64 - z64.max(1, keepdims=True))
    p64 /= p64.sum(1, keepdims=True)
    loss64 = np.mean(-np.log(p64[np.arange(12), t]))
    assert np.dtype(loss.dtype) == np.float32 and abs(float(loss) - loss64) <= 1e-6 * loss64
    dz = ops.softmax_xent_backward(saved, xp.asarray(t), 0.5)
    onehot = np.eye(40)[t]
    # the saved probabilities are bfloat16 (rounded once), then p - onehot is rounded: two roundings at most
    ref = (p64 - onehot) * 0.5 / 12
    assert np.dtype(dz.dtype) == BF16
    err = np.abs(host(dz) - ref)
    assert np.all(err <= 2 * U * (np.abs(ref) + p64 * 0.5 / 12) + 1e-7), np.max(err)


def test_attention_core_sums_in_float32(xp):
    ops, rng = ops_for(xp), np.random.default_rng(4)
    B, nh, T, hs = 2, 2, 12, 8
    (qkv, qkv64) = bf16(xp, rng, B, T, 3, nh, hs)
    heads = [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]
    y = xp.empty((B, T, nh, hs), BF16)
    saved = ops.attention_forward(heads, None, y.transpose(0, 2, 1, 3))
    q, k, v = (qkv64[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(hs) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert_one_rounding(y.transpose(0, 2, 1, 3), p @ v, "attention y")

    (dy, dy64) = bf16(xp, rng, B, T, nh, hs)
    dqkv = xp.empty((B, T, 3, nh, hs), BF16)
    ops.attention_backward(dy.transpose(0, 2, 1, 3), saved, [dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)])
    dy4 = dy64.transpose(0, 2, 1, 3)
    dp = dy4 @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    expected = [ds @ k / np.sqrt(hs), ds.swapaxes(-1, -2) @ q / np.sqrt(hs), p.swapaxes(-1, -2) @ dy4]
    for i, name in enumerate("qkv"):
        assert_one_rounding(dqkv[:, :, i].transpose(0, 2, 1, 3), expected[i], f"d{name}")


def test_embedding_gradients_add_in_float32(xp):
    ops, rng = ops_for(xp), np.random.default_rng(5)
    idx = np.array([3, 1, 3, 3, 0, 1])
    (rows, rows64) = bf16(xp, rng, 6, 16)
    dW = xp.zeros((5, 16), np.float32)
    ops.scatter_add_rows(dW, xp.asarray(idx), rows)
    ref = np.zeros((5, 16))
    np.add.at(ref, idx, rows64)
    assert_float32(dW, ref, "scatter_add_rows")


def test_params_compute_copy_is_the_masters_rounded(xp):
    """Under a mixed precision the layers' views are of a bfloat16 buffer of the same layout, equal to the
    float32 masters rounded to nearest even after refresh_compute and after every AdamW step, which writes
    it (Ops.adamw_step's copy=)."""
    ops, rng = ops_for(xp), np.random.default_rng(6)
    p = Params({"w": (7, 33), "b": (33,)}, xp=xp, dtype="float32", ops=ops, compute=BF16)
    assert p.mixed and np.dtype(p.compute.dtype) == BF16 and p.compute.shape == p.data.shape
    assert np.dtype(p.compute_view("w").dtype) == BF16 and p.compute_view("w").shape == (7, 33)
    p.data[...] = xp.asarray(rng.standard_normal(p.size).astype(np.float32))
    p.refresh_compute()

    def assert_rounded():
        expected = np.asarray(to_numpy(p.data)).astype(BF16)
        assert np.array_equal(np.asarray(to_numpy(p.compute)).view(np.uint16), expected.view(np.uint16))

    assert_rounded()
    p.compute_view("w")[0, 0] = 7  # a view of the flat copy
    assert float(to_numpy(p.compute)[p.offsets["w"]]) == 7
    p.refresh_compute()
    opt = AdamW(p, lr=1e-2)
    for _ in range(3):
        p.grads[...] = xp.asarray(rng.standard_normal(p.size).astype(np.float32))
        opt.step()
        assert_rounded()
    assert np.dtype(p.data.dtype) == np.float32 and np.dtype(p.grads.dtype) == np.float32

    plain = Params({"w": (2, 3)}, xp=xp, dtype="float32", ops=ops)
    assert not plain.mixed and plain.compute is plain.data and plain.compute_view("w") is plain["w"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_generic_cross_entropy_masks_a_padded_head(xp, dtype):
    """Logits over a padded vocabulary (TiedHead.forward(padded=True)): Ops' cross-entropy reads the first
    `valid` columns only, as the fused one does, so a fused head's padding can fall back to it (a bfloat16
    run whose cross-entropy kernel is not built for bfloat16): the same loss, no gradient in the padding."""
    ops, rng = ops_for(xp), np.random.default_rng(7)
    z = rng.standard_normal((6, 10)).astype(precision.dtype_of(dtype))
    padded = np.full((6, 16), np.nan, z.dtype)          # never read
    padded[:, :10] = z
    t = xp.asarray(rng.integers(0, 10, 6))
    loss, saved = ops.softmax_xent_forward(xp.asarray(z), t)
    loss_p, saved_p = ops.softmax_xent_forward(xp.asarray(padded), t, valid=10)
    assert float(loss_p) == float(loss)
    dz, dz_p = (host(ops.softmax_xent_backward(s, t)) for s in (saved, saved_p))
    assert np.array_equal(dz_p[:, :10], dz) and np.all(dz_p[:, 10:] == 0)
