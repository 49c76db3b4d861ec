"""The variants of the block (model.norm_position, model.norm, model.residual, model.activation,
model.mlp_ratio): each whole model against finite differences in float64 and float32 against
float64, the key/value cache against the full forward, the defaults unchanged, the old spelling of
the norm's position still read, and the Hugging Face export refusing what is not GPT-2.
"""

import re

import numpy as np
import pytest
import strategies as S
from hypothesis import given, settings
from test_model import assert_float32_follows_float64, whole_model_gradient_report

from andrea import ANDREA, ModelConfig
from andrea.config import load_config
from andrea.errors import UserError, one_of
from andrea.model.block import NORMS
from andrea.model.sizes import parameter_breakdown
from minitensor.device import to_numpy
from minitensor.layers.layernorm import LayerNorm

TINY = dict(vocab_size=13, context_length=8, d_model=6, n_layer=2, n_head=2)
VARIANTS = {
    "post-norm": dict(norm_position="post"),
    "no-residual": dict(residual=False),
    "post-norm-no-residual": dict(norm_position="post", residual=False),
    "relu": dict(activation="relu"),
    "post-norm-relu": dict(norm_position="post", activation="relu"),
    "mlp-ratio-2": dict(mlp_ratio=2),
    "swiglu": dict(activation="swiglu"),
    "post-norm-swiglu": dict(norm_position="post", activation="swiglu"),
    "no-norm": dict(norm_position="none"),
    "no-norm-no-residual": dict(norm_position="none", residual=False),
    "no-norm-swiglu": dict(norm_position="none", activation="swiglu"),
    # every other kind of norm, pre-norm (the position is apart from the kind)
    **{f"norm={kind}": dict(norm=kind) for kind in NORMS if kind != "layernorm"},
}
variants = pytest.mark.parametrize("variant", sorted(VARIANTS))
# finite differences move a pre-activation by far less than this (see tests/support/layer_cases.py)
KINK_MARGIN = 5e-3


def perturbed_model(backend, variant, seed, B, T, dtype="float64"):
    """A tiny model of the variant, its weights moved off the symmetric init, and a batch; for ReLU,
    redrawn until no MLP pre-activation sits within KINK_MARGIN of the kink."""
    cfg = ModelConfig(**TINY, **VARIANTS[variant])
    for attempt in range(200):
        rng = np.random.default_rng(seed + 7919 * attempt)
        m = ANDREA(cfg, **backend.args, dtype=dtype, seed=seed)
        for _, view in m.named_parameters():
            view += backend.xp.asarray(rng.normal(0, 0.3, view.shape))
        idx, targets = rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T))
        if cfg.activation != "relu":
            return m, idx, targets
        m.loss(idx, targets)
        # ReLU's pre-activation h + b_fc (Ops.bias_relu_forward leaves c_fc's output h as it is)
        margin = min(float(abs(to_numpy(b.mlp._cache.h + b.mlp.c_fc.b)).min()) for b in m.blocks)
        m.backward()  # drops the caches
        m.zero_grad()
        if margin > KINK_MARGIN:
            return m, idx, targets
    raise AssertionError("no draw off ReLU's kink")


@variants
@settings(max_examples=2)
@given(seed=S.seeds, B=S.batch, T=S.time)
def test_variant_gradients_match_finite_differences(model_backend, variant, seed, B, T):
    if VARIANTS[variant].get("activation") == "relu":
        B, T = 1, min(T, 3)  # fewer pre-activations, so a draw clear of the kink comes quickly
    m, idx, targets = perturbed_model(model_backend, variant, seed, B, T)
    report = whole_model_gradient_report(m, idx, targets, model_backend.xp)
    assert report.max_rel_error <= 1e-6, report
    assert len(report.checked) == len(m.params.names())


@variants
def test_variant_float32_matches_float64(model_backend, variant):
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 13, (2, 8)), rng.integers(0, 13, (2, 8))
    assert_float32_follows_float64(ModelConfig(**TINY, **VARIANTS[variant]), model_backend, idx, targets)


@variants
def test_variant_kv_cache_equals_the_full_forward(variant):
    m = ANDREA(ModelConfig(**TINY, **VARIANTS[variant]), device="cpu", dtype="float64", seed=2)
    idx = np.random.default_rng(1).integers(0, 13, (1, 8))
    full = m.logits(idx)
    cache = m.new_kv_cache()
    first = m.forward_kv(idx[:, :5], cache, 0)
    np.testing.assert_allclose(first, full[:, 4], rtol=1e-10, atol=1e-12)
    for t in range(5, 8):
        np.testing.assert_allclose(m.forward_kv(idx[:, t:t + 1], cache, t), full[:, t], rtol=1e-10, atol=1e-12)


