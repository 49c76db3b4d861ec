"""The design document's claims as experiments: `python -m andrea.experiment NAME`.

    python -m andrea.experiment residual      # 12 thin layers with and without residual connections
    python -m andrea.experiment norm          # pre-norm and post-norm, each with and without LR warmup
    python -m andrea.experiment activation    # GELU and ReLU at the same parameter count, three seeds
    python -m andrea.experiment mlp-ratio     # the MLP's expansion 1, 2, 4 and 8
    python -m andrea.experiment residual --scale 4 --seeds 0,1   # 4x the steps, two seeds

Each experiment trains its arms (the matched variants) with andrea.train on the default corpus,
all with the same seed, hence the same initial draws and the same batches in the same order, and
the same token budget; the runs log their gradient flow (train.log_grad_flow). It then writes, in
--out (default runs/experiments/NAME):

    <arm>-seed<k>/    each training run (metrics.jsonl, config.json, a checkpoint, loss.png)
    logs/             each run's console output
    NAME.png          loss against steps, and the gradient norm against depth at step 1 and at the end
    results.md        the table (final validation loss, |dL/dx| at the embeddings over the top of the
                      stack, steps to a loss, diverged or not) and the verdict on the claim
    results.json      the same numbers

The verdict rules are written next to each experiment below, fixed before the runs. Ctrl-C stops
the experiment after the current arm's step (that arm keeps a checkpoint); the same command again
keeps the arms that finished, resumes that one from its checkpoint and trains the rest (an arm
directory holding a run of another config, e.g. another --steps, is trained again); `--report-only`
writes the table, figure and verdict from the arms that finished. Everything after the
experiment's name is optional; `--set section.key=value` changes every arm (applied
last), e.g. a data directory or a smaller model for a quick look.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.errors import UserError
from andrea.files import atomic_writer
from andrea.run.figure import label_depth_axis, new_figure, require_matplotlib
from andrea.run.gradflow import check_flow, embedding_ratio
from andrea.run.preflight import check_directory

# small enough that an arm takes about a minute on 2 loaded CPU cores
THIN = ["model.context_length=64", "model.d_model=64", "model.n_head=4",
        "train.batch_size=8", "train.seq_len=64", "train.eval_batches=8"]


@dataclass
class Experiment:
    claim: str                     # the design document's claim, in English
    original: str                  # its words in the design document (Portuguese)
    base: list                     # overrides every arm shares
    arms: dict                     # arm name -> its own overrides
    steps: int                     # the default budget, in optimizer steps
    seeds: list = field(default_factory=lambda: [0])
    judge: object = None           # results -> (verdict, why)


def _mean(rows, arm, key):
    values = [r[key] for r in rows if r["arm"] == arm and r[key] is not None and math.isfinite(r[key])]
    return statistics.fmean(values) if values else math.nan


def _spread(rows, arm, key):
    values = [r[key] for r in rows if r["arm"] == arm]
    return max(values) - min(values) if len(values) > 1 else 0.0


def judge_residual(rows):
    """Supports: without residuals the embeddings get under a tenth of the residual stack's share of
    the top's gradient at the start, and the run ends at a higher loss. Contradicts: they get as
    much or more. Anything else leaves it open."""
    with_r, without = _mean(rows, "residual", "ratio_init"), _mean(rows, "no-residual", "ratio_init")
    loss_r, loss_n = _mean(rows, "residual", "val_loss"), _mean(rows, "no-residual", "val_loss")
    why = (f"at step 1 the embeddings receive {without:.3g} of the top's gradient norm without residuals and "
           f"{with_r:.3g} with them; final validation loss {loss_n:.3f} without, {loss_r:.3f} with")
    if without < with_r / 10 and not loss_n <= loss_r:
        return "supports", why
    if without >= with_r:
        return "contradicts", why
    return "leaves open", why


def judge_identity(rows):
    """Claim 3 from the residual stack's first step: supports if every sublayer changes the stream
    by under 30% of its norm at initialisation, contradicts if one changes it by more than it is."""
    deltas = [r["delta_init_max"] for r in rows if r["arm"] == "residual"]
    if not deltas:
        return "leaves open", "the residual arm has not run"
    worst = max(deltas)
    why = f"at step 1 the largest sublayer change is {worst:.3g} of the stream it is added to"
    if worst < 0.3:
        return "supports", why
    return ("contradicts" if worst > 1 else "leaves open"), why


def judge_norm(rows):
    """Supports: post-norm without warmup ends worse than post-norm with warmup, by more than the
    seeds' spread, and pre-norm without warmup ends no worse than pre-norm with it (within that
    spread). Contradicts: post-norm without warmup ends no worse than with it."""
    pn, pw = _mean(rows, "post-no-warmup", "val_loss"), _mean(rows, "post-warmup", "val_loss")
    rn, rw = _mean(rows, "pre-no-warmup", "val_loss"), _mean(rows, "pre-warmup", "val_loss")
    noise = max(_spread(rows, a, "val_loss") for a in ("post-no-warmup", "post-warmup", "pre-no-warmup", "pre-warmup"))
    diverged = [r["run"] for r in rows if r["diverged"]]
    why = (f"final validation loss: post-norm {pn:.3f} without warmup, {pw:.3f} with; pre-norm {rn:.3f} "
           f"without, {rw:.3f} with; seed spread {noise:.3f}; diverged: {', '.join(diverged) or 'none'}")
    if (pn - pw > noise or "post-no-warmup" in " ".join(diverged)) and rn - rw <= max(noise, 0.01):
        return "supports", why
    if pn <= pw:
        return "contradicts", why
    return "leaves open", why


def judge_activation(rows):
    """Supports: GELU's mean final validation loss is lower than ReLU's by more than the larger of
    the two arms' spread over seeds; contradicts: ReLU's is lower by that much; else open."""
    gelu, relu = _mean(rows, "gelu", "val_loss"), _mean(rows, "relu", "val_loss")
    noise = max(_spread(rows, "gelu", "val_loss"), _spread(rows, "relu", "val_loss"))
    why = f"mean final validation loss GELU {gelu:.3f}, ReLU {relu:.3f}, over seeds spread {noise:.3f}"
    if relu - gelu > noise:
        return "supports", why
    if gelu - relu > noise:
        return "contradicts", why
    return "leaves open", why


def judge_mlp_ratio(rows):
    """Supports: the loss falls from ratio 1 to 2 to 4, and the gain from 4 to 8 is smaller than
    the gain from 2 to 4. Contradicts: 4 is no better than 2, or 8 gains more than 4 did."""
    loss = {r: _mean(rows, f"ratio-{r}", "val_loss") for r in (1, 2, 4, 8)}
    why = "final validation loss " + ", ".join(f"ratio {r}: {v:.3f}" for r, v in loss.items())
    if loss[1] > loss[2] > loss[4] and loss[4] - loss[8] < loss[2] - loss[4]:
        return "supports", why
    if loss[4] >= loss[2] or loss[4] - loss[8] > loss[2] - loss[4]:
        return "contradicts", why
    return "leaves open", why


EXPERIMENTS = {
    "residual": Experiment(
        claim="A 12-layer stack without residuals would lose the gradient signal long before it reached "
              "the embeddings; with residuals the gradient magnitude stays usable through hundreds of layers.",
        original="Uma pilha de 12 camadas sem resíduos perderia o sinal de gradiente muito antes de alcançar os "
                 "embeddings; com resíduos, a magnitude do gradiente permanece utilizável através de centenas de "
                 "camadas.",
        base=THIN + ["model.n_layer=12"],
        arms={"residual": [], "no-residual": ["model.residual=false"]},
        steps=150, judge=judge_residual),
    "norm": Experiment(
        claim="Post-norm trains poorly without learning-rate warmup and careful tuning; its gradients explode "
              "in the early layers. Pre-norm trains stably.",
        original="O pós-norm treina mal sem aquecimento de LR e ajuste cuidadoso de hiperparâmetros. Os gradientes "
                 "explodem nas camadas iniciais [...] O treinamento pré-norm é estável.",
        base=THIN + ["model.n_layer=12"],
        arms={"pre-warmup": [], "pre-no-warmup": ["train.warmup_steps=0"],
              "post-warmup": ["model.norm=post"], "post-no-warmup": ["model.norm=post", "train.warmup_steps=0"]},
        steps=150, judge=judge_norm),
    "activation": Experiment(
        claim="GELU reaches a lower loss than ReLU at the same parameter count; its smooth curve gives cleaner "
              "gradients.",
        original="Empiricamente, transformers treinados com GELU alcançam perda menor do que transformers treinados "
                 "com ReLU com o mesmo número de parâmetros. [...] a curva suave do GELU fornece gradientes mais "
                 "limpos para a retropropagação.",
        base=THIN + ["model.n_layer=4"],
        arms={"gelu": [], "relu": ["model.activation=relu"]},
        steps=150, seeds=[0, 1, 2], judge=judge_activation),
    "mlp-ratio": Experiment(
        claim="The 4x MLP expansion: smaller ratios lose capacity, larger ones give diminishing returns.",
        original="Proporções menores reduzem a capacidade do modelo. Proporções maiores produzem retornos "
                 "decrescentes por parâmetro gasto.",
        base=THIN + ["model.n_layer=4"],
        arms={f"ratio-{r}": [f"model.mlp_ratio={r}"] for r in (1, 2, 4, 8)},
        steps=150, judge=judge_mlp_ratio),
}
EXIT_INTERRUPTED = 130
COMMON = ["train.log_grad_flow=true", "train.sample_tokens=0", "train.device=cpu"]


# ----------------------------------------------------------------------------- running the arms


def train_arm(out_dir: Path, overrides: list, log_path: Path, resume: bool = False) -> int:
    """One andrea.train run, its console output into log_path (added to it when resuming); returns its
    exit code. A fresh run replaces what out_dir holds; `resume` continues the run there."""
    from andrea import train

    argv = ["--out", str(out_dir), "--resume"] if resume else ["--config", "tiny", "--out", str(out_dir), "--overwrite"]
    for o in [] if resume else overrides:
        argv += ["--set", o]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a" if resume else "w", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            return train.main(argv)
        except UserError as e:
            print(f"error: {e}")
            return 2


def summarise(run_dir: Path, arm: str, seed: int, code: int, target: float | None = None) -> dict:
    """The numbers of one run, from its metrics.jsonl."""
    from andrea.run.runlog import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else {}
    losses = _logged(records, "loss", (int, float))
    vals = _logged(records, "val_loss", (int, float))
    where = run_dir / "metrics.jsonl"
    flows = [(s, check_flow(f, f"{where} step {s}")) for s, f in _logged(records, "grad_flow", dict)]
    val = vals[-1][1] if vals else math.nan
    first = losses[0][1] if losses else math.nan
    init = flows[0][1] if flows else None
    final = flows[-1][1] if flows else None
    return {
        "run": run_dir.name, "arm": arm, "seed": seed, "exit_code": code,
        "val_loss": val, "first_loss": first,
        "diverged": code != 0 or not math.isfinite(val) or val >= first,
        "ratio_init": embedding_ratio(init) if init else math.nan,
        "ratio_final": embedding_ratio(final) if final else math.nan,
        "delta_init_max": max(init["attn_delta"] + init["mlp_delta"]) if init else math.nan,
        "losses": losses, "vals": vals, "unigram_baseline": _baseline(run_dir),
        "grad_init": init["grad_in"] + [init["grad_top"]] if init else [],
        "grad_final": final["grad_in"] + [final["grad_top"]] if final else [],
    }


def _baseline(run_dir):
    """The unigram baseline of the run's validation tokens (andrea.run.rundata.unigram_baseline), or None."""
    from andrea.config import make_config
    from andrea.run.rundata import unigram_baseline
    from andrea.run.runlog import read_saved_config

    try:
        return unigram_baseline(make_config(read_saved_config(run_dir)))
    except UserError:
        return None


