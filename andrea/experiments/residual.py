"""Residual connections: without them a 12-block stack loses the gradient (`residual`, with the
document's claim 3, each sublayer near the identity at initialisation), and with them it stays usable
through hundreds of blocks (`depth`: thin stacks of 12 to 192 blocks)."""

from __future__ import annotations

import math
import statistics

from andrea.experiments.base import (
    LEARNS,
    Experiment,
    Verdict,
    arm_values,
    fmt,
    kept_from_page,
    lower_claim,
    png,
    probe_counts,
)
from andrea.run.figure import label_depth_axis, new_figure


def judge_residual(rows):
    """Supports: at the last step, in every seed, the embeddings of the stack without residuals get
    under a tenth of the residual stack's share of the top's gradient (the largest ratio without
    under a tenth of the smallest with), and the per-seed differences of the final validation loss,
    without minus with residuals, have a t-interval above 0 (base.lower_claim). Contradicts: without
    residuals the embeddings get as much as with them or more (the means), or that interval lies
    below 0. Else open.

    Rewritten before the runs at the default model's shape: the first rule read step 1, where the
    LayerNorm in front of every sublayer rescales its input, so at initialisation the gradient crosses
    12 blocks even without skips (0.33 of the top's against 1.2 in the 150-step runs); those runs lost
    it with the first updates (9e-12 by step 10, 1.6e-13 at the end). The claim is about a stack that
    trains: the rule reads the last step. Its loss half read the seeds' spread until the paired rule
    replaced it, after those runs."""
    with_r, without = arm_values(rows, "residual", "ratio_final"), arm_values(rows, "no-residual", "ratio_final")
    if not (with_r and without):
        missing = [a for a, v in (("residual", with_r), ("no-residual", without)) if not v]
        return Verdict("leaves open", f"no gradient flow logged by {', '.join(missing)}", "not measured")
    loss = lower_claim(rows, "residual", "no-residual")
    why = (f"at the last step the embeddings receive {fmt(max(without))} of the top's gradient norm at most "
           f"without residuals, {fmt(min(with_r))} at least with them; final validation loss, {loss.why}")
    glance = f"gradient at the embeddings {fmt(max(without))} of the top's without, {fmt(min(with_r))} with; " + \
        loss.glance
    gradient_lost = max(without) < min(with_r) / 10
    if gradient_lost and loss.verdict == "supports":
        return Verdict("supports", why, glance)
    if statistics.fmean(without) >= statistics.fmean(with_r) or loss.verdict == "contradicts":
        return Verdict("contradicts", why, glance)
    return Verdict("leaves open", why, glance)


@kept_from_page
def judge_identity(rows):
    """Claim 3 from the residual stack's first step: supports if every sublayer changes the stream
    by under 30% of its norm at initialisation, in every seed; contradicts if one changes it by
    more than it is. (A threshold each seed's run must meet: no arms are compared.)"""
    deltas = [r["delta_init_max"] for r in rows if r["arm"] == "residual"]
    if not deltas:
        return Verdict("leaves open", "no finished run of residual", "not measured")
    worst = max(deltas)
    why = f"at step 1 the largest sublayer change is {worst:.3g} of the stream it is added to (the largest over seeds)"
    glance = f"largest sublayer change at step 1: {worst:.3g} of the stream (under 0.3 supports, over 1 contradicts)"
    if worst < 0.3:
        return Verdict("supports", why, glance)
    return Verdict("contradicts" if worst > 1 else "leaves open", why, glance)


# thin enough that 192 blocks train in seconds a step on 2 loaded cores
THINNER = ["model.context_length=32", "model.d_model=32", "model.n_head=2",
           "train.batch_size=4", "train.seq_len=32", "train.eval_batches=4"]
DEPTHS = (12, 48, 96, 192)
USABLE = 0.1      # |dL/dx| at the embeddings over the top's: at least this is "usable"
VANISHED = 1e-3   # at most this: the signal is lost
FLOOR = 1e-12     # where the depth figure draws a ratio of 0 (float32's gradient underflowed)


def _depth_ratio(rows, residual, n, key):
    """The mean of key over the runs of n blocks with (or without) residuals."""
    values = [r[key] for r in rows if r["n_layer"] == n and r["arm"].startswith("residual") == residual
              and math.isfinite(r[key])]
    return statistics.fmean(values) if values else math.nan


