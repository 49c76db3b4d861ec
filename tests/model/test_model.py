"""The ANDREA model: exact parameter count, the whole model against finite differences, overfitting,
AdamW against a hand-computed step, the LR schedule, and the key/value cache against the full forward.
"""

import math

import numpy as np
import pytest
import strategies as S
from hypothesis import given, settings

from andrea import ANDREA, AdamW, ModelConfig
from andrea.errors import UserError
from andrea.model.sizes import param_shapes, parameter_breakdown
from minitensor.checks.gradcheck import check_gradients
from minitensor.device import to_numpy

TINY = dict(vocab_size=13, context_length=8, d_model=6, n_layer=2, n_head=2)


def test_andrea_120m_has_exactly_92_331_264_parameters():
    cfg = ModelConfig(vocab_size=8449, context_length=1024, d_model=768, n_layer=12, n_head=12)
    parts = parameter_breakdown(cfg)
    assert parts["total"] == 92_331_264
    assert sum(math.prod(s) for s in param_shapes(cfg).values()) == 92_331_264
    assert parts["token embedding (tied with the output head)"] == 6_488_832
    assert parts["position embedding"] == 786_432
    assert parts["final LayerNorm"] == 1_536
    assert [v for k, v in parts.items() if "blocks" in k] == [85_054_464]


def test_parameter_names_and_shapes_follow_gpt2():
    m = ANDREA(ModelConfig(**TINY), device="cpu")
    params = dict(m.named_parameters())
    assert params["transformer.h.1.attn.c_attn.weight"].shape == (6, 18)
    assert params["transformer.h.0.mlp.c_proj.weight"].shape == (24, 6)
    assert params["transformer.wpe.weight"].shape == (8, 6)
    assert "lm_head.weight" not in params  # tied to wte
    assert m.num_parameters() == parameter_breakdown(m.cfg)["total"]


def test_initialisation_follows_gpt2():
    cfg = ModelConfig(vocab_size=300, context_length=64, d_model=64, n_layer=4, n_head=4)
    p = dict(ANDREA(cfg, device="cpu", seed=3).named_parameters())
    assert abs(p["transformer.wte.weight"].std() - 0.02) < 0.001
    assert abs(p["transformer.h.0.mlp.c_proj.weight"].std() - 0.02 / math.sqrt(8)) < 0.0005
    assert np.all(p["transformer.h.2.ln_1.weight"] == 1) and np.all(p["transformer.h.2.attn.c_attn.bias"] == 0)


def whole_model_gradient_report(m, idx, targets, xp):
    """Every parameter's gradient of the model's loss on (idx, targets) against central finite
    differences (float64 models); on CuPy along 6 random directions, so no host read per entry."""
    pairs = {n: (m.params[n], m.params.grad(n)) for n in m.params.names()}

    def backward(dloss):
        m.backward(dloss)
        return {}

    m.loss(idx, targets)
    return check_gradients(lambda: m.loss(idx, targets), backward, {}, pairs, 1.0,
                           directions=None if xp is np else 6)


def assert_float32_follows_float64(cfg, backend, idx, targets):
    """The same model (seed 5) in float32 and in float64: loss within 1e-6 relative, every gradient
    within 1e-3 relative (1e-6 absolute)."""
    grads = {}
    for dtype in ("float32", "float64"):
        m = ANDREA(cfg, **backend.args, dtype=dtype, seed=5)
        loss = m.forward(idx, targets)
        m.zero_grad()
        m.backward()
        grads[dtype] = (loss, to_numpy(m.params.grads).astype(np.float64))
    assert grads["float32"][0] == pytest.approx(grads["float64"][0], rel=1e-6)
    np.testing.assert_allclose(grads["float32"][1], grads["float64"][1], rtol=1e-3, atol=1e-6)