def test_variants_change_the_computation_but_not_the_parameters():
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 13, (2, 8))
    base = ANDREA(ModelConfig(**TINY), dtype="float64", seed=1)
    for variant, extra in VARIANTS.items():
        m = ANDREA(ModelConfig(**TINY, **extra), dtype="float64", seed=1)
        assert not np.allclose(m.logits(idx), base.logits(idx)), variant
        # not GPT-2's parameters: a wider MLP, SwiGLU's c_fc twice as wide, no norms, a norm without a bias
        reshaped = ("mlp_ratio" in extra or extra.get("activation") == "swiglu"
                    or extra.get("norm_position") == "none" or NORMS[extra.get("norm", "layernorm")].params
                    != LayerNorm.params)
        if not reshaped:
            assert m.num_parameters() == base.num_parameters()
            assert [n for n, _ in m.named_parameters()] == [n for n, _ in base.named_parameters()]
    wide = ModelConfig(**TINY, mlp_ratio=2)
    assert wide.mlp_dim == 12 and parameter_breakdown(wide)["total"] == ANDREA(wide).num_parameters()


def test_defaults_are_andrea():
    cfg = load_config("120m").model
    assert (cfg.norm, cfg.norm_position, cfg.residual, cfg.activation, cfg.mlp_ratio, cfg.mlp_dim) == (
        "layernorm", "pre", True, "gelu", 4, 3072)
    assert cfg.is_gpt2 and cfg.variant() == ""
    assert parameter_breakdown(cfg)["total"] == 92_331_264


def test_a_post_norm_block_normalises_its_output():
    m = ANDREA(ModelConfig(**TINY, norm_position="post"), dtype="float64", seed=1)
    x = np.random.default_rng(0).standard_normal((2, 8, 6)) * 5
    y = m.blocks[0].forward(x)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-12)  # ln_2 is last, with w = 1, b = 0 at init
    np.testing.assert_allclose(y.std(axis=-1), 1, rtol=1e-3)


@pytest.mark.parametrize("override, message", [
    ("model.norm=middle", re.escape(f"model.norm must be {one_of(NORMS)} (where it goes is model.norm_position: "
                                    "pre, post or none), got 'middle'")),
    ("model.norm_position=middle", "model.norm_position must be pre, post or none, got 'middle'"),
    ("model.norm=LayerNorm", re.escape(f"model.norm must be {one_of(NORMS)} (")),
    ("model.activation=tanh", "model.activation must be gelu, relu or swiglu, got 'tanh'"),
    ("model.activation=SwiGLU", "model.activation must be gelu, relu or swiglu"),
    ("model.residual=maybe", "model.residual must be true or false"),
    ("model.mlp_ratio=0", "model.mlp_ratio must be positive"),
    ("model.mlp_ratio=0.3", "must be a whole number"),
])
def test_bad_variants_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        load_config("tiny", [override])


def test_mlp_ratio_and_mlp_dim_must_agree():
    assert load_config("120m", ["model.mlp_dim=1536"]).model.mlp_ratio == 2
    with pytest.raises(UserError, match="disagree"):
        load_config("120m", ["model.mlp_ratio=2"])  # the 120m YAML gives mlp_dim 3072
    assert load_config("tiny", ["model.mlp_ratio=2"]).model.mlp_dim == 2 * load_config("tiny").model.d_model


@pytest.mark.parametrize("extra, named", [(dict(norm_position="post"), "norm_position=post"),
                                          (dict(residual=False), "residual=false"),
                                          (dict(activation="relu"), "activation=relu"),
                                          (dict(activation="swiglu"), "activation=swiglu"),
                                          (dict(norm_position="none"), "norm_position=none"),
                                          *[(dict(norm=kind), rf"\(norm={kind}\), not GPT-2")
                                            for kind in NORMS if kind != "layernorm"]])
def test_hf_export_refuses_variants_by_name(tmp_path, extra, named):
    m = ANDREA(ModelConfig(**TINY, **extra))
    with pytest.raises(UserError, match=named):
        m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_hf_export_keeps_a_wider_mlp(tmp_path):
    m = ANDREA(ModelConfig(**TINY, mlp_ratio=2))
    m.save_pretrained(tmp_path / "hf")
    back = ANDREA.from_pretrained(tmp_path / "hf")
    assert back.cfg.mlp_dim == 12


