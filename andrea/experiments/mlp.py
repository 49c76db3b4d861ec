"""The MLP: its activation (`activation`: GELU against ReLU at the same parameters), its expansion
(`mlp-ratio`: 1, 2, 4 and 8 times d_model) and the one alternative the document names (`swiglu`:
SwiGLU at 8/3 against GELU at 4x, parameters matched)."""

from __future__ import annotations

import math

from andrea.experiments.base import (
    LEARNS,
    SHALLOW_STEPS,
    Experiment,
    against_spread,
    arm_mean,
    compare,
    details_counts,
    fmt,
    not_learned,
    probe_counts,
    seed_spread,
    spread_words,
    unlearned,
)


def judge_activation(rows):
    """Supports: GELU's mean final validation loss is lower than ReLU's by more than the larger of
    the two arms' spread over seeds; contradicts: ReLU's is lower by that much; else open."""
    gelu, relu, effect, spread = compare(rows, "gelu", "relu")
    why = f"mean final validation loss GELU {gelu:.3f}, ReLU {relu:.3f} ({spread_words(effect, spread)})"
    return against_spread(effect, spread), why


def judge_mlp_ratio(rows):
    """Supports: the loss falls from ratio 1 to 2 to 4, each by more than the seeds' spread, and the
    gain from 4 to 8 is smaller than the gain from 2 to 4 by more than that spread. Contradicts: 4
    ends above 2, or 8 gains more than 4 did, by more than the spread. Else open.

    Rewritten for issue 28, before its runs: the first rule compared the means alone; each
    difference is now set against the seeds' spread (the widest of the four arms)."""
    loss = {r: arm_mean(rows, f"ratio-{r}", "val_loss") for r in (1, 2, 4, 8)}
    noise = seed_spread(rows, [f"ratio-{r}" for r in (1, 2, 4, 8)])
    gain12, gain24, gain48 = loss[1] - loss[2], loss[2] - loss[4], loss[4] - loss[8]
    why = ("mean final validation loss " + ", ".join(f"ratio {r}: {v:.3f}" for r, v in loss.items()) +
           f"; gains 1 to 2: {gain12:.3f}, 2 to 4: {gain24:.3f}, 4 to 8: {gain48:.3f}; seeds' spread {fmt(noise)}")
    if not math.isfinite(noise):
        return "leaves open", why + "; one seed: the spread over seeds is not measured, so no difference decides"
    if gain12 > noise and gain24 > noise and gain24 - gain48 > noise:
        return "supports", why
    if -gain24 > noise or gain48 - gain24 > noise:
        return "contradicts", why
    return "leaves open", why


def judge_swiglu(rows):
    """Supports: at parameter counts within 1% of each other, SwiGLU at 8/3 ends no worse than GELU
    at 4x by more than the larger seed spread (comparable or better capacity). Contradicts: it ends
    worse by more than that spread. Anything else (counts not matched, or a run that did not learn:
    unlearned) leaves it open."""
    gelu, swiglu = arm_mean(rows, "gelu-4x", "val_loss"), arm_mean(rows, "swiglu-8_3x", "val_loss")
    noise = seed_spread(rows, ["gelu-4x", "swiglu-8_3x"])
    n = {a: next((r["params"] for r in rows if r["arm"] == a), 0) for a in ("gelu-4x", "swiglu-8_3x")}
    seeds = len({r["seed"] for r in rows})
    why = (f"mean final validation loss GELU 4x {gelu:.3f}, SwiGLU 8/3 {swiglu:.3f} over {seeds} seed(s), spread "
           f"{noise:.3f}; parameters {n['gelu-4x']:,} and {n['swiglu-8_3x']:,}")
    if not n["gelu-4x"] or abs(n["swiglu-8_3x"] - n["gelu-4x"]) > 0.01 * n["gelu-4x"]:
        return "leaves open", why + " (not matched)"
    if unlearned(rows):
        return not_learned(rows, why)
    if not math.isfinite(noise):
        return "leaves open", why + " (" + spread_words(gelu - swiglu, noise) + ")"
    if swiglu - gelu > noise:
        return "contradicts", why
    return "supports", why + ("; SwiGLU lower by more than the spread" if gelu - swiglu > noise else
                              "; the difference is within the spread: comparable")


EXPERIMENTS = {
    "activation": Experiment(
        claim="GELU reaches a lower loss than ReLU at the same parameter count; its smooth curve gives cleaner "
              "gradients.",
        original="Empiricamente, transformers treinados com GELU alcançam perda menor do que transformers treinados "
                 "com ReLU com o mesmo número de parâmetros. [...] a curva suave do GELU fornece gradientes mais "
                 "limpos para a retropropagação.",
        base=LEARNS + ["model.n_layer=4"],
        arms={"gelu": [], "relu": ["model.activation=relu"]},
        steps=SHALLOW_STEPS, judge=judge_activation),
    "mlp-ratio": Experiment(
        claim="The 4x MLP expansion: smaller ratios lose capacity, larger ones give diminishing returns.",
        original="Proporções menores reduzem a capacidade do modelo. Proporções maiores produzem retornos "
                 "decrescentes por parâmetro gasto.",
        base=LEARNS + ["model.n_layer=4"],
        arms={f"ratio-{r}": [f"model.mlp_ratio={r}"] for r in (1, 2, 4, 8)},
        steps=SHALLOW_STEPS, judge=judge_mlp_ratio),
    "swiglu": Experiment(
        claim="SwiGLU at 8/3 the model width gives comparable capacity to GELU at 4x at lower cost.",
        original="SwiGLU com 8/3 da largura [...] com capacidade comparável a um custo menor.",
        base=LEARNS + ["model.n_layer=4"],
        arms={"gelu-4x": [], "swiglu-8_3x": ["model.activation=swiglu"]},
        steps=SHALLOW_STEPS, judge=judge_swiglu, probe=probe_counts, details=details_counts),
}

