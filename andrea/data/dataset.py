"""The data side of training: corpus files, the train/validation split, token files, batches.

- A corpus is a sorted list of files; each file is one document, and the
  tokenizer puts the end-of-text id between documents. The default corpus is the
  `.py` source of the running interpreter's standard library, which needs no download.
- A token file is a 128-byte header followed by the token ids as little-endian uint16:

      offset  size  field
      0       8     magic b"ANDREATK"
      8       4     format version (uint32, currently 1)
      12      4     vocab size the ids were made with (uint32)
      16      8     token count (uint64)
      24      64    tokenizer fingerprint, ASCII sha256 hex, NUL padded
      88      40    zero

  so a file made by another tokenizer, a cut-off copy or a stray file is refused before training.
- A data directory (written by `andrea.prepare`) holds `tokenizer.json`, the token files of each
  split in shards (`train-00000.bin`, ..., `val-00000.bin`, ...; ~100M tokens each) and `meta.json`,
  written last: the manifest naming every shard with its token count and largest id (checked when
  written, so opening a directory reads headers, never the ids). `open_split` reads a split as one
  `TokenShards` sequence; a directory from before the shards (`train.bin`, `val.bin`) still opens.
- `BatchLoader` draws (B, T) windows at random offsets from a seeded PCG64, splits each optimizer
  step's windows across data-parallel ranks in a fixed order, and can be resumed exactly on any
  number of processes; `iter_eval_batches` gives fixed windows for a comparable validation loss
  (every world-th batch to each rank).

Everything is written through `atomic_writer`: a file appears under its final name complete or
not at all. No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import heapq
import json
import os
import struct
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from andrea.errors import UserError

MAGIC = b"ANDREATK"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sIIQ64s")
TOKEN_DTYPE = np.dtype("<u2")
MAX_VOCAB = 1 << 16  # ids must fit uint16

# Directory and glob inputs take every file except these: hidden entries (.git, editor files) and
# formats that are never text. An explicitly named file is always taken.
SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages", "node_modules"}
BINARY_SUFFIXES = (
    {".pyc", ".pyo", ".so", ".dll", ".dylib", ".o", ".a", ".exe", ".bin", ".whl", ".jar"}  # compiled
    | {".npy", ".npz", ".pkl", ".pt", ".safetensors", ".db", ".sqlite"}  # data
    | {".zip", ".gz", ".bz2", ".xz", ".zst", ".tar", ".7z"}  # archives
    | {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".pdf", ".mp3", ".wav", ".mp4"}  # media
    | {".ttf", ".otf", ".woff", ".woff2"}  # fonts
)


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


# ----------------------------------------------------------------------------- corpus files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus_files() -> list[Path]:
    """The `.py` files of this interpreter's standard library, sorted, without site-packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib_root()):
        # Pruned, not filtered: site-packages can be far larger than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in {"site-packages", "dist-packages", "__pycache__"}]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(p for p in files if p.is_file())


def resolve_inputs(specs: Iterable[str], progress: Callable[[int], None] | None = None) -> list[Path]:
    """Expand files, directories and glob patterns into a sorted, deduplicated list of files.

    A named file is taken as is. A directory is searched recursively for every file except
    hidden ones, those under `SKIPPED_DIRS` (`__pycache__`, ...) and known binary formats
    (`BINARY_SUFFIXES`). A pattern with `*`, `?` or `[` is a glob (`**` recurses): the files it
    matches are filtered the same way, the directories searched. A spec that yields no file is a
    UserError. `progress`, if given, is called with the number of files found so far as they are
    found (listing a large corpus takes a while).
    """
    return [Path(name) for name in iter_input_names(specs, progress)]


def resolve_input_names(specs: Iterable[str], progress: Callable[[int], None] | None = None) -> list[str]:
    """`resolve_inputs` as absolute path strings, in the same order."""
    return list(iter_input_names(specs, progress))


