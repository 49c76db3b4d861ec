"""Running an experiment: each arm and seed an andrea.train run into its own directory (kept when it
finished, resumed when interrupted, trained again when its config changed), then the numbers of
each run (summarise) and the report (andrea.experiments.report)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from andrea.errors import UserError
from andrea.experiments import EXPERIMENTS, lock, page
from andrea.experiments.base import logged
from andrea.experiments.report import draw, report, save_results
from andrea.run.figure import require_matplotlib
from andrea.run.gradflow import check_flow, embedding_ratio
from andrea.run.preflight import check_directory
from minitensor.parallel import num_threads

EXIT_INTERRUPTED = 130
LOAD_LINE = "experiment: 1-minute load average at the end of this session:"
THREADS_LINE = "threads (ANDREA_NUM_THREADS; the numba kernels are bit-reproducible at a fixed count):"
SESSION_LINE = "experiment: this session's wall time, start-up included:"
# a validation loss this many nats above the run's first training loss: the run blew up (summarise)
ROSE = 1.0
COMMON = ["train.log_grad_flow=true", "train.sample_tokens=0", "train.device=cpu"]


def run_experiment(name, out, steps=None, scale=1.0, seeds=None, extra=(), command="", report_only=False,
                   arms=None, doc=None):
    """Train (or keep, or resume) every arm of experiment `name` (or those of `arms`) for each seed into
    out/<arm>-seed<k>, or with report_only read the finished ones; then the report, the figure and
    results.json in out, and the doc's section when `doc` is given. The report covers every finished
    run of those arms in out: the seeds trained now and any others it holds, so that `--seeds 3,4`
    adds two seeds to an experiment without training its first ones again. Returns results.md's text."""
    exp = EXPERIMENTS[name]
    out = Path(out)
    _check_out(name, out, doc, create=not report_only)
    chosen = [a for a in exp.arms if not arms or a in arms]
    if report_only:
        asked = list(seeds or found_seeds(out, exp) or exp.seeds)
        return _write_report(name, exp, out, _finished_rows(name, out, chosen, asked), asked, chosen, command, doc)
    trained = list(dict.fromkeys(seeds or exp.seeds))
    with lock.holding(out, exp, [(arm, seed) for seed in trained for arm in chosen]):
        rows = []
        for seed in trained:
            for arm in chosen:
                n_steps = arm_steps(exp, arm, steps, scale)
                run_dir, sets = out / f"{arm}-seed{seed}", arm_sets(exp, arm, seed, n_steps, extra)
                code = _train_to_the_end(name, run_dir, sets, out / "logs", n_steps)
                rows.append(summarise(run_dir, arm, seed, code))
        others = [s for s in found_seeds(out, exp) if s not in trained]
        rows += _kept_rows(name, exp, out, chosen, others, lambda arm, seed: arm_sets(
            exp, arm, seed, arm_steps(exp, arm, steps, scale), extra))
        return _write_report(name, exp, out, rows, trained + others, chosen, command, doc)


def arm_sets(exp, arm, seed, n_steps, extra=()):
    """The overrides of one arm's run of `seed`: the experiment's, its budget, the arm's, the seed, --set."""
    return exp.base + budget(n_steps) + COMMON + exp.arms[arm] + [f"train.seed={seed}"] + list(extra)


def found_seeds(out, exp):
    """The seeds of the runs out holds (directories <arm>-seed<k> of the experiment's arms), in order."""
    found = set()
    for d in Path(out).iterdir() if Path(out).is_dir() else ():
        arm, _, seed = d.name.rpartition("-seed")
        if d.is_dir() and arm in exp.arms and seed.isdigit():
            found.add(int(seed))
    return sorted(found)


def _finished_rows(name, out, arms, seeds):
    """The rows of the finished runs of `arms` x `seeds` in out (--report-only); the others are named."""
    rows = []
    for seed in seeds:
        for arm in arms:
            run_dir = out / f"{arm}-seed{seed}"
            if finished(run_dir):
                rows.append(summarise(run_dir, arm, seed, 0))
            else:
                print(f"{name}: {run_dir} has no finished run: left out", file=sys.stderr, flush=True)
    return rows


def _kept_rows(name, exp, out, arms, seeds, sets_of):
    """The rows of runs out holds for seeds this session did not train: those that finished with the
    config this session would give them (sets_of(arm, seed)); the others are named and left out."""
    rows = []
    for seed in seeds:
        for arm in arms:
            run_dir = out / f"{arm}-seed{seed}"
            if arm_state(run_dir, sets_of(arm, seed), quiet=True) == "finished":
                rows.append(summarise(run_dir, arm, seed, 0))
            elif run_dir.exists():
                print(f"{name}: {run_dir.name} is not a finished run of this config: left out of the report",
                      file=sys.stderr, flush=True)
    return rows