def _logged(records, key, kind):
    """[(step, value)] of the steps whose record holds `key` as a `kind`, in step order."""
    return [(s, records[s][key]) for s in sorted(records) if isinstance(records[s].get(key), kind)]


def steps_to(rows, target):
    """The first logged step at which each run's training loss is at or below target (None: never)."""
    for r in rows:
        r["steps_to_target"] = next((s for s, loss in r["losses"] if loss <= target), None)


def default_target(rows):
    """A loss every run that did not diverge reaches by the end: the highest of their last logged
    training losses, rounded up to 0.05 nats."""
    finals = [r["losses"][-1][1] for r in rows if not r["diverged"] and r["losses"]]
    return math.ceil(max(finals) * 20) / 20 if finals else math.nan


# ----------------------------------------------------------------------------- the report


def _fmt(x, digits=3):
    if x is None:
        return "never"
    if isinstance(x, float):
        return "nan" if not math.isfinite(x) else f"{x:.{digits}g}" if abs(x) < 0.01 else f"{x:.{digits}f}"
    return str(x)


def table(rows, target):
    head = ("| run | final val loss | \\|dL/dx\\| embeddings / top, step 1 | same, last step | "
            f"steps to train loss {target:.2f} | diverged |\n|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['run']} | {_fmt(r['val_loss'])} | {_fmt(r['ratio_init'])} | {_fmt(r['ratio_final'])} | "
        f"{_fmt(r['steps_to_target'])} | {'yes' if r['diverged'] else 'no'} |\n" for r in rows)


