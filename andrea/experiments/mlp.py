"""The MLP: its activation (`activation`: GELU against ReLU at the same parameters), its expansion
(`mlp-ratio`: 1, 2, 4 and 8 times d_model) and the one alternative the document names (`swiglu`:
SwiGLU at 8/3 against GELU at 4x, parameters matched)."""

from __future__ import annotations

import functools

from andrea.experiments import paired
from andrea.experiments.base import (
    LEARNS,
    NO_WORSE,
    SHALLOW_STEPS,
    Experiment,
    Verdict,
    details_counts,
    lower_claim,
    no_worse_claim,
    not_learned,
    probe_counts,
)


def judge_activation(rows):
    """Supports: the per-seed differences ReLU - GELU of the final validation loss have a t-interval
    above 0 (GELU ends lower); contradicts: below 0; else open (base.lower_claim).

    Rewritten from the seeds' spread to the paired differences (andrea.experiments.paired) after the
    first runs: the spread rule set a difference of means against the widest range of either arm,
    which one seed of one arm can set."""
    return lower_claim(rows, "gelu", "relu", names=("GELU", "ReLU"))


RATIOS = (1, 2, 4, 8)


def _ratio_intervals(rows):
    """The per-seed gains 1 to 2, 2 to 4 and 4 to 8 (loss at the smaller ratio minus at the larger),
    and the per-seed slowdown, the gain 2 to 4 minus the gain 4 to 8 (loss2 - 2 loss4 + loss8)."""
    gains = [paired.paired(rows, f"ratio-{b}", f"ratio-{a}", f"gain {a} to {b}") for a, b in zip(RATIOS, RATIOS[1:])]
    slowdown = paired.contrast(rows, {"ratio-2": 1, "ratio-4": -2, "ratio-8": 1},
                               "gain 2 to 4 - gain 4 to 8")
    return gains, slowdown


def judge_mlp_ratio(rows):
    """Supports: the per-seed gains 1 to 2 and 2 to 4 each have a t-interval above 0 (the loss falls
    from 1 to 2 to 4), and so does the per-seed slowdown (gain 2 to 4 minus gain 4 to 8: returns
    diminish past 4). Contradicts: the gain 2 to 4's interval lies below 0 (4 ends above 2), or the
    slowdown's does (8 gains more than 4 did). Else open.

    Rewritten twice: before the runs at the default model's shape (the means alone became means
    against the seeds' spread), then after them to the paired differences, whose intervals read each
    seed's own gains (the spread rule set every gain against the widest range of any ratio, which
    one slow seed of ratio 2 set)."""
    (g12, g24, g48), slowdown = _ratio_intervals(rows)
    parts = (g12, g24, slowdown)
    why = "; ".join(paired.words(iv) for iv in (g12, g24, g48, slowdown))
    glance = ", ".join(f"{iv.what} {paired.short(iv)}" for iv in parts)
    if all(paired.directional(iv) == "supports" for iv in parts):
        return Verdict("supports", why, glance)
    if paired.directional(g24) == "contradicts" or paired.directional(slowdown) == "contradicts":
        return Verdict("contradicts", why, glance)
    open_parts = [iv for iv in parts if paired.directional(iv) == "leaves open"]
    need = [paired.seeds_to_settle(iv) for iv in open_parts]
    if need and None not in need:
        why += f"; the slowest of the open parts ({open_parts[need.index(max(need))].what})" + \
            paired.settle_words(open_parts[need.index(max(need))])
    return Verdict("leaves open", why, glance)


def _matched(rows):
    """(the two arms' parameter counts, whether they are within 1% of each other)."""
    n = {a: next((r["params"] for r in rows if r["arm"] == a), 0) for a in ("gelu-4x", "swiglu-8_3x")}
    return n, bool(n["gelu-4x"]) and abs(n["swiglu-8_3x"] - n["gelu-4x"]) <= 0.01 * n["gelu-4x"]


def judge_swiglu(rows, margin):
    """A claim of comparable capacity: SwiGLU at 8/3, at a parameter count within 1% of GELU at 4x,
    ends no worse than it by more than `margin` (SwiGLU ending lower counts as comparable or better,
    as the first rule said). Supports: the t-interval of the per-seed differences SwiGLU - GELU
    lies wholly below the margin; contradicts: wholly above it; else open, and open too when the
    counts are not matched or a run did not learn (unlearned).

    Rewritten from the seeds' spread to the paired differences with a stated margin after the first
    runs: the spread rule called a difference "comparable" whenever it was within the range of
    either arm's seeds, which one wide arm makes easy, while SwiGLU ended above GELU in every seed."""
    n, matched = _matched(rows)
    verdict = no_worse_claim(rows, "gelu-4x", "swiglu-8_3x", margin, names=("GELU 4x", "SwiGLU 8/3"))
    counts = f"; parameters {n['gelu-4x']:,} and {n['swiglu-8_3x']:,}"
    if not matched:
        return Verdict("leaves open", verdict.why + counts + " (not matched)", verdict.glance + "; not matched")
    return not_learned(rows, verdict.why + counts, verdict.glance) or verdict._replace(why=verdict.why + counts)


EXPERIMENTS = {
    "activation": Experiment(
        claim="GELU reaches a lower loss than ReLU at the same parameter count; its smooth curve gives cleaner "
              "gradients.",
        original="Empiricamente, transformers treinados com GELU alcançam perda menor do que transformers treinados "
                 "com ReLU com o mesmo número de parâmetros. [...] a curva suave do GELU fornece gradientes mais "
                 "limpos para a retropropagação.",
        base=LEARNS + ["model.n_layer=4"],
        arms={"gelu": [], "relu": ["model.activation=relu"]},
        steps=SHALLOW_STEPS, judge=judge_activation, short="GELU beats ReLU"),
    "mlp-ratio": Experiment(
        claim="The 4x MLP expansion: smaller ratios lose capacity, larger ones give diminishing returns.",
        original="Proporções menores reduzem a capacidade do modelo. Proporções maiores produzem retornos "
                 "decrescentes por parâmetro gasto.",
        base=LEARNS + ["model.n_layer=4"],
        arms={f"ratio-{r}": [f"model.mlp_ratio={r}"] for r in (1, 2, 4, 8)},
        steps=SHALLOW_STEPS, judge=judge_mlp_ratio, short="4x is the MLP's right width"),
    "swiglu": Experiment(
        claim="SwiGLU at 8/3 the model width gives comparable capacity to GELU at 4x at lower cost.",
        original="SwiGLU com 8/3 da largura [...] com capacidade comparável a um custo menor.",
        base=LEARNS + ["model.n_layer=4"],
        arms={"gelu-4x": [], "swiglu-8_3x": ["model.activation=swiglu"]},
        steps=SHALLOW_STEPS, judge=functools.partial(judge_swiglu, margin=NO_WORSE), probe=probe_counts,
        details=details_counts, short="SwiGLU at 8/3 matches GELU at 4x"),
}