def iter_input_names(specs: Iterable[str], progress: Callable[[int], None] | None = None) -> Iterator[str]:
    """`resolve_inputs` one absolute path string at a time, without holding the list: a directory
    is walked one directory at a time (`_walk_text_files`), each spec's files come sorted, and the
    specs' streams are merged, a file named twice given once. Paths are ordered part by part, as
    `Path`s compare: a directory's files come at the place of its name among its siblings.

    A glob is the exception: its matches are expanded, sorted and held whole (the glob module
    returns them as a list anyway). A spec that yields no file raises when its stream ends.
    """
    progress = progress or (lambda n: None)
    previous, count = None, 0
    for name in heapq.merge(*(_spec_names(spec) for spec in specs), key=_part_key):
        if name != previous:
            count += 1
            progress(count)
            yield name
        previous = name


def _part_key(name: str) -> str:
    # Paths compare part by part: as strings whose separator sorts before every character.
    return name.replace(os.sep, "\0")


def _spec_names(spec: str) -> Iterator[str]:
    """The files of one spec in `_part_key` order; a UserError once it is clear there are none."""
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        names: Iterable[str] = [os.path.abspath(path)]
    elif os.path.isdir(path):
        names = _walk_text_files(path)
    elif any(ch in spec for ch in "*?["):
        names = sorted(set(_glob_names(path)), key=_part_key)
    else:
        names = []
    found = False
    for name in names:
        found = True
        yield name
    if not found:
        raise UserError(f"input {spec!r} matches no file")


def _glob_names(pattern: str) -> Iterator[str]:
    for match in _glob(pattern):
        if os.path.isdir(match):
            yield from _walk_text_files(match)
        elif os.path.isfile(match) and _looks_like_text(Path(match)):
            yield os.path.abspath(match)


def _glob(pattern: str) -> Iterator[str]:
    """The paths `pattern` matches, as `glob.glob(pattern, recursive=True)` gives them, except that a
    wildcard (`**` included) never goes through a symbolic link to a directory, as the directory walk
    never enters one: `self -> .` or `up -> ..` would make `**` loop or take each file many times
    (glob follows them until the path is too long). A link written out in the pattern is followed."""
    parts = Path(os.path.expanduser(pattern)).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    top = os.path.join(*parts[:fixed]) if fixed else os.curdir
    if fixed == len(parts):
        return iter([top] if os.path.lexists(top) else [])
    matches = _match(top, parts[fixed:], prefix=fixed > 0)
    if pattern.endswith(("/", os.sep)):  # as in glob: a trailing slash matches directories only
        return (m for m in matches if os.path.isdir(m))
    return matches


def _match(directory: str, parts: tuple[str, ...], prefix: bool = True) -> Iterator[str]:
    """The paths under `directory` that the pattern parts `parts` match (see `_glob`)."""
    head, rest = parts[0], parts[1:]
    name = (lambda entry: os.path.join(directory, entry)) if prefix else (lambda entry: entry)
    if head == "**":
        if not rest:  # every file and directory below: the directory itself, walked by the caller
            yield directory if prefix else os.curdir
            return
        yield from _match(directory, rest, prefix)
        for entry, is_dir in _wildcard_entries(directory, "*"):
            if is_dir:
                yield from _match(name(entry), parts)
        return
    if not glob.has_magic(head):
        path = name(head)
        if not rest:
            if os.path.lexists(path):
                yield path
        elif os.path.isdir(path):
            yield from _match(path, rest)
        return
    for entry, is_dir in _wildcard_entries(directory, head):
        if not rest:
            yield name(entry)
        elif is_dir:
            yield from _match(name(entry), rest)


def _wildcard_entries(directory: str, part: str) -> list[tuple[str, bool]]:
    """(name, is a real directory) of the entries of `directory` that the wildcard `part` matches:
    hidden names only for a part that starts with a dot, and no symbolic link to a directory."""
    entries = _scandir(directory)
    taken = []
    for entry in entries:
        if entry.name.startswith(".") and not part.startswith("."):
            continue
        if not fnmatch.fnmatchcase(entry.name, part):
            continue
        linked_dir = entry.is_symlink() and os.path.isdir(entry.path)
        if not linked_dir:
            taken.append((entry.name, _is_dir(entry)))
    return sorted(taken)