def _write_report(name, exp, out, rows, seeds, arms, command, doc):
    """The report of `rows` into out (results.md, results.json, the figure) and, with `doc`, into its
    page, which is refused while a run of `arms` x `seeds` has not finished: a page's verdict is read
    from every arm. With `doc`, the page's runs of the seeds out lacks join the rows (page.runs_beside).
    Returns results.md's text."""
    if not rows:
        raise UserError(f"{out} holds no finished run of this experiment: run it without --report-only")
    order = list(exp.arms)
    done = {r["run"] for r in rows}
    missing = [(a, s) for s in sorted(set(seeds)) for a in arms if f"{a}-seed{s}" not in done]
    names = [f"{a}-seed{s}" for a, s in missing]
    for r in rows if exp.probe else ():
        r.update(exp.probe(out / r["run"]))
    if doc is not None and not missing:
        rows += page.runs_beside(doc, name, exp, rows)
    rows.sort(key=lambda r: (r["seed"], order.index(r["arm"])))
    target = default_target(rows)
    steps_to(rows, target)
    figure, note = _figure(name, exp, rows)
    text, verdicts, body = report(name, exp, rows, target, command, names, note)
    save_results(out, name, text, {"experiment": name, "target": target, "rows": rows, "verdicts": [
        {"what": what, **v._asdict()} for what, v in verdicts]}, figure)
    if doc is not None:
        if missing:
            raise UserError(f"--doc {doc} not written: {', '.join(names)} {'has' if len(names) == 1 else 'have'} no "
                            f"finished run in {out}, and a page's verdicts read every arm of every seed: train them "
                            f"(--seeds {','.join(str(s) for s in sorted({s for _, s in missing}))} without "
                            "--report-only), then write the page")
        page.write_doc(doc, name, body, figure, page.glance_rows(name, exp, verdicts, rows), rows, command)
    return text


def _figure(name, exp, rows):
    """(the figure as PNG bytes, ""), or without matplotlib (None, the report's line saying so)."""
    try:
        require_matplotlib("andrea.experiment")
    except UserError as e:
        note = f"Figure: not drawn: {e}."
        print(f"{name}: {note}", file=sys.stderr, flush=True)
        return None, note
    return (exp.figure or draw)(name, rows), ""


def arm_steps(exp, arm, steps=None, scale=1.0):
    """An arm's budget in optimizer steps: --steps when given, else the arm's own default (exp.arm_steps)
    or the experiment's (exp.steps), times --scale."""
    return steps or max(2, round(exp.arm_steps.get(arm, exp.steps) * scale))


def budget(n_steps):
    """The overrides of an n_steps run: 20 log lines, 5 evaluations, one checkpoint at the end, a
    tenth of the steps of warmup (which an arm's own overrides may replace: they come after)."""
    return [f"train.max_steps={n_steps}", f"train.log_interval={max(1, n_steps // 20)}",
            f"train.eval_interval={max(1, n_steps // 5)}", f"train.checkpoint_interval={n_steps}",
            f"train.warmup_steps={max(1, n_steps // 10)}"]


def _check_out(name, out, doc, create):
    """Refuse, before any training, what would fail later: a --doc without this experiment's section
    (or without matplotlib, as the page shows the figure), an --out that cannot be a directory or one
    holding something else than this experiment's runs; with `create`, make --out now, so that one
    that cannot be made is said before any work."""
    if doc is not None:
        require_matplotlib("andrea.experiment --doc")
        page.doc_section(doc, name)
    check_directory(out, "--out")
    # one listing: what it holds and whether any of it is ours, read together (another session of this
    # experiment starting into the same new --out may add its lock file at any moment)
    try:
        names = set(os.listdir(out))
    except (FileNotFoundError, NotADirectoryError):
        names = set()
    if names and not names & {"results.json", "logs", lock.LOCK_FILE}:
        raise UserError(f"{out} holds something that is not this experiment's: choose another --out")
    if create:
        _make_out(out)


