"""The token file: a 128-byte header followed by the token ids as little-endian uint16.

      offset  size  field
      0       8     magic b"ANDREATK"
      8       4     format version (uint32, currently 1)
      12      4     vocab size the ids were made with (uint32)
      16      8     token count (uint64)
      24      64    tokenizer fingerprint, ASCII sha256 hex, NUL padded
      88      40    zero

so a file made by another tokenizer, a cut-off copy or a stray file is refused before training.
Files are written through `token_writer` (atomically: complete under their name or absent) and
opened as read-only memmaps (`open_tokens`), checked by their header alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from andrea.errors import UserError
from andrea.files import atomic_writer, named

MAGIC = b"ANDREATK"
FORMAT_VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sIIQ64s")
TOKEN_DTYPE = np.dtype("<u2")
MAX_VOCAB = 1 << 16  # ids must fit uint16


@dataclass(frozen=True)
class TokenFileHeader:
    version: int
    vocab_size: int
    count: int
    fingerprint: str


class TokenSink:
    """Appends token ids to an open token file, counts them and hashes them (`sha256`: of the bytes
    after the header, what the manifest records and `verify_shards` checks; see `token_writer`)."""

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


def open_tokens(path, vocab_size: int | None = None, fingerprint: str | None = None,
                header: TokenFileHeader | None = None) -> np.ndarray:
    """The ids of a token file as a read-only uint16 memmap, checked by its header alone (no scan of
    the ids: TokenShards checks each batch's). `vocab_size` and `fingerprint`, when given, must be
    what the file was made with; `header`, when the caller has read it already."""
    path = Path(path)
    header = header or read_token_header(path)
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