def _scandir(directory: str) -> list[os.DirEntry]:
    """The entries of `directory`, unsorted; none for one that cannot be listed (as `os.walk` skips it)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def _walk_text_files(top: str) -> Iterator[str]:
    """The files a directory input takes under the directory `top`, as absolute paths in
    `_part_key` order.

    Depth first with each directory's entries sorted by name, files and subdirectories together,
    so the order is that of sorting every path at once, while only the entries of the directories
    on the current path are held. Hidden entries, `SKIPPED_DIRS` and binary suffixes are left out;
    a symbolic link to a directory is not followed (a link to a file is taken); a directory that
    cannot be listed is skipped, as `os.walk` does. Nothing when `top`, as written, passes through a
    skipped directory.
    """
    if SKIPPED_DIRS & set(Path(top).parts):
        return
    stack = [iter(_directory_entries(os.path.abspath(top)))]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
        elif entry[1]:
            stack.append(iter(_directory_entries(entry[0])))
        else:
            yield entry[0]


def _directory_entries(directory: str) -> list[tuple[str, bool]]:
    """(path, is a directory to enter) for the entries of `directory` a walk takes, sorted by name."""
    entries = _scandir(directory)
    taken = []
    for entry in entries:
        if entry.name.startswith(".") or entry.name in SKIPPED_DIRS:
            continue
        if _is_dir(entry):
            if not entry.is_symlink():
                taken.append((entry.name, True))
        elif not _binary_suffix(entry.name) and _is_file(entry):
            taken.append((entry.name, False))
    taken.sort()
    return [(os.path.join(directory, name), is_dir) for name, is_dir in taken]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _binary_suffix(name: str) -> bool:
    return Path(name).suffix.lower() in BINARY_SUFFIXES


def _looks_like_text(path: Path) -> bool:
    return path.suffix.lower() not in BINARY_SUFFIXES and not SKIPPED_DIRS & set(path.parts)


@dataclass(frozen=True)
class Document:
    path: Path
    text: str
    n_bytes: int  # size of the file on disk
    valid_utf8: bool  # False: undecodable bytes were replaced by U+FFFD


def read_documents(paths: Iterable[Path]) -> Iterator[Document]:
    """Read each file as one document.

    A file that is not valid UTF-8 is kept, its bad bytes replaced by U+FFFD, and flagged
    (`valid_utf8=False`) so the caller can count it: dropping it would silently shrink the
    corpus (the stdlib has a few Latin-1 test files). An unreadable file is a UserError.
    """
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror or e}") from e
        try:
            yield Document(Path(path), raw.decode("utf-8"), len(raw), True)
        except UnicodeDecodeError:
            yield Document(Path(path), raw.decode("utf-8", errors="replace"), len(raw), False)


def split_validation(paths: list[Path], root: Path, val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Split files into (train, val): a file is in val when a hash of its path under `root` falls
    below `val_fraction`, so the split is the same on every machine and for every run.

    With two or more files, each side gets at least one file.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    key = {p: _split_key(Path(p).relative_to(root).as_posix()) for p in paths}
    val = [p for p in paths if key[p] < val_fraction]
    if len(paths) >= 2:
        if not val:
            val = [min(paths, key=key.__getitem__)]
        elif len(val) == len(paths):
            val.remove(max(val, key=key.__getitem__))
    val_set = set(val)
    return [p for p in paths if p not in val_set], val


def _split_key(relative_path: str) -> float:
    digest = hashlib.sha256(relative_path.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


# ----------------------------------------------------------------------------- token files


@dataclass(frozen=True)
class TokenFileHeader:
    version: int
    vocab_size: int
    count: int
    fingerprint: str


class TokenSink:
    """Appends token ids to an open token file, counts them and hashes them (`sha256`: of the bytes
    after the header, what the manifest records and `verify_split` checks; see `token_writer`)."""

    def __init__(self, f: BinaryIO, vocab_size: int, path=None):
        self._f, self.path = f, path
        self.vocab_size = vocab_size
        self.count = 0
        self.sha256 = hashlib.sha256()

    def write(self, tokens) -> None:
        ids = np.asarray(tokens)
        if ids.size == 0:
            return
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"token id {hi if hi >= self.vocab_size else lo} is outside 0..{self.vocab_size - 1}")
        raw = np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes()
        try:
            self._f.write(raw)
        except OSError as e:  # a full disk: the error names the shard (the sink's owner may not be in a with)
            raise named(e, self.path) from None
        self.sha256.update(raw)
        self.count += ids.size


@contextlib.contextmanager
def token_writer(path, vocab_size: int, fingerprint: str) -> Iterator[TokenSink]:
    """Stream token ids into a new token file; it appears under `path` only if the block succeeds."""
    _check_vocab_size(vocab_size)
    fp = fingerprint.encode("ascii")
    if len(fp) > 64:
        raise ValueError("a tokenizer fingerprint has at most 64 ASCII characters")
    with atomic_writer(path) as f:
        f.write(bytes(HEADER_SIZE))  # the count is known only at the end
        sink = TokenSink(f, vocab_size, path)
        yield sink
        f.seek(0)
        f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, vocab_size, sink.count, fp))


def write_tokens(path, tokens: np.ndarray, vocab_size: int, fingerprint: str) -> None:
    """Write `tokens` (1-D ints < vocab_size) as an andrea token file, atomically."""
    with token_writer(path, vocab_size, fingerprint) as sink:
        sink.write(tokens)


def _check_vocab_size(vocab_size: int) -> None:
    if not 0 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"token files hold uint16 ids: vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")


def read_token_header(path) -> TokenFileHeader:
    """Read and check the header of a token file: magic, version and the file's length."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise UserError(f"token file {path} does not exist: run python -m andrea.prepare") from None
    except OSError as e:
        raise UserError(f"cannot read token file {path}: {e.strerror or e}") from e
    if not head.startswith(MAGIC):
        raise UserError(f"{path} is not an andrea token file (made by python -m andrea.prepare)")
    if len(head) < HEADER_SIZE:
        raise UserError(f"{path} is truncated (shorter than its header): re-run python -m andrea.prepare --force")
    _, version, vocab_size, count, fp = _HEADER.unpack_from(head)
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path} is token file format version {version}; this andrea reads version {FORMAT_VERSION}: "
            "re-run python -m andrea.prepare --force"
        )
    expected = HEADER_SIZE + count * TOKEN_DTYPE.itemsize
    if size != expected:
        raise UserError(
            f"{path} is truncated or corrupt: its header promises {count} tokens ({expected} bytes) "
            f"but the file has {size} bytes: re-run python -m andrea.prepare --force"
        )
    return TokenFileHeader(version, vocab_size, count, fp.rstrip(b"\0").decode("ascii", errors="replace"))


