"""The tied head over a padded vocabulary (issue 26, item 3), on the CuPy stand-in.

With the fused cross-entropy, CupyOps pads the head's vocabulary to a multiple of 128
(ops.vocab_padding: 8449 -> 8576, so every leading dimension of its three GEMMs is a multiple of
16 bytes): TiedHead.forward(x, padded=True) writes the first V columns of (N, Vp) logits,
SoftmaxCrossEntropy.forward(valid=V) gives the padded columns probability 0, and backward reads the
first V columns of dlogits only. Checked here: the loss and every gradient equal the unpadded CPU
ones (float64, and float32 against float64) with NaNs in the padded columns (never read), the
backward against finite differences, and the CPU never padding.
"""

import numpy as np
import pytest
from gpu_standin import standin_cupy
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minitensor.backends import fused_pieces, get_ops
from minitensor.checks.gradcheck import check_gradients
from minitensor.layers.embedding import TiedHead
from minitensor.layers.loss import SoftmaxCrossEntropy


def _inputs(N, C, V, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (N, C)), rng.normal(0, 0.5, (V, C)), rng.integers(0, V, N)


def _step(xp, ops, x, W, t, dtype, padded):
    """Loss, dx, dW of the head and the cross-entropy on xp, and the logits' width."""
    W_dev = xp.asarray(W.astype(dtype))
    dW = xp.zeros_like(W_dev)
    head, loss_fn = TiedHead(W_dev, dW, ops=ops), SoftmaxCrossEntropy(check=False, ops=ops)
    logits = head.forward(xp.asarray(x.astype(dtype)), padded=padded)
    logits[..., W.shape[0]:] = np.nan  # the padding, if any: never read
    loss = loss_fn.forward(logits, xp.asarray(t), inplace=True, valid=W.shape[0] if padded else None)
    dlogits = loss_fn.backward(0.75)
    dlogits[..., W.shape[0]:] = np.nan  # the padding's gradient, if any: never read either
    dx = head.backward(dlogits)
    host = (lambda a: a.get()) if xp is not np else np.asarray
    return float(loss), host(dx), host(dW), logits.shape[-1], head


def test_the_cpu_never_pads():
    ops = get_ops(np, "numpy")
    assert ops.vocab_padding(8449) == 8449
    *_, width, head = _step(np, ops, *_inputs(3, 4, 37), np.float64, padded=True)
    assert width == 37


@settings(max_examples=6, deadline=None)
@example(N=1, C=1, V=128)
@example(N=2, C=3, V=8449)
@given(N=st.integers(1, 6), C=st.integers(1, 9), V=st.sampled_from([1, 5, 37, 127, 128, 129, 200]))
def test_the_padded_head_equals_the_unpadded_one(N, C, V):
    x, W, t = _inputs(N, C, V, seed=N * 1000 + C * 10 + V)
    ref = _step(np, get_ops(np, "numpy"), x, W, t, np.float64, padded=False)
    with standin_cupy() as cupy:
        ops = get_ops(cupy, "fused")
        assert set(ops.in_use) == set(fused_pieces()) and ops.vocab_padding(8449) == 8576
        loss, dx, dW, width, head = _step(cupy, ops, x, W, t, np.float64, padded=True)
        loss32, dx32, dW32, *_ = _step(cupy, ops, x, W, t, np.float32, padded=True)
    assert width == -(-V // 128) * 128  # a vocabulary already aligned is used as it is
    assert loss == pytest.approx(ref[0], rel=1e-12)
    np.testing.assert_allclose(dx, ref[1], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(dW, ref[2], rtol=1e-10, atol=1e-14)
    assert dW.shape == (V, C)
    assert loss32 == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(dx32, dx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dW32, dW, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("N, C, V", [(3, 5, 37), (1, 2, 129)])
def test_the_padded_backward_matches_finite_differences(N, C, V):
    x, W, t = _inputs(N, C, V, seed=V)
    with standin_cupy() as cupy:
        ops = get_ops(cupy, "fused")
        xd, Wd, td = cupy.asarray(x), cupy.asarray(W), cupy.asarray(t)
        dW = cupy.zeros_like(Wd)
        head, loss_fn = TiedHead(Wd, dW, ops=ops), SoftmaxCrossEntropy(check=False, ops=ops)

        def forward():
            return loss_fn.forward(head.forward(xd, padded=True), td, inplace=True, valid=V)

        def backward(dy):
            return {"x": head.backward(loss_fn.backward(float(dy)))}

        forward()  # check_gradients starts with backward
        report = check_gradients(forward, backward, inputs={"x": xd}, params={"W": (Wd, dW)},
                                 dy=cupy.asarray(np.float64(0.6)), directions=3)
    assert report.max_rel_error < 1e-6, report
