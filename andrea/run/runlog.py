"""A run directory that tells one story: its metrics and its last words (andrea.run.rundir claims it;
andrea.run.metrics writes metrics.jsonl, surviving a full disk).

    drop_rows_after(out_dir / "metrics.jsonl", step, ...)     # on resume: each step once
    code = final_checkpoint_check(out_dir, step, last, code)  # non-zero when the last save failed

metrics.jsonl holds one JSON object per line: a step row ({"step", "loss", ...}) or an event
({"event": "resume", "at_step", "checkpoint", "dropped_rows"}), which has no "step" key, so
readers that plot step rows skip it. A resume from step N drops the rows after N (the
interrupted run's, which the resumed run recomputes) by rewriting the file atomically, then
appends the resume event.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from andrea.errors import UserError
from andrea.files import atomic_writer, warn
from andrea.run import checkpoint as ckpt
from andrea.run.metrics import read_records

EXIT_SAVE_FAILED = 4
PROGRESS_AFTER_S = 5.0  # a step slower than this shows its micro-batches
_STALE_TMP = re.compile(r"^\..+\.(\d+)\.tmp$")  # andrea.files.atomic_writer's scratch: .<name>.<pid>.tmp


# ----------------------------------------------------------------------------------------------- metrics

def drop_rows_after(path, step: int, checkpoint) -> int:
    """Rewrites metrics.jsonl without the rows after `step`, plus a resume event; returns how many
    rows were dropped. Atomic: a crash leaves the old file or the new one, never a mix."""
    path = Path(path)
    rows = read_records(path)
    kept = [r for r in rows if not (isinstance(r.get("step"), int) and r["step"] > step)]
    event = {"event": "resume", "at_step": step, "checkpoint": str(checkpoint),
             "dropped_rows": len(rows) - len(kept), "time": time.time()}
    try:
        with atomic_writer(path) as f:
            for r in [*kept, event]:
                f.write((json.dumps(r) + "\n").encode())
    except OSError as e:
        warn(f"could not rewrite {path} ({e.strerror or e}): rows after step {step} from the interrupted run "
             "stay in it")
    return len(rows) - len(kept)


# ----------------------------------------------------------------------------------------------- the directory

def remove_stale_temporaries(*dirs) -> list[Path]:
    """Deletes the scratch files of saves and preparations that were killed (their process is gone)."""
    removed = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in d.iterdir():
            match = _STALE_TMP.match(p.name)
            if p.name.startswith(".tmp-ckpt-") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            elif match and p.is_file() and not _alive(int(match.group(1))):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def read_saved_config(out_dir: Path) -> dict:
    """A run's config.json as a dict, or a one-line error saying what is wrong with it."""
    saved = out_dir / "config.json"
    if not saved.is_file():
        raise UserError(f"nothing to resume in {out_dir}: it has no config.json (start a run without --resume)")
    try:
        base = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"cannot resume from {out_dir}: {saved} is not readable JSON ({e}); restore it, or "
                        "start a fresh run with --overwrite") from e
    if not isinstance(base, dict):
        raise UserError(f"cannot resume from {out_dir}: {saved} does not hold a config (a JSON object)")
    return base


# ----------------------------------------------------------------------------------------------- the end

def final_checkpoint_check(out_dir, step: int, last_checkpoint, code: int) -> int:
    """When the save at the end failed, says which checkpoint is newest on disk and returns non-zero."""
    if code not in (0, 130) or (last_checkpoint is not None and Path(last_checkpoint).name == f"ckpt-{step:08d}"):
        return code
    newest = ckpt.list_checkpoints(out_dir)
    where = f"the newest on disk is {newest[0]} (step {int(newest[0].name.split('-')[1])})" if newest else \
        "there is no checkpoint on disk"
    print(f"error: the checkpoint of step {step} could not be saved; {where}. Free some space and resume "
          f"with --resume, which continues from there", file=sys.stderr, flush=True)
    return EXIT_SAVE_FAILED


def summary(out_dir, steps_done: int, step: int, seconds: float, rate, loss, val, checkpoint,
            baseline=None) -> str:
    """The end-of-run line: steps, time, throughput, the last step's loss, the last validation loss
    beside the data's unigram baseline (a loss below it learned more than token frequencies),
    where the checkpoint is. `rate` is (tokens/s, seconds, steps) of the training steps the rate
    comes from (andrea.run.throughput.Throughput.run_rate: after the first, without evaluation or saving);
    `loss` the last step's training loss, `val` (step, loss, bits per byte) of the last evaluation, or None;
    `baseline` the validation tokens' unigram entropy (meta.json's unigram_val_nats), or None."""
    tokens_per_s, train_s, timed = rate
    after_first = "after the first step, " if timed < steps_done else ""
    loss = f"{loss:.4f}" if loss is not None else "n/a"
    val = f"{val[1]:.4f} ({val[2]:.4f} bits/byte, step {val[0]})" if val is not None else "n/a"
    if baseline is not None:
        val += f" against a unigram baseline of {baseline:.4f}"
    return (f"done: step {step} ({steps_done} this run) in {seconds:.1f} s | {tokens_per_s:,.0f} tokens/s "
            f"({timed} step{'s' if timed != 1 else ''} {after_first}{train_s:.1f} s of training) | train loss "
            f"{loss} | val loss {val} | checkpoint {checkpoint or 'none'} | metrics {Path(out_dir) / 'metrics.jsonl'}")


class MicroBatchProgress:
    """Wraps the training data loader: a step slower than PROGRESS_AFTER_S reports its micro-batches.

    Everything else (state_dict, load_state_dict, ...) goes to the wrapped loader.
    """

    def __init__(self, loader, accum: int, out=None):
        self._loader, self._accum, self._out = loader, accum, out or sys.stdout
        self._calls = 0
        self._step_start = self._last_report = time.perf_counter()

    def next_batch(self):
        i = self._calls % self._accum
        now = time.perf_counter()
        if i == 0:
            self._step_start = self._last_report = now
        elif now - self._last_report >= PROGRESS_AFTER_S:
            self._last_report = now
            print(f"  micro-batch {i}/{self._accum} done ({now - self._step_start:.0f} s into the step)",
                  file=self._out, flush=True)
        self._calls += 1
        return self._loader.next_batch()

    def __getattr__(self, name):
        return getattr(self._loader, name)
