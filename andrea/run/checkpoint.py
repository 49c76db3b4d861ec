"""Crash-safe checkpoints for training runs: one directory per step, published atomically, no pickle.

Layout::

    out_dir/ckpt-00000200/tensors.safetensors   every tensor (safetensors format)
    out_dir/ckpt-00000200/meta.json             the caller's meta plus format version, step, creation
                                                time, byte size and sha256 of the tensors file

A save writes both files (meta.json last: it marks the checkpoint complete) into a scratch sibling
`.tmp-ckpt-...`, fsyncs them, renames the directory into place (atomic on POSIX) and fsyncs the parent.
So a `ckpt-*` directory is either complete or absent; a crash leaves at most a scratch directory, which
readers ignore and the next save deletes. Loading re-checks the recorded size and sha256, so a truncated
or bit-flipped file is refused instead of trained on, and `latest_checkpoint` walks back to the newest
checkpoint that loads and fits the run.

One writer per out_dir: a save deletes every scratch directory it finds there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from andrea import files
from andrea.errors import UserError

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
META_FILE = "meta.json"

_SCRATCH_PREFIX = ".tmp-ckpt-"
_NAME = re.compile(r"ckpt-(\d{8,})")
# What safetensors stores for NumPy; checked up front so a bad dtype fails before anything is written.
_DTYPES = frozenset({
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64",
})
_RECORD_FIELDS = {
    "step": int, "created": str, "tensors_bytes": int, "tensors_sha256": str, "meta": dict,
}
_HASH_CHUNK = 8 << 20
# safetensors reports I/O failures as text ("... No space left on device (os error 28)").
_OS_ERROR = re.compile(r"\(os error (\d+)\)")

Validate = Callable[[dict, dict], None]


class CheckpointError(UserError):
    """A checkpoint cannot be saved or loaded; the one-line message names the file and the problem."""


# ----------------------------------------------------------------------------------------------- saving

def save_checkpoint(out_dir, step: int, tensors: dict[str, np.ndarray], meta: dict,
                    keep_last: int = 3) -> Path:
    """Write `out_dir/ckpt-{step:08d}` atomically, then keep only the `keep_last` newest checkpoints.

    tensors: name -> NumPy array (C-contiguous arrays are written without a copy). meta: any
    JSON-serialisable dict; it comes back as JSON gives it (tuples as lists, int keys as strings).
    A failed save (full disk, ...) raises CheckpointError and leaves the earlier checkpoints as they were.
    """
    out_dir = Path(out_dir)
    step = _check_step(step)
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    arrays = _check_tensors(tensors)
    _check_meta(meta)
    final = out_dir / f"ckpt-{step:08d}"
    try:
        _save_atomically(out_dir, final, step, arrays, meta)
    except OSError as err:
        raise CheckpointError(
            f"saving checkpoint {final} failed: {_reason(err)}; the earlier checkpoints are intact"
        ) from err
    try:
        _prune(out_dir, keep_last, final)
    except OSError as err:
        raise CheckpointError(
            f"saved {final}, but deleting older checkpoints failed: {_reason(err)}"
        ) from err
    return final


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
    return int(step)


def _check_tensors(tensors) -> dict[str, np.ndarray]:
    """Refuse what safetensors cannot store, and make every array C-contiguous.

    safetensors.numpy writes `nbytes` bytes from the array's data pointer, so a transposed or sliced
    view would be saved scrambled without complaint; only such views are copied.
    """
    if not isinstance(tensors, dict):
        raise CheckpointError(
            f"checkpoint tensors must be a dict of name -> array, not {type(tensors).__name__}"
        )
    arrays = {}
    for name, array in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"tensor name {name!r} cannot be saved: use a non-empty string")
        if not isinstance(array, np.ndarray):
            raise CheckpointError(
                f"tensor {name!r} is a {type(array).__name__}, not a NumPy array: copy it to the host first"
            )
        if array.dtype.name not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store")
        # not np.ascontiguousarray for all: it turns a 0-d array into shape (1,)
        arrays[name] = array if array.flags.c_contiguous else np.ascontiguousarray(array)
    return arrays


def _check_meta(meta) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint meta is not JSON-serialisable ({err}): convert NumPy scalars with .item()"
        ) from err


def _save_atomically(out_dir: Path, final: Path, step: int, arrays: dict, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(_SCRATCH_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save; frees its disk space first
    scratch = _scratch_path(out_dir, final.name)
    scratch.mkdir()
    try:
        _write_checkpoint(scratch, step, arrays, meta)
        _publish(scratch, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone already when the publish succeeded


def _scratch_path(out_dir: Path, name: str) -> Path:
    """`.tmp-ckpt-00000200-<random>` for checkpoint `ckpt-00000200`: unique, and matched by the cleanup."""
    return out_dir / f".tmp-{name}-{secrets.token_hex(4)}"


def _write_checkpoint(scratch: Path, step: int, arrays: dict, meta: dict) -> None:
    tensors_path = scratch / TENSORS_FILE
    _write_file(tensors_path, lambda path: _save_tensors(arrays, path))
    size, sha256 = _file_digest(tensors_path)
    record = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "tensors_bytes": size,
        "tensors_sha256": sha256,
        "meta": meta,
    }
    text = json.dumps(record, indent=1) + "\n"
    _write_file(scratch / META_FILE, lambda path: path.write_text(text, encoding="utf-8"))
    _fsync(scratch)  # the directory entries too, before the rename can make them visible


def _write_file(path: Path, write: Callable[[Path], None]) -> None:
    """Create `path` with `write(path)` and force it to disk before anything depends on it.

    Every checkpoint file goes through here, tensors first and meta.json last, so tests replace this
    function to inject a full disk or a crash between the two.
    """
    write(path)
    _fsync(path)


def _save_tensors(arrays: dict, path: Path) -> None:
    try:
        safetensors.numpy.save_file(arrays, path)
    except safetensors.SafetensorError as err:
        # turn "I/O error: ... (os error 28)" back into an OSError, so a full disk is handled as one
        match = _OS_ERROR.search(str(err))
        code = int(match[1]) if match else errno.EIO
        raise OSError(code, os.strerror(code) if match else f"safetensors: {err}") from err
    # safetensors creates its file 0600; give it the permissions meta.json gets from the umask
    os.chmod(path, path.parent.stat().st_mode & 0o666)


def _publish(scratch: Path, final: Path) -> None:
    """Rename the finished scratch directory to `final`.

    A re-save of the same step moves the old `final` aside first and deletes it only once the new one is
    in place; a crash between the two renames loses that step's old copy, never an older checkpoint.
    """
    aside = None
    if final.exists():
        aside = _scratch_path(final.parent, final.name)
        os.rename(final, aside)
    try:
        os.rename(scratch, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)
        raise
    _fsync(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _prune(out_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the `keep_last` most recently saved checkpoints; `keep`, just saved, always stays.

    Ordered by save time, not step: after a resume from an older checkpoint the abandoned higher steps
    age out, instead of pushing out the checkpoints of the run that continues.
    """
    others = sorted((p for p in list_checkpoints(out_dir) if p != keep), key=_saved_at, reverse=True)
    for path in others[keep_last - 1:]:
        aside = _scratch_path(out_dir, path.name)
        os.rename(path, aside)  # one atomic step, so a crash never leaves a half-deleted ckpt-*
        shutil.rmtree(aside, ignore_errors=True)


