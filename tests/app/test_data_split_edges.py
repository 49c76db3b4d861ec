"""Edges of the split that the values other tests use never reach: a Parquet row group of a few rows
larger than a block (more blocks wanted than rows fill), and the one-file `--val-fraction` advice
when the exact fraction lies just above a thousandth (rounding it would advise one that fails).
"""

import math

import numpy as np
import pytest
from documents import split_documents
from optional import require
from test_prepare_scale import WORDS, all_ids

from andrea.data import preparation
from andrea.data.sources import parquet
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

SMALL = {"progress": False, "allow_smaller_vocab": True, "vocab_size": 300}


def words(rng, n):
    return " ".join(rng.choice(WORDS, n))


def test_a_row_group_of_a_few_large_rows_is_read_in_blocks_of_at_least_one_row(tmp_path, monkeypatch):
    """10 rows of ~9 blocks: 8 pieces of ceil(10 / 8) = 2 rows would leave the last 3 empty (or, counted
    as rows - k x per, negative); each block holds 1 or 2 rows, every row once, in order."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    rng = np.random.default_rng(0)
    texts = [f"row {i}: " + words(rng, 150) for i in range(10)]
    path = tmp_path / "big-rows.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=10, compression="none")
    nbytes = pq.ParquetFile(path).metadata.row_group(0).total_byte_size
    monkeypatch.setattr(parquet, "MAX_BLOCK", nbytes // 9)  # ~9 blocks' worth: 8 pieces wanted, 5 fill
    units = list(parquet.scan(path, path.stat().st_size, 1 << 20, lambda n: None, "text"))
    assert [u.count for u in units] == [2] * 5
    assert np.array_equal(np.concatenate([u.records for u in units]), np.arange(10))
    assert [u.first for u in units] == [0, 2, 4, 6, 8] and units[-1].end == nbytes
    assert [u.start for u in units] == [0] + [u.end for u in units[:-1]]  # the group's bytes, cut in turn
    meta = preparation.prepare([str(path)], tmp_path / "d", text_field="text", val_fraction=0.3, **SMALL)
    tok = Tokenizer.load(tmp_path / "d" / "tokenizer.json")
    docs = [d for split in ("train", "val") for d in split_documents(tok, all_ids(tmp_path / "d", split))]
    assert sorted(docs) == sorted(texts) and sum(meta["documents"].values()) == 10


def test_an_empty_row_group_is_no_block_and_the_rows_after_it_are_found(tmp_path):
    """A writer given an empty table writes a row group of no rows: it makes no block (and divides by
    nothing), and the next group's rows are read from their own group."""
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    path = tmp_path / "gap.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for rows in (["a b", "c d"], [], ["e f"]):
            writer.write_table(pa.table({"text": pa.array(rows, pa.string())}))
    units = list(parquet.scan(path, path.stat().st_size, 1 << 20, lambda n: None, "text"))
    assert [(u.first, u.count) for u in units] == [(0, 2), (2, 1)]
    read = [parquet.documents(path, u.start, u.end, u.first, u.count, "text") for u in units]
    assert [d.texts for d in read] == [["a b", "c d"], ["e f"]] and [d.records for d in read] == [[0, 1], [2]]


def one_file_with_a_long_last_line(path, low: float, high: float):
    """A file whose exact least fraction, 1000 x (1 - last line's start / size), has a fractional part
    in [low, high): short lines, then a last line of ~1/40 of the file."""
    rng = np.random.default_rng(1)
    head = "".join(f"{i} {words(rng, 6)}\n" for i in range(400))
    last = "omega " * 150 + "\n"
    for pad in range(2000):
        data = ("x" * pad + head + last).encode()
        size, line = len(data), len(data) - len(last) - 1  # the newline before the last line
        exact = 1000 * (1 - line / size)
        if low <= exact - math.floor(exact) < high:
            path.write_bytes(data)
            return exact
    raise AssertionError("no padding gives that fraction")


@pytest.mark.parametrize("low, high", [(0.05, 0.45), (0.55, 0.95)])
def test_the_one_file_val_fraction_advice_is_the_least_thousandth_that_works(tmp_path, low, high):
    path = tmp_path / "book.txt"
    exact = one_file_with_a_long_last_line(path, low, high)
    with pytest.raises(UserError, match=r"use --val-fraction (\S+) or more") as info:
        preparation.prepare([str(path)], tmp_path / "refused", val_fraction=0.001, **SMALL)
    advised = float(str(info.value).split("--val-fraction ")[-1].split()[0])
    assert advised == math.ceil(exact) / 1000  # rounded, [0.05, 0.45) would advise one thousandth less
    with pytest.raises(UserError, match="would hold no text"):  # a thousandth less does not take the last line
        preparation.prepare([str(path)], tmp_path / "less", val_fraction=advised - 0.001, **SMALL)
    meta = preparation.prepare([str(path)], tmp_path / "d", val_fraction=advised, **SMALL)
    tok = Tokenizer.load(tmp_path / "d" / "tokenizer.json")
    val = tok.decode(all_ids(tmp_path / "d", "val").tolist())
    assert meta["val_tokens"] > 0 and val.startswith("omega ") and val.count("omega") == 150