def read_tokens(path, vocab_size: int | None = None, fingerprint: str | None = None) -> np.ndarray:
    """Open a token file as a read-only uint16 memmap, refusing files that do not fit.

    `vocab_size` and `fingerprint`, when given, must match what the file was made with. Every id is
    checked against the file's vocab size (one pass of `max` over the map).
    """
    path = Path(path)
    header = read_token_header(path)
    tokens = _open_ids(path, header, vocab_size, fingerprint)
    top = int(tokens.max()) if len(tokens) else 0
    if top >= header.vocab_size:
        raise UserError(
            f"{path} holds token id {top} but was made with only {header.vocab_size} ids: the file is "
            "corrupt; re-run python -m andrea.prepare --force"
        )
    return tokens


def _open_ids(path: Path, header: TokenFileHeader, vocab_size: int | None, fingerprint: str | None) -> np.ndarray:
    """The ids of a token file whose header was read, as a read-only memmap (no scan of the ids)."""
    if vocab_size is not None and header.vocab_size != vocab_size:
        raise UserError(
            f"{path} was made with a tokenizer of {header.vocab_size} ids, this model has {vocab_size}: "
            "re-run python -m andrea.prepare"
        )
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise UserError(
            f"{path} was made with a different tokenizer (fingerprint {header.fingerprint[:12]}, "
            f"expected {fingerprint[:12]}): re-run python -m andrea.prepare --force"
        )
    if header.count == 0:
        empty = np.zeros(0, dtype=TOKEN_DTYPE)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_SIZE, shape=(header.count,))


