"""The corpus as a stream of bounded blocks: where files are cut, which block is validation, and
an encoder that runs on every core yet gives its results in corpus order.

A file of `size` bytes is cut near every multiple of the block size U: the cut for the nominal
position p is just after the first newline in [p, p + U), or, in a line longer than that, at the
first UTF-8 character that starts at or after p. So a file has ceil(size / U) blocks (the last
ones may be empty inside a very long line), each at most ~2U bytes, none splitting a character,
and the list of blocks follows from the file sizes alone (but for a one-file corpus's validation
cut, below): it is known before the text is read.
Every piece of work (reading, tokenizer training, encoding) handles one block at a time, which
is what keeps memory flat whatever the size of the corpus or of its largest file. Encoding a
block instead of its whole file changes ids only at the cuts; decoding gives the text back exactly.

The validation split (a stable function of the files' paths and sizes, the same on every machine):

- several files: a block is validation when a hash of (its file's path under the corpus root, its
  index) falls below `val_fraction`; block 0 hashes the path alone, so a file of one block is
  split exactly as whole files were before blocks existed. U = val_fraction x corpus bytes / 4,
  kept within 64 KiB..1 MiB: small enough that even a few large files give the split many blocks
  to choose from (four 26 MB files at 1%: 400 blocks, not 4 files), large enough that the default
  corpus's files (all under 0.31 MB) stay whole. Each side gets at least one block.
- one file: its last `val_fraction` of bytes, from the first newline after that point (none there:
  no validation, which preparation refuses with advice). The only plan that reads the file: around
  that one cut, so that it falls at a line's end.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.errors import UserError

MIN_BLOCK = 64 << 10
MAX_BLOCK = 1 << 20
SCAN = 1 << 16  # bytes read at a time while looking for the newline after a cut's nominal position


@dataclass(frozen=True)
class Block:
    """Bytes [start nominal, end nominal) of file `file` (an index into the corpus's file list), cut
    by `cut_at`; `index` is its position in the file, `val` its side of the split."""

    file: int
    index: int
    nominal_start: int
    nominal_end: int
    val: bool
    last: bool  # the file's last block: an EOT follows the document in each split it went to


def block_size(total_bytes: int, val_fraction: float) -> int:
    return int(min(MAX_BLOCK, max(MIN_BLOCK, val_fraction * total_bytes / 4)))


class Blocks(Sequence):
    """The plan of a corpus: block j's fields in row j of six numpy arrays (26 bytes a block, not a
    Python object each: a corpus of a million files plans in ~30 MB). `blocks[j]` gives a `Block`."""

    def __init__(self, file, index, nominal_start, nominal_end, val, last):
        self.file = np.asarray(file, dtype=np.int32)
        self.index = np.asarray(index, dtype=np.int32)
        self.nominal_start = np.asarray(nominal_start, dtype=np.int64)
        self.nominal_end = np.asarray(nominal_end, dtype=np.int64)
        self.val = np.asarray(val, dtype=bool)
        self.last = np.asarray(last, dtype=bool)

    def __len__(self) -> int:
        return len(self.file)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        return Block(int(self.file[j]), int(self.index[j]), int(self.nominal_start[j]), int(self.nominal_end[j]),
                     bool(self.val[j]), bool(self.last[j]))

    def nominal_bytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of blocks [start, stop) by their nominal bounds (the cuts move them by a line at most)."""
        return int((self.nominal_end[start:stop] - self.nominal_start[start:stop]).sum())


