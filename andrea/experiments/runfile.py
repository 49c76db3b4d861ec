"""The per-run figures kept beside a --doc page: experiments/NAME-runs.json, written with the page's
section by --doc and read back by --from-doc and by a later --doc, so that every interval on the
page can be computed again from the figures the rules read, at full precision, when the runs
themselves are gone, and seeds can be added to a page whose first runs are gone.

The file is JSON (Python's json writes a non-finite figure as NaN or Infinity, and reads it back):

    {"experiment": "swiglu",                   the experiment's name
     "command": "python -m andrea.experiment swiglu --report-only --doc docs/experiments.md",
     "about": "...",                           these lines, shortly
     "runs": [{"run": "gelu-4x-seed0", "arm": "gelu-4x", "seed": 0, "val_loss": 5.2041..., ...}, ...]}

one object per run, one line each, in the report's order, with every number the report read from
that run: its final validation loss `val_loss`, `unigram_baseline`, `diverged`, `seconds`, its
budget (`steps`, `tokens`), the gradient ratios, the probe's figures, and the curves the figure
draws (`losses` and `vals`: [step, loss] pairs; the gradient by depth). A run whose figures came
from a page's tables rather than from its directory (a page written before the file was kept) has
`"from": "table"`: its figures are the tables' as printed (the final validation loss to 3 decimals)
and it has no curves. A reader recomputes a paired interval with andrea.experiments.paired:
`paired.paired(runs, "gelu-4x", "swiglu-8_3x")` is SwiGLU - GELU per seed, its mean and 95%
t-interval, as the page's verdict line prints it (tests/e2e/test_experiment_runfile.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from andrea.errors import UserError
from andrea.files import atomic_writer

ABOUT = ("one object per run with the figures its report read, at full precision, and its curves (andrea/experiments/"
         "runfile.py); python -m andrea.experiment NAME --from-doc PAGE judges them again")


def path_of(doc, name) -> Path:
    """Where the page `doc` keeps the per-run figures of experiment `name`: beside its figure."""
    return Path(doc).parent / "experiments" / f"{name}-runs.json"


def write(doc, name, rows, command):
    """Keep `rows` (the report's, in its order) beside `doc`: one line a run."""
    head = json.dumps({"experiment": name, "command": command, "about": ABOUT})[:-1]
    text = head + ', "runs": [\n' + ",\n".join(json.dumps(r) for r in rows) + "\n]}\n"
    with atomic_writer(path_of(doc, name)) as f:
        f.write(text.encode())


def read(doc, name, arms) -> list | None:
    """The runs kept beside `doc` for experiment `name` (None when it keeps none), each checked to be
    a run of one of `arms` with a seed, a final validation loss and whether it diverged; anything
    else is one line naming the file and what to do."""
    path = path_of(doc, name)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _unreadable(path, f"it is not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("experiment") != name or not isinstance(obj.get("runs"), list):
        raise _unreadable(path, f'it is not an object with "experiment": "{name}" and a list of "runs"')
    for k, r in enumerate(obj["runs"]):
        if not _is_run(r, arms):
            raise _unreadable(path, f"its run {k} is not an object with run, arm (one of {', '.join(arms)}), seed, "
                                    "val_loss and diverged")
    return obj["runs"]


def _is_run(r, arms):
    return (isinstance(r, dict) and r.get("arm") in arms and isinstance(r.get("seed"), int)
            and r.get("run") == f"{r['arm']}-seed{r['seed']}" and isinstance(r.get("val_loss"), (int, float))
            and isinstance(r.get("diverged"), bool))


def _unreadable(path, why):
    return UserError(f"{path} cannot be read back: {why}: write it again from the runs (--report-only --doc), or "
                     "delete it to judge the page's tables as printed")


def check_against(kept, table_rows, name, path, fmt):
    """Refuse a kept file that is not the page's tables at full precision: the same runs, and each
    final validation loss and divergence as the table prints them (`fmt`: how it prints a figure)."""
    kept_runs, table_runs = {r["run"] for r in kept}, {r["run"] for r in table_rows}
    if kept_runs != table_runs:
        differ = sorted(kept_runs ^ table_runs)
        raise UserError(f"{path} and the section for {name} hold different runs ({', '.join(differ)} in one only): "
                        "write both from the runs (--report-only --doc), or delete the file to judge the tables")
    by_run = {r["run"]: r for r in kept}
    for t in table_rows:
        k = by_run[t["run"]]
        if fmt(float(k["val_loss"])) != fmt(t["val_loss"]) or k["diverged"] != t["diverged"]:
            raise UserError(f"the section for {name}: run {t['run']} prints a final val loss of {fmt(t['val_loss'])} "
                            f"(diverged: {'yes' if t['diverged'] else 'no'}), {path} keeps {k['val_loss']!r} "
                            f"(diverged: {'yes' if k['diverged'] else 'no'}): write both from the runs "
                            "(--report-only --doc), or delete the file to judge the tables as printed")
