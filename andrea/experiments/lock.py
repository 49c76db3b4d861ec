"""Who trains which run of an experiment's --out: one lock per run (arm and seed), all of a session's
taken before it opens any file for writing, held until it ends.

    with lock.holding(out, exp, [(arm, seed), ...]):   # UserError at once if another process holds one
        ...                                             # train, keep or resume them; write the report

Two sessions may share an --out when their runs differ: one process per half of the arms, or per
seeds, then `--report-only` (docs/experiments.md does so to use both cores). Two sessions over the
same run are not: the second would open the first's log and retrain or resume into its run. So the
second session is refused before it writes anything, wherever the first is in its own list.

The locks are POSIX record locks (fcntl F_SETLK, Python's fcntl.lockf) on the bytes of one file,
out/.experiment.lock: the run of arm index i (in the experiment's order) and seed k locks byte
k * MAX_ARMS + i (k taken modulo 2^48 so that any seed's byte is a valid offset: two seeds 2^48
apart would share a byte, which can only refuse a session, never let two in). The kernel drops them
when the process ends, however it ends (kill -9 included): there is no stale lock to clean. They
belong to the process: a session must not open the lock file a second time, as closing any
descriptor of it drops them all. A file system that cannot lock is a warning, as in andrea.data.lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from andrea.errors import UserError

LOCK_FILE = ".experiment.lock"
MAX_ARMS = 64   # bytes per seed: more than any experiment's arms (depth has 8)


def _byte(exp, arm: str, seed: int) -> int:
    return (seed % 2**48) * MAX_ARMS + list(exp.arms).index(arm)


def _open_lock_file(out: Path) -> int:
    """out's lock file, created if missing. A new --out that another command's check of the path made
    and removed again (andrea.run.paths.check_directory) between this session's making it and opening
    the file is made again: once the file is in it, no such check removes it."""
    while True:
        try:
            return os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            out.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def holding(out: Path, exp, runs) -> Iterator[None]:
    """Lock each (arm, seed) of `runs` in out's lock file until the block ends; a one-line UserError
    naming the first run another process holds, before anything is written (the lock file itself is
    created if missing: empty, and never written)."""
    fd = _open_lock_file(Path(out))
    try:
        for arm, seed in runs:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _byte(exp, arm, seed))
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise UserError(f"--out {out}: {arm}-seed{seed} is being trained by another "
                                    "andrea.experiment: wait for that one to finish, or choose another --out") from None
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                print(f"warning: {out} cannot be locked here ({e.strerror}): make sure no other andrea.experiment "
                      "trains into it at the same time", file=sys.stderr, flush=True)
                break
        yield
    finally:
        os.close(fd)  # drops every lock of this process on the file
