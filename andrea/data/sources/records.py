"""The records source: files whose records each hold one document (JSON Lines: a line; Parquet: a
row; the text in a named field), a document never cut, the split chosen document by document.

Planning scans each file once, streamed (a format's `scan`: never the whole file in memory), into
blocks of whole records: a block starts at the first record that starts at or after a multiple of
the block size U (andrea.data.stream.block_size), so it holds ~U bytes, and a record longer than
that is a block of its own, kept whole. The scan counts the documents of each block and which of
them are validation, so each side's count is known before any text is encoded.

The split: a document's id is (its file's path under the corpus root, its record number: a line
number from 1), and it is validation when a hash of that id (`record_keys`) falls below
`val_fraction`, so ~val_fraction of the documents (not of the tokens) are validation, the same on
every machine and for any number of threads. With two documents or more each side gets at least
one: the document of smallest key goes to validation when none fell there (of largest key to
training when all did).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable

import numpy as np

from andrea.data import stream
from andrea.data.corpus import FileList
from andrea.data.inputs import iter_input_names
from andrea.data.sources import BlockText, Part, Place, Plan, Source, jsonl, parquet
from andrea.errors import UserError

# the suffix of a file -> the module that reads it (its `scan` and `documents`); a directory or
# glob input takes the files of these suffixes, a file named explicitly is read by its suffix, as
# JSON Lines when it has none of these
FORMATS = {".jsonl": jsonl, ".ndjson": jsonl, ".parquet": parquet}
DEFAULT_TEXT_FIELD = "text"  # the field read when inputs of records come without one


def default_text_field(inputs: list[str] | None, text_field: str | None) -> str | None:
    """The text field a request reads: the one given; else DEFAULT_TEXT_FIELD when every input names
    files of records by its suffix (`web.jsonl`, `'shards/*.parquet'`), as Hugging Face's datasets
    name their text column; else None, text files. Inputs that mix the two are a UserError."""
    if text_field is not None or not inputs:
        return text_field
    records = [spec for spec in inputs if spec.lower().endswith(tuple(FORMATS))]
    if not records:
        return None
    if len(records) < len(inputs):
        other = next(spec for spec in inputs if spec not in records)
        raise UserError(f"the inputs name files of records ({records[0]}) and text ({other}): give a text field "
                        "(--text-field NAME, data.text_field) to read every input as records, or prepare the text "
                        "apart")
    return DEFAULT_TEXT_FIELD


def format_of(path) -> object:
    return FORMATS.get(str(path)[str(path).rfind("."):].lower(), jsonl)


def file_seed(relative_path: str) -> int:
    return int.from_bytes(hashlib.sha256(relative_path.encode("utf-8", errors="surrogateescape")).digest()[:8], "big")


def record_keys(seed: int, records: np.ndarray) -> np.ndarray:
    """Numbers in [0, 1) for the records `records` of the file whose path gives `seed`: splitmix64
    (Steele, Lea and Flood, 2014) of seed + record x its golden-ratio increment, vectorised."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.asarray(records, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


class RecordSource(Source):
    def __init__(self, files: FileList, description: str, text_field: str):
        super().__init__(files, description)
        self.text_field = text_field

    @classmethod
    def open(cls, inputs: list[str] | None, text_field: str, progress: Callable[[int], None] | None = None):
        if not inputs:
            raise UserError(f"a text field ({text_field!r}) reads documents from JSON Lines or Parquet files: name "
                            "them with --input, or leave --text-field unset to read the standard library's files")
        if not text_field:
            raise UserError("the text field is empty: give the name of the field that holds each document's text")
        names = iter_input_names(inputs, progress, keep=lambda name: name.lower().endswith(tuple(FORMATS)),
                                 looked_for=f"{', '.join(sorted(FORMATS))} file (a source of records takes those)")
        files = FileList.under_common_root(names)
        return cls(files, f"{len(files)} record files from {' '.join(inputs)}, text field {text_field!r}",
                   text_field)

    def settings(self) -> dict:
        return {"text_field": self.text_field}

    def plan(self, sizes: np.ndarray, val_fraction: float, log) -> RecordPlan:
        U = stream.block_size(int(sizes.sum()), val_fraction)
        table = {k: [] for k in ("file", "index", "start", "end", "first", "count", "documents", "val")}
        lowest, highest = (2.0, None), (-1.0, None)  # (key, (file, record)) of the extreme documents
        bar = log.progress("scanning the records", len(self.files), int(sizes.sum()), unit="files")
        for i, path in enumerate(self.files):
            seed = file_seed(self.files.relative(i))
            units = format_of(path).scan(path, int(sizes[i]), U, lambda n, i=i: bar.update(i, n), self.text_field)
            for k, unit in enumerate(units):
                keys = record_keys(seed, unit.records)
                for name, value in zip(table, (i, k, unit.start, unit.end, unit.first, unit.count, len(keys),
                                               int((keys < val_fraction).sum()))):
                    table[name].append(value)
                if len(keys):
                    lo, hi = int(np.argmin(keys)), int(np.argmax(keys))
                    lowest = min(lowest, (float(keys[lo]), (i, int(unit.records[lo]))), key=lambda e: e[0])
                    highest = max(highest, (float(keys[hi]), (i, int(unit.records[hi]))), key=lambda e: e[0])
            bar.update(i + 1, 0)
        bar.done()
        return RecordPlan(self, sizes, table, (lowest[1], highest[1]), val_fraction)


