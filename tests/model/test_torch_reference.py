"""andrea's hand-derived backprop against PyTorch autograd on the same weights, in float64.

The loss, the logits and every parameter gradient (the tied wte included: lookup and head together)
must agree to rounding. PyTorch comes with the `reference` extra; without it this file is skipped (never in CI).
"""

import numpy as np
import pytest
from optional import require  # noqa: E402

torch = require("torch")

from andrea import ANDREA, ModelConfig  # noqa: E402
from andrea.interop.torch_reference import build_torch_model, load_andrea_state, torch_grads  # noqa: E402

CFG = dict(vocab_size=37, context_length=8, d_model=12, n_layer=2, n_head=3)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _pair(seed, sdpa=False):
    """An andrea model with weights moved off the symmetric init, and a torch model holding the same."""
    m = ANDREA(ModelConfig(**CFG), device="cpu", dtype="float64", seed=seed)
    rng = np.random.default_rng(seed)
    for _, view in m.named_parameters():  # so LayerNorm gains and biases matter too
        view += rng.normal(0, 0.3, view.shape)
    t = build_torch_model(m.cfg, dtype="float64", sdpa=sdpa)
    load_andrea_state(t, m.state_dict())
    return m, t, rng


@pytest.mark.parametrize("seed,B,T", [(0, 3, 8), (1, 2, 5)])
def test_loss_and_every_gradient_match_pytorch_autograd(seed, B, T):
    m, t, rng = _pair(seed)
    idx = rng.integers(0, CFG["vocab_size"], (B, T))
    idx[0, :3] = 7  # repeated ids: the embedding gradient must scatter-add
    targets = rng.integers(0, CFG["vocab_size"], (B, T))

    loss = m.forward(idx, targets)
    m.zero_grad()
    m.backward()
    grads = {name: np.array(g) for name, g in m.named_grads()}

    t_loss = t(torch.from_numpy(idx), torch.from_numpy(targets))
    t_loss.backward()
    t_grads = torch_grads(t)

    assert abs(loss - t_loss.item()) <= 1e-12 * abs(t_loss.item())
    assert set(grads) == set(t_grads)
    errors = {name: _rel(grads[name], t_grads[name]) for name in t_grads}
    bad = {name: e for name, e in errors.items() if not e <= 1e-10}
    assert not bad, f"gradients differ from torch autograd (max relative error): {bad}"


def test_logits_match_pytorch():
    m, t, rng = _pair(2)
    idx = rng.integers(0, CFG["vocab_size"], (2, 8))
    logits = np.asarray(m.forward(idx))
    with torch.no_grad():
        t_logits = t(torch.from_numpy(idx)).numpy()
    assert logits.shape == t_logits.shape == (2, 8, CFG["vocab_size"])
    assert _rel(logits, t_logits) <= 1e-12


def test_fused_attention_path_matches_the_explicit_one():
    m, t, rng = _pair(3)
    t_sdpa = build_torch_model(m.cfg, dtype="float64", sdpa=True)
    load_andrea_state(t_sdpa, m.state_dict())
    idx = torch.from_numpy(rng.integers(0, CFG["vocab_size"], (2, 8)))
    with torch.no_grad():
        assert _rel(t_sdpa(idx).numpy(), t(idx).numpy()) <= 1e-12


def test_torch_names_and_shapes_are_andreas():
    m = ANDREA(ModelConfig(**CFG), device="cpu")
    t = build_torch_model(m.cfg)
    assert {n: tuple(p.shape) for n, p in t.named_parameters()} == {n: v.shape for n, v in m.named_parameters()}
