"""The directories andrea writes into: what each one is, and who is writing there now.

    rundir.check(out, "export")                        # before any work: UserError if out is not ours to fill
    with rundir.claim(out, "run", resume, overwrite):  # the same check, then the directory is ours until
        ...                                            # the block ends (or the process does)

A command never deletes or overwrites a file it did not create. So a directory that andrea.train
(a "run") or andrea.export (an "export") writes into carries a marker, `.andrea`, a JSON object
{"kind": "run" | "export", "pid": the process that claimed it last}, written atomically when the
directory is claimed. Before writing, a command asks what the directory is:

- missing, or holding none of the files the command writes: it is claimed and marked;
- marked with the command's own kind: a run is continued (--resume) or replaced (--overwrite,
  which deletes only the files andrea.train writes), an export is replaced by a new export of the
  same run (the marker of an export names its run directory, "source");
- anything else (a Hugging Face model saved by transformers, a data directory, a user's own
  config.json, the run being exported, the export of another run...) is refused, `--overwrite`
  or not, naming the files that are in the way.

A run of an older layout, written before the marker existed (an andrea config.json, no marker), is
refused with a line saying to resume it with the andrea version that wrote it.

While a command writes, it holds an exclusive lock (flock) on the directory itself, so a second
command claiming the same directory (two andrea.train into one --out) is refused at once instead of
interleaving their files. The kernel drops the lock when the process ends, however it ends
(kill -9 included): a lock left by a dead process locks nothing, and there is no lock file to clean.
A file system that cannot lock (some network mounts) is a warning, and the command goes on unlocked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from andrea.data.lock import flock
from andrea.errors import UserError
from andrea.files import atomic_writer
from andrea.run import checkpoint as ckpt

WRITERS = "command writes into it"  # what must not run beside a directory that cannot be locked

MARKER = ".andrea"
KINDS = {"run": "andrea.train", "export": "andrea.export"}
# what each kind writes; any of these in an unmarked directory is another program's file
RUN_FILES = ("config.json", "tokenizer.json", "metrics.jsonl", "loss.png")
def run_dirs() -> list[str]:
    """The folders a run's metrics sinks write in (andrea.run.sinks: each sink's `directory`), when
    train.log_to has them: a run's like its files."""
    from andrea.run.sinks import SINKS

    return sorted({sink.directory for sink in SINKS.values()})
EXPORT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_FILES = {"run": RUN_FILES, "export": EXPORT_FILES}
_ANDREA_CONFIG_SECTIONS = {"model", "train", "data"}


def _marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def kind_of(directory) -> str | None:
    """"run" or "export" for a directory andrea wrote (its marker), another kind a marker names, or
    None: missing, empty, or another program's."""
    marker = _marker(Path(directory))
    return marker["kind"] if marker is not None and isinstance(marker.get("kind"), str) else None


def _refuse_an_older_run(directory: Path) -> None:
    """A run written before the marker existed: an andrea config.json (its three sections), no marker."""
    if _marker(directory) is not None:
        return
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(config, dict) and config.keys() >= _ANDREA_CONFIG_SECTIONS:
        raise UserError(f"--out {directory} holds a run of an older layout (no {MARKER} marker): resume it with "
                        "the andrea version that wrote it, or choose another --out")


def _written_by(kind: str, directory: Path) -> list[str]:
    """The names in `directory` that a command of `kind` writes (checkpoints included for a run)."""
    names = [name for name in _FILES[kind] if (directory / name).exists()]
    if kind == "run":
        names += [p.name for p in ckpt.list_checkpoints(directory)]
        names += [name for name in run_dirs() if (directory / name).is_dir()]
    return names


