"""Sources: what a preparation reads, as documents, in blocks that every phase handles one at a time.

A source is a corpus listed (its files, a root, a description) that plans itself into blocks
(andrea.data.stream's `Blocks`: pieces of its files, known before the text is read, each read on
its own by any thread) and reads a block as `BlockText`: parts of text, each on one side of the
split. The preparation (andrea.data.preparation) asks nothing else of it: the tokenizer trains on
the training parts of a sample of the blocks, the encoder writes each part's documents to its
split's shards with an end-of-text id after each document.

    source = opening.open_source(["data.jsonl"], text_field="text")  # or (None): the stdlib's files
    plan = source.plan(source.sizes(), val_fraction=0.01, log=Log(False))
    plan.check()                                               # both splits hold text, else a UserError
    for j in range(len(plan.blocks)):
        plan.read(j).parts                                     # [Part(val, texts, n_bytes, ends), ...]

The sources:

    files.py     files, directories and globs of text (the stdlib by default): a file is a document,
                 cut into blocks at line ends; the split by block (andrea.data.stream)
    records.py   files of records, one document each, never cut: the split by a hash of each
                 document's id (its file and record number); the formats it reads:
    jsonl.py     JSON Lines: one object a line, the text in a named field (`--text-field`)
    parquet.py   Parquet: one row a document, the text in a named column (pyarrow, the `parquet` extra)
    opening.py   open_source: which of them a request names

Adding a source (docs/data.md, "Add a source"): a record format is a module like jsonl.py (`scan`
a file into `Unit`s, blocks of whole records; `Documents` of one block) registered in `records.FORMATS`;
anything else is a `Source` subclass whose `plan` returns a `Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from andrea.data.corpus import FileList
from andrea.data.stream import Blocks


@dataclass
class Part:
    """Text of one block on one side of the split: `texts` are whole documents, each followed by an
    end-of-text id, except the last when `ends` is False (a file's text that goes on in the next block)."""

    val: bool
    texts: list[str]
    n_bytes: int  # UTF-8 bytes of the texts (the statistics count text, not the markup around it)
    ends: bool = True


@dataclass(frozen=True)
class Place:
    """A line of a file, to name in a message: its number (from 1), or its byte offset when the number
    is not known (a text file's block does not know its first line's): counted when it is named."""

    path: Path
    line: int | None = None
    offset: int = 0

    def __str__(self) -> str:
        line = self.line
        if line is None:
            line = 1
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(min(1 << 20, self.offset - f.tell())), b""):
                    line += chunk.count(b"\n")
        return f"{self.path}, line {line}"


@dataclass
class BlockText:
    """Block j read: its bytes as stored, whether they were all UTF-8, its parts in corpus order. A
    line (a record) holding bytes that are not UTF-8 is read with U+FFFD in their place and counted
    here by itself: `bad_lines` of them, `bad_bytes` their bytes, `first_bad` where the first is."""

    n_bytes: int
    valid_utf8: bool
    parts: list[Part] = field(default_factory=list)
    empty_documents: int = 0  # documents of the block that hold no text (written as nothing)
    bad_lines: int = 0
    bad_bytes: int = 0
    first_bad: Place | None = None
    skipped: int = 0  # records that could not be read, left out (Source.skip_bad_records)
    first_skipped: str | None = None  # what was wrong with the first of them


@dataclass
class Unit:
    """A block of whole records as a record format's `scan` finds it (records.py): bytes [start, end)
    of its file, the number of its first record, the numbers of the records that hold a document,
    and how many records it holds (blank ones too)."""

    start: int
    end: int
    first: int
    records: np.ndarray  # (n,) int64
    count: int


@dataclass
class Documents:
    """A block's documents as a record format's `documents` reads them: their record numbers, texts
    and UTF-8 sizes, and the block's bytes as stored; the numbers of the records that were not
    UTF-8 (read with U+FFFD) and their bytes. A format that sets only `valid_utf8` False has its
    whole block counted as not UTF-8."""

    n_bytes: int
    valid_utf8: bool
    records: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    bad_records: list[int] = field(default_factory=list)
    bad_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # with skip_bad: why each record left out was


class Plan:
    """A source's corpus (`source`) cut into blocks (`blocks`), with what reading them needs;
    `sizes` are its files' sizes in bytes when planned."""

    source: Source
    sizes: np.ndarray
    blocks: Blocks

    def read(self, j: int) -> BlockText:
        raise NotImplementedError

    def check(self) -> None:
        """A UserError, saying what to change, when a split would hold no text."""
        raise NotImplementedError

    def manifest(self, documents: dict) -> dict:
        """The source's part of meta.json; `documents`: the documents each split received."""
        raise NotImplementedError


class Source:
    """A corpus listed: its files under `files.root`, a one-line description, the files of its
    default that were left out. `settings()` is what a data directory records of the source beside
    the inputs (a different value is a different corpus). With `skip_bad_records`, a record that cannot
    be read is left out and counted instead of stopping the preparation (a records source's)."""

    skip_bad_records = False

    def __init__(self, files: FileList, description: str, left_out: tuple[Path, ...] = ()):
        self.files, self.description, self.left_out = files, description, left_out

    @property
    def root(self) -> Path:
        return self.files.root

    def sizes(self) -> np.ndarray:
        return np.array([p.stat().st_size for p in self.files], dtype=np.int64)

    def settings(self) -> dict:
        return {}

    def plan(self, sizes: np.ndarray, val_fraction: float, log) -> Plan:
        raise NotImplementedError
