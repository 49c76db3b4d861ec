"""Properties the generic checks do not pin down: repeated ids, causality, the loss gradient's rows,
bad targets, the checker catching a wrong backward, and a small stack checked end to end.
"""


import numpy as np
import pytest
import strategies as S
from hypothesis import given, settings
from layer_cases import all_ops, attention_case, embedding_case, linear_case, loss_case

from minitensor.backends import get_ops
from minitensor.backends.cupy_ops import CupyOps
from minitensor.checks.gradcheck import check_gradients
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.layers.attention import CausalSelfAttention
from minitensor.layers.embedding import Embedding, PositionEmbedding, TiedHead
from minitensor.layers.gelu import GELU
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.linear import Linear
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.layers.relu import ReLU

examples = settings(max_examples=15)


def test_embedding_sums_gradients_of_repeated_ids(xp):
    case = embedding_case(xp, np.float64, 0, {"B": 2, "T": 3, "C": 4, "V": 5})
    idx = case.extra["idx"]
    idx[...] = xp.asarray([[1, 1, 3], [1, 0, 3]])
    case.forward()
    dy = xp.asarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    case.backward(dy)
    dW = to_numpy(case.params.grad("wte"))
    d = to_numpy(dy)
    np.testing.assert_allclose(dW[1], d[0, 0] + d[0, 1] + d[1, 0])
    np.testing.assert_allclose(dW[3], d[0, 2] + d[1, 2])
    np.testing.assert_allclose(dW[0], d[1, 1])
    np.testing.assert_allclose(dW[[2, 4]], 0)


@examples
@given(seed=S.seeds, n=S.time, V=S.vocab, C=S.width)
def test_scatter_add_equals_add_at(xp, seed, n, V, C):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, V, n)
    rows = rng.standard_normal((n, C))
    expected = rng.standard_normal((V, C))
    start = expected.copy()
    np.add.at(expected, idx, rows)
    for ops in all_ops(xp):
        dW = xp.asarray(start.copy())
        ops.scatter_add_rows(dW, xp.asarray(idx), xp.asarray(rows))
        np.testing.assert_allclose(to_numpy(dW), expected, rtol=1e-12, atol=1e-12, err_msg=repr(ops))


