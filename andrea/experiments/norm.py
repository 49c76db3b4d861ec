"""LayerNorm: where it goes (`norm`: pre-norm against post-norm, each with and without warmup) and
what it is for (`no-norm`: no LayerNorm anywhere, at the default learning rate and above)."""

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
    probe_counts,
    seed_spread,
    spread_words,
)


def judge_norm(rows):
    """Supports: post-norm without warmup ends worse than post-norm with warmup, by more than the
    seeds' spread (or diverges), and pre-norm without warmup ends no worse than pre-norm with it
    (within that spread). Contradicts: post-norm without warmup ends better than with it, by more
    than the spread. Else open.

    Rewritten for issue 28, before its runs: "contradicts" read any post-norm difference that was
    not a loss (pn <= pw); a difference within the seeds' spread now leaves the claim open, and one
    seed (no spread) decides nothing."""
    arms = ("post-no-warmup", "post-warmup", "pre-no-warmup", "pre-warmup")
    pn, pw = arm_mean(rows, "post-no-warmup", "val_loss"), arm_mean(rows, "post-warmup", "val_loss")
    rn, rw = arm_mean(rows, "pre-no-warmup", "val_loss"), arm_mean(rows, "pre-warmup", "val_loss")
    noise = seed_spread(rows, arms)
    diverged = [r["run"] for r in rows if r["diverged"]]
    why = (f"mean final validation loss: post-norm {pn:.3f} without warmup, {pw:.3f} with; pre-norm {rn:.3f} "
           f"without, {rw:.3f} with; seeds' spread {fmt(noise)}; diverged: {', '.join(diverged) or 'none'}")
    if not math.isfinite(noise):
        return "leaves open", why + "; one seed: the spread over seeds is not measured, so no difference decides"
    post_suffers = pn - pw > noise or any(r.startswith("post-no-warmup") for r in diverged)
    if post_suffers and rn - rw <= max(noise, 0.01):
        return "supports", why
    if pw - pn > noise:
        return "contradicts", why
    return "leaves open", why


def judge_pre_over_post(rows):
    """The document's conclusion, prefer pre-norm: supports if pre-norm with warmup ends below
    post-norm with warmup by more than the seeds' spread, contradicts if above by that much."""
    pre, post, effect, spread = compare(rows, "pre-warmup", "post-warmup")
    why = (f"mean final validation loss with warmup: pre-norm {pre:.3f}, post-norm {post:.3f} "
           f"({spread_words(effect, spread)})")
    return against_spread(effect, spread), why


def _no_norm_at(rows, lr, noise):
    """At one learning rate: (none unstable where pre-norm is not, none ends worse, the table's words)."""
    pre, none = [r for r in rows if r["arm"] == f"pre-lr{lr}"], [r for r in rows if r["arm"] == f"none-lr{lr}"]
    bad = [r for r in none if r["diverged"] or r["first_nonfinite"] is not None]
    unstable = bool(bad) and not any(r["diverged"] for r in pre)
    lp, ln = arm_mean(rows, f"pre-lr{lr}", "val_loss"), arm_mean(rows, f"none-lr{lr}", "val_loss")
    # ends worse by more than the seeds' spread; nan (every run non-finite) counts as worse
    worse = not math.isfinite(ln) or (math.isfinite(noise) and ln > lp + noise)
    steps = ", ".join(f"step {r['first_nonfinite']}" for r in none if r["first_nonfinite"] is not None)
    words = f"lr {lr}: pre-norm {lp:.3f}, none {ln:.3f}" + (f" (non-finite from {steps})" if steps else "")
    return unstable, worse, words


def judge_no_norm(rows):
    """Supports: at some learning rate the model without LayerNorm goes non-finite or diverges while
    pre-norm at that rate does not, or it ends worse than pre-norm at every rate by more than the
    seed spread. Contradicts: at every rate it ends no worse than pre-norm (within the spread) and
    never goes non-finite. Anything else leaves it open."""
    rates = sorted({r["arm"].split("-lr")[1] for r in rows}, key=float)
    noise = seed_spread(rows, sorted({r["arm"] for r in rows}))
    unstable, worse, parts = zip(*[_no_norm_at(rows, lr, noise) for lr in rates]) if rates else ((), (), ())
    why = "final validation loss " + "; ".join(parts) + f"; seed spread {noise:.3f}"
    if any(unstable) or (rates and all(worse)):
        return "supports", why
    if math.isfinite(noise) and not any(worse) and not any(r["first_nonfinite"] is not None for r in rows):
        return "contradicts", why
    return "leaves open", why


EXPERIMENTS = {
    "norm": Experiment(
        claim="Post-norm trains poorly without learning-rate warmup and careful tuning; its gradients explode "
              "in the early layers. Pre-norm trains stably.",
        original="O pós-norm treina mal sem aquecimento de LR e ajuste cuidadoso de hiperparâmetros. Os gradientes "
                 "explodem nas camadas iniciais [...] O treinamento pré-norm é estável.",
        # 6 blocks for 400 steps (819,200 tokens), where the first budget (12 blocks, 200 steps: the same
        # block-steps) left pre-norm without warmup 0.49-0.58 nats under the unigram baseline, and 300
        # steps of 12 blocks 0.90 (seed 0); at 6 x 400, seed 0 ends 1.12 under without warmup, 1.60 with
        base=LEARNS + ["model.n_layer=6"],
        arms={"pre-warmup": [], "pre-no-warmup": ["train.warmup_steps=0"],
              "post-warmup": ["model.norm=post"], "post-no-warmup": ["model.norm=post", "train.warmup_steps=0"]},
        steps=400, judge=judge_norm, more=[("the conclusion (prefer pre-norm)", judge_pre_over_post)]),
    "no-norm": Experiment(
        claim="LayerNorm keeps activations in a numerically stable range; without it, small instabilities "
              "accumulate into NaN gradients.",
        original="A LayerNorm mantém as ativações em uma faixa numericamente estável; sem ela, pequenas "
                 "instabilidades se acumulam em gradientes NaN.",
        # the default rate and one ten times it. At 3e-2 the first budget (300 steps, as the default rate's)
        # left pre-norm 0.52-0.65 nats under the unigram baseline and 800 steps seed 1 at 0.95, so the 3e-2
        # arms train 1000. 1e-2, run at first, was dropped to keep the time: at 300 steps it left all
        # three pre-norm seeds and two without LayerNorm short of the mark, and nothing went non-finite.
        base=LEARNS + ["model.n_layer=4"],
        arms={f"{norm}-lr{lr}": [f"model.norm={norm}", f"train.lr={lr}"]
              for lr in ("3e-3", "3e-2") for norm in ("pre", "none")},
        steps=SHALLOW_STEPS, arm_steps={"pre-lr3e-2": 1000, "none-lr3e-2": 1000},
        judge=judge_no_norm, probe=probe_counts, details=details_counts),
}

