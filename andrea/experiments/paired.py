"""Paired verdicts: the per-seed differences between arms, their mean and a t-interval, and where
that interval lies.

Every arm of an experiment trains once per seed, and a seed gives every arm the same batches in
the same order and the same initial draws wherever the arms' shapes agree: the runs of one seed
are a pair (or a set), and what varies from seed to seed is shared by the arms of that seed. So a
claim that arm B ends lower than arm A is read from the differences d_k = A_k - B_k, one per seed
k, rather than from the two arms' means and ranges:

    mean  m = (1/n) sum d_k;   standard deviation  s = sqrt(sum (d_k - m)^2 / (n - 1))
    interval  m -+ t * s / sqrt(n),  t the 1 - (1 - LEVEL)/2 quantile of Student's t, n - 1 degrees of freedom

(the t-interval, which assumes the differences scatter normally; with 3 to 5 seeds a bootstrap over
seeds has too few resamples to mean anything). A directional claim ("B ends lower than A") is
supported when the whole interval lies above 0, contradicted when it lies below, else left open.
A claim of "no worse" or "comparable" states a margin in nats before its runs (base.Margin): it is
supported when the whole interval lies below the margin, contradicted when it lies above it, else
open. An open verdict says about how many seeds would settle it: the n at which the interval's
half-width t * s / sqrt(n) falls below the distance from the mean to the bound, if the differences
kept their mean and standard deviation (an estimate from the seeds run, not a promise).
Reference: any statistics text's paired t-test, e.g. Wasserman, All of Statistics (2004), 10.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95        # two-sided: 2.5% outside each end
MOST_SEEDS = 100    # how far seeds_to_settle looks: beyond this, "more than MOST_SEEDS"


def t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's T with `df` (a positive integer) degrees of freedom: the finite
    series of Abramowitz & Stegun 26.7.3 (df odd) and 26.7.4 (df even), in theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:   # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    term = total = 0.0  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + ... up to cos^(df-2)))
    if df > 1:
        term = total = math.cos(theta)
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
    return 2 / math.pi * (theta + s * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| < t) = level (the two-sided interval's multiplier), by bisection on the CDF."""
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < level:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_two_sided(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Interval:
    """The per-seed differences of one comparison, their mean and t-interval (nan with fewer than 2)."""
    what: str            # the difference in words: "relu - gelu"
    seeds: list          # the seeds both (all) arms finished, in order
    diffs: list          # one difference per seed
    mean: float
    lo: float
    hi: float
    sd: float
    absent: str = ""     # why no seed counts, when none does: the arms with no finished (or no usable) run

    @property
    def n(self) -> int:
        return len(self.diffs)


def interval(what: str, seeds, diffs, level: float = LEVEL) -> Interval:
    n = len(diffs)
    mean = statistics.fmean(diffs) if diffs else math.nan
    if n < 2:
        return Interval(what, list(seeds), list(diffs), mean, math.nan, math.nan, math.nan)
    sd = statistics.stdev(diffs)
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(what, list(seeds), list(diffs), mean, mean - half, mean + half, sd)


def usable(row) -> bool:
    """A run whose final validation loss can enter a difference: finite, and not diverged (the loss
    of a run that blew up measures the blow-up, not the arm)."""
    v = row.get("val_loss")
    return v is not None and math.isfinite(v) and not row.get("diverged")


def contrast(rows, weights: dict, what: str, key: str = "val_loss") -> Interval:
    """The t-interval of sum(weight * value of arm) per seed, over the seeds where every arm in
    `weights` has a usable run: {"relu": 1, "gelu": -1} is relu - gelu."""
    per_seed = {}
    for r in rows:
        if r["arm"] in weights and usable(r):
            per_seed.setdefault(r["seed"], {})[r["arm"]] = r[key]
    seeds = sorted(s for s, arms in per_seed.items() if len(arms) == len(weights))
    diffs = [sum(w * per_seed[s][a] for a, w in weights.items()) for s in seeds]
    iv = interval(what, seeds, diffs)
    missing = [a for a in weights if not any(r["arm"] == a for r in rows)]
    blown = [a for a in weights if a not in missing and not any(r["arm"] == a and usable(r) for r in rows)]
    iv.absent = "; ".join(([f"no finished run of {', '.join(missing)}"] if missing else []) +
                          ([f"every run of {', '.join(blown)} diverged"] if blown else []))
    return iv


def paired(rows, lower: str, higher: str, what: str | None = None, key: str = "val_loss") -> Interval:
    """higher - lower per seed: positive where `higher` ends above `lower`, as a claim that `lower`
    ends lower predicts; `what` names the difference in the text (default "higher - lower")."""
    return contrast(rows, {higher: 1, lower: -1}, what or f"{higher} - {lower}", key)


def directional(iv: Interval) -> str:
    """A claim that the difference is positive: supported when the interval lies above 0."""
    if not math.isfinite(iv.lo):
        return "leaves open"
    return "supports" if iv.lo > 0 else "contradicts" if iv.hi < 0 else "leaves open"


def no_worse(iv: Interval, margin: float) -> str:
    """A claim that the difference (how much worse the claim's arm ends) is under `margin`: supported
    when the whole interval lies below it, contradicted when the whole interval lies above it."""
    if not math.isfinite(iv.lo):
        return "leaves open"
    return "supports" if iv.hi < margin else "contradicts" if iv.lo > margin else "leaves open"


def seeds_to_settle(iv: Interval, bound: float = 0.0) -> int | None:
    """About how many seeds in all would put the interval clear of `bound`, were the differences to
    keep their mean and standard deviation: the least n whose half-width t * s / sqrt(n) is under
    |mean - bound|; None when it cannot be told (under 2 seeds, or the mean on the bound), and
    MOST_SEEDS + 1 when more than MOST_SEEDS would be needed."""
    gap = abs(iv.mean - bound)
    if iv.n < 2 or not (math.isfinite(gap) and gap > 0):
        return None
    if iv.sd == 0:
        return iv.n
    for n in range(max(iv.n, 2), MOST_SEEDS + 1):
        if t_quantile(LEVEL, n - 1) * iv.sd / math.sqrt(n) < gap:
            return n
    return MOST_SEEDS + 1


def signed(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.3f}"


def short(iv: Interval) -> str:
    """"+0.166 [-0.217, +0.549]": the mean difference and its interval, for a table cell."""
    if iv.n == 0:
        return iv.absent or "no seed in which every arm finished"
    if iv.n < 2:
        return f"{signed(iv.mean)} (one seed: no interval)"
    return f"{signed(iv.mean)} [{signed(iv.lo)}, {signed(iv.hi)}]"


def words(iv: Interval) -> str:
    """The comparison in full: each seed's difference, the mean, the interval and its level."""
    if iv.n == 0:
        return f"{iv.what}: {iv.absent or 'no seed in which every arm finished'}, so no difference is read"
    each = ", ".join(f"{signed(d)} (seed {s})" for s, d in zip(iv.seeds, iv.diffs))
    above = sum(d > 0 for d in iv.diffs)
    text = f"{iv.what} per seed: {each}; positive in {above} of {iv.n}; mean {signed(iv.mean)}"
    if iv.n < 2:
        return text + ", one seed: no interval, so nothing is decided"
    return text + f", {LEVEL:.0%} t-interval [{signed(iv.lo)}, {signed(iv.hi)}]"


def settle_words(iv: Interval, bound: float = 0.0) -> str:
    """For an open verdict: how many seeds would settle it (seeds_to_settle), in words."""
    n = seeds_to_settle(iv, bound)
    where = "0" if bound == 0 else f"the margin {bound:g}"
    if n is None:
        return "" if iv.n < 2 else f"; no number of seeds is estimated to clear {where} (the mean lies on it)"
    if n > MOST_SEEDS:
        return f"; more than {MOST_SEEDS} seeds would be needed to clear {where} at this mean and spread"
    return (f"; about {n} seeds in all would clear {where} if the differences kept this mean and standard "
            f"deviation ({n - iv.n} more)")
