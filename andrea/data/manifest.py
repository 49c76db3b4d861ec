"""A data directory's manifest and its splits: what `andrea.prepare` writes, what training opens.

A data directory holds `tokenizer.json`, the token files of each split in shards (`train-00000.bin`,
..., `val-00000.bin`, ...; ~100M tokens each, andrea.data.tokenfile) and `meta.json`, written last:
the manifest naming every shard with its token count, largest id and the sha256 of its ids (checked
when written, so opening a directory reads headers, never the ids). `open_split` reads a split as
one `TokenShards` sequence. A directory of an older layout (one `train.bin` and `val.bin`) is
refused with a line saying to prepare it again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from andrea.data.tokenfile import HEADER_SIZE, TOKEN_DTYPE, open_tokens, read_token_header
from andrea.errors import UserError

DATA_FORMAT = "andrea-data"  # meta.json's "format": what marks a directory as an andrea data directory
META_VERSION = 2  # meta.json with a shard list; version 1 (one train.bin, one val.bin) is refused


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
    """The data directory's meta.json when it is complete (META_VERSION), else None; a UserError for a
    directory of an older layout, which this andrea does not read."""
    try:
        meta = json.loads((Path(data_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("meta_version") == 1:
        raise UserError(f"{data_dir} holds data of an older layout (one train.bin and val.bin, meta_version 1): "
                        "delete it and prepare it again (python -m andrea.prepare), or use the andrea version "
                        "that wrote it")
    return meta if meta.get("meta_version") == META_VERSION else None


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
    """
    data_dir = Path(data_dir)
    meta = read_data_meta(data_dir)
    if meta is None:
        raise UserError(f"{data_dir} holds no complete prepared data (meta.json): run python -m andrea.prepare")
    arrays, names = [], []
    for entry in meta["shards"][split]:
        path = data_dir / entry["file"]
        header = read_token_header(path)
        if header.count != entry["tokens"]:
            raise UserError(f"{path} holds {header.count} tokens but meta.json says {entry['tokens']}: the data "
                            "directory was changed since it was prepared; prepare it again (--force)")
        if entry["max_id"] >= vocab_size:
            raise UserError(f"{path} holds token id {entry['max_id']}, past this model's {vocab_size} ids")
        arrays.append(open_tokens(path, vocab_size, fingerprint, header))
        names.append(entry["file"])
    return TokenShards(arrays, vocab_size, names)


def check_shards(data_dir, meta: dict, fingerprint: str) -> None:
    """Every shard the manifest `meta` names has the header and size it says, made with the tokenizer
    of `fingerprint`: a UserError naming the first that does not (headers only, no ids read)."""
    data_dir = Path(data_dir)
    for split in ("train", "val"):
        for entry in meta["shards"][split]:
            path, count = data_dir / entry["file"], int(entry["tokens"])
            header = read_token_header(path)  # the file's size against its header's count
            if header.count != count:
                raise UserError(f"{path} holds {header.count} tokens but meta.json says {count}: the data "
                                "directory was changed since it was prepared; prepare it again (--force)")
            if header.fingerprint != fingerprint:
                raise UserError(f"{path} was made with another tokenizer than {data_dir / 'tokenizer.json'}: the "
                                "data directory was changed since it was prepared; prepare it again (--force)")


VERIFY_CHUNK = 1 << 24  # bytes of ids read at a time by verify_shards


def verify_shards(data_dir, meta: dict, fingerprint: str) -> tuple[int, int, list[str]]:
    """Read every shard whole: (shards with a checksum, tokens read, problems). A problem is a shard
    whose ids' sha256 or largest id is not the manifest's, each a line naming the shard; the headers
    and sizes are checked first (`check_shards`, a UserError). Manifests from before the checksums
    have none: their shards are counted as read but not as checked."""
    data_dir = Path(data_dir)
    check_shards(data_dir, meta, fingerprint)
    checked, tokens, problems = 0, 0, []
    for entry in (e for split in ("train", "val") for e in meta["shards"][split]):
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
