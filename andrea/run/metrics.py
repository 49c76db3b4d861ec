"""What a run records and where it goes: the Metrics object the Trainer logs each record to (a dict),
which hands it to every sink, and the sink that is always there, metrics.jsonl.

    sinks = open_sinks(out_dir, cfg, world, start_step)     # train.log_to's, before the run writes anything
    with open_metrics(out_dir, cfg, world, start_step, sinks) as metrics:
        metrics.log({"step": 20, "loss": 7.65, "lr": 1.2e-3, ...})   # a dict, never a string
        metrics.flush()                                             # at the end of a log step

Rank 0 alone writes: its Metrics holds metrics.jsonl's sink (JsonlSink) and those train.log_to
names (andrea.run.sinks: TensorBoard, W&B); every other rank's holds none. A sink has three calls,
`log(record)`, `flush()` and `close()`, and never stops training: metrics.jsonl survives a full disk
by itself (a warning, the lines lost), and an optional sink that raises is warned about once and
left out for the rest of the run. How each sink takes a resume: andrea.run.sinks.

metrics.jsonl holds one JSON object per line: a step's record ({"step", "loss", ...}), a skipped
step's ({"step", "loss", "grad_norm", "skipped": true}) or an event ({"event": "resume", ...}, no
"step": andrea.run.runlog.drop_rows_after). Every reader of it goes through `read_records`:

    records = read_records(out_dir / "metrics.jsonl")   # every object, in file order
    per_step = by_step(records)                          # {step: its last record}, skipped steps left out
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from andrea.errors import UserError
from andrea.files import warn
from andrea.run.sinks import SINKS


class Metrics:
    """Hands each record (a dict) to every sink, in order; metrics.jsonl's comes first."""

    def __init__(self, sinks=()):
        self.sinks = list(sinks)

    def log(self, record: dict) -> None:
        self._each("log", record)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        self.sinks = []

    def _each(self, call, *args):
        for sink in list(self.sinks):
            try:
                getattr(sink, call)(*args)
            except Exception as e:  # an optional sink's failure (a full disk, its library) is not the run's
                warn(f"the {sink.name} metrics sink failed ({type(e).__name__}: {e}); training goes on without it")
                self.sinks.remove(sink)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sinks(out_dir, cfg, world, start_step: int) -> list:
    """The optional sinks of train.log_to, opened (resuming after `start_step`, the checkpoint's step, 0
    for a new run) on rank 0 alone, before the run writes anything in `out_dir`: one that cannot start
    is a UserError that leaves `out_dir` as it was (the sinks opened before it closed, the folders
    this call made removed), so that the same command, once fixed, starts the run."""
    if not world.is_main:
        return []
    folders = [Path(out_dir) / SINKS[name].directory for name in cfg.train.log_to]
    made = [folder for folder in folders if not os.path.lexists(folder)]
    opened = []
    for name in cfg.train.log_to:
        try:
            opened.append(SINKS[name](Path(out_dir), cfg, start_step))
        except Exception as e:  # W&B not logged in, a library's own failure...: before any step
            Metrics(opened).close()
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)
            raise UserError(f"the {name} metrics sink (train.log_to) could not start: {type(e).__name__}: {e}") from e
    return opened


def open_metrics(out_dir, cfg, world, start_step: int, sinks=None) -> Metrics:
    """The run's Metrics: on rank 0 metrics.jsonl and each sink of train.log_to (`sinks`, opened by
    open_sinks; opened here when None); on the other ranks, none."""
    if not world.is_main:
        return Metrics()
    sinks = open_sinks(out_dir, cfg, world, start_step) if sinks is None else sinks
    return Metrics([JsonlSink(Path(out_dir) / "metrics.jsonl"), *sinks])


# ----------------------------------------------------------------------------------------------- metrics.jsonl

class JsonlSink:
    """Appends each record to metrics.jsonl as a line of JSON; a failed write (full disk, ...) is a
    warning, not the end.

    Lines are kept until flush and written with os.write on an O_APPEND descriptor, so a failure
    loses at most those lines; a line cut short by a full disk is ended before the next one, and
    readers skip it (read_records).
    """

    name = "metrics.jsonl"

    def __init__(self, path):
        self.path = Path(path)
        self.pending: list[str] = []
        self.cut_short = False
        self.failures = 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, record: dict) -> None:
        self.pending.append(json.dumps(record) + "\n")

    def flush(self) -> None:
        data, self.pending = "".join(self.pending), []
        if not data:
            return
        try:
            if self.cut_short:
                _write(self.fd, b"\n")
                self.cut_short = False
            raw = data.encode()
            written = _write(self.fd, raw)
            if written < len(raw):
                self.cut_short = True
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                warn(f"writing {self.path} failed ({e.strerror or e}); training goes on, these metrics are "
                     f"lost ({self.failures} failed write{'s' if self.failures != 1 else ''} so far)")

    def close(self) -> None:
        self.flush()
        os.close(self.fd)


def _write(fd: int, data: bytes) -> int:
    """The one place metrics reach the disk (a test makes it fail as a full disk would)."""
    return os.write(fd, data)


# ----------------------------------------------------------------------------------------------- reading

def read_records(path, strict: bool = False) -> list[dict]:
    """Every JSON object of a metrics.jsonl, in file order: step records (the skipped steps' too) and
    events. The one reader of the file: resume, plot, gradient flow and experiments read through it.

    A line cut short (the start of a JSON object, which a crash or a full disk leaves; JsonlSink
    ends it before the next line) is passed over wherever it is, and a missing file holds none.
    Any other line that is not a JSON object is passed over too, or with `strict` (a file a user
    named) a UserError: it is not a metrics file."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif strict and line.strip() and not line.lstrip().startswith("{"):
            raise UserError(f"{path} line {n} is not JSON: is it a metrics file of andrea.train?")
    return records


def by_step(records) -> dict[int, dict]:
    """{step: record} of read_records' records, the last of a step winning (a resumed run repeats the
    steps after its checkpoint); events and the steps the non-finite guard skipped left out."""
    return {r["step"]: r for r in records if isinstance(r.get("step"), int) and not r.get("skipped")}
