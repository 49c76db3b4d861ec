"""Who may write a data directory: one preparation at a time, like a run directory (andrea/run/rundir.py).

    with lock.writing(data_dir, say):   # created if missing; an exclusive flock on the directory itself
        ...                             # check what it holds, then write: no other process writes meanwhile
    with lock.reading(data_dir):        # a shared flock while train opens the manifest, tokenizer, shards
        ...

A second preparation of the same directory (two `prepare`, or the parallel `train`s of an experiment
sharing data/stdlib) waits, saying so, rather than being refused: once the first has finished, the
second finds the directory complete and, if it asked for the same data, uses it as it is (a refusal
would fail every parallel arm but one); if it asked for other data, it is refused then with the
reason (another tokenizer, another corpus), as any prepare into a complete directory is. While it
waits it has read nothing, so nothing it decides rests on a half-written directory. Ctrl-C ends the
wait. The lock is the kernel's (flock): it ends with its process, however it ends (kill -9
included), so there is never a stale lock. A file system that cannot lock is a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def writing(data_dir, say: Callable[[str], None] | None = None) -> Iterator[bool]:
    """Hold `data_dir` (made if missing) for writing until the block ends; yields True when this call
    created it. A directory that another process removed while this one waited, or before this one
    could open it, is made again: what the block reads and writes is the directory this one locked."""
    data_dir = Path(data_dir)
    while True:
        created = not data_dir.exists()
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(data_dir, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed between the two calls (another command's check made it and removed it): made again
        try:
            _wait_for(fd, data_dir, say)
            if _same_directory(fd, data_dir):
                yield created
                return
        finally:
            os.close(fd)  # closing the descriptor drops the lock


@contextlib.contextmanager
def reading(data_dir, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `data_dir` for reading while its manifest, tokenizer and shards are opened: a shared flock,
    so a preparation in progress is waited for (and waits), and what is opened is one preparation's.
    A directory that is not there is not held; the opened shards stay readable after the block."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        yield
        return
    fd = os.open(data_dir, os.O_RDONLY)
    try:
        _wait_for(fd, data_dir, say, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _wait_for(fd: int, data_dir: Path, say, how: int = fcntl.LOCK_EX) -> None:
    if flock(fd, how | fcntl.LOCK_NB, data_dir, "process prepares it"):
        return
    (say or _say)(f"waiting: another process is preparing {data_dir} (a prepare or a train); this one goes on "
                  "when it has finished (Ctrl-C stops waiting)")
    flock(fd, how, data_dir, "process prepares it")


def _same_directory(fd: int, data_dir: Path) -> bool:
    """The locked directory is still the one at `data_dir` (not removed or replaced while waiting)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(data_dir))
    except FileNotFoundError:
        return False


def flock(fd: int, how: int, directory: Path, others: str) -> bool:
    """flock: False when another process holds the lock (with LOCK_NB). A file system without locks
    (some network mounts) gets a warning and no lock, rather than no work: `others` says what must
    then not run at the same time. Data directories and run directories (andrea.run.rundir) alike."""
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        _say(f"warning: {directory} cannot be locked here ({e.strerror}): make sure no other {others} "
             "at the same time")
    return True


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