class RecordPlan(Plan):
    def __init__(self, source: RecordSource, sizes: np.ndarray, table: dict, extremes, val_fraction: float):
        self.source, self.sizes, self.val_fraction = source, sizes, val_fraction
        lowest, highest = extremes  # the (file, record) of the smallest and the largest key
        file = np.asarray(table["file"], dtype=np.int64)
        last = np.append(file[1:] != file[:-1], True) if len(file) else np.zeros(0, bool)
        self.blocks = stream.Blocks(file, table["index"], table["start"], table["end"], np.zeros(len(file), bool),
                                    last)
        self.first = np.asarray(table["first"], dtype=np.int64)  # each block's first record number
        self.count = np.asarray(table["count"], dtype=np.int64)  # and how many records it holds
        self.documents = int(np.sum(table["documents"]))
        self.val_documents = int(np.sum(table["val"]))
        self.forced = {}  # (file, record) -> val, for a split that no document's key chose
        if self.documents >= 2 and self.val_documents == 0:
            self.forced[lowest] = True
            self.val_documents = 1
        elif self.documents >= 2 and self.val_documents == self.documents:
            self.forced[highest] = False
            self.val_documents -= 1

    def check(self) -> None:
        if self.documents < 2:
            what = "no document (every record is blank)" if self.documents == 0 else "one document"
            raise UserError(f"the corpus holds {what}: a document is never cut between training and validation, "
                            "so at least two are needed (a JSON Lines file holds one per line)")

    def read(self, j: int) -> BlockText:
        b = self.blocks[j]
        files = self.source.files
        skip = {"skip_bad": True} if self.source.skip_bad_records else {}
        if skip and "skip_bad" not in inspect.signature(format_of(files[b.file]).documents).parameters:
            raise UserError(f"--skip-bad-records: the reader of {files[b.file]}'s format cannot leave records out: "
                            "fix the file, or prepare without the option")
        docs = format_of(files[b.file]).documents(files[b.file], b.nominal_start, b.nominal_end, int(self.first[j]),
                                                  int(self.count[j]), self.source.text_field, **skip)
        records = np.asarray(docs.records, dtype=np.int64)
        val = record_keys(file_seed(files.relative(b.file)), records) < self.val_fraction
        for (file, record), side in self.forced.items():
            if file == b.file:
                val[records == record] = side
        parts = [Part(side, [], 0) for side in (False, True)]
        for text, size, is_val in zip(docs.texts, docs.sizes, val.tolist()):
            if text:
                parts[is_val].texts.append(text)
                parts[is_val].n_bytes += size
        empty = sum(1 for text in docs.texts if not text)
        out = BlockText(docs.n_bytes, docs.valid_utf8 and not docs.bad_records, [p for p in parts if p.texts], empty)
        if docs.bad_records:
            out.bad_lines, out.bad_bytes = len(docs.bad_records), docs.bad_bytes
            out.first_bad = Place(files[b.file], line=docs.bad_records[0])
        elif not docs.valid_utf8:  # a format that does not say which records: its whole block
            out.bad_lines, out.bad_bytes, out.first_bad = 1, docs.n_bytes, Place(files[b.file], line=int(self.first[j]))
        if docs.skipped:
            out.skipped, out.first_skipped = len(docs.skipped), docs.skipped[0]
        return out

    def manifest(self, stats: dict) -> dict:
        return {"files": len(self.source.files), "documents": stats["documents"],
                "empty_documents": stats["empty_documents"]}