def test_swiglu_at_8_3_matches_gelu_at_4x_in_parameters():
    """SwiGLU's default width is 8/3 d_model, rounded: its MLP's 3 C F weights against GELU's 8 C^2."""
    for d_model in (6, 64, 128, 768):
        gelu = ModelConfig(**{**TINY, "d_model": d_model, "n_head": 2})
        swiglu = ModelConfig(**{**TINY, "d_model": d_model, "n_head": 2, "activation": "swiglu"})
        assert swiglu.mlp_dim == round(8 * d_model / 3)
        n_gelu, n_swiglu = (parameter_breakdown(c)["total"] for c in (gelu, swiglu))
        assert abs(n_swiglu - n_gelu) <= 3 * d_model * TINY["n_layer"], (d_model, n_gelu, n_swiglu)
        assert n_swiglu == ANDREA(swiglu).num_parameters()
    assert ModelConfig(**TINY, activation="swiglu", mlp_dim=5).mlp_dim == 5          # a width given is kept
    assert ANDREA(ModelConfig(**TINY, activation="swiglu", mlp_dim=5)).params.shapes[
        "transformer.h.0.mlp.c_fc.weight"] == (6, 10)                                 # gate and value halves


def test_no_norm_has_no_layernorm_anywhere():
    cfg = ModelConfig(**TINY, norm_position="none")
    m = ANDREA(cfg, dtype="float64", seed=1)
    assert not [n for n, _ in m.named_parameters() if ".ln_" in n]
    assert parameter_breakdown(cfg)["total"] == m.num_parameters()
    assert m.num_parameters() == ANDREA(ModelConfig(**TINY)).num_parameters() - (2 * 2 + 1) * 2 * 6
    x = np.random.default_rng(0).standard_normal((2, 8, 6)) * 5
    block = m.blocks[0]
    y = block.forward(x)  # x + attn(x) + mlp(...): the stream's scale is kept, not normalised
    np.testing.assert_allclose(y, x + block.attn.infer(x) + block.mlp.infer(x + block.attn.infer(x)),
                               rtol=1e-12, atol=1e-12)
    assert float(np.abs(y.std(axis=-1) - 1).max()) > 1


def test_odd_widths_are_refused_by_swiglu():
    from minitensor.layers.swiglu import SwiGLU

    with pytest.raises(ValueError, match="even last axis"):
        SwiGLU().forward(np.ones((2, 5)))


@pytest.mark.parametrize("old", ["pre", "post", "none"])
def test_the_old_model_norm_is_read_as_the_position_of_a_layernorm(old):
    """Before the kind was apart, model.norm was the position: a config (or a checkpoint's) saying
    norm: post means norm_position post with a LayerNorm, and is saved again in the new spelling."""
    cfg = load_config("tiny", [f"model.norm={old}"])
    assert (cfg.model.norm, cfg.model.norm_position) == ("layernorm", old)
    assert {k: cfg.to_dict()["model"][k] for k in ("norm", "norm_position")} == {"norm": "layernorm",
                                                                                "norm_position": old}
    assert load_config("tiny", [f"model.norm={old}", f"model.norm_position={old}"]).model.norm_position == old
    with pytest.raises(UserError, match=f"model.norm '{old}' is the old spelling of model.norm_position"):
        load_config("tiny", [f"model.norm={old}", f"model.norm_position={'pre' if old != 'pre' else 'post'}"])


def test_rmsnorm_has_a_weight_and_no_bias_and_divides_by_the_root_mean_square():
    cfg = ModelConfig(**TINY, norm="rms")
    m = ANDREA(cfg, dtype="float64", seed=1)
    norms = [n for n, _ in m.named_parameters() if ".ln_" in n]
    assert norms and all(n.endswith(".weight") for n in norms) and len(norms) == 2 * 2 + 1
    assert parameter_breakdown(cfg)["final RMSNorm"] == 6 and parameter_breakdown(cfg)["total"] == m.num_parameters()
    x = np.random.default_rng(0).standard_normal((2, 8, 6)) * 5 + 3
    y = m.ln_f.forward(x)                           # w = 1 at init: y = x / rms(x), its mean kept
    np.testing.assert_allclose(np.sqrt((y * y).mean(axis=-1)), 1, rtol=1e-6)
    np.testing.assert_allclose(y * np.sqrt((x * x).mean(axis=-1, keepdims=True) + cfg.ln_eps), x, rtol=1e-12)
    assert type(m.blocks[0].ln_1).__name__ == "RMSNorm" and m.blocks[0].position == "pre"