@kept_from_page
def judge_depth(rows):
    """Supports: with residuals the embeddings get at least USABLE of the top's gradient norm at
    every depth, at step 1 and at the end, while without them it falls to VANISHED or below at some
    depth. Contradicts: with residuals it falls to VANISHED or below at some depth. Else open. (A
    threshold on the means over seeds, whose ratios lie orders of magnitude apart: no interval.)"""
    keys = ("ratio_init", "ratio_final")
    depths = sorted({r["n_layer"] for r in rows})
    res = [_depth_ratio(rows, True, n, k) for n in depths for k in keys]
    nores = [_depth_ratio(rows, False, n, k) for n in depths for k in keys]
    why = "; ".join(f"{n} blocks: with residuals {fmt(_depth_ratio(rows, True, n, keys[0]))} at step 1, "
                    f"{fmt(_depth_ratio(rows, True, n, keys[1]))} at the end; without "
                    f"{fmt(_depth_ratio(rows, False, n, keys[0]))} and {fmt(_depth_ratio(rows, False, n, keys[1]))}"
                    for n in depths) + " (|dL/dx| at the embeddings over the top's)"
    least = [min((v for v in vs if math.isfinite(v)), default=math.nan) for vs in (res, nores)]
    glance = (f"the embeddings get at least {fmt(least[0])} of the top's gradient with residuals at every depth, "
              f"as little as {fmt(least[1])} without")
    if any(v <= VANISHED for v in res):
        return Verdict("contradicts", why, glance)
    if res and all(v >= USABLE for v in res) and any(v <= VANISHED for v in nores):
        return Verdict("supports", why, glance)
    return Verdict("leaves open", why, glance)


def draw_depth(name, rows):
    """Left: |dL/dx| at the embeddings over the top's against depth; right: the 192-block profiles."""
    fig = new_figure("andrea.experiment", figsize=(11, 4.2), dpi=90)
    ratio_ax, depth_ax = fig.subplots(1, 2)
    depths = sorted({r["n_layer"] for r in rows})
    for c, residual in enumerate((True, False)):
        for key, ls in (("ratio_init", "--"), ("ratio_final", "-")):
            ratios = [max(_depth_ratio(rows, residual, n, key), FLOOR) for n in depths]  # nan stays nan
            ratio_ax.plot(range(len(depths)), ratios, color=f"C{c}", ls=ls,
                          marker="o", label=f"{'with' if residual else 'without'} residuals, "
                                            f"{'step 1' if key == 'ratio_init' else 'last step'}")
        deepest = next((r for r in rows if r["n_layer"] == depths[-1] and r["arm"].startswith(
            "residual" if residual else "no-residual")), None)
        if deepest and deepest["grad_final"]:
            depth_ax.plot(deepest["grad_init"], color=f"C{c}", ls="--", lw=1)
            depth_ax.plot(deepest["grad_final"], color=f"C{c}", lw=2, label=deepest["arm"])
    ratio_ax.set(yscale="log", xlabel="blocks", ylabel=f"|dL/dx| embeddings / top (0 drawn at {FLOOR:g})",
                 title=f"{name}: the gradient reaching the embeddings")
    ratio_ax.set_xticks(range(len(depths)), [str(n) for n in depths])
    label_depth_axis(depth_ax, f"{depths[-1]} blocks: step 1 (dashed), last step")
    for ax in (ratio_ax, depth_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return png(fig)


EXPERIMENTS = {
    "residual": Experiment(
        claim="A 12-layer stack without residuals would lose the gradient signal long before it reached "
              "the embeddings; with residuals the gradient magnitude stays usable through hundreds of layers.",
        original="Uma pilha de 12 camadas sem resíduos perderia o sinal de gradiente muito antes de alcançar os "
                 "embeddings; com resíduos, a magnitude do gradiente permanece utilizável através de centenas de "
                 "camadas.",
        base=LEARNS + ["model.n_layer=12"],
        arms={"residual": [], "no-residual": ["model.residual=false"]},
        steps=200, judge=judge_residual, short="residuals keep the gradient through 12 blocks",
        more=[("claim 3 (near identity at initialisation)", judge_identity)]),
    "depth": Experiment(
        claim="With residuals the gradient magnitude stays usable through hundreds of layers.",
        original="Com resíduos, a magnitude do gradiente permanece utilizável através de centenas de camadas.",
        base=THINNER,
        arms={f"{kind}-{n}": [f"model.n_layer={n}"] + ([] if kind == "residual" else ["model.residual=false"])
              for n in DEPTHS for kind in ("residual", "no-residual")},
        steps=30, judge=judge_depth, probe=probe_counts, figure=draw_depth,
        short="the gradient usable through hundreds of layers"),
}

