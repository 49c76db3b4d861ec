"""andrea.probe: the logit lens at the top of the stack is the model's own loss, and the attention
statistics of heads whose attention is known (uniform over the prefix)."""

import numpy as np
import pytest

from andrea import ANDREA, ModelConfig
from andrea.errors import UserError
from andrea.model.block import NORMS
from andrea.probe import attention_stats, lens_losses, norm_stats, windows_of

TINY = dict(vocab_size=29, context_length=9, d_model=8, n_layer=3, n_head=2)


@pytest.mark.parametrize("variant", [{}, {"norm_position": "none"}, {"activation": "swiglu"}])
def test_the_lens_after_the_last_block_is_the_models_loss(variant):
    m = ANDREA(ModelConfig(**TINY, **variant), dtype="float64", seed=3)
    rng = np.random.default_rng(0)
    for _, view in m.named_parameters():
        view += rng.normal(0, 0.2, view.shape)
    x, y = rng.integers(0, 29, (3, 9)), rng.integers(0, 29, (3, 9))
    losses = lens_losses(m, x, y)
    assert len(losses) == 4
    np.testing.assert_allclose(losses[-1], m.forward(x, y), rtol=1e-10)
    assert len(set(losses)) == 4  # each depth predicts differently


@pytest.mark.parametrize("variant", [{}, {"norm_position": "post"}, {"norm_position": "none"},
                                     *({"norm": kind} for kind in NORMS if kind != "layernorm")])
def test_the_probe_reports_the_statistics_each_norm_has(variant):
    """Per block and norm, the mean over every token of each statistic the norm's kind has: a
    LayerNorm's mean and rstd (block 0's ln_1 by hand here: its input is the embeddings), none
    without norms."""
    cfg = ModelConfig(**TINY, **variant)
    m = ANDREA(cfg, dtype="float64", seed=3)
    x = np.random.default_rng(2).integers(0, 29, (2, 9))
    stats = norm_stats(m, x)
    names = [] if cfg.norm_position == "none" else list(NORMS[cfg.norm].stats)
    assert len(stats) == 3 and all(list(s[ln]) == names for s in stats for ln in ("ln_1", "ln_2"))
    if names == ["mean", "rstd"] and cfg.norm_position == "pre":
        h = m.wte.W[x] + m.wpe.W[:9]
        assert stats[0]["ln_1"]["mean"] == pytest.approx(h.mean(axis=-1).mean(), rel=1e-12)
        assert stats[0]["ln_1"]["rstd"] == pytest.approx((1 / np.sqrt(h.var(axis=-1) + cfg.ln_eps)).mean(), rel=1e-12)


def test_uniform_attention_has_the_distance_and_previous_share_of_a_uniform_prefix():
    m = ANDREA(ModelConfig(**TINY), dtype="float64", seed=3)
    for name, view in m.named_parameters():
        if "c_attn" in name:
            view[..., :2 * TINY["d_model"]] = 0                          # q = k = 0: every score equal
    T = 9
    distance, previous = attention_stats(m, np.random.default_rng(1).integers(0, 29, (2, T)))
    # position i attends 1/(i + 1) to each of 0..i: distance i / 2, previous share 1 / (i + 1)
    want_distance = np.mean([i / 2 for i in range(T)])
    want_previous = np.mean([1 / (i + 1) for i in range(1, T)])
    np.testing.assert_allclose(distance, np.full((3, 2), want_distance), rtol=1e-12)
    np.testing.assert_allclose(previous, np.full((3, 2), want_previous), rtol=1e-12)


def test_windows_spread_over_the_split_and_a_short_split_is_refused():
    ids = np.arange(100)
    x, y = windows_of(ids, 10, 4)
    assert x.shape == y.shape == (4, 10) and x[0, 0] == 0 and y[-1, -1] == 99
    np.testing.assert_array_equal(y, x + 1)
    with pytest.raises(UserError, match="fewer than one window"):
        windows_of(ids[:10], 10, 4)
