"""Loss curves of training runs: `python -m andrea.plot RUN [RUN ...] [--out loss.png]`.

Each run directory (a train --out) gives its training loss (every log_interval steps, one batch
each, so noisy) and validation loss (every eval_interval steps) from metrics.jsonl, against the
tokens seen: step x batch_size x seq_len x micro-batches, from the run's config.json. The unigram
baseline of the run's data (the loss of predicting every token by its frequency in the training
tokens, from the data directory's meta.json) is drawn as a dashed line: a model below it has
learned more than token frequencies. Several runs share one figure, one colour each. An existing
--out is replaced only when andrea.plot drew it (the PNG's Software text says so): a command never
overwrites a file it did not create.
`--grad-flow` draws instead the gradient norm against depth of runs trained with
train.log_grad_flow (andrea.run.gradflow).

matplotlib comes from the optional `plot` extra; the figure is drawn on an Agg canvas of its own,
so nothing about the process's matplotlib backend changes.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.config import build_config
from andrea.errors import UserError
from andrea.files import atomic_writer
from andrea.run.figure import new_figure
from andrea.run.metrics import by_step, read_records
from andrea.run.preflight import check_output_file


@dataclass
class Curves:
    label: str
    train: list[tuple[int, float]] = field(default_factory=list)  # (tokens seen, loss)
    val: list[tuple[int, float]] = field(default_factory=list)
    baseline: float | None = None


def read_run(run_dir) -> Curves:
    """The loss curves of one run directory; a missing or empty metrics.jsonl is a UserError."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: give the --out directory of a training run")
    per_step = by_step(read_records(path, strict=True))
    if not per_step:
        raise UserError(f"{path} holds no loss yet: plot once training has logged a step")
    tokens_per_step, data_dir = _run_config(run_dir)
    curves = Curves(run_dir.name or str(run_dir))
    for step, r in sorted(per_step.items()):
        tokens = int(r.get("tokens", step * tokens_per_step))
        if isinstance(r.get("loss"), (int, float)):
            curves.train.append((tokens, float(r["loss"])))
        if isinstance(r.get("val_loss"), (int, float)):
            curves.val.append((tokens, float(r["val_loss"])))
    curves.baseline = _unigram_baseline(run_dir, data_dir)
    return curves


def _run_config(run_dir: Path) -> tuple[int, Path]:
    """(tokens per optimizer step, the data directory) from the run's config.json."""
    try:
        cfg = build_config(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot read {run_dir / 'config.json'} ({e}): is {run_dir} a training run?") from None
    m, t = cfg.model, cfg.train
    return t.batch_size * t.sequence_length(m) * t.accumulation_steps(m), cfg.data.resolved_dir()


def _unigram_baseline(run_dir: Path, data_dir: Path) -> float | None:
    """The validation unigram entropy of the run's data, when its data directory (relative to the
    working directory, as in training) is found and holds the run's tokenizer; else None."""
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        same = meta.get("tokenizer_fingerprint") == _tokenizer_fingerprint(run_dir / "tokenizer.json")
    except (OSError, ValueError, UserError):
        return None
    return float(meta["unigram_val_nats"]) if same and "unigram_val_nats" in meta else None


def _tokenizer_fingerprint(path: Path) -> str:
    from andrea.data.tokenizer import load_tokenizer  # tokenizers is a dependency, but plotting alone need not load it

    return load_tokenizer(path).fingerprint()


def draw(runs: list[Curves]):
    """A matplotlib Figure of the runs' curves (matplotlib imported here: it is optional)."""
    fig = new_figure("andrea.plot", figsize=(7, 4.2))
    from matplotlib.ticker import EngFormatter
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        name = run.label if len(runs) > 1 else ""
        if run.train:  # a run of one logged step is one point, which a line without a marker hides
            ax.plot(*zip(*run.train), color=colour, alpha=0.45, lw=1, marker="o" if len(run.train) == 1 else "",
                    ms=4, label=f"{name} train".strip())
        if run.val:
            ax.plot(*zip(*run.val), color=colour, lw=2, marker="o", ms=4, label=f"{name} validation".strip())
        if run.baseline is not None:
            ax.axhline(run.baseline, color=colour, ls="--", lw=1,
                       label=f"{name} unigram baseline {run.baseline:.2f}".strip())
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(runs[0].label if len(runs) == 1 else "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


SOFTWARE = "andrea.plot"  # the PNG's Software text chunk: the mark of a figure drawn here
_PNG = b"\x89PNG\r\n\x1a\n"


def drawn_here(path) -> bool:
    """Whether `path` is a PNG that andrea.plot drew (its text chunks precede the image data)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    return head.startswith(_PNG) and b"Software\x00" + SOFTWARE.encode() in head


def check_output(out, replace: bool = False) -> None:
    """Refuses, before anything is drawn, an --out that cannot be written, or that holds a file
    andrea.plot did not draw (unless `replace`: a training run's own loss.png)."""
    out = Path(out)
    check_output_file(out, "--out")
    if out.exists() and not replace and not drawn_here(out):
        raise UserError(f"--out {out} already exists and is not a figure drawn by andrea.plot: choose another "
                        "name, or move that file away")
    # what the write needs (a new file beside out, renamed over it), tried: permissions alone do not
    # tell, as a read-only mount, or root, shows
    parent = out.parent if str(out.parent) else Path(".")
    try:
        tempfile.NamedTemporaryFile(dir=parent, prefix=".tmp-plot-").close()
    except OSError as e:
        raise UserError(f"--out {out} cannot be written: {e.strerror or e} in {parent}; choose another --out") from None


def plot_runs(run_dirs, out, replace: bool = False) -> Path:
    """Draw the runs into the PNG `out` (written atomically) and return its path; see check_output."""
    check_output(out, replace)
    runs = [read_run(d) for d in run_dirs]
    labels = [r.label for r in runs]
    for run, d in zip(runs, run_dirs):
        if labels.count(run.label) > 1:  # out/a/tiny and out/b/tiny: the names alone do not tell them apart
            run.label = str(d)
    buffer = io.BytesIO()
    draw(runs).savefig(buffer, format="png", metadata={"Software": SOFTWARE})
    out = Path(out)
    with atomic_writer(out) as f:
        f.write(buffer.getvalue())
    return out


def plot_after_training(run_dir) -> str:
    """Draw RUN/loss.png at the end of a training run; returns the line that says where (or why not)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no loss plot: matplotlib is not installed (pip install -e '.[plot]', then python -m andrea.plot)"
    try:
        # the run directory is the run's own (andrea.run.rundir): its loss.png too, whoever drew it
        return f"loss plot: {plot_runs([run_dir], Path(run_dir) / 'loss.png', replace=True)}"
    except (UserError, OSError) as e:  # the run itself succeeded: a failed plot must not fail it
        return f"warning: no loss plot: {e}"


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.plot", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN", help="training run directories (train --out)")
    ap.add_argument("--out", help="the PNG to write (default loss.png, or grad_flow.png with --grad-flow)")
    ap.add_argument("--grad-flow", action="store_true",
                    help="draw the gradient norm against depth instead (runs trained with train.log_grad_flow)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    if args.grad_flow:
        from andrea.run.gradflow import plot_flow

        out = args.out or "grad_flow.png"
        check_output(out)  # as for the loss plot: never over a file andrea.plot did not draw
        path = plot_flow(args.runs, out, metadata={"Software": SOFTWARE})
    else:
        path = plot_runs(args.runs, args.out or "loss.png")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