def plan_blocks(paths: Sequence[Path], sizes, root: Path, val_fraction: float) -> Blocks:
    """Every block of the corpus, in order, with its side of the split (see the module docstring)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    nonempty = np.flatnonzero(sizes)
    if len(nonempty) == 1:
        (i,) = nonempty
        return _one_file_blocks(Path(paths[i]), int(i), int(sizes[i]), val_fraction)
    U = block_size(int(sizes.sum()), val_fraction)
    per_file = -(-sizes[nonempty] // U)  # blocks in each non-empty file
    file = np.repeat(nonempty, per_file)
    first = np.repeat(np.cumsum(per_file) - per_file, per_file)  # each block's file's first block
    index = np.arange(len(file)) - first
    start = index * U
    end = np.minimum(start + U, sizes[file])
    last = index == np.repeat(per_file, per_file) - 1
    keys = np.empty(len(file))
    for j, (i, k) in enumerate(zip(file.tolist(), index.tolist())):
        rel = Path(paths[i]).relative_to(root).as_posix()
        keys[j] = split_key(rel if k == 0 else f"{rel}#{k}")
    val = keys < val_fraction
    if len(file) >= 2 and not val.any():
        val[int(np.argmin(keys))] = True
    elif len(file) >= 2 and val.all():
        val[int(np.argmax(keys))] = False
    return Blocks(file, index, start, end, val, last)


def _one_file_blocks(path: Path, i: int, size: int, val_fraction: float) -> Blocks:
    """The blocks of a one-file corpus: validation from the first newline in its last `val_fraction`.
    That cut is placed on the newline itself, where `cut_at` falls just after it; a tail holding no
    newline gives no validation blocks (a cut never falls inside a line between the two splits)."""
    U = block_size(size, val_fraction)
    tail = _newline_at_or_after(path, min(int(size * (1 - val_fraction)), size - 1), size)
    edges = np.array(sorted({*range(0, tail, U), tail, *range(tail, size, U), size}), dtype=np.int64)
    n = len(edges) - 1
    return Blocks(np.full(n, i), np.arange(n), edges[:-1], edges[1:], edges[:-1] >= tail, np.arange(n) == n - 1)


def _newline_at_or_after(path: Path, pos: int, size: int) -> int:
    """The offset of the first newline at or after `pos` in the file at `path`; `size` if none."""
    try:
        with open(path, "rb") as f:
            f.seek(pos)
            while pos < size:
                chunk = f.read(min(SCAN, size - pos))
                if not chunk:
                    break
                newline = chunk.find(b"\n")
                if newline >= 0:
                    return pos + newline
                pos += len(chunk)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    return size


def split_key(relative_path: str) -> float:
    """A number in [0, 1) from a hash of `relative_path`: what decides a block's side of the split."""
    digest = hashlib.sha256(relative_path.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def cut_at(f, nominal: int, size: int, limit: int) -> int:
    """Where the block boundary with nominal position `nominal` falls in the open file `f`: just
    after the first newline in [nominal, limit), else at the first character start at or after it."""
    if nominal <= 0:
        return 0
    if nominal >= size:
        return size
    pos = nominal
    while pos < limit:
        f.seek(pos)
        chunk = f.read(min(SCAN, limit - pos))
        if not chunk:
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            return pos + newline + 1
        pos += len(chunk)
    f.seek(nominal)
    head = f.read(4)
    skip = 0
    while skip < min(3, len(head)) and head[skip] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        skip += 1
    return nominal + skip


def block_span(f, block: Block, size: int, next_nominal_end: int) -> tuple[int, int]:
    """(start, end) in the open file `f` of `block` (of a file of `size` bytes when planned)."""
    start = cut_at(f, block.nominal_start, size, block.nominal_end)
    end = size if block.last else cut_at(f, block.nominal_end, size, next_nominal_end)
    return start, max(start, end)


def read_block(path: Path, block: Block, size: int, next_nominal_end: int, span_only: bool = False,
               with_start: bool = False):
    """The bytes of `block` of the file at `path` (of `size` bytes when planned); with `span_only`,
    how many they are, found by reading only around the cuts; with `with_start`, (where they start
    in the file, the bytes)."""
    try:
        with open(path, "rb") as f:
            start, end = block_span(f, block, size, next_nominal_end)
            if span_only:
                return end - start
            f.seek(start)
            return (start, f.read(end - start)) if with_start else f.read(end - start)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e


def decode(raw: bytes) -> tuple[str, bool]:
    """(text, valid): bytes that are not UTF-8 become U+FFFD and `valid` is False."""
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), False


def decode_lines(raw: bytes) -> tuple[str, list[int], int]:
    """(text, where, n): `raw` decoded as `decode` does it, with the offsets in `raw` of the lines that
    hold bytes that are not UTF-8 and the bytes of those lines (newlines included), so that one bad
    line counts as that line, never as its whole block. A newline is never part of a multi-byte
    character, so decoding line by line gives the same text as decoding the block at once."""
    try:
        return raw.decode("utf-8"), [], 0
    except UnicodeDecodeError as e:
        first = raw.rfind(b"\n", 0, e.start) + 1  # every line before the first error is UTF-8
    where, n, start = [], 0, first
    while start < len(raw):
        end = raw.find(b"\n", start)
        end = len(raw) if end < 0 else end + 1
        try:
            raw[start:end].decode("utf-8")
        except UnicodeDecodeError:
            where.append(start)
            n += end - start
        start = end
    return raw.decode("utf-8", errors="replace"), where, n


class BlockReader:
    """Reads the blocks of a planned corpus: `read(j)` gives block j's (bytes, text, valid)."""

    def __init__(self, paths: Sequence[Path], sizes, blocks: Blocks):
        self.paths, self.sizes, self.blocks = paths, sizes, blocks

    def read(self, j: int) -> tuple[int, str, bool]:
        raw = self._read(j, span_only=False)
        text, valid = decode(raw)
        return len(raw), text, valid

    def read_lines(self, j: int) -> tuple[int, str, list[int], int]:
        """Block j's (bytes, text, where, n): `where` the offsets in its file of the lines that hold
        bytes that are not UTF-8, `n` the bytes of those lines (`decode_lines`)."""
        start, raw = self._read(j, span_only=False, with_start=True)
        text, where, n = decode_lines(raw)
        return len(raw), text, [start + k for k in where], n

    def n_bytes(self, j: int) -> int:
        """How many bytes block j holds, its cuts found without reading the rest of it."""
        return self._read(j, span_only=True)

    def _read(self, j: int, span_only: bool, with_start: bool = False):
        b = self.blocks[j]
        following = self.blocks[j + 1] if j + 1 < len(self.blocks) else None
        size = int(self.sizes[b.file])
        limit = following.nominal_end if following is not None and following.file == b.file else size
        return read_block(self.paths[b.file], b, size, limit, span_only, with_start)


def ordered_map(
    work: Callable[[int], object], items: Iterable[int], workers: int, stop: threading.Event | None = None
) -> Iterator[object]:
    """`work(item)` for each item, run by `workers` threads, yielded in the order of `items`.

    At most 2 x workers + 2 items are in flight, so memory is bounded by a few blocks. The order of
    the output is the order of the input whatever the number of workers. On any exception (Ctrl-C
    included) the queued work is cancelled and the running work (one block each) is not waited for.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="andrea-encode")
    pending: deque[Future] = deque()
    try:
        for item in items:
            if stop is not None and stop.is_set():
                return
            pending.append(pool.submit(work, item))
            if len(pending) > 2 * workers + 2:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _result(future: Future):
    # a short timeout in a loop: a Ctrl-C reaches the main thread within this time
    while True:
        try:
            return future.result(timeout=0.25)
        except FutureTimeout:
            continue