@settings(max_examples=2)
@given(seed=S.seeds, B=S.batch, T=S.time)
def test_whole_model_gradients_match_finite_differences(model_backend, seed, B, T):
    m = ANDREA(ModelConfig(**TINY), **model_backend.args, dtype="float64", seed=seed)
    rng = np.random.default_rng(seed)
    for _, view in m.named_parameters():  # move off the symmetric init so every path matters
        view += model_backend.xp.asarray(rng.normal(0, 0.3, view.shape))
    idx, targets = rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T))
    report = whole_model_gradient_report(m, idx, targets, model_backend.xp)
    assert report.max_rel_error <= 1e-6, report
    assert len(report.checked) == len(m.params.names())


def test_the_open_epilogues_give_the_bits_of_block_forward(model_backend, monkeypatch):
    """The trunk joins each residual in the norm after it (Block.forward_open, Norm.forward_joined) and
    sums c_proj's bias gradients in the norms' backward (Norm.backward_and_sum_skip): the loss and every
    gradient bit for bit those of Block.forward and Linear's own bias gradients, which a block recording its
    flow (or any block that is not pre-norm with residuals) still runs, on each backend; except, where the
    fused kernels run, c_proj's bias gradients, which layernorm_bwd sums in chunks of rows where cuBLAS's
    GEMV summed them in its own order: those within float32's rounding of the same sum."""
    from andrea.model.block import Block

    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layer=2, n_head=2)
    rng = np.random.default_rng(4)
    x = rng.integers(0, 50, (2, 17))
    runs = []
    for opens in (True, False):
        if not opens:
            monkeypatch.setattr(Block, "opens", property(lambda self: False))
            monkeypatch.setattr(Block, "backward", _backward_with_linear_bias_grads)
        m = ANDREA(cfg, **model_backend.args, seed=0)
        loss = m.forward(x[:, :-1], x[:, 1:])
        m.zero_grad()
        m.backward()
        runs.append((loss, to_numpy(m.params.grads).copy()))
    assert runs[0][0] == runs[1][0]
    reordered = np.zeros(runs[0][1].shape, bool)
    if model_backend.kernels == "fused":
        for name in m.params.names():
            if name.endswith("c_proj.bias"):
                start = m.params.offsets[name]
                reordered[start:start + int(np.prod(m.params.shapes[name]))] = True
    np.testing.assert_array_equal(runs[0][1][~reordered], runs[1][1][~reordered])
    np.testing.assert_allclose(runs[0][1][reordered], runs[1][1][reordered], rtol=1e-5, atol=1e-7)


def _backward_with_linear_bias_grads(self, dx2):
    """Block.backward as before the norms summed c_proj's bias gradients: each Linear its own."""
    dx1 = self.ln_2.backward(self.mlp.backward(dx2), skip=dx2)
    return self.ln_1.backward(self.attn.backward(dx1), skip=dx1)


def test_overfits_one_batch(model_backend):
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layer=2, n_head=2)
    m = ANDREA(cfg, **model_backend.args, seed=0)
    opt = AdamW(m, lr=2e-2, weight_decay=0.0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (2, 17))
    first = m.forward(x[:, :-1], x[:, 1:])
    # on NumPy the loss goes 3.933 -> 0.14 at step 20 -> 0.012 at step 30 (at lr 1e-2 and 4 sequences: 0.46,
    # then 0.06; the fused stand-in emulates the flash kernels thread by thread, so sequences and steps are few)
    for _ in range(30):
        loss = m.forward(x[:, :-1], x[:, 1:])
        m.zero_grad()
        m.backward()
        opt.step()
    assert loss < first / 100, (first, loss)


