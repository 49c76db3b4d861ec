"""An experiment's report: the per-run and per-arm tables, the lines on learning, time and budget,
the figure, the verdicts; written into results.md/results.json (and, with --doc, into a Markdown
page: andrea.experiments.page)."""

from __future__ import annotations

import io
import json
import math
import os

from andrea.experiments.base import LEARNED, arm_mean, fmt, seed_spread
from andrea.files import atomic_writer
from andrea.run.figure import label_depth_axis, new_figure


def _below(r):
    """How far the run's final validation loss is below its unigram baseline (nan without one)."""
    return r["unigram_baseline"] - r["val_loss"] if r.get("unigram_baseline") is not None else math.nan


def judge(exp, rows):
    """[(what, Verdict)]: the claim's verdict, then each further one (exp.more), from the same rows."""
    return [("claim", exp.judge(rows))] + [(what, rule(rows)) for what, rule in exp.more]


VERDICTS = "**Verdicts**"   # the line that opens the verdicts (andrea.experiments.page finds them by it)


def verdict_block(verdicts, source):
    """The verdicts in Markdown: the opening line (`source`: where their figures come from), then one
    line each, **what: verdict**: why."""
    lines = [f"{VERDICTS} {source} (rules: andrea/experiments/; paired differences: andrea/experiments/paired.py):\n"]
    return "\n".join(lines + [f"**{what}: {v.verdict}**: {v.why}.\n" for what, v in verdicts])


def report(name, exp, rows, target, command, missing=(), figure_note=""):
    """(results.md's text, the verdicts [(what, Verdict)], the body: what a --doc section holds, all but
    the title and claim). `missing`: the runs of the reported seeds that have not finished, named
    under the budget; `figure_note`: a line saying why there is no figure, where there is none."""
    verdicts = judge(exp, rows)
    body = [f"Command: `{command}`\n", budget_line(rows)] + page_line(name, rows)
    if missing:
        body.append(f"Not finished, so not in the tables or the verdicts: {', '.join(missing)}.\n")
    body += [table(rows, target), arm_table(rows), learned_line(rows), time_line(rows)]
    if exp.details:
        body.append(exp.details(rows))
    if figure_note:
        body.append(figure_note + "\n")
    body.append(verdict_block(verdicts, "from these runs"))
    body = "\n".join(body)
    return f"# {name}\n\n> {exp.claim}\n>\n> ({exp.original})\n\n" + body, verdicts, body


def budget_line(rows):
    """Each run's configured budget (steps and training tokens, from its config.json), grouped by arm when
    the arms' budgets differ, the seeds, and the runs that stopped before it: the non-finite guard's.
    (It read the last logged step until no-norm's runs, whose guard-stopped runs made it say "Budget:
    75, 90, 300 steps".)"""
    budgets = {}  # (steps, tokens) -> its arms
    for r in rows:
        budgets.setdefault((r.get("steps"), r.get("tokens")), {})[r["arm"]] = None
    seeds = sorted({r["seed"] for r in rows})

    def words(steps, tokens):
        return (f"{steps if steps is not None else 'unknown'} steps, {f'{tokens:,}' if tokens else 'unknown'} "
                "training tokens")
    if len(budgets) == 1:
        text = f"Budget: {words(*next(iter(budgets)))} per run"
    else:
        text = "Budget per run: " + "; ".join(f"{words(*b)} ({', '.join(arms)})" for b, arms in budgets.items())
    text += f"; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}."
    stopped = [r for r in rows if r.get("last_step") and r.get("steps") and r["last_step"] < r["steps"]]
    if stopped:
        text += (" Stopped before the end by the non-finite guard: " +
                 ", ".join(f"{r['run']} (at step {r['last_step']})" for r in stopped) + ".")
    return text + "\n"


