"""Parquet: a table whose rows are documents, the text in a named string column (what Hugging Face
datasets are stored as, and what `Dataset.to_parquet` writes), read with pyarrow (the `parquet` extra).

A row group is read in at most MAX_PIECES blocks of consecutive rows, each of ~1 MiB of its
uncompressed data (andrea.data.stream.MAX_BLOCK), found from the metadata alone. pyarrow reads a
row group's rows only in order, so block k decodes the k blocks before it and drops them: with at
most MAX_PIECES that costs a few decodes of the group (at a rate hundreds of times the encoder's),
and a block holds at most the rows of one row group. A row's record number is its index in the
file, from 0. A null in the column is an error naming the row; the column missing or not of
strings, an error naming the file and its columns.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from andrea.data.sources import Documents, Unit
from andrea.data.stream import MAX_BLOCK
from andrea.errors import UserError

MAX_PIECES = 8  # blocks a row group is read in, at most (see above)


def _open(path: Path, text_field: str):
    """The ParquetFile at `path`, its column `text_field` checked to be strings."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path} is a Parquet file: reading it needs pyarrow (pip install -e '.[parquet]')") from None
    try:
        table = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path} as Parquet: {e}") from None
    schema = table.schema_arrow
    if text_field not in schema.names:
        columns = ", ".join(repr(n) for n in schema.names[:8])
        raise UserError(f"{path}: no column {text_field!r} (its columns: {columns}): name the column that holds the "
                        "text with --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{path}: the column {text_field!r} holds {kind}, not strings of text")
    return table


def _pieces(meta, group: int) -> tuple[int, int]:
    """(blocks, rows per block) of row group `group`: every block holds a row at least (a few large
    rows, 10 of 9 MiB: 5 blocks of 2, not 8 of which 3 would be empty), an empty group none."""
    rows, nbytes = meta.row_group(group).num_rows, meta.row_group(group).total_byte_size
    pieces = min(MAX_PIECES, max(1, math.ceil(nbytes / MAX_BLOCK)), max(rows, 1))
    per = max(1, math.ceil(rows / pieces))
    return math.ceil(rows / per), per


def scan(path: Path, size: int, U: int, progress: Callable[[int], None], text_field: str) -> Iterator[Unit]:
    """The blocks of the Parquet file at `path`, from its metadata alone (`U` is not used: a block's
    rows follow from the metadata, so that `documents` finds them again); each Unit's bytes are
    positions in the file's uncompressed data (what the progress and the tokenizer sample count)."""
    meta = _open(path, text_field).metadata
    first, position = 0, 0
    for group in range(meta.num_row_groups):
        rows, nbytes = meta.row_group(group).num_rows, meta.row_group(group).total_byte_size
        pieces, per = _pieces(meta, group)
        for k in range(pieces):
            count = min(per, rows - k * per)
            start = position + nbytes * k * per // max(rows, 1)
            end = position + nbytes * min(rows, (k + 1) * per) // max(rows, 1)
            yield Unit(start, end, first, np.arange(first, first + count, dtype=np.int64), count)
            first += count
        position += nbytes
    progress(size)  # the metadata alone was read


def documents(path: Path, start: int, end: int, first: int, count: int, text_field: str,
              skip_bad: bool = False) -> Documents:
    """The `count` rows of the file at `path` from row `first` on (one block of `scan`); with
    `skip_bad`, a null is left out, its error kept in `skipped`."""
    table = _open(path, text_field)
    meta = table.metadata
    begins = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    group = int(np.searchsorted(begins, first, side="right")) - 1
    _, per = _pieces(meta, group)
    k = (first - int(begins[group])) // per
    batches = table.iter_batches(batch_size=per, row_groups=[group], columns=[text_field], use_threads=False)
    texts = next(itertools.islice(batches, k, None)).column(0).to_pylist()
    out = Documents(end - start, True)
    for row, text in enumerate(texts, first):
        if text is None:
            error = f"{path}, row {row}: the column {text_field!r} is null there, not a string of text"
            if not skip_bad:
                raise UserError(f"{error}; or leave out every such row, counted, with prepare --skip-bad-records")
            out.skipped.append(error)
            continue
        out.records.append(row)
        out.texts.append(text)
        out.sizes.append(len(text.encode("utf-8")))
    return out