def draw(name, rows):
    """The figure: validation (and faint training) loss against steps; |dL/dx| against depth."""
    fig = new_figure("andrea.experiment", figsize=(11, 4.2), dpi=90)
    loss_ax, depth_ax = fig.subplots(1, 2)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for r in rows:
        colour = f"C{arms.index(r['arm']) % 10}"
        first_seed = r["seed"] == min(x["seed"] for x in rows if x["arm"] == r["arm"])
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
    loss_ax.set_title(f"{name}: loss")
    label_depth_axis(depth_ax, "gradient norm against depth: step 1 (dashed), last step")
    for ax in (loss_ax, depth_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def report(name, exp, rows, target, command):
    verdicts = [("claim", *exp.judge(rows))]
    if name == "residual":
        verdicts.append(("claim 3 (near identity at initialisation)", *judge_identity(rows)))
    lines = [f"# {name}\n", f"> {exp.claim}\n>\n> ({exp.original})\n",
             f"Command: `{command}`\n", table(rows, target)]
    baselines = sorted({r["unigram_baseline"] for r in rows if r.get("unigram_baseline") is not None})
    if baselines:  # the arms share their data, so one number (or one per data directory, if --set says so)
        lines.append(f"Unigram baseline of the validation tokens: {', '.join(f'{b:.3f}' for b in baselines)} "
                     "nats/token; a final validation loss below it learned more than the tokens' frequencies.\n")
    for what, verdict, why in verdicts:
        lines.append(f"\n**{what}: {verdict}**: {why}.\n")
    return "\n".join(lines), verdicts


def arm_state(run_dir: Path, sets: list) -> str:
    """What run_dir holds for an arm trained with `sets`: "finished" (this arm's run, to its end),
    "interrupted" (this arm's run, with a checkpoint to resume from), or "new" (nothing of this arm:
    missing, never checkpointed, or a run of another config, e.g. another --steps, which is retrained)."""
    from andrea.config import make_config
    from andrea.run import checkpoint as ckpt
    from andrea.run.launch import config_differences
    from andrea.run.runlog import read_saved_config

    if not (run_dir / "config.json").is_file():
        return "new"
    try:
        differ = config_differences("tiny", sets, make_config(read_saved_config(run_dir)))
    except UserError:
        return "new"
    if differ:
        print(f"{run_dir} holds a run of another config ({', '.join(differ[:3])} differ): trained again",
              file=sys.stderr, flush=True)
        return "new"
    if finished(run_dir):
        return "finished"
    return "interrupted" if ckpt.list_checkpoints(run_dir) else "new"


def finished(run_dir: Path) -> bool:
    """Whether run_dir holds a run that trained to its train.max_steps."""
    from andrea.run.runlog import read_metrics

    try:
        max_steps = json.loads((run_dir / "config.json").read_text())["train"]["max_steps"]
        return max(read_metrics(run_dir / "metrics.jsonl"), default=0) == max_steps
    except (OSError, ValueError, KeyError, UserError):
        return False


def run_experiment(name, out, steps=None, scale=1.0, seeds=None, extra=(), command="", report_only=False,
                   arms=None):
    exp = EXPERIMENTS[name]
    out = Path(out)
    _check_out(out)
    n_steps = steps or max(2, round(exp.steps * scale))
    interval = max(1, n_steps // 15)
    budget = [f"train.max_steps={n_steps}", f"train.log_interval={interval}",
              f"train.eval_interval={max(1, n_steps // 5)}", f"train.checkpoint_interval={n_steps}",
              f"train.warmup_steps={max(1, n_steps // 10)}"]
    rows = []
    for seed in seeds or exp.seeds:
        for arm, overrides in exp.arms.items():
            if arms and arm not in arms:
                continue
            run_dir = out / f"{arm}-seed{seed}"
            if report_only:
                if finished(run_dir):
                    rows.append(summarise(run_dir, arm, seed, 0))
                else:
                    print(f"{name}: {run_dir} has no finished run: left out", file=sys.stderr, flush=True)
                continue
            sets = exp.base + budget + COMMON + overrides + [f"train.seed={seed}"] + list(extra)
            rows.append(summarise(run_dir, arm, seed, _train_to_the_end(name, run_dir, sets, out / "logs", n_steps)))
    if not rows:
        raise UserError(f"{out} holds no finished run of this experiment: run it without --report-only")
    target = default_target(rows)
    steps_to(rows, target)
    text, verdicts = report(name, exp, rows, target, command)
    _save(out, name, text, {"experiment": name, "steps": n_steps, "target": target, "rows": rows,
                            "verdicts": verdicts}, draw(name, rows))
    return text


def _check_out(out):
    """Refuse, before any training, what would fail later: no matplotlib to draw the figure with, an
    --out that cannot be a directory, or one holding something else than this experiment's runs."""
    require_matplotlib("andrea.experiment")  # the figure comes last: say now, not after the training
    check_directory(out, "--out")
    if out.exists() and any(out.iterdir()) and not (out / "results.json").exists() and not (out / "logs").exists():
        raise UserError(f"{out} holds something that is not this experiment's: choose another --out")


def _train_to_the_end(name, run_dir, sets, logs, n_steps):
    """Train one arm, or resume it, or keep it when it has finished already; its exit code. A run that
    did not start is an error, and Ctrl-C in it stops the experiment, not just this arm: that arm keeps
    its checkpoint, and the same command again resumes it (and keeps the arms that finished)."""
    state = arm_state(run_dir, sets)
    if state == "finished":
        print(f"{name}: {run_dir.name} has finished already: kept", file=sys.stderr, flush=True)
        return 0
    doing = "resuming" if state == "interrupted" else "training"
    print(f"{name}: {doing} {run_dir.name} ({n_steps} steps)", file=sys.stderr, flush=True)
    log = logs / f"{run_dir.name}.log"
    code = train_arm(run_dir, sets, log, resume=state == "interrupted")
    if code == 2:
        raise UserError(f"{run_dir.name} did not start: {_last_line(log)}")
    if code == EXIT_INTERRUPTED:
        print(f"{name}: interrupted in {run_dir.name}, which keeps its checkpoint; the same command again resumes "
              "it and keeps the arms that finished", file=sys.stderr, flush=True)
        raise KeyboardInterrupt
    return code


def _save(out, name, text, results, figure):
    """The figure, the report beside it, and results.json last: its presence marks the directory as
    this experiment's."""
    with atomic_writer(out / f"{name}.png") as f:
        f.write(figure)
    with atomic_writer(out / "results.md") as f:
        f.write(text.encode() + f"\n![{name}]({name}.png)\n".encode())
    with atomic_writer(out / "results.json") as f:
        f.write(json.dumps(results, indent=1).encode())


def _last_line(path):
    lines = [x for x in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.experiment", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(EXPERIMENTS), help="which claim to test")
    ap.add_argument("--out", help="where the runs, figure and table go (default runs/experiments/NAME)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the default number of steps (e.g. 4)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (instead of the default budget)")
    ap.add_argument("--seeds", help="comma-separated seeds (default: the experiment's; 0,1,2 for activation)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value in every arm, applied last (repeatable)")
    ap.add_argument("--arms", help="comma-separated arms to run (default: all; e.g. to run arms in parallel "
                                   "processes, then --report-only)")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: the table, figure and verdict from the finished runs already in --out")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise UserError(f"--scale must be positive and finite, got {args.scale}")
    if args.steps is not None and args.steps < 2:
        raise UserError(f"--steps must be at least 2, got {args.steps}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise UserError(f"--seeds must be integers separated by commas, got {args.seeds!r}") from None
    arms = args.arms.split(",") if args.arms else None
    unknown = sorted(set(arms or ()) - set(EXPERIMENTS[args.name].arms))
    if unknown:
        raise UserError(f"--arms: {', '.join(unknown)} is not an arm of {args.name}; its arms are "
                        f"{', '.join(EXPERIMENTS[args.name].arms)}")
    command = "python -m andrea.experiment " + " ".join(argv if argv is not None else sys.argv[1:])
    text = run_experiment(args.name, args.out or Path("runs/experiments") / args.name, args.steps, args.scale,
                          seeds, args.set, command, args.report_only, arms)
    print(text)
    return 0


if __name__ == "__main__":
    run_cli(main)