def page_line(name, rows):
    """[the line naming the runs whose figures are a --doc page's, not --out's (page.runs_beside)], or []."""
    table = [r["run"] for r in rows if r.get("from") == "table"]
    kept = [r["run"] for r in rows if r.get("from") == "page"]
    if not (table or kept):
        return []
    text = "Not in --out, so read from the page this report is written into:"
    if table:
        text += (f" {', '.join(table)}, from its tables as printed (the final validation loss to 3 decimals; no "
                 "curves, so not drawn);")
    if kept:
        text += f" {', '.join(kept)}, from the figures kept beside it (experiments/{name}-runs.json);"
    return [text[:-1] + ".\n"]


def table(rows, target):
    head = ("| run | final val loss | unigram baseline - val loss | \\|dL/dx\\| embeddings / top, step 1 | "
            f"same, last step | steps to train loss {target:.2f} | diverged | time (s) |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['run']} | {fmt(r['val_loss'])} | {fmt(_below(r))} | {fmt(r['ratio_init'])} | "
        f"{fmt(r['ratio_final'])} | {fmt(r['steps_to_target'])} | {'yes' if r['diverged'] else 'no'} | "
        f"{fmt(r.get('seconds'), 0) if r.get('seconds') is not None else 'not logged'} |\n" for r in rows)


def arm_table(rows):
    """Per arm, over its seeds: the mean final validation loss and the seeds' spread (max - min)."""
    head = ("| arm | seeds | mean final val loss | spread over seeds (max - min) | unigram baseline - mean |\n"
            "|---|---|---|---|---|\n")
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        mean, spread = arm_mean(rows, arm, "val_loss"), seed_spread(rows, [arm])
        baseline = mine[0].get("unigram_baseline")
        unmeasured = "one seed" if len(mine) < 2 else "not measured: diverged"   # seed_spread leaves those out
        lines.append(f"| {arm} | {', '.join(str(r['seed']) for r in mine)} | {fmt(mean)} | "
                     f"{fmt(spread) if math.isfinite(spread) else unmeasured} | "
                     f"{fmt(baseline - mean) if baseline is not None else 'nan'} |\n")
    return head + "".join(lines)


def learned_line(rows):
    """The unigram baseline, and whether every run that trained ended LEARNED nats under it.

    A run that did not diverge is read in one of two ways (issue 28's re-budget): one that ended at or
    above the baseline did not train (nothing learned beyond the tokens' frequencies: a failure, as a
    divergence is, and the effect some claims predict: post-norm at lr 3e-3, a deep stack without
    skips); one that ended under it by less than LEARNED trained, but short of the mark: at its
    budget (which a longer one may change) or at its arm's setting (no-norm's raised rates)."""
    baselines = sorted({r["unigram_baseline"] for r in rows if r.get("unigram_baseline") is not None})
    if not baselines:
        return "The data directory's meta.json has no unigram baseline: whether the runs learned is not measured.\n"
    short = [r for r in rows if not r["diverged"] and not _below(r) >= LEARNED]
    stuck, slow = [r for r in short if not _below(r) > 0], [r for r in short if _below(r) > 0]
    # the arms share their data, so one number (or one per data directory, if --set says so)
    text = (f"Unigram baseline of the validation tokens: {', '.join(f'{b:.3f}' for b in baselines)} nats/token; a "
            "final validation loss below it learned more than the tokens' frequencies. ")
    if stuck:
        text += ("Runs that did not diverge yet did not train (ended at or above it): " +
                 ", ".join(f"{r['run']} ({fmt(r['val_loss'])})" for r in stuck) + ". ")
    if not any(not r["diverged"] and _below(r) > 0 for r in rows):
        return text + "No run trained.\n"
    if not slow:
        return text + f"Every run that trained ended at least {LEARNED:.1f} nats under it.\n"
    return text + (f"Runs that trained but ended less than {LEARNED:.1f} nats under it: " +
                   ", ".join(f"{r['run']} ({fmt(r['val_loss'])})" for r in slow) + ".\n")


