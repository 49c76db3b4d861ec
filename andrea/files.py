"""The small file helpers every command shares: atomic writes, JSON reading and writing, warnings.

`atomic_writer` is how andrea writes every file it keeps (checkpoints, token shards, manifests,
tokenizers, exports, plots): a file appears under its final name complete or not at all. No pickle
anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from andrea.errors import UserError


@contextlib.contextmanager
def atomic_writer(path) -> Iterator[BinaryIO]:
    """Open `path` for binary writing so that it appears complete or not at all.

    Writes go to a hidden temporary file beside `path`, which is fsync'ed and renamed over
    `path` only when the block ends without an exception; on any exception it is removed. A failure
    of the file system (a full disk) names `path`: a write's OSError carries no file name of its own.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise named(e, path) from None if e.filename is None else e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def named(e: OSError, path) -> OSError:
    """`e` naming `path` when it names no file (a write's error does not): OSError(errno, ...) is the
    errno's own subclass, so a caller catching PermissionError still does."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is; not every OS can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path, obj: dict) -> None:
    """`obj` as indented JSON in `path`, atomically (a path that is not UTF-8 survives as it was read)."""
    with atomic_writer(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode("utf-8", errors="surrogateescape"))


def read_json(path) -> dict:
    """The JSON object in `path`; a UserError naming the file when it is missing, unreadable, not
    JSON or not an object."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} must hold a JSON object")
    return obj


def warn(msg: str) -> None:
    """A warning on stderr: something went wrong and the command goes on."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)