def test_adamw_step_equals_a_hand_computed_one():
    m = ANDREA(ModelConfig(**TINY), device="cpu", dtype="float64", seed=1)
    rng = np.random.default_rng(1)
    before = {n: v.copy() for n, v in m.named_parameters()}
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.9, 1e-8, 0.5
    opt = AdamW(m, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    grads = []
    for _ in (1, 2):
        g = {n: rng.standard_normal(v.shape) for n, v in m.named_parameters()}
        for n, view in m.named_grads():
            view[...] = g[n]
        grads.append(g)
        opt.step()
    for n, p0 in before.items():
        decay = wd if p0.ndim >= 2 else 0.0
        p, mom, vel = p0.copy(), 0.0, 0.0
        for t, g in enumerate(grads, start=1):
            mom = b1 * mom + (1 - b1) * g[n]
            vel = b2 * vel + (1 - b2) * g[n] ** 2
            p = p * (1 - lr * decay) - lr * (mom / (1 - b1 ** t)) / (np.sqrt(vel / (1 - b2 ** t)) + eps)
        np.testing.assert_allclose(dict(m.named_parameters())[n], p, rtol=1e-12, atol=1e-14, err_msg=n)
    ln_w = before["transformer.ln_f.weight"]  # 1-D: no decay, so a zero gradient leaves it unchanged
    assert ln_w.ndim == 1


def test_adamw_decays_matrices_but_not_vectors():
    m = ANDREA(ModelConfig(**TINY), device="cpu", dtype="float64")
    opt = AdamW(m, lr=0.1, weight_decay=0.5)
    before = {n: v.copy() for n, v in m.named_parameters()}
    m.zero_grad()
    opt.step()  # zero gradients: only the decay moves anything
    after = dict(m.named_parameters())
    np.testing.assert_allclose(after["transformer.wte.weight"], before["transformer.wte.weight"] * 0.95)
    np.testing.assert_array_equal(after["transformer.ln_f.weight"], before["transformer.ln_f.weight"])
    np.testing.assert_array_equal(after["transformer.h.0.attn.c_attn.bias"], before["transformer.h.0.attn.c_attn.bias"])


def test_grad_scale_equals_scaled_gradients():
    a = ANDREA(ModelConfig(**TINY), device="cpu", dtype="float64")
    b = ANDREA(ModelConfig(**TINY), device="cpu", dtype="float64")
    g = np.random.default_rng(0).standard_normal(a.params.grads.shape)
    a.params.grads[...] = g
    b.params.grads[...] = 0.25 * g
    AdamW(a).step(grad_scale=0.25)
    AdamW(b).step()
    np.testing.assert_allclose(a.params.data, b.params.data, rtol=1e-13)
    assert b.ops.global_norm(b.params.grads) == pytest.approx(0.25 * np.linalg.norm(g), rel=1e-12)


@pytest.mark.parametrize("prompt_len", [1, 5, 8])
def test_kv_cache_logits_equal_the_full_forward(model_backend, prompt_len):
    m = ANDREA(ModelConfig(**TINY), **model_backend.args, dtype="float64", seed=2)
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 13, (2, 8))
    full = to_numpy(m.forward(idx))
    cache = m.new_kv_cache(batch_size=2)
    step_logits = [to_numpy(m.forward_kv(idx[:, :prompt_len], cache, 0))]
    for t in range(prompt_len, 8):
        step_logits.append(to_numpy(m.forward_kv(idx[:, t:t + 1], cache, t)))
    np.testing.assert_allclose(step_logits[0], full[:, prompt_len - 1], rtol=1e-10, atol=1e-12)
    for k, t in enumerate(range(prompt_len, 8), start=1):
        np.testing.assert_allclose(step_logits[k], full[:, t], rtol=1e-10, atol=1e-12)


def test_bad_inputs_are_refused():
    m = ANDREA(ModelConfig(**TINY), device="cpu")
    with pytest.raises(UserError, match="id 13, outside"):
        m.forward(np.array([[1, 13]]))
    with pytest.raises(UserError, match="9 positions; the context length is 8"):
        m.forward(np.zeros((1, 9), dtype=int))
    with pytest.raises(UserError, match="must be integers"):
        m.forward(np.zeros((1, 2)))
    with pytest.raises(UserError, match="divisible by model.n_head"):
        ModelConfig(d_model=10, n_head=3)


def test_float32_model_matches_float64(model_backend):
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 13, (2, 8)), rng.integers(0, 13, (2, 8))
    assert_float32_follows_float64(ModelConfig(**TINY), model_backend, idx, targets)