def time_line(rows):
    """The runs' training time, from their logs, and the load the machine was under."""
    seconds = [r["seconds"] for r in rows if r.get("seconds") is not None]
    loads = [x for r in rows for x in r.get("load", [])]
    if not seconds:
        return "Time: not logged (the runs have no log in logs/).\n"
    total = sum(seconds)
    text = (f"Time: the {len(seconds)} runs' wall times add up to {int(total // 60)} min {total % 60:.0f} s (each "
            "from its own log)")
    if len(seconds) < len(rows):
        text += f"; {len(rows) - len(seconds)} runs have no time logged"
    stopped = sum(1 for r in rows if r.get("untimed_by_train"))
    if stopped:
        text += (f"; {stopped} run{'s' if stopped > 1 else ''} without a \"done\" line (stopped before the end) timed "
                 "by the experiment, start-up included")
    threads = sorted({n for r in rows for n in r.get("threads", [])})
    if threads:
        text += f"; {' or '.join(map(str, threads))} thread{'s' if threads != [1] else ''} per run (ANDREA_NUM_THREADS)"
    if loads:
        low, high = f"{min(loads):.1f}", f"{max(loads):.1f}"
        span = low if low == high else f"{low} to {high}"
        text += f"; 1-minute load average {span} at the runs' ends"
        cores = os.cpu_count() or 1
        if max(loads) > cores + 0.5:  # one busy thread per core reads about `cores`
            text += f" (more than this machine's {cores} cores: other work shared them, a time measured under load)"
    return text + ".\n"


def draw(name, rows):
    """The figure: validation (and faint training) loss against steps; |dL/dx| against depth."""
    fig = new_figure("andrea.experiment", figsize=(11, 4.2), dpi=90)
    loss_ax, depth_ax = fig.subplots(1, 2)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for r in rows:
        colour = f"C{arms.index(r['arm']) % 10}"
        # a run read from a --doc page's tables has no curves: the first seed drawn is the first that has
        first_seed = r["seed"] == min((x["seed"] for x in rows if x["arm"] == r["arm"] and x["losses"]), default=None)
        if r["losses"]:
            loss_ax.plot(*zip(*r["losses"]), color=colour, alpha=0.25, lw=0.8)
        if r["vals"]:
            loss_ax.plot(*zip(*r["vals"]), color=colour, lw=2 if first_seed else 1, marker="o", ms=3,
                         label=r["arm"] if first_seed else None)
        if first_seed and r["grad_final"]:
            depth_ax.plot(r["grad_init"], color=colour, ls="--", lw=1)
            depth_ax.plot(r["grad_final"], color=colour, lw=2, label=r["arm"])
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (nats/token): validation (dots), training (faint)")
    loss_ax.set_title(f"{name}: loss" + _cut_blown_up(loss_ax, rows))
    label_depth_axis(depth_ax, "gradient norm against depth: step 1 (dashed), last step")
    for ax in (loss_ax, depth_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # runs without a gradient-flow log draw no line there
            ax.legend(fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _cut_blown_up(ax, rows):
    """Cut the loss axis off at twice the largest first loss when a run went above that: the losses of
    no-norm's runs without LayerNorm at lr 3e-2 reached 4e6, which flattened every other curve to a
    line. Returns the title's words for the cut ("" when nothing was cut)."""
    finite = [v for r in rows for _, v in r["losses"] + r["vals"] if math.isfinite(v)]
    firsts = [r["losses"][0][1] for r in rows if r["losses"] and math.isfinite(r["losses"][0][1])]
    if not firsts or max(finite) <= 2 * max(firsts):
        return ""
    ax.set_ylim(min(finite) - 0.25, 2 * max(firsts))
    return f" (cut off above {2 * max(firsts):.1f})"


def save_results(out, name, text, results, figure):
    """The figure (None: not drawn), the report beside it, and results.json last: its presence marks
    the directory as this experiment's."""
    if figure is not None:
        with atomic_writer(out / f"{name}.png") as f:
            f.write(figure)
    with atomic_writer(out / "results.md") as f:
        f.write(text.encode() + (f"\n![{name}]({name}.png)\n".encode() if figure is not None else b""))
    with atomic_writer(out / "results.json") as f:
        f.write(json.dumps(results, indent=1).encode())
