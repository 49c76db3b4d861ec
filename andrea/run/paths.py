"""The checks of a path the commands will write, made before any work: a directory that can be
(or become) one and be written, a file whose directory exists. Below preflight and prepare, which
both use them (prepare is itself called by preflight's data check).
"""

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from andrea.errors import UserError


def check_directory(path, what: str, writable: bool = True) -> None:
    """Refuses a path that cannot be (or become) a directory: a file, or a file among its parents;
    with `writable`, one that cannot be written or made (tried: made and removed again); without, an
    existing one that cannot be read (a complete data directory on a read-only mount is only read)."""
    path = Path(path)
    if not writable and path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise UserError(f"{what} {path} cannot be read: no permission to read it")
        return
    if _is_file(path):
        raise UserError(f"{what} {path} is a file, not a directory: choose a directory")
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if _is_file(ancestor):  # one look: another command's check may make and remove a new directory there
        raise UserError(f"{what} {path} cannot be created: {ancestor} is a file")
    if ancestor.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
        if not ancestor.exists():  # removed meanwhile (another command's check of the same new path): again
            return check_directory(path, what, writable)
        raise UserError(f"{what} {path} cannot be written: no permission to write in {ancestor}")
    if not path.is_dir():
        _try_creating(path, what)


def _is_file(path: Path) -> bool:
    """Something that is not a directory at `path`, in one look (another process may make and remove
    a directory there between two)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _try_creating(path: Path, what: str) -> None:
    """Makes the missing directories of `path`, then removes them again. Permission bits say too
    little (root may write anywhere by them, yet not in /proc or on a read-only mount; a link to
    nowhere or a name too long passes them): only making the directory shows that it can be made."""
    missing = []
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    if path.is_symlink() and not path.exists():
        raise UserError(f"{what} {missing[0]} cannot be created: {path} is a link to {os.readlink(path)}, "
                        "which does not exist")
    made = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if _is_file(directory):
                    raise
                continue  # made meanwhile by another process (and maybe removed again): its, not ours to remove
            made.append(directory)
    except OSError as e:
        raise UserError(f"{what} {missing[0]} cannot be created: {e.strerror or e} ({e.filename})") from None
    finally:
        for directory in reversed(made):
            _remove_if_unused(directory)


def _remove_if_unused(directory: Path) -> None:
    """Removes a directory the check made, unless another process has begun using it: put a file in
    it (rmdir fails), or claimed it, which locks it (andrea.data.lock, andrea.run.rundir). The lock is
    taken for the removal, so a claim made meanwhile either holds it first (the directory is left to
    it) or waits and finds the directory gone (and makes its own): never a lock on a removed one while
    another process writes into a new one at the same path."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # claimed by another process: its directory now
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # a file system that cannot lock: removed as before, if still empty
        with contextlib.suppress(OSError):  # only if still empty: another process may have begun using it
            os.rmdir(directory)
    finally:
        os.close(fd)


def check_output_file(path, what: str) -> None:
    """Refuses a file to be written whose directory does not exist, or which is a directory."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory: give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{what} {path}: the directory {parent} does not exist")
