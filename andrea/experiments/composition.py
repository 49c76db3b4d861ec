"""How the blocks compose (`composition`): the logit lens (the residual stream after each block, read
through the final LayerNorm and the tied head) and each head's attention distance and previous-token
share, set against the document's three bands (early: syntax and position; middle: relations; late:
content). The numbers come from andrea.probe."""

from __future__ import annotations

import functools
import math
import statistics
from typing import NamedTuple

from andrea.experiments.base import (
    LEARNS,
    SHALLOW_STEPS,
    Experiment,
    Verdict,
    kept_from_page,
    not_learned,
    png,
    probe_counts,
    unlearned,
)
from andrea.run.figure import new_figure


def probe_composition(run_dir):
    from andrea.probe import probe_run

    return probe_counts(run_dir) | probe_run(run_dir)


def _bands(n):
    """The blocks of the early, middle and late thirds (the first ones a block larger when 3 does not
    divide n)."""
    sizes = [n // 3 + (k < n % 3) for k in range(3)]
    return [list(range(sum(sizes[:k]), sum(sizes[:k + 1]))) for k in range(3)]


def _band_of(i, n):
    return next(k for k, b in enumerate(_bands(n)) if i in b)


# What makes an attention reading a specialisation rather than uniform attention (rewritten after the
# first runs at the LEARNS budget, which learned 1.43-1.49 nats yet attended almost uniformly: each
# block's mean distance 24-34 tokens where uniform causal attention over 128 gives 31.75, the largest
# previous-token share 0.06 where uniform gives 0.035; the rules read those differences of a few
# hundredths as an early band in the middle third and a middle band in the last, "contradicts"
# both, and the late band's lens drop counted the raw embeddings' 14-nat lens as block 0's gain)
PREVIOUS_HEAD = 0.5   # a previous-token head puts at least this share on the token before
LONG_RANGE = 1.25     # a long-range block's mean distance is at least this times uniform attention's


class Reading(NamedTuple):
    """One run's readings for the bands: bands[k] is the third (0 early, 1 middle, 2 late) that band
    k's measure points to; share and reach say whether the attention readings are specialised."""
    bands: tuple      # (strongest previous-token head, longest mean distance, largest lens drop)
    share: float      # the strongest previous-token share
    reach: float      # the longest mean distance (over a block's heads) over uniform attention's


def _composition_votes(r):
    """One run's Reading. The lens's drop through block 0 is counted from the unigram baseline (what
    a model with no block can reach) rather than from the embeddings' lens, which reads raw token
    vectors through the tied head and so favours the input token itself."""
    n = r["n_layer"]
    prev = [max(h) for h in r["previous"]]
    dist = [statistics.fmean(h) for h in r["distance"]]
    lens = list(r["lens_loss"])
    if r.get("unigram_baseline") is not None:
        lens[0] = r["unigram_baseline"]
    gains = [lens[i] - lens[i + 1] for i in range(n)]
    band_gain = [sum(gains[i] for i in b) for b in _bands(n)]
    bands = (_band_of(prev.index(max(prev)), n), _band_of(dist.index(max(dist)), n),
             band_gain.index(max(band_gain)))
    return Reading(bands, max(prev), max(dist) / r.get("uniform_distance", math.nan))


BAND_NAMES = ("early", "middle", "late")
BANDS = [("early: syntax and position", "strongest previous-token head"),
         ("middle: relations", "longest mean attention distance"),
         ("late: content", "largest drop of the logit lens's loss")]


def _specialised(k, votes):
    """Whether every seed's reading for band k is a specialisation (see PREVIOUS_HEAD, LONG_RANGE)."""
    if k == 0:
        return all(v.share >= PREVIOUS_HEAD for v in votes)
    if k == 1:
        return all(v.reach >= LONG_RANGE for v in votes)   # nan (no uniform reference) is not
    return True


def _where(k, v):
    """Band k's reading of one run, in words."""
    strength = {0: f" (share {v.share:.2f})", 1: f" ({v.reach:.2f} x uniform)"}.get(k, "")
    return BAND_NAMES[v.bands[k]] + strength


@kept_from_page
def judge_composition_band(k, rows):
    """Band k's rule of three, over every seed (a verdict only when the seeds agree):
    early (syntax and position): the band of the strongest previous-token head (the largest
    p_{i,i-1} share), read only when that share is at least PREVIOUS_HEAD; middle (relations): the
    band of the longest mean attention distance (over a block's heads), read only when it is at
    least LONG_RANGE times uniform attention's; late (content): the band whose blocks lower the
    logit lens's loss most (block 0's drop counted from the unigram baseline). Supports when the
    band read is band k, contradicts when it is another; a reading that is not a specialisation
    (uniform attention, as described above) or a run that did not learn (unlearned) leaves it open."""
    votes = [_composition_votes(r) for r in rows]
    found = {v.bands[k] for v in votes}
    where = ", ".join(_where(k, v) for v in votes)
    why = f"{BANDS[k][1]}: in the {where} third, per seed"
    glance = f"{BANDS[k][1]}: {', '.join(BAND_NAMES[v.bands[k]] for v in votes)} third, per seed"
    if unlearned(rows):
        return not_learned(rows, why, glance)
    if not _specialised(k, votes):
        limit = f"a share of {PREVIOUS_HEAD}" if k == 0 else f"{LONG_RANGE} x uniform attention's distance"
        return Verdict("leaves open", why + f" (under {limit}: attention not specialised, so no band is read)",
                       glance + " (attention not specialised)")
    if len(found) > 1:
        return Verdict("leaves open", why + " (the seeds disagree)", glance)
    return Verdict("supports" if found == {k} else "contradicts", why, glance)


@kept_from_page
def judge_composition(rows):
    """Claim 'each block refines, the stream accumulates': supports if the logit lens's loss falls at
    every block (each block's output predicts better than its input) in every seed; contradicts if
    it rises at some block in every seed; else, or when a run did not learn (unlearned), open. (A
    reading each seed's run must show: no arms are compared.)"""
    falls = [all(b < a for a, b in zip(r["lens_loss"], r["lens_loss"][1:])) for r in rows]
    rises = [any(b > a for a, b in zip(r["lens_loss"], r["lens_loss"][1:])) for r in rows]
    why = "logit lens loss by depth (embeddings, then after each block): " + "; ".join(
        f"seed {r['seed']}: " + " > ".join(f"{v:.2f}" for v in r["lens_loss"]) for r in rows)
    glance = f"the lens's loss falls at every block in {sum(falls)} of {len(rows)} seeds"
    if unlearned(rows):
        return not_learned(rows, why, glance)
    if all(falls):
        return Verdict("supports", why, glance)
    if all(rises):
        return Verdict("contradicts", why, glance)
    return Verdict("leaves open", why, glance)


def details_composition(rows):
    """Per seed: the logit lens by depth, and per block the heads' attention distance and previous-token share."""
    from andrea.probe import PROMPT

    text = []
    for r in rows:
        text.append(f"\n{r['run']}: logit lens and attention by depth (lens top 3: at the last token of {PROMPT!r})\n")
        text.append("| depth | lens loss | lens top 3 | mean attention distance per head | previous-token share "
                    "per head |\n|---|---|---|---|---|\n")
        if "uniform_distance" in r:
            text.append(f"| uniform attention | | | {r['uniform_distance']:.1f} | {r['uniform_previous']:.2f} |\n")
        text.append(f"| embeddings | {r['lens_loss'][0]:.3f} | | | |\n")
        for i in range(r["n_layer"]):
            text.append(f"| block {i} | {r['lens_loss'][i + 1]:.3f} | {r['lens_top'][i].replace('|', '/')} | "
                        f"{' '.join(f'{d:.1f}' for d in r['distance'][i])} | "
                        f"{' '.join(f'{p:.2f}' for p in r['previous'][i])} |\n")
    return "".join(text)


def draw_composition(name, rows):
    """The logit lens's loss by depth, and per block the heads' attention distance and previous-token share."""
    fig = new_figure("andrea.experiment", figsize=(13, 4.2), dpi=90)
    lens_ax, dist_ax, prev_ax = fig.subplots(1, 3)
    for c, r in enumerate(rows):
        lens_ax.plot(range(len(r["lens_loss"])), r["lens_loss"], marker="o", color=f"C{c}", label=r["run"])
        for i, (d, p) in enumerate(zip(r["distance"], r["previous"])):
            dist_ax.scatter([i] * len(d), d, color=f"C{c}", s=12, label=r["run"] if i == 0 else None)
            prev_ax.scatter([i] * len(p), p, color=f"C{c}", s=12, label=r["run"] if i == 0 else None)
    lens_ax.set(xlabel="blocks applied (0 = embeddings)", ylabel="logit lens loss (nats/token)",
                title=f"{name}: logit lens")
    dist_ax.set(xlabel="block", ylabel="mean attention distance (tokens)", title="each head's mean attention distance")
    prev_ax.set(xlabel="block", ylabel="attention on the previous token", title="each head's previous-token share",
                ylim=(0, 1))
    for ax in (lens_ax, dist_ax, prev_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return png(fig)


EXPERIMENTS = {
    "composition": Experiment(
        claim="Each block learns a refinement and the residual stream accumulates them; the layers specialise: "
              "early ones syntax and position, middle ones relations, late ones content.",
        original="Cada bloco aprende um refinamento, e o fluxo residual os acumula [...] camadas iniciais: sintaxe "
                 "e posição; intermediárias: relações; finais: conteúdo.",
        base=LEARNS + ["model.n_layer=6"],
        arms={"pre-norm": []},
        steps=SHALLOW_STEPS, judge=judge_composition, probe=probe_composition, figure=draw_composition,
        short="each block refines; the layers specialise",
        details=details_composition, more=[(f"band {what}", functools.partial(judge_composition_band, k))
                                                  for k, (what, _) in enumerate(BANDS)]),
}