def _make_out(out, tries=100):
    """mkdir -p --out, tried again while another session's check (andrea.run.paths.check_directory) makes and
    removes the same new --out: Path.mkdir then raises FileExistsError for a directory gone again."""
    for _ in range(tries):
        try:
            return out.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # FileExistsError with nothing there: made and removed again meanwhile, so again
            error = e
            if not isinstance(e, FileExistsError) or out.is_dir() or os.path.lexists(e.filename or out):
                break
    if out.is_dir():
        return
    link = " (a symbolic link to a missing directory)" if error.filename and Path(error.filename).is_symlink() else ""
    raise UserError(f"--out {out} cannot be created: {error.filename}: {error.strerror}{link}: choose another --out")


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
    start = time.monotonic()
    code, error = train_arm(run_dir, sets, log, resume=state == "interrupted")
    with open(log, "a", encoding="utf-8") as f:  # what else ran beside it: its time is measured under that load
        f.write(f"{SESSION_LINE} {time.monotonic() - start:.1f} s\n")
        f.write(f"{LOAD_LINE} {os.getloadavg()[0]:.2f}; {THREADS_LINE} {num_threads()}\n")
    if code == 2:
        raise UserError(f"{run_dir.name} did not start: {error} (its log: {log})")
    if code == EXIT_INTERRUPTED:
        print(f"{name}: interrupted in {run_dir.name}, which keeps its checkpoint; the same command again resumes "
              "it and keeps the arms that finished", file=sys.stderr, flush=True)
        raise KeyboardInterrupt
    return code