def unigram_entropy(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """Cross-entropy in nats/token of the val tokens under the train unigram distribution.

    Both arguments are (V,) id counts. Add-one smoothing over all V ids keeps ids unseen in
    train finite. This is the loss of a model that ignores context: the first bar to beat.
    """
    V = len(train_counts)
    log_p = np.log((np.asarray(train_counts, dtype=np.float64) + 1.0) / (np.sum(train_counts) + V))  # (V,)
    return float(-(np.asarray(val_counts, dtype=np.float64) @ log_p) / max(np.sum(val_counts), 1))


# ----------------------------------------------------------------------------- a split in shards

DATA_FORMAT = "andrea-data"  # meta.json's "format": what marks a directory as an andrea data directory
SHARDED_META_VERSION = 2  # meta.json with a shard list; version 1 had one train.bin and one val.bin


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


class TokenShards:
    """The token stream of one split, stored as consecutive shards, read as one sequence.

    `len()` is the total count and `windows(starts, length)` gathers rows tokens[s : s + length]
    by offset in the whole stream, crossing from one shard into the next where a window does (the
    shards are consecutive pieces of one stream, cut after an EOT). Offsets are int64, so a split
    past 2^32 tokens works. With `vocab_size`, each gathered window is checked to be in range: the
    ids were checked when written, and one `max` per batch catches a file changed since.
    """

    def __init__(self, shards: list[np.ndarray], vocab_size: int | None = None, names: list[str] | None = None):
        self.shards = list(shards)
        self.names = names or [f"shard {i}" for i in range(len(shards))]
        self.vocab_size = vocab_size
        self.ends = np.cumsum([len(a) for a in self.shards], dtype=np.int64)  # (n_shards,)
        self.begins = self.ends - np.array([len(a) for a in self.shards], dtype=np.int64)

    @classmethod
    def of(cls, tokens) -> TokenShards:
        """`tokens` itself if it is a TokenShards, else one shard holding the 1-D array `tokens`."""
        return tokens if isinstance(tokens, TokenShards) else cls([np.asarray(tokens)])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def windows(self, starts, length: int) -> np.ndarray:
        """Rows tokens[s : s + length] for each s in `starts`: int64 of shape (len(starts), length)."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            i = int(np.searchsorted(self.ends, start, side="right"))  # the shard holding `start`
            filled = 0
            while filled < length:
                local = start + filled - int(self.begins[i])
                piece = self.shards[i][local : local + length - filled]
                out[row, filled : filled + len(piece)] = piece
                filled += len(piece)
                i += 1
        if self.vocab_size is not None and out.size and (out.max() >= self.vocab_size or out.min() < 0):
            raise UserError(f"a token file of this data holds an id outside 0..{self.vocab_size - 1} (one of "
                            f"{', '.join(self.names[:3])}...): it changed since it was written; prepare it again")
        return out


def read_data_meta(data_dir) -> dict | None:
    """The data directory's meta.json when it is complete (a version this andrea reads), else None."""
    try:
        meta = json.loads((Path(data_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("meta_version") not in (1, SHARDED_META_VERSION):
        return None
    return meta


def split_counts(data_dir) -> tuple[int, int] | None:
    """(train tokens, val tokens) of a complete data directory, from its meta.json; None if incomplete."""
    meta = read_data_meta(data_dir)
    if meta is None:
        return None
    try:
        return int(meta["train_tokens"]), int(meta["val_tokens"])
    except (KeyError, TypeError, ValueError):
        return None


def open_split(data_dir, split: str, vocab_size: int, fingerprint: str) -> TokenShards:
    """The `split` ("train" or "val") of a prepared data directory, checked against the tokenizer.

    Each shard's header must match its manifest entry (count, vocab size, fingerprint) and the
    manifest's largest id must fit `vocab_size`: a check of headers, not of the ids themselves.
    A version-1 directory (one `train.bin` / `val.bin`) is read as one shard, checked as before.
    """
    data_dir = Path(data_dir)
    meta = read_data_meta(data_dir)
    if meta is None:
        raise UserError(f"{data_dir} holds no complete prepared data (meta.json): run python -m andrea.prepare")
    if meta["meta_version"] == 1:
        return TokenShards([read_tokens(data_dir / f"{split}.bin", vocab_size, fingerprint)], vocab_size)
    arrays, names = [], []
    for entry in meta["shards"][split]:
        path = data_dir / entry["file"]
        header = read_token_header(path)
        if header.count != entry["tokens"]:
            raise UserError(f"{path} holds {header.count} tokens but meta.json says {entry['tokens']}: the data "
                            "directory was changed since it was prepared; prepare it again (--force)")
        if entry["max_id"] >= vocab_size:
            raise UserError(f"{path} holds token id {entry['max_id']}, past this model's {vocab_size} ids")
        arrays.append(_open_ids(path, header, vocab_size, fingerprint))
        names.append(entry["file"])
    return TokenShards(arrays, vocab_size, names)


def check_shards(data_dir, meta: dict, fingerprint: str) -> None:
    """Every shard the manifest `meta` names has the header and size it says, made with the tokenizer
    of `fingerprint`: a UserError naming the first that does not (headers only, no ids read)."""
    data_dir = Path(data_dir)
    for split in ("train", "val"):
        for name, count in _manifest_files(meta, split):
            path = data_dir / name
            header = read_token_header(path)  # the file's size against its header's count
            if header.count != count:
                raise UserError(f"{path} holds {header.count} tokens but meta.json says {count}: the data "
                                "directory was changed since it was prepared; prepare it again (--force)")
            if header.fingerprint != fingerprint:
                raise UserError(f"{path} was made with another tokenizer than {data_dir / 'tokenizer.json'}: the "
                                "data directory was changed since it was prepared; prepare it again (--force)")


def _manifest_files(meta: dict, split: str) -> list[tuple[str, int]]:
    if meta["meta_version"] == 1:
        return [(f"{split}.bin", int(meta[f"{split}_tokens"]))]
    return [(e["file"], int(e["tokens"])) for e in meta["shards"][split]]


VERIFY_CHUNK = 1 << 24  # bytes of ids read at a time by verify_shards


def verify_shards(data_dir, meta: dict, fingerprint: str) -> tuple[int, int, list[str]]:
    """Read every shard whole: (shards with a checksum, tokens read, problems). A problem is a shard
    whose ids' sha256 or largest id is not the manifest's, each a line naming the shard; the headers
    and sizes are checked first (`check_shards`, a UserError). Manifests from before the checksums
    have none: their shards are counted as read but not as checked."""
    data_dir = Path(data_dir)
    check_shards(data_dir, meta, fingerprint)
    checked, tokens, problems = 0, 0, []
    entries = [e for split in ("train", "val") for e in meta["shards"][split]] if meta["meta_version"] != 1 else []
    for entry in entries:
        path = data_dir / entry["file"]
        digest, top = hashlib.sha256(), -1
        with open(path, "rb") as f:
            f.seek(HEADER_SIZE)
            while chunk := f.read(VERIFY_CHUNK):
                digest.update(chunk)
                top = max(top, int(np.frombuffer(chunk, dtype=TOKEN_DTYPE).max()))
        tokens += int(entry["tokens"])
        if "sha256" not in entry:
            continue
        checked += 1
        if digest.hexdigest() != entry["sha256"]:
            problems.append(f"{path}: its ids' checksum is not the one meta.json recorded when it was written")
        elif top != entry["max_id"]:
            problems.append(f"{path}: its largest id is {top}, meta.json says {entry['max_id']}")
    return checked, tokens, problems


# ----------------------------------------------------------------------------- batches


def _check_window(n_tokens: int, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise UserError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if n_tokens < seq_len + 1:
        raise UserError(
            f"the data holds {n_tokens} tokens, too few for the context length {seq_len} "
            f"(a window needs {seq_len + 1}): use a larger corpus or a shorter context_length"
        )


def _windows(tokens: TokenShards, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    chunk = tokens.windows(starts, seq_len + 1)  # (B, T+1)
    return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])


class BatchLoader:
    """Random (B, T) training windows: x = tokens[o:o+T], y = tokens[o+1:o+T+1] per row.

    Offsets come from `np.random.Generator(PCG64(seed))`, so a seed fixes the whole stream.
    Data-parallel runs (`world` processes, `accum` micro-batches each) draw all B x accum x world
    windows of an optimizer step in one call, and rank r takes the r-th contiguous share, cut
    into its micro-batches in order. The windows of each step are therefore the same set for any
    world size that divides the step, and the generator's state between steps does not depend
    on it (PCG64's bounded integers come out the same whether drawn in one call or several, so
    one process draws exactly what it drew before this split existed).

    `state_dict()` / `load_state_dict()` (between optimizer steps) let a resumed run, on any
    number of processes, draw exactly the batches it would have.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 accum: int = 1, rank: int = 0, world: int = 1):
        _check_window(len(tokens), batch_size, seq_len)
        if not (accum >= 1 and world >= 1 and 0 <= rank < world):
            raise ValueError(f"bad data-parallel split: accum {accum}, rank {rank}, world {world}")
        self.tokens = TokenShards.of(tokens)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.accum, self.rank, self.world = accum, rank, world
        self.windows = 0  # drawn by all ranks together: the same count on any world size
        self._queue: list[np.ndarray] = []  # this rank's micro-batches of the current step
        self._rng = np.random.Generator(np.random.PCG64(seed))

    @property
    def batches(self) -> int:
        """Micro-batches this rank has taken."""
        return self.windows // (self.batch_size * self.world) - len(self._queue)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Return (x, y), both int64 of shape (B, T)."""
        if not self._queue:
            self._queue = self._draw_step()
        return _windows(self.tokens, self._queue.pop(0), self.seq_len)

    def _draw_step(self) -> list[np.ndarray]:
        share = self.batch_size * self.accum
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len, size=share * self.world)
        self.windows += len(starts)
        mine = starts[self.rank * share : (self.rank + 1) * share]
        return [mine[i : i + self.batch_size] for i in range(0, share, self.batch_size)]

    def state_dict(self) -> dict:
        """JSON-safe state: PCG64's 128-bit integers are kept as decimal strings."""
        if self._queue:
            raise RuntimeError("the data-loader state is only defined between optimizer steps")
        s = self._rng.bit_generator.state
        return {
            "bit_generator": s["bit_generator"],
            "state": str(s["state"]["state"]),
            "inc": str(s["state"]["inc"]),
            "has_uint32": int(s["has_uint32"]),
            "uinteger": int(s["uinteger"]),
            "windows": self.windows,
        }

    def load_state_dict(self, d: dict) -> None:
        try:
            state = {
                "bit_generator": d["bit_generator"],
                "state": {"state": int(d["state"]), "inc": int(d["inc"])},
                "has_uint32": int(d["has_uint32"]),
                "uinteger": int(d["uinteger"]),
            }
            # checkpoints from before the data-parallel split counted one process's batches
            windows = int(d["windows"]) if "windows" in d else int(d["batches"]) * self.batch_size
            self._rng.bit_generator.state = state
            self.windows, self._queue = windows, []
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"the saved data-loader state is not one this version can resume from: {e}") from e


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int, rank: int = 0, world: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield up to `max_batches` fixed (x, y) int64 batches of shape (B, T) for validation.

    Windows start at evenly spaced offsets from the first token to the last full window, so they
    sample the whole file and never overlap; every batch is full unless the file holds fewer than
    B windows, in which case there is one smaller batch. With `world` > 1, rank r gets batches
    r, r + world, ... of that same list.
    """
    _check_window(len(tokens), batch_size, seq_len)
    tokens = TokenShards.of(tokens)
    n_windows = min(max_batches * batch_size, (len(tokens) - 1) // seq_len)
    if n_windows >= batch_size:
        n_windows -= n_windows % batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).round().astype(np.int64)
    for i in range(rank * batch_size, n_windows, world * batch_size):
        yield _windows(tokens, starts[i : i + batch_size], seq_len)