@pytest.mark.gpu
def test_embedding_gradient_on_cupy_is_the_sequential_sum_on_every_run(cupy):
    """CuPy's add.at is atomic (its sums' order, and so their rounding, vary from run to run; the
    stand-in's too): the embedding's backward adds each id's rows in position order instead, so
    a GPU's gradient, and a resume on it, can be bit-identical. float32 against that order's sum
    bit for bit, twice (a GPU's float additions round as NumPy's); float64 against add.at."""
    rng = np.random.default_rng(0)
    V, C, n = 23, 300, 60                                    # C: two blocks of columns
    idx = rng.permutation(np.arange(n) % (n // 3))           # 20 ids, each at 3 scattered positions
    occurrence = np.array([np.count_nonzero(idx[:i] == idx[i]) for i in range(n)])
    big = np.float32(2**24)                                  # +-2**24 and 1 in a row: order decides the rounding
    rows = (np.array([big, 1, -big], np.float32)[occurrence][:, None]
            + rng.standard_normal((n, C)).astype(np.float32))
    start = rng.standard_normal((V, C)).astype(np.float32)
    sequential, reverse = start.copy(), start.copy()
    for i in range(n):
        sequential[idx[i]] += rows[i]
        reverse[idx[n - 1 - i]] += rows[n - 1 - i]
    assert not np.array_equal(sequential, reverse)           # another order would show
    ops = CupyOps(cupy)
    for _ in range(2):
        dW = cupy.asarray(start)
        ops.scatter_add_rows(dW, cupy.asarray(idx), cupy.asarray(rows))
        np.testing.assert_array_equal(dW.get(), sequential)
    expected = start.astype(np.float64)
    np.add.at(expected, idx, rows.astype(np.float64))
    dW = cupy.asarray(start.astype(np.float64))
    ops.scatter_add_rows(dW, cupy.asarray(idx), cupy.asarray(rows.astype(np.float64)))
    np.testing.assert_allclose(dW.get(), expected, rtol=1e-12, atol=1e-12)


@examples
@given(seed=S.seeds, d=S.attention_dims())
def test_attention_is_causal(xp, seed, d):
    case = attention_case(xp, np.float64, seed, d)
    y0 = to_numpy(case.forward()).copy()
    x = case.inputs["x"]
    t_changed = int(np.random.default_rng(seed).integers(0, d["T"]))
    x[:, t_changed:] += 1.0
    y1 = to_numpy(case.forward())
    # bit for bit on a GPU too: the same kernels on the same shapes (a GEMM's output row i reads row i
    # of its left operand only, in an order fixed by the shapes), and a causal row never reads a later
    # position's score (the fused softmax skips it) or adds its value but times an exact 0
    np.testing.assert_array_equal(y1[:, :t_changed], y0[:, :t_changed])
    assert not np.allclose(y1[:, t_changed:], y0[:, t_changed:])


@examples
@given(seed=S.seeds, B=S.batch, T=S.time, V=S.vocab)
def test_cross_entropy_gradient_rows_sum_to_zero(xp, seed, B, T, V):
    case = loss_case(xp, np.float64, seed, {"B": B, "T": T, "V": V})
    case.forward()
    dlogits = to_numpy(case.backward(1.0)["logits"])
    np.testing.assert_allclose(dlogits.sum(axis=-1), 0, atol=1e-15)


def test_cross_entropy_is_stable_for_huge_logits(xp):
    logits = xp.asarray([[1000.0, 0.0, -1000.0]])
    loss = SoftmaxCrossEntropy().forward(logits, xp.asarray([1]))
    assert abs(float(loss) - 1000.0) < 1e-9


def test_a_layer_built_without_ops_takes_the_backend_of_its_arrays(xp):
    """Built without ops=, a layer runs each forward (and its backward) on the backend of the arrays
    it is given, the model's `get_ops(xp)`; it was NumPy's whatever the arrays, which on CuPy wrote
    a CuPy array into np.empty (refused by CuPy 14)."""
    rng = np.random.default_rng(0)
    logits, targets = xp.asarray(rng.standard_normal((2, 3, 5))), xp.asarray(rng.integers(0, 5, (2, 3)))
    loss, own = SoftmaxCrossEntropy(), SoftmaxCrossEntropy(ops=get_ops(xp))
    assert float(loss.forward(logits, targets)) == float(own.forward(logits, targets))  # one backend, one result
    assert loss.ops is get_ops(xp)
    np.testing.assert_array_equal(to_numpy(loss.backward()), to_numpy(own.backward()))
    p = Params({"w": (4, 3), "b": (3,), "g": (3,), "beta": (3,)}, xp=xp, dtype=np.float64)
    p["w"][...] = xp.asarray(rng.standard_normal((4, 3)))
    p["g"][...] = 1.0
    x = xp.asarray(rng.standard_normal((2, 4)))
    layers = [(Linear(p["w"], p.grad("w"), p["b"], p.grad("b")), x),
              (LayerNorm(p["g"], p.grad("g"), p["beta"], p.grad("beta")), x[:, :3]), (GELU(), x)]
    for layer, x in layers:
        layer.backward(layer.forward(x))
        assert layer.ops is get_ops(xp), type(layer).__name__


@pytest.mark.gpu
def test_a_layer_refuses_arrays_of_another_module_than_its_backend(cupy):
    with pytest.raises(TypeError, match="built with the numpy backend but given cupy arrays: build it with"):
        SoftmaxCrossEntropy(ops=get_ops(np)).forward(cupy.zeros((1, 3)), cupy.asarray([1]))
    with pytest.raises(TypeError, match="built with the cupy backend but given numpy arrays"):
        GELU(ops=CupyOps(cupy)).forward(np.zeros(3))


@pytest.mark.parametrize("bad", [-1, 5])
def test_cross_entropy_refuses_targets_out_of_range(xp, bad):
    logits = xp.zeros((1, 2, 5))
    with pytest.raises(ValueError, match=f"target id {bad} is out of range"):
        SoftmaxCrossEntropy().forward(logits, xp.asarray([[0, bad]]))


def test_embedding_refuses_ids_out_of_range(xp):
    p = Params({"w": (4, 2)}, xp=xp)
    with pytest.raises(ValueError, match="token id 4 is out of range"):
        Embedding(p["w"], p.grad("w")).forward(xp.asarray([[0, 4]]))


def test_checker_catches_a_wrong_backward(xp):
    case = linear_case(xp, np.float64, 0, {"B": 2, "T": 3, "n_in": 4, "n_out": 5})
    layer = case.layer
    right = layer.backward

    def wrong(dy):
        dx = right(dy)
        layer.dW[0, 0] *= 1.001  # one entry off by 0.1%
        return dx

    dy = xp.asarray(np.random.default_rng(1).standard_normal((2, 3, 5)))
    case.forward()
    good = check_gradients(case.forward, lambda g: {"x": right(g)}, case.inputs, case.param_pairs(), dy)
    case.forward()
    bad = check_gradients(case.forward, lambda g: {"x": wrong(g)}, case.inputs, case.param_pairs(), dy)
    assert good.max_rel_error < 1e-8
    assert bad.max_rel_error > 1e-4
    assert bad.worst.name == "w" and bad.worst.index == (0, 0)


def test_checker_directional_mode_catches_a_wrong_backward(xp):
    case = linear_case(xp, np.float64, 0, {"B": 2, "T": 3, "n_in": 4, "n_out": 5})
    right = case.layer.backward
    dy = xp.asarray(np.random.default_rng(1).standard_normal((2, 3, 5)))
    case.forward()
    good = check_gradients(case.forward, lambda g: {"x": right(g)}, case.inputs, case.param_pairs(), dy,
                           directions=4)
    case.forward()
    bad = check_gradients(case.forward, lambda g: {"x": 1.01 * right(g)}, case.inputs, case.param_pairs(), dy,
                          directions=4)
    assert good.max_rel_error < 1e-8 and good.checked["x"] == 4
    assert bad.max_rel_error > 1e-3 and bad.worst.name == "x"


def test_relu_gradient_at_exactly_zero_is_zero(xp):
    """minitensor.layers.relu's rule: at the kink x = 0 the derivative is taken as 0 (dy where x > 0),
    for -0.0 too, through the layer and on each backend's ReLU and fused bias + ReLU (where h = x + b
    is exactly 0)."""
    x = xp.asarray([-1.0, -0.0, 0.0, 1e-300, 2.0])
    dy = xp.asarray([3.0, 5.0, 7.0, 11.0, 13.0])
    want = [0.0, 0.0, 0.0, 11.0, 13.0]
    b = xp.asarray([0.5, 0.25, -0.25, 1.5, 0.5])
    for ops in all_ops(xp):
        assert to_numpy(ops.relu_backward(x, dy)).tolist() == want, ops
        dx, y = ops.relu_backward(x, dy, recompute_output=True)
        assert to_numpy(dx).tolist() == want and to_numpy(y).tolist() == [0.0, 0.0, 0.0, 1e-300, 2.0], ops
        h = xp.asarray([-1.0, 0.0, 0.0, 0.25, 2.0])  # x - b exactly, so that x + b is h again
        assert to_numpy(ops.bias_relu_backward(h - b, b, dy)).tolist() == [0.0, 0.0, 0.0, 11.0, 13.0], ops
        relu = ReLU(ops=ops)
        relu.forward(x)
        assert to_numpy(relu.backward(dy)).tolist() == want, ops


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("prompt", [1, 4])
def test_attention_with_a_kv_cache_equals_the_full_forward(xp, prompt, residual):
    """forward_kv, the inference path: a prompt, then one token at a time attending over the keys
    and values it cached (in a cache longer than the sequence, as a model's is), gives the training
    forward's rows, with the block's residual too."""
    d = {"B": 2, "T": 7, "C": 8, "n_head": 2}
    case = attention_case(xp, np.float64, 4, d)
    x, layer = case.inputs["x"], case.layer
    r = xp.asarray(np.random.default_rng(5).standard_normal(x.shape)) if residual else None
    full = to_numpy(layer.forward(x, residual=r))
    cache = tuple(xp.zeros((2, 2, d["T"] + 3, 4)) for _ in range(2))  # (B, n_head, context, hs)
    rows = [layer.forward_kv(x[:, :prompt], cache, 0, residual=None if r is None else r[:, :prompt])]
    for t in range(prompt, d["T"]):
        rows.append(layer.forward_kv(x[:, t:t + 1], cache, t, residual=None if r is None else r[:, t:t + 1]))
    np.testing.assert_allclose(np.concatenate([to_numpy(a) for a in rows], axis=1), full, rtol=1e-12, atol=1e-12)


def test_backward_without_forward_raises(xp):
    with pytest.raises(RuntimeError, match="without a forward"):
        GELU().backward(xp.ones(3))


@settings(max_examples=6)
@given(seed=S.seeds, d=S.attention_dims(), V=S.vocab)
def test_small_stack_end_to_end(xp, seed, d, V):
    """embedding + position + one pre-norm block + final norm + tied head + loss, every parameter.

    C >= 4: with 2 or 3 features, random residual rows can be nearly constant, and LayerNorm's
    curvature there (rstd up to 1/sqrt(eps)) outgrows any finite-difference step; the LayerNorm
    case itself covers C = 1..3 on well-conditioned rows.
    """
    rng = np.random.default_rng(seed)
    B, T, nh = d["B"], d["T"], d["n_head"]
    C = nh * max(2, -(-4 // nh), d["C"] // nh)
    shapes = {"wte": (V, C), "wpe": (T, C), "ln1.w": (C,), "ln1.b": (C,), "attn.w": (C, 3 * C),
              "attn.b": (3 * C,), "proj.w": (C, C), "proj.b": (C,), "ln2.w": (C,), "ln2.b": (C,),
              "fc.w": (C, 4 * C), "fc.b": (4 * C,), "fcp.w": (4 * C, C), "fcp.b": (C,), "lnf.w": (C,), "lnf.b": (C,)}
    p = Params(shapes, xp=xp, dtype=np.float64)
    for name, view in p.items():
        base = 1.0 if name.endswith(".w") and name.startswith("ln") else 0.0
        view[...] = xp.asarray(base + 0.3 * rng.standard_normal(view.shape))

    ops = get_ops(xp)

    def lin(n):
        return Linear(p[n + ".w"], p.grad(n + ".w"), p[n + ".b"], p.grad(n + ".b"), ops=ops)

    def ln(n):
        return LayerNorm(p[n + ".w"], p.grad(n + ".w"), p[n + ".b"], p.grad(n + ".b"), ops=ops)

    wte, wpe = Embedding(p["wte"], p.grad("wte"), ops=ops), PositionEmbedding(p["wpe"], p.grad("wpe"), ops=ops)
    ln1, attn, ln2, fc, gelu, fcp, lnf = ln("ln1"), CausalSelfAttention(lin("attn"), lin("proj"), nh, ops=ops), \
        ln("ln2"), lin("fc"), GELU(ops=ops), lin("fcp"), ln("lnf")
    head, loss = TiedHead(p["wte"], p.grad("wte"), ops=ops), SoftmaxCrossEntropy(ops=ops)
    idx = xp.asarray(rng.integers(0, V, (B, T)))
    targets = xp.asarray(rng.integers(0, V, (B, T)))

    def forward():
        x = wte.forward(idx) + wpe.forward(B, T)
        x = x + attn.forward(ln1.forward(x))
        x = x + fcp.forward(gelu.forward(fc.forward(ln2.forward(x))))
        return loss.forward(head.forward(lnf.forward(x)), targets)

    def backward(dloss):
        dx = lnf.backward(head.backward(loss.backward(dloss)))
        dx = dx + ln2.backward(fc.backward(gelu.backward(fcp.backward(dx))))
        dx = dx + ln1.backward(attn.backward(dx))
        wte.backward(dx)
        wpe.backward(dx)
        return {}

    forward()
    pairs = {n: (p[n], p.grad(n)) for n in p.names()}
    # on CuPy every perturbed entry would cost a host read: random directions there instead
    report = check_gradients(forward, backward, {}, pairs, 1.0, directions=None if xp is np else 6)
    assert report.max_rel_error <= 1e-6, report


def test_linear_epilogue_row_blocks_add_bias_and_residual(xp, monkeypatch):
    from minitensor.backends.cpu import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "EPILOGUE_BLOCK", 5)  # 5 // 3 = 1 row per block, and an odd count of rows
    ops = get_ops(xp)
    rng = np.random.default_rng(3)
    y, b, r = (xp.asarray(rng.standard_normal(s)) for s in ((7, 3), (3,), (7, 3)))
    want = to_numpy(y) + to_numpy(b) + to_numpy(r)
    ops.add_epilogue(y, b, r)
    np.testing.assert_allclose(to_numpy(y), want, rtol=1e-15)
    ops.add_epilogue(y, None, r)
    np.testing.assert_allclose(to_numpy(y), want + to_numpy(r), rtol=1e-15)
