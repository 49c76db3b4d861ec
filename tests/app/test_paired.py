"""The statistics of the experiments' verdicts (andrea/experiments/paired.py): Student's t quantile,
the paired t-interval, where an interval lies, and how many seeds would settle an open one."""

import math
import statistics

import pytest
from optional import require

from andrea.experiments import paired

# two-sided 95% t multipliers from any printed table (e.g. NIST/SEMATECH e-Handbook, 1.3.6.7.2)
TABLE_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 29: 2.045}


@pytest.mark.parametrize("df, t", sorted(TABLE_95.items()))
def test_the_t_quantile_matches_the_printed_table(df, t):
    assert paired.t_quantile(0.95, df) == pytest.approx(t, abs=5e-4)


def test_the_t_quantile_matches_scipy_at_every_level_and_df():
    require("scipy")
    from scipy import stats
    for df in range(1, 80):
        for level in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999):
            assert paired.t_quantile(level, df) == pytest.approx(stats.t.ppf(0.5 + level / 2, df), rel=1e-9)
    assert paired.t_quantile(0.95, 2000) == pytest.approx(1.9612, abs=1e-4)  # near the normal's 1.960


def rows(arms):
    """Result rows as summarise makes them: {arm: [final val loss of seed 0, seed 1, ...]}."""
    return [{"arm": arm, "run": f"{arm}-seed{k}", "seed": k, "val_loss": v, "diverged": False}
            for arm, values in arms.items() for k, v in enumerate(values)]


def test_the_interval_is_the_paired_t_interval_of_the_per_seed_differences():
    a, b = [5.204, 5.206, 5.191], [5.544, 5.316, 5.239]  # SwiGLU against GELU, docs/experiments.md section 6
    iv = paired.paired(rows({"gelu": a, "swiglu": b}), "gelu", "swiglu")
    d = [y - x for x, y in zip(a, b)]
    half = 4.302653 * statistics.stdev(d) / math.sqrt(3)
    assert iv.seeds == [0, 1, 2] and iv.diffs == pytest.approx(d)
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((statistics.fmean(d), statistics.fmean(d) - half,
                                                     statistics.fmean(d) + half), abs=1e-6)
    assert paired.short(iv) == "+0.166 [-0.216, +0.548]"
    assert "positive in 3 of 3; mean +0.166, 95% t-interval [-0.216, +0.548]" in paired.words(iv)


def test_only_seeds_where_every_arm_ran_cleanly_are_paired():
    r = rows({"a": [5.0, 5.1, 5.2, 5.3], "b": [5.1, 5.2, math.nan, 5.4]})
    r[-1]["diverged"] = True  # b's seed 3 blew up: its loss measures the blow-up
    iv = paired.paired(r, "a", "b")
    assert iv.seeds == [0, 1] and iv.n == 2
    none = paired.paired(rows({"a": [5.0, 5.1]}), "a", "b")
    assert none.n == 0 and paired.directional(none) == "leaves open"
    assert paired.words(none) == "b - a: no finished run of b, so no difference is read"  # never "b nan"
    blown = rows({"a": [5.0, 5.1], "b": [9.0, 9.1]})
    for x in blown[2:]:
        x["diverged"] = True
    assert paired.short(paired.paired(blown, "a", "b")) == "every run of b diverged"


@pytest.mark.parametrize("diffs, directional, no_worse", [
    ([0.0, 0.0, 0.0], "leaves open", "supports"),                  # equal in every seed
    ([0.30, 0.32, 0.31], "supports", "contradicts"),               # clearly higher
    ([-0.30, -0.32, -0.31], "contradicts", "supports"),            # clearly lower
    ([0.01, -0.02, 0.015], "leaves open", "supports"),             # within the margin either way
    ([0.010, 0.011, 0.012], "supports", "supports"),               # one-signed and small, tight: decided
    ([0.340, 0.110, 0.048], "leaves open", "leaves open"),         # one-signed, wide: SwiGLU's seeds
    ([0.04, 0.06, 0.05], "supports", "leaves open"),               # around the margin itself
])
def test_where_the_interval_lies_decides(diffs, directional, no_worse):
    iv = paired.interval("b - a", range(len(diffs)), diffs)
    assert paired.directional(iv) == directional
    assert paired.no_worse(iv, 0.05) == no_worse


def test_one_seed_decides_nothing():
    iv = paired.interval("b - a", [0], [0.5])
    assert math.isnan(iv.lo) and paired.directional(iv) == "leaves open" == paired.no_worse(iv, 0.05)
    assert paired.seeds_to_settle(iv) is None and paired.short(iv) == "+0.500 (one seed: no interval)"


def test_seeds_to_settle_is_the_least_n_whose_half_width_clears_the_bound():
    iv = paired.interval("b - a", [0, 1, 2], [0.340, 0.110, 0.048])
    n = paired.seeds_to_settle(iv)
    half = [paired.t_quantile(0.95, k - 1) * iv.sd / math.sqrt(k) for k in (n - 1, n)]
    assert half[0] >= iv.mean > half[1] and n == 6
    assert paired.seeds_to_settle(iv, 0.05) == 10  # to clear the margin above the mean's 0.166 - 0.05
    assert "about 6 seeds in all would clear 0" in paired.settle_words(iv) and "(3 more)" in paired.settle_words(iv)
    tiny = paired.interval("b - a", [0, 1, 2], [0.077, -0.025, -0.030])  # GELU against ReLU
    assert paired.seeds_to_settle(tiny) == paired.MOST_SEEDS + 1
    assert f"more than {paired.MOST_SEEDS} seeds" in paired.settle_words(tiny)
    flat = paired.interval("b - a", [0, 1, 2], [0.0, 0.0, 0.0])
    assert paired.seeds_to_settle(flat) is None and "the mean lies on it" in paired.settle_words(flat)
    settled = paired.interval("b - a", [0, 1], [1.0, 1.1])  # two seeds, already clear of 0
    assert settled.lo > 0 and paired.seeds_to_settle(settled) == 2


def test_seeds_to_settle_a_mean_below_its_bound_is_counted_as_one_above_it():
    """The distance from the mean to the bound, on either side (issue 48: a mutant that read only a
    mean above its bound survived every test): the mirror image of the differences needs as many
    seeds, and a mean under a margin gets the least n whose half-width clears the margin."""
    iv = paired.interval("b - a", [0, 1, 2], [0.340, 0.110, 0.048])
    mirrored = paired.interval("a - b", [0, 1, 2], [-0.340, -0.110, -0.048])
    assert paired.seeds_to_settle(mirrored) == paired.seeds_to_settle(iv) == 6
    assert "about 6 seeds in all would clear 0" in paired.settle_words(mirrored)
    n = paired.seeds_to_settle(iv, 0.3)  # the mean 0.166 lies 0.134 under the margin 0.3
    half = [paired.t_quantile(0.95, k - 1) * iv.sd / math.sqrt(k) for k in (n - 1, n)]
    assert half[0] >= 0.3 - iv.mean > half[1] and n == 8
    assert paired.seeds_to_settle(mirrored, -0.3) == 8