def _saved_at(path: Path) -> tuple[float, int]:
    """(creation time, step) from meta.json; an unreadable one sorts oldest, so it goes first."""
    step = int(_NAME.fullmatch(path.name)[1])
    try:
        created = json.loads((path / META_FILE).read_text(encoding="utf-8"))["created"]
        return datetime.fromisoformat(created).timestamp(), step
    except (OSError, ValueError, TypeError, KeyError):
        return float("-inf"), step


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_digest(path: Path) -> tuple[int, str]:
    """(byte size, sha256 hex) of a file, read in chunks so a 400 MB file costs no memory."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _reason(err: OSError) -> str:
    """'no space left on device', not '[Errno 28] No space left on device: <scratch path>'."""
    text = err.strerror or str(err)
    return text[:1].lower() + text[1:]


# ---------------------------------------------------------------------------------------------- loading

def load_checkpoint(path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, meta) of one checkpoint directory, after checking it is complete and undamaged.

    The arrays are writable copies: nothing stays mapped to the file. Raises
    CheckpointError naming the file and what is wrong with it.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    record = _read_record(path / META_FILE)
    tensors_path = path / TENSORS_FILE
    _verify_tensors_file(tensors_path, record["tensors_bytes"], record["tensors_sha256"])
    try:
        tensors = safetensors.numpy.load_file(tensors_path, backend="pread")  # no mmap: one copy, no more
    except (safetensors.SafetensorError, OSError) as err:
        raise CheckpointError(f"checkpoint {tensors_path} is not a valid safetensors file: {err}") from err
    return tensors, record["meta"]


def _read_record(meta_path: Path) -> dict:
    try:
        record = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {meta_path} is missing: the checkpoint is incomplete or damaged"
        ) from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {meta_path} cannot be read: {_reason(err)}") from err
    except ValueError as err:  # bad UTF-8 or bad JSON
        raise CheckpointError(f"checkpoint {meta_path} is not valid JSON: {err}") from err
    if not isinstance(record, dict) or "format_version" not in record:
        raise CheckpointError(f"checkpoint {meta_path} has no format_version: not an andrea checkpoint")
    if record["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {meta_path} has format version {record['format_version']!r}; "
            f"this andrea reads version {FORMAT_VERSION}"
        )
    for field, kind in _RECORD_FIELDS.items():
        if not isinstance(record.get(field), kind):
            raise CheckpointError(f"checkpoint {meta_path} has no valid {field!r} field: the file is damaged")
    return record


def _verify_tensors_file(path: Path, expected_size: int, expected_sha256: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is missing: the checkpoint was damaged") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {_reason(err)}") from err
    if size < expected_size:
        raise CheckpointError(
            f"checkpoint {path} is truncated ({size} of {expected_size} bytes): damaged after it was saved"
        )
    if size > expected_size:
        raise CheckpointError(
            f"checkpoint {path} has {size} bytes, {expected_size} were saved: changed after it was saved"
        )
    try:
        _, sha256 = _file_digest(path)
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {_reason(err)}") from err
    if sha256 != expected_sha256:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: sha256 {sha256[:16]}... differs from the saved "
            f"{expected_sha256[:16]}..."
        )


# ---------------------------------------------------------------------------------------------- finding

def list_checkpoints(out_dir) -> list[Path]:
    """Complete-looking checkpoints (meta.json present) in out_dir, highest step first; unverified."""
    return [path for path in _checkpoint_dirs(out_dir) if (path / META_FILE).is_file()]


def _checkpoint_dirs(out_dir) -> list[Path]:
    """Every `ckpt-<step>` directory, highest step first; scratch directories never match."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(path.name[5:]), path) for path in out_dir.iterdir()
             if is_checkpoint_name(path.name) and path.is_dir()]
    return [path for _, path in sorted(found, reverse=True)]


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is the name save_checkpoint gives a checkpoint directory (ckpt-NNNNNNNN)."""
    match = _NAME.fullmatch(name)
    return bool(match) and name == f"ckpt-{int(match[1]):08d}"


def latest_checkpoint(out_dir, validate: Validate | None = None,
                      warn: Callable[[str], None] = files.warn) -> tuple[Path, dict, dict]:
    """(path, tensors, meta) of the newest checkpoint that loads and passes `validate(tensors, meta)`.

    `validate` raises UserError (or CheckpointError) when a checkpoint does not fit the run, e.g. other
    shapes. Each refused checkpoint, including a damaged `ckpt-*` without meta.json, is reported through
    `warn` and the next older one is tried. Other exceptions from `validate` are bugs and propagate.
    """
    refused = []
    for path in _checkpoint_dirs(out_dir):
        try:
            tensors, meta = load_checkpoint(path)
            if validate is not None:
                validate(tensors, meta)
        except UserError as err:
            warn(f"skipping {path}: {err}")
            refused.append((path.name, str(err)))
            continue
        return path, tensors, meta
    raise CheckpointError(_nothing_usable(Path(out_dir), refused))


def _nothing_usable(out_dir: Path, refused: list[tuple[str, str]]) -> str:
    """Why no checkpoint serves: the reason itself when every one was refused for the same one (a
    config that does not fit them all reads as that, not as damage)."""
    names, reasons = [name for name, _ in refused], {reason for _, reason in refused}
    if not out_dir.is_dir():
        why = "the directory does not exist"
    elif not refused:
        why = "it holds no checkpoints"
    elif len(reasons) == 1:
        why = f"{len(refused)} of {len(refused)} refused ({', '.join(names)}): {reasons.pop()}"
    else:
        why = f"all {len(refused)} were refused ({', '.join(names)}); see the warnings above"
    return f"no usable checkpoint in {out_dir}: {why}"