def train_arm(out_dir: Path, overrides: list, log_path: Path, resume: bool = False) -> tuple[int, str]:
    """One andrea.train run, its console output into log_path (added to it when resuming); returns its
    exit code and the last error line it printed ("" if none). A fresh run replaces what out_dir
    holds; `resume` continues the run there."""
    from andrea import train

    argv = ["--out", str(out_dir), "--resume"] if resume else ["--config", "tiny", "--out", str(out_dir), "--overwrite"]
    for o in [] if resume else overrides:
        argv += ["--set", o]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # this session's output starts here (a resumed run's log holds the earlier sessions')
    begin = log_path.stat().st_size if resume and log_path.is_file() else 0
    with open(log_path, "a" if resume else "w", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            code = train.main(argv)
        except UserError as e:
            print(f"error: {e}")
            code = 2
        except SystemExit as e:  # the argument parser's one-line error (exit 2) ends in sys.exit
            code = e.code if isinstance(e.code, int) else 1
    return code or 0, _error_line(log_path, begin)


def arm_state(run_dir: Path, sets: list, quiet: bool = False) -> str:
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
        if not quiet:
            print(f"{run_dir} holds a run of another config ({', '.join(differ[:3])} differ): trained again",
                  file=sys.stderr, flush=True)
        return "new"
    if finished(run_dir):
        return "finished"
    return "interrupted" if ckpt.list_checkpoints(run_dir) else "new"


def finished(run_dir: Path) -> bool:
    """Whether run_dir holds a run that trained to its train.max_steps, or that the non-finite guard
    stopped (its last train.max_bad_steps records skipped steps): trained again, it would stop again."""
    from andrea.run.metrics import by_step, read_records

    try:
        train_cfg = json.loads((run_dir / "config.json").read_text())["train"]
        records = read_records(run_dir / "metrics.jsonl", strict=True)
        if max(by_step(records), default=0) == train_cfg["max_steps"]:
            return True
        skipped = {r["step"] for r in records if r.get("skipped")}
        last = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
        bad = train_cfg["max_bad_steps"]
        return last >= bad and all(last - k in skipped for k in range(bad))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return False


def summarise(run_dir: Path, arm: str, seed: int, code: int, target: float | None = None) -> dict:
    """The numbers of one run, from its metrics.jsonl. It diverged when it did not end cleanly, or its last
    validation loss is not finite or not below its first training loss, or any validation loss rose
    more than ROSE nats above that first loss. (The last rule added for no-norm at lr 3e-2 over 800
    steps, before its verdict was read: without LayerNorm, seed 1 reached a validation loss of 304,255
    at step 160 and came back to 7.27 by step 800, which the first rules read as a run that trained,
    only short. No run of the other experiments rises that far: the depth probe's stacks without
    skips, the nearest, stay within 0.23 nats of their first loss, and their reports are unchanged.)"""
    from andrea.run.metrics import by_step, read_records

    records = by_step(read_records(run_dir / "metrics.jsonl", strict=True))
    losses = logged(records, "loss", (int, float))
    vals = logged(records, "val_loss", (int, float))
    where = run_dir / "metrics.jsonl"
    flows = [(s, check_flow(f, f"{where} step {s}")) for s, f in logged(records, "grad_flow", dict)]
    val = vals[-1][1] if vals else math.nan
    first = losses[0][1] if losses else math.nan
    init = flows[0][1] if flows else None
    final = flows[-1][1] if flows else None
    return {
        "run": run_dir.name, "arm": arm, "seed": seed, "exit_code": code,
        "val_loss": val, "first_loss": first,
        "diverged": code != 0 or not math.isfinite(val) or val >= first or any(v > first + ROSE for _, v in vals),
        "ratio_init": embedding_ratio(init) if init else math.nan,
        "ratio_final": embedding_ratio(final) if final else math.nan,
        "delta_init_max": max(init["attn_delta"] + init["mlp_delta"]) if init else math.nan,
        "losses": losses, "vals": vals, "last_step": _last_step(run_dir / "metrics.jsonl"), **_saved(run_dir),
        **_timing(run_dir.parent / "logs" / f"{run_dir.name}.log"),
        "grad_init": init["grad_in"] + [init["grad_top"]] if init else [],
        "grad_final": final["grad_in"] + [final["grad_top"]] if final else [],
    }


def _last_step(path):
    """The last step metrics.jsonl has a record of, a step the non-finite guard skipped included; None
    without one."""
    from andrea.run.metrics import read_records

    return max((r["step"] for r in read_records(path) if isinstance(r.get("step"), int)), default=None)


def _saved(run_dir):
    """{"unigram_baseline": the unigram baseline of the run's validation tokens (andrea.run.rundata.unigram_baseline)
    or None, "tokens": the tokens it trains on (steps x tokens per step), or None, "steps": its configured
    train.max_steps, or None}, from its config.json."""
    from andrea.config import make_config
    from andrea.run.rundata import unigram_baseline
    from andrea.run.runlog import read_saved_config

    try:
        cfg = make_config(read_saved_config(run_dir))
    except UserError:
        return {"unigram_baseline": None, "tokens": None, "steps": None}
    t = cfg.train
    per_step = t.batch_size * t.sequence_length(cfg.model) * t.accumulation_steps(cfg.model)
    return {"unigram_baseline": unigram_baseline(cfg), "tokens": t.max_steps * per_step, "steps": t.max_steps}


def _timing(log_path):
    """{"seconds": the run's time from its log, summed over its sessions (a resumed run has two): each
    session's "done: ... in S s" line, or, in a session that has none (the non-finite guard or Ctrl-C
    stopped it), the experiment's own SESSION_LINE, start-up included; "untimed_by_train": how many
    sessions only the latter timed; "load": the 1-minute load averages logged at each session's end;
    "threads": the thread counts it ran with}. (SESSION_LINE since no-norm's runs at lr 3e-2: the
    three the guard stopped had no time in the report.)"""
    try:
        text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {"seconds": None, "untimed_by_train": 0, "load": [], "threads": []}
    seconds, by_experiment = [], 0
    for session in re.split(rf"^{re.escape(LOAD_LINE)}.*$", text, flags=re.M):
        done = re.findall(r"^done: step \d+ \(\d+ this run\) in ([0-9.]+) s", session, re.M)
        wall = re.findall(rf"^{re.escape(SESSION_LINE)} ([0-9.]+) s$", session, re.M)
        if done or wall:
            seconds.append(float((done or wall)[-1]))
            by_experiment += not done
    load = [float(m) for m in re.findall(rf"^{re.escape(LOAD_LINE)} ([0-9.]+)", text, re.M)]
    threads = sorted({int(m) for m in re.findall(rf"; {re.escape(THREADS_LINE)} (\d+)$", text, re.M)})
    return {"seconds": sum(seconds) if seconds else None, "untimed_by_train": by_experiment, "load": load,
            "threads": threads}


def steps_to(rows, target):
    """The first logged step at which each run's training loss is at or below target (None: never). A
    run whose figures are a page's tables (page.page_runs) has no losses: it keeps the step its table
    printed where that table's target is this one, else it has none ("not kept")."""
    for r in rows:
        if r.get("from") == "table":
            r["steps_to_target"] = r["steps_to_target"] if r.get("target") == target else "not kept"
            continue
        r["steps_to_target"] = next((s for s, loss in r["losses"] if loss <= target), None)


def default_target(rows):
    """A loss every run that did not diverge reaches by the end: the highest of their last logged
    training losses, rounded up to 0.05 nats."""
    finals = [r["losses"][-1][1] for r in rows if not r["diverged"] and r["losses"]]
    return math.ceil(max(finals) * 20) / 20 if finals else math.nan


def _error_line(path, begin):
    """The last line starting "error:" that the session which began at offset `begin` of the log printed
    (its own error, not what the experiment appends after it), without that word; else its last line."""
    with open(path, "rb") as f:
        f.seek(begin)
        lines = [x for x in f.read().decode("utf-8", errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    return errors[-1].removeprefix("error:").strip() if errors else lines[-1] if lines else "no output"