def check(directory, kind: str, resume: bool = False, overwrite: bool = False, source=None) -> None:
    """Refuses (UserError) a directory that a command of `kind` must not write into; writes nothing.
    `source`: what an export exports (its run directory), which an earlier export there must share."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is a file, not a directory: choose a directory")
    if not directory.is_dir():
        return
    _refuse_if_in_use(directory, kind)  # say so first, whatever it holds
    _refuse_an_older_run(directory)
    _refuse_what_is_not_ours(directory, kind, resume, overwrite, source)


def _source(source) -> str | None:
    """How a marker names an export's source: the run directory's absolute path."""
    return None if source is None else str(Path(source).resolve())


def _refuse_another_source(directory: Path, source) -> None:
    """An export is replaced only by an export of the same run (a marker without a source is of an
    andrea that did not record it: which run it holds is unknown, so it is not replaced either)."""
    earlier = (_marker(directory) or {}).get("source")
    if source is not None and earlier != _source(source):
        whose = f"of another run ({earlier})" if earlier else "of a run it does not name (an older andrea's)"
        raise UserError(f"--out {directory} holds the export {whose}, not of {_source(source)}: choose another --out, "
                        "or delete that export first")


def _refuse_what_is_not_ours(directory: Path, kind: str, resume: bool, overwrite: bool, source=None) -> None:
    found, ours = kind_of(directory), _written_by(kind, directory)
    command = KINDS[kind]
    if directory.resolve().name.startswith("ckpt-") and (directory / ckpt.META_FILE).is_file():
        raise UserError(f"--out {directory} is a checkpoint of a training run; choose a new or empty directory")
    if found == "run" and kind == "export":
        raise UserError(f"--out {directory} is a training run's directory (andrea.train --out); export into a "
                        "new or empty directory, e.g. --out export/NAME")
    if found not in (None, kind):
        raise UserError(f"--out {directory} was written by {KINDS.get(found, found)}, not {command}: choose "
                        "another --out")
    if found is None and ours:
        raise UserError(f"--out {directory} already holds {', '.join(ours[:4])}, which {command} did not write "
                        f"(another program's files: a Hugging Face model, a data directory?); choose a new or "
                        "empty directory")
    if kind == "run" and ours and not resume and not overwrite:
        raise UserError(f"{directory} holds another run: add --resume to continue it, choose another --out, or "
                        "add --overwrite to delete it and start afresh")
    if kind == "export" and found == "export":
        _refuse_another_source(directory, source)


# ----------------------------------------------------------------------------------------------- claims

_held: list[Claim] = []


class Claim:
    """A directory claimed by this process (made if missing): its lock (flock on the directory) until
    release().

    Another command's check of the same new path (andrea.run.paths.check_directory: made, locked for
    a moment and removed again) may remove the directory before this one opens or locks it: the lock
    is then on a removed directory, which the path no longer names, so it is taken again on the
    directory at the path (a few tries, as that check holds its lock only while it removes)."""

    def __init__(self, directory: Path, kind: str, tries: int = 3):
        self.directory, self.kind = directory, kind
        for _ in range(tries):
            directory.mkdir(parents=True, exist_ok=True)
            try:
                self.fd = os.open(directory, os.O_RDONLY)
            except FileNotFoundError:
                continue
            if flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, directory, WRITERS) and _still_at(self.fd, directory):
                return
            os.close(self.fd)
            time.sleep(0.05)
        self.fd = None
        raise _in_use(directory, kind)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None
        if self in _held:
            _held.remove(self)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _still_at(fd: int, directory: Path) -> bool:
    """The directory `fd` holds is still the one at `directory` (not removed, nor replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(directory))
    except FileNotFoundError:
        return False


def _refuse_if_in_use(directory: Path, kind: str, tries: int = 3) -> None:
    """A shared lock taken and dropped at once: it fails only while a claim holds the directory
    (several processes may probe at the same time, as the ranks of one run do).

    Another command's check of the same new path (andrea.run.paths.check_directory: made, locked for a
    moment while it removes it again) is no claim: a lock that is gone a moment later was that (tried
    again, as Claim does), and a directory gone meanwhile holds nothing in use. The ranks of one run meet
    it: each rank's preflight checks the new --out while another rank probes it here."""
    for attempt in range(tries):
        try:
            fd = os.open(directory, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            free = flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, directory, WRITERS)
        finally:
            os.close(fd)
        if free:
            return
        if attempt + 1 < tries:
            time.sleep(0.05)
    raise _in_use(directory, kind)


def _in_use(directory: Path, kind: str) -> UserError:
    holder = ""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        holder = f" (process {int(json.loads((directory / MARKER).read_text())['pid'])})"
    return UserError(f"--out {directory} is in use by another {KINDS[kind]}{holder}: wait for it to finish, "
                     "or choose another --out")


def claim(directory, kind: str, resume: bool = False, overwrite: bool = False, source=None) -> Claim:
    """Checks `directory` (as check() does), creates it if missing, locks it and marks it as `kind`
    (and an export with its `source`).

    For a run with --overwrite, then deletes the earlier run's files (and only those). The claim
    holds until release(), the end of a `with` block on it or of a `released_at_end()` block, or
    the end of the process.
    """
    directory = Path(directory)
    check(directory, kind, resume, overwrite, source)
    held = Claim(directory, kind)
    try:
        _refuse_what_is_not_ours(directory, kind, resume, overwrite, source)  # again, holding the lock
        if kind == "run" and not resume:
            for path in ckpt.list_checkpoints(directory):
                shutil.rmtree(path)
            for name in RUN_FILES:
                (directory / name).unlink(missing_ok=True)
            for name in run_dirs():
                shutil.rmtree(directory / name, ignore_errors=True)
        marker = {"kind": kind, "written_by": KINDS[kind], "pid": os.getpid()}
        if source is not None:
            marker["source"] = _source(source)
        with atomic_writer(directory / MARKER) as f:
            f.write((json.dumps(marker) + "\n").encode())
    except BaseException:
        held.release()
        raise
    _held.append(held)
    return held


@contextlib.contextmanager
def released_at_end():
    """Every claim made inside the block is released when it ends, however it ends."""
    depth = len(_held)
    try:
        yield
    finally:
        while len(_held) > depth:
            _held[-1].release()
