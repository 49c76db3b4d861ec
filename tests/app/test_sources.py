"""Documents as the unit of data: the JSON Lines source (one document a line, the text in a named
field) beside the files source, and the rules both commands share (the default data directory, the
validation fraction's range).

A JSONL document goes whole to one split, ended by an EOT; the split is by document, deterministic;
a document longer than a block stays whole; the file is scanned in chunks; a malformed line is a
one-line error naming its file and line; an interrupted or concurrent preparation leaves a data
directory as the files source does; and a JSONL corpus prepares and trains as a user runs it.
A small tokenizer trained once per module keeps each preparation to a fraction of a second.
"""

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from documents import split_documents
from hypothesis import given, settings
from hypothesis import strategies as st
from optional import require
from test_prepare_scale import WORDS, all_ids, lines, snapshot

from andrea import prepare, train
from andrea.cli import run_cli
from andrea.config import load_config
from andrea.data import lock, preparation, shards
from andrea.data.progress import Log
from andrea.data.request import default_data_dir
from andrea.data.sources import jsonl, opening, parquet, records
from andrea.data.stream import MAX_BLOCK
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    tok = Tokenizer.train([lines(np.random.default_rng(0), 200_000)], vocab_size=600, allow_smaller=True)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


def documents(n, seed=0, words=(1, 60)):
    """`n` texts of random words and newlines, each distinct (its number first)."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, rng.integers(*words))).replace(" eta ", "\neta ")
            for i in range(n)]


def write_jsonl(path, texts, field="text", extra_lines=()):
    """One object a line, the text in `field`; `extra_lines` (line index, raw line) inserted as given."""
    rows = [json.dumps({"id": i, field: t, "meta": {"n": i}}, ensure_ascii=i % 2 == 0) for i, t in enumerate(texts)]
    for index, raw in extra_lines:
        rows.insert(index, raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def split_texts(data_dir, split, tok):
    """The documents of a split, as text: its ids cut at every EOT (each document ends with one)."""
    return split_documents(tok, all_ids(data_dir, split))


def cli(main, argv, capsys):
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


# ----------------------------------------------------------------------------- documents and the split


def test_each_jsonl_document_goes_whole_to_one_split_in_order_ending_with_eot(tmp_path, tok_path):
    texts = documents(400)
    a = write_jsonl(tmp_path / "c" / "a.jsonl", texts[:250], extra_lines=[(3, ""), (10, "   \t"), (20, "")])
    b = write_jsonl(tmp_path / "c" / "sub" / "b.ndjson", texts[250:] + [""])  # an empty text is no document
    (tmp_path / "c" / "notes.txt").write_text("not a record")  # a directory input takes .jsonl/.ndjson only
    out = tmp_path / "d"
    meta = preparation.prepare([str(tmp_path / "c")], out, progress=False, tokenizer=tok_path, val_fraction=0.2,
                               text_field="text")
    tok = Tokenizer.load(tok_path)
    train_docs, val_docs = split_texts(out, "train", tok), split_texts(out, "val", tok)
    # every document once, whole, on one side; each side in corpus order
    assert sorted(train_docs + val_docs) == sorted(texts)
    assert train_docs == [t for t in texts if t in set(train_docs)]
    assert val_docs == [t for t in texts if t in set(val_docs)]
    assert 0.12 < len(val_docs) / len(texts) < 0.28  # ~val_fraction of the documents
    assert meta["documents"] == {"train": len(train_docs), "val": len(val_docs)} and meta["empty_documents"] == 1
    assert meta["files"] == 2 and meta["text_field"] == "text" and "2 record files" in meta["corpus"]
    assert meta["bytes"] == sum(len(t.encode()) for t in texts)  # the text's bytes, not the JSON's
    assert (meta["not_utf8_lines"], meta["not_utf8_files"], meta["first_not_utf8_line"]) == (0, 0, None)  # all UTF-8
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(all_ids(out, "train")), len(all_ids(out, "val")))
    # deterministic: one thread and small shards give the same documents on the same side
    again = preparation.prepare([str(a), str(b)], tmp_path / "d2", progress=False, tokenizer=tok_path,
                                val_fraction=0.2, text_field="text", workers=1, shard_tokens=3_000)
    assert len(again["shards"]["train"]) > 1
    for split in ("train", "val"):
        assert np.array_equal(all_ids(out, split), all_ids(tmp_path / "d2", split))


def splitmix64(state):
    """Steele, Lea and Flood's SplitMix64 output for a state (the state already advanced), in Python's
    integers: the reference record_keys vectorises."""
    z = state % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return z ^ (z >> 31)


def test_record_keys_are_splitmix64_of_the_files_seed_and_each_record():
    """The split of every data directory hangs on these numbers: a changed constant or shift would
    move documents between the splits of a corpus prepared again."""
    assert splitmix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # SplitMix64's first output from seed 0
    seed = records.file_seed("web/part-0.jsonl")
    assert seed == int.from_bytes(hashlib.sha256(b"web/part-0.jsonl").digest()[:8], "big")
    numbers = np.array([1, 2, 7, 1000, 2**40])
    expected = [(splitmix64(seed + int(n) * 0x9E3779B97F4A7C15) >> 11) / 2.0**53 for n in numbers]
    assert records.record_keys(seed, numbers).tolist() == expected


def test_the_scans_progress_counts_each_file_and_ends_at_all_of_them(tmp_path):
    for k in range(3):
        write_jsonl(tmp_path / f"part-{k}.jsonl", documents(5, seed=k))
    source = opening.open_source([str(tmp_path)], text_field="text")
    shown = io.StringIO()
    source.plan(source.sizes(), 0.2, Log(True, shown))
    assert "scanning the records 3/3 files" in shown.getvalue()


def test_the_split_is_a_function_of_each_documents_file_and_line(tmp_path, tok_path):
    """Documents moved to other lines change side independently; the same lines keep theirs; with two
    documents each side gets one, whatever the fraction."""
    texts = documents(200, seed=1)
    tok = Tokenizer.load(tok_path)
    write_jsonl(tmp_path / "c" / "x.jsonl", texts)
    preparation.prepare([str(tmp_path / "c" / "x.jsonl")], tmp_path / "d1", progress=False, tokenizer=tok_path,
                        val_fraction=0.1, text_field="text")
    first = set(split_texts(tmp_path / "d1", "val", tok))
    shutil.copytree(tmp_path / "c", tmp_path / "moved")  # another root, the same file name and lines
    preparation.prepare([str(tmp_path / "moved" / "x.jsonl")], tmp_path / "d2", progress=False, tokenizer=tok_path,
                        val_fraction=0.1, text_field="text")
    assert set(split_texts(tmp_path / "d2", "val", tok)) == first
    write_jsonl(tmp_path / "c" / "x.jsonl", texts[::-1])  # each text on another line
    preparation.prepare([str(tmp_path / "c" / "x.jsonl")], tmp_path / "d3", progress=False, tokenizer=tok_path,
                        val_fraction=0.1, text_field="text")
    assert set(split_texts(tmp_path / "d3", "val", tok)) != first
    write_jsonl(tmp_path / "two.jsonl", texts[:2])
    meta = preparation.prepare([str(tmp_path / "two.jsonl")], tmp_path / "d4", progress=False, tokenizer=tok_path,
                               val_fraction=0.01, text_field="text")
    assert meta["documents"] == {"train": 1, "val": 1}


@pytest.mark.slow  # seconds: left out of the fast tier (tests/conftest.py)
def test_a_document_larger_than_a_block_stays_whole_in_one_split(tmp_path, tok_path):
    huge = "doc huge: " + lines(np.random.default_rng(7), MAX_BLOCK + 300_000)  # 1.3 MB of text in one line
    texts = documents(30, seed=2)
    texts.insert(11, huge)
    write_jsonl(tmp_path / "h.jsonl", texts)
    tok = Tokenizer.load(tok_path)
    meta = preparation.prepare([str(tmp_path / "h.jsonl")], tmp_path / "d", progress=False, tokenizer=tok_path,
                               val_fraction=0.2, text_field="text")
    docs = {split: split_texts(tmp_path / "d", split, tok) for split in ("train", "val")}
    assert sorted(docs["train"] + docs["val"]) == sorted(texts)
    assert (huge in docs["train"]) != (huge in docs["val"])
    assert meta["blocks"] >= 2  # the huge line is a block of its own, the short lines around it others


def test_a_corpus_of_fewer_than_two_documents_or_no_text_field_is_refused(tmp_path, tok_path):
    write_jsonl(tmp_path / "one.jsonl", ["a lonely document"], extra_lines=[(0, ""), (2, " ")])
    with pytest.raises(UserError, match="holds one document: a document is never cut"):
        preparation.prepare([str(tmp_path / "one.jsonl")], tmp_path / "d", progress=False, tokenizer=tok_path,
                            text_field="text")
    assert not (tmp_path / "d").exists()
    with pytest.raises(UserError, match="name them with --input"):
        preparation.prepare(None, tmp_path / "d", progress=False, tokenizer=tok_path, text_field="text")


# ----------------------------------------------------------------------------- the scan, streamed


def reference_units(data: bytes, U: int):
    """(start, end, first line, non-blank line numbers, lines) of each block, from the whole file in memory."""
    starts, pos = [], 0
    while pos < len(data):
        starts.append(pos)
        newline = data.find(b"\n", pos)
        pos = len(data) if newline < 0 else newline + 1
    units = []
    for number, start in enumerate(starts, 1):
        end = starts[number] if number < len(starts) else len(data)
        blank = not data[start:end].strip(b" \t\r\n")
        if not units or start // U != units[-1][0] // U:
            if units:
                units[-1][1] = start
            units.append([start, len(data), number, [], 0])
        units[-1][4] += 1
        if not blank:
            units[-1][3].append(number)
    return [tuple(u) for u in units]


LINE = st.one_of(st.just(""), st.just(" \t"), st.just("\r"), st.text("{}ab\" ", max_size=30))


@settings(max_examples=150, deadline=None)
@given(st.lists(LINE, max_size=40), st.booleans(), st.integers(1, 40), st.integers(1, 9))
def test_the_scan_reads_in_chunks_and_finds_blocks_of_whole_lines(tmp_path_factory, rows, final_newline, U, chunk):
    path = tmp_path_factory.mktemp("scan") / "x.jsonl"
    data = ("\n".join(rows) + ("\n" if final_newline and rows else "")).encode()
    path.write_bytes(data)
    read = []
    original, jsonl.CHUNK = jsonl.CHUNK, chunk  # chunks of a few bytes: every line crosses chunks
    try:
        units = list(jsonl.scan(path, len(data), U, read.append))
    finally:
        jsonl.CHUNK = original
    assert [(u.start, u.end, u.first, u.records.tolist(), u.count) for u in units] == reference_units(data, U)
    assert sum(read) == len(data) and max(read, default=0) <= chunk


# ----------------------------------------------------------------------------- bad lines


@pytest.mark.parametrize("raw, said", [
    ('{"text": "unfinished', "not JSON"),
    ('["text", "a list"]', "a JSON list, not an object"),
    ('{"body": "x", "id": 4}', "no field 'text' (its fields: 'body', 'id'): name the field"),
    ('{"text": null}', "holds null, not a string"),
    ('{"text": 12}', "holds a JSON int, not a string"),
])
def test_a_malformed_line_is_one_line_naming_the_file_and_line_and_a_fixed_file_prepares(tmp_path, tok_path, raw,
                                                                                      said, capsys):
    texts = documents(120, seed=3)
    path = write_jsonl(tmp_path / "bad.jsonl", texts, extra_lines=[(77, raw)])
    argv = ["--input", str(path), "--text-field", "text", "--data-dir", str(tmp_path / "d"), "--tokenizer",
            str(tok_path), "--quiet"]
    code, _, err = cli(prepare.main, argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"error: {path}, line 78: " in err and said in err
    assert not (tmp_path / "d" / "meta.json").exists()
    write_jsonl(path, texts)
    assert cli(prepare.main, argv, capsys)[0] == 0
    preparation.prepare([str(path)], tmp_path / "fresh", progress=False, tokenizer=tok_path, text_field="text")
    for split in ("train", "val"):
        assert np.array_equal(all_ids(tmp_path / "d", split), all_ids(tmp_path / "fresh", split))


def test_a_lone_surrogate_escape_is_read_as_a_replacement_character(tmp_path, tok_path):
    texts = documents(50, seed=4)
    path = write_jsonl(tmp_path / "s.jsonl", texts, extra_lines=[(5, '{"text": "half \\ud800 a pair"}')])
    meta = preparation.prepare([str(path)], tmp_path / "d", progress=False, tokenizer=tok_path, text_field="text",
                               val_fraction=0.2)
    tok = Tokenizer.load(tok_path)
    docs = split_texts(tmp_path / "d", "train", tok) + split_texts(tmp_path / "d", "val", tok)
    assert "half \ufffd a pair" in docs and meta["not_utf8_files"] == 1
    block = jsonl.documents(path, 0, path.stat().st_size, 1, 51, "text")  # the whole file, one block
    line = path.read_bytes().split(b"\n")[5]
    assert block.bad_records == [6] and block.bad_bytes == len(line) + 1  # that line and its newline


# ----------------------------------------------------------------------------- Parquet


def write_parquet(path, texts, row_group_size, field="text"):
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path, row_group_size=row_group_size)
    return path


@pytest.mark.slow  # seconds: left out of the fast tier (tests/conftest.py)
def test_parquet_rows_are_documents_read_in_blocks_of_a_row_group(tmp_path, tok_path):
    """Row groups of ~2.5 MB are read in pieces, small ones whole; beside a JSON Lines file in the same
    directory, every document goes once, whole, to one side, in order."""
    texts = documents(3000, seed=10, words=(150, 250))  # ~1.2 KB each
    big = write_parquet(tmp_path / "c" / "big.parquet", texts[:2500], row_group_size=2000)
    write_parquet(tmp_path / "c" / "small.parquet", texts[2500:2900], row_group_size=150)
    write_jsonl(tmp_path / "c" / "rest.jsonl", texts[2900:])
    pieces = list(parquet.scan(big, big.stat().st_size, 1 << 20, lambda n: None, "text"))
    assert len(pieces) > 3 and sum(u.count for u in pieces) == 2500  # the 2000-row group in pieces
    assert [u.first for u in pieces] == [0] + list(np.cumsum([u.count for u in pieces])[:-1])
    meta = preparation.prepare([str(tmp_path / "c")], tmp_path / "d", progress=False, tokenizer=tok_path,
                               val_fraction=0.1, text_field="text")
    tok = Tokenizer.load(tok_path)
    train_docs, val_docs = split_texts(tmp_path / "d", "train", tok), split_texts(tmp_path / "d", "val", tok)
    assert sorted(train_docs + val_docs) == sorted(texts)
    in_order = texts[:2500] + texts[2900:] + texts[2500:2900]  # big.parquet, rest.jsonl, small.parquet
    assert train_docs == [t for t in in_order if t in set(train_docs)]
    assert val_docs == [t for t in in_order if t in set(val_docs)]
    assert 0.06 < len(val_docs) / len(texts) < 0.14 and meta["files"] == 3
    assert meta["documents"] == {"train": len(train_docs), "val": len(val_docs)}


def test_a_parquet_column_missing_or_not_text_or_null_is_one_line(tmp_path, tok_path, capsys):
    pa, pq = require("pyarrow"), require("pyarrow.parquet")
    texts = documents(60, seed=11)
    cases = {
        "missing": (pa.table({"id": list(range(60)), "body": texts}), "no column 'text' (its columns: 'id', 'body')"),
        "numbers": (pa.table({"text": list(range(60))}), "the column 'text' holds int64, not strings"),
        "null": (pa.table({"text": texts[:41] + [None] + texts[42:]}), "row 41: the column 'text' is null there"),
    }
    for name, (table, said) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=25)
        code, _, err = cli(prepare.main, ["--input", str(path), "--text-field", "text", "--data-dir",
                                          str(tmp_path / name), "--tokenizer", str(tok_path), "--quiet"], capsys)
        assert code == 2 and err.count("\n") == 1 and said in err and str(path) in err, err


# ----------------------------------------------------------------------------- a data directory kept whole


@pytest.mark.slow  # seconds: left out of the fast tier (tests/conftest.py)
def test_an_interrupted_jsonl_preparation_resumes_to_what_an_uninterrupted_one_writes(tmp_path, tok_path,
                                                                                    monkeypatch):
    path = write_jsonl(tmp_path / "r.jsonl", documents(3000, seed=5))
    kwargs = dict(progress=False, tokenizer=tok_path, text_field="text", workers=2, shard_tokens=20_000)
    whole = preparation.prepare([str(path)], tmp_path / "whole", **kwargs)
    out, take, calls = tmp_path / "out", shards.Encoder._take, []

    def interrupted(self, piece):
        calls.append(piece)
        if len(calls) == 9:
            raise KeyboardInterrupt
        take(self, piece)

    monkeypatch.setattr(shards.Encoder, "_take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preparation.prepare([str(path)], out, **kwargs)
    monkeypatch.setattr(shards.Encoder, "_take", take)
    state = json.loads((out / shards.STATE_FILE).read_text())
    assert not (out / "meta.json").exists() and 0 < state["next_block"] < 9
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    resumed = preparation.prepare([str(path)], out, **kwargs)
    assert resumed["shards"] == whole["shards"] and resumed["documents"] == whole["documents"]
    assert not (out / shards.STATE_FILE).exists()


def test_a_second_jsonl_preparation_waits_then_finds_the_directory_complete(tmp_path, tok_path, capsys):
    path = write_jsonl(tmp_path / "w.jsonl", documents(100, seed=6))
    done = tmp_path / "done"
    preparation.prepare([str(path)], done, progress=False, tokenizer=tok_path, text_field="text")
    other, result = tmp_path / "other", {}
    with lock.writing(other):
        waiting = threading.Thread(target=lambda: result.update(meta=preparation.prepare(
            [str(path)], other, progress=True, tokenizer=tok_path, text_field="text")))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and list(other.iterdir()) == []
        shutil.copytree(done, other, dirs_exist_ok=True)
    waiting.join(30)
    assert result["meta"]["skipped"] and "waiting: another process is preparing" in capsys.readouterr().err
    before = snapshot(other)
    with pytest.raises(UserError, match="another corpus"):  # another text field is another corpus
        preparation.prepare([str(path)], other, progress=False, tokenizer=tok_path, text_field="body")
    # a .jsonl named without a text field is read as records of `text`: the same corpus, kept
    assert preparation.prepare([str(path)], other, progress=False, tokenizer=tok_path)["skipped"]
    assert snapshot(other) == before


def _sigint_as_from_a_terminal():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # seconds: left out of the fast tier (tests/conftest.py)
def test_ctrl_c_while_encoding_a_jsonl_corpus_exits_130_leaving_nothing_half_written(tmp_path, tok_path):
    path = write_jsonl(tmp_path / "big.jsonl", documents(40_000, seed=8, words=(20, 80)))  # ~8 MB
    out = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "andrea.prepare", "--input", str(path), "--text-field", "text",
                             "--data-dir", str(out), "--tokenizer", str(tok_path), "--workers", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_sigint_as_from_a_terminal)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("encoding "):
                break
        time.sleep(0.1)
        assert proc.poll() is None, "".join(seen)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and err.rstrip().endswith("interrupted") and "Traceback" not in err, err
    left = [p.name for p in out.iterdir()]
    assert "meta.json" not in left and not [n for n in left if n.endswith(".tmp")], left


# ----------------------------------------------------------------------------- one rule for both commands


def test_prepare_and_train_find_the_same_data_directory_and_take_the_same_fractions(tmp_path):
    for inputs in ([], ["texts/shakespeare.txt"], ["~/books/**/*.txt"], ["corpus/"], ["web.jsonl"], ["a", "b"]):
        cfg = load_config("tiny", [f"data.inputs={','.join(inputs)}"] if inputs else [])
        assert cfg.data.resolved_dir() == default_data_dir(inputs or None)
    assert default_data_dir(["web.jsonl"]).as_posix() == "data/web"
    assert default_data_dir(["a.txt", "b.txt"]).as_posix() == "data/custom"
    for fraction in (0.0, 0.5, 0.7, -0.1):
        with pytest.raises(UserError, match=r"data.val_fraction must be between 0 and 0.5 \(both exclusive\)"):
            load_config("tiny", [f"data.val_fraction={fraction}"])
        with pytest.raises(UserError, match=r"--val-fraction must be between 0 and 0.5 \(both exclusive\)"):
            preparation.prepare(["x"], tmp_path / "d", val_fraction=fraction)
    assert load_config("tiny", ["data.val_fraction=0.49"]).data.val_fraction == 0.49


@pytest.mark.slow  # seconds: left out of the fast tier (tests/conftest.py)
def test_a_jsonl_corpus_prepares_then_trains_as_a_user_runs_it(tmp_path, monkeypatch, capsys):
    """`prepare --input web.jsonl --text-field text` writes data/web; `train` with the same inputs and
    text field finds it there (the one rule) and trains a tiny model a few steps on it."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "web.jsonl", documents(2500, seed=9, words=(20, 120)))  # ~1.6 MB
    code, out, err = cli(prepare.main, ["--input", "web.jsonl", "--text-field", "text", "--vocab-size", "700",
                                        "--quiet"], capsys)
    assert code == 0, err
    assert "documents" in out and "val;" in out and (tmp_path / "data" / "web" / "meta.json").exists()
    prepared = snapshot(tmp_path / "data" / "web")
    config = {"model": {"vocab_size": 700, "context_length": 32, "d_model": 16, "n_layer": 1, "n_head": 2},
              "train": {"batch_size": 4, "max_steps": 4, "warmup_steps": 1, "log_interval": 1, "eval_interval": 4,
                        "eval_batches": 2, "checkpoint_interval": 4, "sample_tokens": 0, "device": "cpu"},
              }
    (tmp_path / "web.yaml").write_text(yaml.safe_dump(config))  # a tiny model; the data as docs/data.md sets it
    code, out, err = cli(train.main, ["--config", "web.yaml", "--out", "run", "--set", "data.inputs=web.jsonl",
                                      "--set", "data.text_field=text"], capsys)
    assert code == 0, err
    assert "preparing" not in err and snapshot(tmp_path / "data" / "web") == prepared  # found, not made again
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    assert len(steps) == 4 and all(np.isfinite(r["loss"]) for r in steps) and any("val_loss" in r for r in rows)
