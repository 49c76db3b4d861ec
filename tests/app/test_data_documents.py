"""Bad documents, one at a time: a line that is not UTF-8 is that line, not its block, and a small
corpus with one is prepared (the line named, its bad bytes read as U+FFFD), while a corpus that is
mostly not text is refused naming its first bad line and what was read; a JSON Lines line too deep to
decode, a compressed file and an input of records that holds none are one line saying what to do;
and `.jsonl`/`.parquet` inputs given without a text field are read as records of the `text` field.
"""

import json

import numpy as np
import pytest
from documents import split_documents
from optional import require
from test_prepare_scale import WORDS, all_ids, lines

from andrea import prepare
from andrea.cli import run_cli
from andrea.data import preparation, stream
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

SMALL = {"progress": False, "allow_smaller_vocab": True, "vocab_size": 300}  # a tokenizer trained on the corpus


def text_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"{i} " + " ".join(rng.choice(WORDS, rng.integers(3, 12))) for i in range(n)]


def jsonl_rows(texts):
    return [json.dumps({"id": i, "text": t}).encode() for i, t in enumerate(texts)]


def documents_of(data_dir):
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    return [d for split in ("train", "val") for d in split_documents(tok, all_ids(data_dir, split))]


def cli(argv, capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(prepare.main, argv)
    return info.value.code, capsys.readouterr().err


# ----------------------------------------------------------------------------- not UTF-8, line by line


def test_decoding_names_only_the_lines_that_are_not_utf8_and_gives_the_same_text():
    raw = b"good line\ncaf\xe9 latin-1\nalso good \xc3\xa9\n\xff\xfe\nlast"
    text, where, n = stream.decode_lines(raw)
    assert text == raw.decode("utf-8", errors="replace")
    assert where == [raw.index(b"caf"), raw.index(b"\xff")] and n == len(b"caf\xe9 latin-1\n") + len(b"\xff\xfe\n")
    assert stream.decode_lines(b"all good\n") == ("all good\n", [], 0)


def test_one_latin1_line_in_a_small_text_file_is_named_and_the_corpus_prepared(tmp_path, capsys):
    """38 kB of text with one Latin-1 comment in the middle: once refused whole as 'does not look like
    text: 0.0 of the first 0.0 MB'; now that one line is counted, named and read with U+FFFD."""
    rows = [r.encode() for r in text_lines(900)]
    rows[350] = b"# caf\xe9 au lait"
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\n".join(rows) + b"\n")
    assert 30_000 < path.stat().st_size < 45_000
    code, err = cli(["--input", str(path), "--data-dir", str(tmp_path / "d"), "--allow-smaller-vocab",
                     "--vocab-size", "300"], capsys)
    assert code == 0, err
    assert f"1 line not UTF-8 (the first: {path}, line 351)" in err and "iconv" in err
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["not_utf8_lines"] == 1 and meta["first_not_utf8_line"] == f"{path}, line 351"
    assert "# caf\ufffd au lait" in "".join(documents_of(tmp_path / "d"))


def test_one_latin1_line_of_300_in_json_lines_is_that_document_alone(tmp_path):
    rows = jsonl_rows(text_lines(300, seed=1))
    rows[150] = b'{"id": 150, "text": "na\xefve caf\xe9"}'
    path = tmp_path / "web.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    meta = preparation.prepare([str(path)], tmp_path / "d", text_field="text", **SMALL)
    assert meta["not_utf8_lines"] == 1 and meta["first_not_utf8_line"] == f"{path}, line 151"
    docs = documents_of(tmp_path / "d")
    assert "na\ufffdve caf\ufffd" in docs and len(docs) == 300


def test_a_lone_surrogate_escape_is_a_replacement_character_in_a_small_corpus(tmp_path):
    """jsonl.py's docstring: `\\ud800` becomes U+FFFD; in a corpus of 40 lines it was refused as not text."""
    rows = jsonl_rows(text_lines(40, seed=2))
    rows[7] = b'{"text": "half \\ud800 a pair"}'
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    meta = preparation.prepare([str(path)], tmp_path / "d", text_field="text", **SMALL)
    assert "half \ufffd a pair" in documents_of(tmp_path / "d")
    assert meta["not_utf8_lines"] == 1 and meta["first_not_utf8_line"] == f"{path}, line 8"


def test_a_corpus_mostly_not_text_is_refused_naming_its_first_bad_line_and_what_was_read(tmp_path):
    rng = np.random.default_rng(0)
    good = "".join(lines(rng, 8_000)).encode()
    (tmp_path / "c").mkdir()
    binary = rng.integers(128, 256, 30_000, dtype=np.uint8)
    binary[99::100] = ord("\n")  # lines of bytes that are never UTF-8
    (tmp_path / "c" / "blob.dat").write_bytes(good + binary.tobytes())
    with pytest.raises(UserError) as info:
        preparation.prepare([str(tmp_path / "c")], tmp_path / "d", **SMALL)
    said = str(info.value)
    first = good.count(b"\n") + 1
    assert "does not look like text" in said and f"blob.dat, line {first}" in said and "kB" in said, said
    assert "0.0 MB" not in said and not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------- JSON Lines that cannot be read


def test_a_deeply_nested_line_is_one_line_naming_it(tmp_path, capsys):
    rows = jsonl_rows(text_lines(30, seed=3))
    rows.insert(12, b'{"text": ' + b"[" * 100_000 + b"}")
    path = tmp_path / "deep.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    code, err = cli(["--input", str(path), "--text-field", "text", "--data-dir", str(tmp_path / "d"), "--quiet"],
                    capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{path}, line 13: nested too deeply" in err and "fix or remove that line" in err


@pytest.mark.parametrize("name", ["web.jsonl.gz", "web"])
def test_a_compressed_file_is_refused_saying_to_decompress_it(tmp_path, name, capsys):
    import gzip

    path = tmp_path / name
    path.write_bytes(gzip.compress(b"\n".join(jsonl_rows(text_lines(30)))))
    code, err = cli(["--input", str(path), "--text-field", "text", "--data-dir", str(tmp_path / "d"), "--quiet"],
                    capsys)
    assert code == 2 and err.count("\n") == 1 and "is compressed" in err and "decompress it first" in err, err


def test_an_input_of_records_that_holds_none_says_what_it_looked_for(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("no records here\n")
    code, err = cli(["--input", str(tmp_path / "c"), "--text-field", "text", "--data-dir", str(tmp_path / "d"),
                     "--quiet"], capsys)
    assert code == 2 and ".jsonl, .ndjson, .parquet file" in err and "the directory holds no" in err, err
    code, err = cli(["--input", str(tmp_path / "c" / "*.py"), "--data-dir", str(tmp_path / "d"), "--quiet"], capsys)
    assert code == 2 and "the glob pattern matches no text file" in err, err


# ----------------------------------------------------------------------------- records without --text-field


def test_jsonl_and_parquet_given_without_a_text_field_are_records_of_the_text_field(tmp_path, capsys):
    texts = text_lines(60, seed=4)
    path = tmp_path / "web.jsonl"
    path.write_bytes(b"\n".join(jsonl_rows(texts)) + b"\n")
    meta = preparation.prepare([str(path)], tmp_path / "d", **SMALL)
    assert meta["text_field"] == "text" and sorted(documents_of(tmp_path / "d")) == sorted(texts)
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet")
    meta = preparation.prepare([str(tmp_path / "rows.parquet")], tmp_path / "p", **SMALL)
    assert meta["text_field"] == "text" and sorted(documents_of(tmp_path / "p")) == sorted(texts)
    (tmp_path / "notes.txt").write_text("\n".join(texts))
    code, err = cli(["--input", str(path), str(tmp_path / "notes.txt"), "--data-dir", str(tmp_path / "m"),
                     "--quiet"], capsys)
    assert code == 2 and "files of records" in err and "--text-field" in err, err


# ----------------------------------------------------------------------------- bad records left out, when asked


def test_records_that_cannot_be_read_are_left_out_and_counted_when_asked(tmp_path, capsys):
    texts = text_lines(80, seed=5)
    rows = jsonl_rows(texts)
    rows.insert(30, b'{"text": "unfinished')
    rows.insert(61, b'{"body": "no text field"}')
    path = tmp_path / "web.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    argv = ["--input", str(path), "--data-dir", str(tmp_path / "d"), "--allow-smaller-vocab", "--vocab-size", "300"]
    code, err = cli(argv + ["--quiet"], capsys)
    assert code == 2 and f"{path}, line 31: not JSON" in err and "--skip-bad-records" in err, err
    code, err = cli(argv + ["--skip-bad-records"], capsys)
    assert code == 0, err
    assert f"note: 2 records left out (--skip-bad-records), the first: {path}, line 31: not JSON" in err
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["skipped_records"] == 2 and meta["first_skipped_record"].startswith(f"{path}, line 31: ")
    assert sorted(documents_of(tmp_path / "d")) == sorted(texts)  # every good record, none of the bad
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    pq.write_table(pa.table({"text": texts[:40] + [None] + texts[40:]}), tmp_path / "rows.parquet")
    meta = preparation.prepare([str(tmp_path / "rows.parquet")], tmp_path / "p", skip_bad_records=True, **SMALL)
    assert meta["skipped_records"] == 1 and "row 40: the column 'text' is null" in meta["first_skipped_record"]
    assert sorted(documents_of(tmp_path / "p")) == sorted(texts)
