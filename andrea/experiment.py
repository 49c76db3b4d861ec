"""The design document's claims as experiments: `python -m andrea.experiment NAME`.

    python -m andrea.experiment residual      # 12 layers with and without residual connections
    python -m andrea.experiment norm          # pre-norm and post-norm, each with and without LR warmup
    python -m andrea.experiment activation    # GELU and ReLU at the same parameter count
    python -m andrea.experiment mlp-ratio     # the MLP's expansion 1, 2, 4 and 8
    python -m andrea.experiment swiglu        # SwiGLU at 8/3 the width against GELU at 4x, same parameters
    python -m andrea.experiment no-norm       # no LayerNorm anywhere against pre-norm, at lr 3e-3 and 3e-2
    python -m andrea.experiment depth         # |dL/dx| through 12, 48, 96, 192 thin blocks, with and without skips
    python -m andrea.experiment composition   # the logit lens and each head's attention distance, by depth
    python -m andrea.experiment residual --scale 4 --seeds 0,1,2,3,4   # 4x the steps, five seeds
    python -m andrea.experiment swiglu --seeds 3,4     # two more seeds; the report covers every finished one

Each experiment trains its arms (the matched variants) with andrea.train on the default corpus, on
the default model's shape (LEARNS) for a budget at which every arm that trains ends more than
LEARNED nats under the corpus's unigram baseline (a run that ends above it did not train at all: the
report names it); each seed gives every arm the same initial draws and the same batches in the same
order, and every arm the same token budget; three seeds by default. A verdict comparing arms reads
the per-seed differences between them, their mean and 95% t-interval (andrea/experiments/paired.py):
a claim that one arm ends lower is supported when the interval lies above 0 and contradicted when
below; a claim of "no worse" or "comparable" is supported when it lies below the experiment's
stated margin (in nats), contradicted when above; else the claim is left open, and the report says
about how many seeds would settle it. The runs log their gradient flow (train.log_grad_flow). It then
writes, in --out (default runs/experiments/NAME):

    <arm>-seed<k>/    each training run (metrics.jsonl, config.json, a checkpoint, loss.png)
    logs/             each run's console output, with the machine's load at its end
    NAME.png          loss against steps, and the gradient norm against depth at step 1 and at the end
                      (without matplotlib, the report says it was not drawn, and the rest is written)
    results.md        the tables (per run: final validation loss, its distance under the unigram
                      baseline, |dL/dx| at the embeddings over the top of the stack, steps to a loss,
                      diverged or not, time; per arm: the mean over seeds and their spread) and the verdicts
    results.json      the same numbers

The verdict rules are written next to each experiment, fixed before the runs (a rule rewritten says
why beside it). Ctrl-C stops the experiment after the current arm's step (that arm keeps a
checkpoint); the same command again keeps the arms that finished, resumes that one from its
checkpoint and trains the rest (an arm directory holding a run of another config, e.g. another
--steps, is trained again). Other seeds, `--seeds 3,4`, are trained beside the finished ones, and
the report covers every finished run of this config in --out. Two commands may train into one --out
at the same time when their runs differ (`--arms` or `--seeds` halves, one per core); one that would
train a run the other is training is refused before it writes anything. `--report-only` writes the
tables, figure and verdicts from the runs that finished, and `--doc docs/experiments.md` also writes
them into that page's section for the experiment and its at-a-glance table (every arm of every seed
must have finished), and keeps every run's figures beside it in experiments/NAME-runs.json
(andrea/experiments/runfile.py); the page's runs of seeds that --out does not hold (their runs gone)
join the report with the page's figures, so `--seeds 3,4` adds seeds to a page whose first runs are
gone. `--from-doc docs/experiments.md` judges the page's own per-run figures again with the current
rules, without the runs: those kept beside it at full precision, else its tables as printed.
Everything after the experiment's name is optional; `--set section.key=value` changes every arm
(applied last), e.g. a data directory or a smaller model for a quick look.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.errors import UserError
from andrea.experiments import EXPERIMENTS, page
from andrea.experiments.runs import run_experiment


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.experiment", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(EXPERIMENTS), help="which claim to test")
    ap.add_argument("--out", help="where the runs, figure and table go (default runs/experiments/NAME)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the default number of steps (e.g. 4)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (instead of the default budget)")
    ap.add_argument("--seeds", help="comma-separated seeds to train (default: the experiment's, 0,1,2); the report "
                                    "covers them and every other seed already finished in --out")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value in every arm, applied last (repeatable)")
    ap.add_argument("--arms", help="comma-separated arms to run (default: all; e.g. to run arms in parallel "
                                   "processes, then --report-only)")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: the table, figure and verdict from the finished runs already in --out")
    ap.add_argument("--doc", metavar="FILE.md",
                    help="also write the table, verdicts and figure into FILE's section for this experiment (between "
                         "its marker lines; the figure in experiments/NAME.png beside it, each run's figures in "
                         "experiments/NAME-runs.json) and its rows of FILE's at-a-glance table, e.g. "
                         "docs/experiments.md; FILE's runs of seeds --out lacks join the report")
    ap.add_argument("--from-doc", metavar="FILE.md",
                    help="train nothing and read no runs: judge again, with the current rules, the per-run figures "
                         "that FILE keeps beside it (experiments/NAME-runs.json), else its section's tables, and "
                         "write the verdicts and at-a-glance rows back into FILE (the tables and figure stay as the "
                         "runs wrote them)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    command = "python -m andrea.experiment " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_doc:
        return _from_doc(args, command)
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise UserError(f"--scale must be positive and finite, got {args.scale}")
    if args.steps is not None and args.steps < 2:
        raise UserError(f"--steps must be at least 2, got {args.steps}")
    seeds = _seeds(args.seeds)
    arms = args.arms.split(",") if args.arms else None
    unknown = sorted(set(arms or ()) - set(EXPERIMENTS[args.name].arms))
    if unknown:
        raise UserError(f"--arms: {', '.join(unknown)} is not an arm of {args.name}; its arms are "
                        f"{', '.join(EXPERIMENTS[args.name].arms)}")
    if args.doc and arms and set(arms) != set(EXPERIMENTS[args.name].arms):
        raise UserError("--doc writes the verdicts of every arm: drop --arms (train the arms in parts without "
                        "--doc, then write the page with --report-only --doc)")
    text = run_experiment(args.name, args.out or Path("runs/experiments") / args.name, args.steps, args.scale,
                          seeds, args.set, command, args.report_only, arms, args.doc)
    print(text)
    return 0


def _seeds(text):
    """--seeds as a list of integers (None when not given): train.seed's range, each once."""
    if not text:
        return None
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds must be integers separated by commas, got {text!r}") from None
    if any(not 0 <= s < 2**63 for s in seeds):
        raise UserError(f"--seeds must be between 0 and 2^63 - 1, got {text!r}")
    return list(dict.fromkeys(seeds))


def _from_doc(args, command):
    """--from-doc: the page's figures judged again (andrea.experiments.page.rejudge); it takes no other flag."""
    given = [flag for flag, value in (("--out", args.out), ("--steps", args.steps), ("--seeds", args.seeds),
                                      ("--set", args.set), ("--arms", args.arms), ("--report-only", args.report_only),
                                      ("--doc", args.doc), ("--scale", args.scale != 1.0)) if value]
    if given:
        raise UserError(f"--from-doc reads only the page: drop {', '.join(given)}")
    print(page.rejudge(args.from_doc, args.name, EXPERIMENTS[args.name], command))
    return 0


if __name__ == "__main__":
    run_cli(main)
