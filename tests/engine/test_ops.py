"""`Ops`, the textbook every backend is checked against, checked itself: each forward against the
maths written as scalar loops over Python floats (math.tanh, math.exp), each backward against
fourth-order central differences of that forward (minitensor.checks.gradcheck), float64, small odd
shapes. Nothing here goes through a backend's override."""

import math

import numpy as np
import pytest

from minitensor.backends.ops import Ops
from minitensor.checks.gradcheck import check_gradients

OPS = Ops(np)
rng = np.random.default_rng(27)


def assert_gradients(forward, backward, inputs, params, dy):
    report = check_gradients(forward, backward, inputs=inputs, params=params, dy=dy)
    assert report.max_rel_error < 1e-6, report


def test_gelu_is_the_tanh_formula_and_its_derivative():
    x = rng.standard_normal((3, 7)) * 3.0
    want = [[0.5 * a * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3))) for a in row] for row in x]
    np.testing.assert_allclose(OPS.gelu_forward(x), want, rtol=1e-14, atol=1e-300)
    dy = rng.standard_normal(x.shape)
    assert_gradients(lambda: OPS.gelu_forward(x), lambda d: {"x": OPS.gelu_backward(x, d)}, {"x": x}, {}, dy)
    dx, y = OPS.bias_gelu_backward(x, x[0], dy, recompute_output=True)
    np.testing.assert_array_equal(y, OPS.bias_gelu_forward(x, x[0]))
    np.testing.assert_array_equal(dx, OPS.gelu_backward(x + x[0], dy))


def test_layernorm_normalises_each_row_and_its_three_paths_are_the_gradient():
    N, C = 5, 9
    x, w, b = rng.standard_normal((N, C)) * 2.0 + 1.0, rng.standard_normal(C), rng.standard_normal(C)
    y, mean, rstd = OPS.layernorm_forward(x, w, b, 1e-5)
    for n in range(N):
        mu = math.fsum(x[n]) / C
        var = math.fsum((a - mu) ** 2 for a in x[n]) / C
        assert mean[n, 0] == pytest.approx(mu, rel=1e-14)
        np.testing.assert_allclose(y[n], [(a - mu) / math.sqrt(var + 1e-5) * wc + bc for a, wc, bc in zip(x[n], w, b)],
                                   rtol=1e-12)
    dw, db, dres = np.zeros(C), np.zeros(C), rng.standard_normal((N, C))

    def backward(d):
        stats = OPS.layernorm_forward(x, w, b, 1e-5)[1:]
        return {"x": OPS.layernorm_backward(d, x, *stats, w, dw, db, dres) - dres}

    assert_gradients(lambda: OPS.layernorm_forward(x, w, b, 1e-5)[0], backward, {"x": x},
                     {"w": (w, dw), "b": (b, db)}, rng.standard_normal((N, C)))


def scalar_attention(q, k, v, b):
    """y[t] = sum over s <= t of softmax_s(q_t . k_s / sqrt(hs)) v_s, for one head, in Python floats."""
    T, hs = q.shape
    y = np.zeros((T, hs))
    for t in range(T):
        scores = [math.fsum((q[t] + b[0]) * (k[s] + b[1])) / math.sqrt(hs) for s in range(t + 1)]
        top = max(scores)
        e = [math.exp(a - top) for a in scores]
        y[t] = sum(ei / math.fsum(e) * (v[s] + b[2]) for s, ei in enumerate(e))
    return y


def test_dense_causal_attention_is_the_masked_softmax_and_its_backward():
    B, nh, T, hs = 2, 3, 5, 4
    qkv = rng.standard_normal((3, B, nh, T, hs))
    bias = rng.standard_normal(3 * nh * hs)

    def forward():
        y = np.empty((B, nh, T, hs))
        forward.saved = OPS.attention_forward(list(qkv), bias, y)
        return y

    y = forward()
    bh = bias.reshape(3, nh, hs)
    for bb in range(B):
        for h in range(nh):
            np.testing.assert_allclose(y[bb, h], scalar_attention(*qkv[:, bb, h], bh[:, h]), rtol=1e-12, atol=1e-14)

    def backward(dy):
        forward()
        d = np.zeros_like(qkv)
        OPS.attention_backward(dy, forward.saved, list(d))
        return {"qkv": d}

    assert_gradients(forward, backward, {"qkv": qkv}, {}, rng.standard_normal((B, nh, T, hs)))


def test_causal_softmax_of_the_last_rows_sees_the_earlier_keys():
    s = rng.standard_normal((2, 3, 7))                  # 3 new query rows at positions 4, 5, 6 of 7
    p = OPS.causal_softmax(s)
    for r in range(3):
        seen = s[:, r, :5 + r]
        np.testing.assert_allclose(p[:, r, :5 + r], np.exp(seen) / np.exp(seen).sum(axis=-1, keepdims=True), rtol=1e-14)
        assert not p[:, r, 5 + r:].any()


def test_cross_entropy_is_the_mean_negative_log_probability_and_its_gradient():
    N, V = 6, 11
    z, t = rng.standard_normal((N, V)) * 3.0, rng.integers(0, V, N)
    loss, _ = OPS.softmax_xent_forward(z, t)
    want = math.fsum(math.log(math.fsum(math.exp(a) for a in z[n])) - z[n, t[n]] for n in range(N)) / N
    assert float(loss) == pytest.approx(want, rel=1e-14)
    assert_gradients(lambda: OPS.softmax_xent_forward(z, t)[0],
                     lambda d: {"z": OPS.softmax_xent_backward(OPS.softmax_xent_forward(z, t)[1], t, float(d))},
                     {"z": z}, {}, np.asarray(0.7))


def test_scatter_add_sums_repeated_ids():
    dW, rows, idx = rng.standard_normal((4, 3)), rng.standard_normal((6, 3)), np.array([1, 3, 1, 0, 1, 3])
    want = dW.copy()
    for i, n in enumerate(idx):
        want[n] += rows[i]
    OPS.scatter_add_rows(dW, idx, rows)
    np.testing.assert_allclose(dW, want, rtol=1e-15)


def test_adamw_is_the_papers_update_element_by_element():
    """Loshchilov & Hutter's Algorithm 2 (with PyTorch's bias correction), one Python float at a time."""
    n, lr, b1, b2, eps, wd = 9, 1e-2, 0.9, 0.95, 1e-8, 0.1
    p, decayed = rng.standard_normal(n), (np.arange(n) % 3 != 0).astype(float)
    m, v = np.zeros(n), np.zeros(n)
    want = [(float(a), 0.0, 0.0) for a in p]
    for t in range(1, 4):
        g, scale = rng.standard_normal(n), 0.5
        OPS.adamw_step(p, g, m, v, decayed, lr, b1, b2, eps, wd, t, scale)
        for i, (pi, mi, vi) in enumerate(want):
            gi = g[i] * scale
            mi, vi = b1 * mi + (1 - b1) * gi, b2 * vi + (1 - b2) * gi * gi
            pi = pi - lr * (wd * decayed[i] * pi + (mi / (1 - b1 ** t)) / (math.sqrt(vi / (1 - b2 ** t)) + eps))
            want[i] = (pi, mi, vi)
    np.testing.assert_allclose(np.stack([p, m, v], axis=1), want, rtol=1e-13)
