"""Preparing data at scale (issue 21) and without destroying anything (issue 20, classes 1, 5, 7):
blocks, shards and their manifest, output independent of the number of threads, resuming an
interrupted preparation, a data directory that needs no corpus, a validation split that honours
its fraction, tokenizer training on bounded pieces that answers Ctrl-C at once.

A small tokenizer trained once per module is handed to `prepare` wherever training one is not
the point, so each preparation takes a fraction of a second.
"""

import _thread
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea import prepare
from andrea.data import preparation, progress, shards, stream
from andrea.data.bpe_training import trainer_pieces
from andrea.data.corpus import FileList
from andrea.data.manifest import open_split, split_counts
from andrea.data.tokenfile import HEADER_SIZE, open_tokens, token_writer
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
    "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega",
    "café", "naïve", "中文", "😀", "def", "return", "class", "import", "self"]


def lines(rng, n_bytes):
    """Text of random words in lines of 1-12 words, about `n_bytes` long."""
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS, rng.integers(1, 13))) + "\n"
        out.append(line)
        size += len(line.encode())
    return "".join(out)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    tok = Tokenizer.train([lines(rng, 200_000)], vocab_size=600, allow_smaller=True)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


@pytest.fixture
def ctrl_c_after():
    """ctrl_c_after(seconds): a Ctrl-C then, as a terminal sends it. Python's own SIGINT handler is
    put back for the test: a suite started in the background (`... &` in a script) inherits SIGINT
    ignored, and `_thread.interrupt_main` does nothing then."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = []

    def schedule(seconds):
        timers.append(threading.Timer(seconds, _thread.interrupt_main))
        timers[-1].start()

    yield schedule
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGINT, previous)


def make_corpus(root, n_files, n_bytes, seed=1):
    rng = np.random.default_rng(seed)
    for i in range(n_files):
        p = root / f"d{i % 3}" / f"f{i:03d}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(lines(rng, n_bytes), encoding="utf-8")
    return root


def all_ids(data_dir, split):
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    shards = open_split(data_dir, split, tok.vocab_size, tok.fingerprint()).shards
    return np.concatenate([np.asarray(a) for a in shards])


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ----------------------------------------------------------------------------- blocks and the split


def test_blocks_cover_every_file_exactly_and_never_split_a_character(tmp_path):
    text = "".join(f"línea {i} 😀\n" for i in range(20_000)) + "x" * 200_000 + "é" * 100_000 + "\nend"
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    (tmp_path / "small.txt").write_text("small\n", encoding="utf-8")
    paths = sorted(tmp_path.iterdir())
    sizes = [p.stat().st_size for p in paths]
    blocks = stream.plan_blocks(paths, sizes, tmp_path, 0.01)
    reader = stream.BlockReader(paths, sizes, blocks)
    pieces = [reader.read(j) for j in range(len(blocks))]
    assert all(valid for _, _, valid in pieces)
    big = [t for b, (_, t, _) in zip(blocks, pieces) if paths[b.file].name == "big.txt"]
    assert "".join(big) == text and len(big) == -(-sizes[0] // stream.MIN_BLOCK)
    assert max(len(t.encode()) for t in big) <= 2 * stream.MIN_BLOCK + 4
    assert sum(n for n, _, _ in pieces) == sum(sizes)


def test_validation_honours_the_fraction_with_few_large_files(tmp_path, tok_path):
    """Four 1 MB files at 1%: whole files would put 25% of the corpus in validation."""
    corpus = make_corpus(tmp_path / "c", 4, 1_000_000)
    stats = preparation.prepare([str(corpus)], tmp_path / "d", val_fraction=0.01, progress=False, tokenizer=tok_path)
    share = stats["val_bytes"] / stats["bytes"]
    assert 0.003 < share < 0.03, share
    assert 0.003 < stats["val_tokens"] / (stats["train_tokens"] + stats["val_tokens"]) < 0.03


def test_the_split_is_a_stable_function_of_paths_and_sizes(tmp_path):
    corpus = make_corpus(tmp_path / "c", 30, 20_000)
    paths = sorted(p for p in corpus.rglob("*.txt"))
    sizes = [p.stat().st_size for p in paths]
    first = stream.plan_blocks(paths, sizes, corpus, 0.1)
    moved = tmp_path / "elsewhere"
    shutil.move(corpus, moved)
    again = stream.plan_blocks([moved / p.relative_to(corpus) for p in paths], sizes, moved, 0.1)
    assert [b.val for b in first] == [b.val for b in again] and any(b.val for b in first)


# ----------------------------------------------------------------------------- shards, threads, resume


def test_output_is_the_same_for_any_number_of_threads_and_shard_size(tmp_path, tok_path):
    corpus = make_corpus(tmp_path / "c", 24, 30_000)
    one = preparation.prepare([str(corpus)], tmp_path / "one", progress=False, tokenizer=tok_path, workers=1)
    many = preparation.prepare([str(corpus)], tmp_path / "many", progress=False, tokenizer=tok_path, workers=3,
                               shard_tokens=20_000)
    assert len(one["shards"]["train"]) == 1 and len(many["shards"]["train"]) > 3
    for split in ("train", "val"):
        assert np.array_equal(all_ids(tmp_path / "one", split), all_ids(tmp_path / "many", split))
    for entry in many["shards"]["train"]:
        ids = open_tokens(tmp_path / "many" / entry["file"])
        assert entry["tokens"] == len(ids) and entry["max_id"] == int(ids.max())
    assert sum(e["tokens"] for e in many["shards"]["train"]) == many["train_tokens"] == one["train_tokens"]
    assert many["unigram_val_nats"] == one["unigram_val_nats"]


def test_an_interrupted_prepare_resumes_from_its_last_finished_shard(tmp_path, tok_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", 24, 30_000)
    whole = preparation.prepare([str(corpus)], tmp_path / "whole", progress=False, tokenizer=tok_path, workers=2,
                                shard_tokens=20_000)
    out = tmp_path / "out"
    take, calls = shards.Encoder._take, []

    def interrupted(self, piece):
        calls.append(piece.block)
        if len(calls) == 15:
            raise KeyboardInterrupt
        take(self, piece)

    monkeypatch.setattr(shards.Encoder, "_take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, workers=2, shard_tokens=20_000)
    monkeypatch.setattr(shards.Encoder, "_take", take)
    state = json.loads((out / shards.STATE_FILE).read_text())
    assert not (out / "meta.json").exists() and 0 < state["next_block"] < 15
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # the unfinished shard is gone

    work, encoded = shards.Encoder._work, []
    monkeypatch.setattr(shards.Encoder, "_work", lambda self, j: encoded.append(j) or work(self, j))
    resumed = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path, workers=2,
                                  shard_tokens=20_000)
    assert min(encoded) == state["next_block"]  # the finished shards were not encoded again
    assert resumed["shards"] == whole["shards"] and not (out / shards.STATE_FILE).exists()
    for split in ("train", "val"):
        assert np.array_equal(all_ids(out, split), all_ids(tmp_path / "whole", split))
    assert {k: resumed[k] for k in ("train_tokens", "val_tokens", "unigram_val_nats", "bytes", "not_utf8_files")} \
        == {k: whole[k] for k in ("train_tokens", "val_tokens", "unigram_val_nats", "bytes", "not_utf8_files")}


def test_ctrl_c_while_encoding_stops_within_a_second(tmp_path, tok_path, monkeypatch, ctrl_c_after):
    corpus = make_corpus(tmp_path / "c", 40, 5_000)
    work = shards.Encoder._work
    monkeypatch.setattr(shards.Encoder, "_work", lambda self, j: time.sleep(0.3) or work(self, j))
    ctrl_c_after(0.5)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        preparation.prepare([str(corpus)], tmp_path / "d", progress=False, tokenizer=tok_path, workers=2)
    assert time.perf_counter() - t0 < 1.5
    assert not [p for p in (tmp_path / "d").iterdir() if p.name.endswith(".tmp") or p.name == "meta.json"]


def test_progress_comes_every_few_seconds_in_a_log(tmp_path, tok_path, monkeypatch, capsys):
    corpus = make_corpus(tmp_path / "c", 12, 5_000)
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.05)
    work = shards.Encoder._work
    monkeypatch.setattr(shards.Encoder, "_work", lambda self, j: time.sleep(0.03) or work(self, j))
    preparation.prepare([str(corpus)], tmp_path / "d", progress=True, tokenizer=tok_path, workers=1)
    assert capsys.readouterr().err.count("encoding ") >= 3
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)  # listing says how far it got, too
    preparation.prepare([str(corpus)], tmp_path / "d2", progress=True, tokenizer=tok_path, workers=1)
    assert "listing the corpus: 12 files so far" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a data directory stands alone


def test_a_prepared_directory_needs_no_corpus(tmp_path, tok_path):
    corpus = make_corpus(tmp_path / "c", 6, 20_000)
    out = tmp_path / "d"
    first = preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)
    before = snapshot(out)
    os.utime(next(corpus.rglob("*.txt")))  # touched: nothing happens
    assert preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)["skipped"]
    shutil.move(corpus, tmp_path / "moved")  # gone: nothing happens either
    again = preparation.prepare([str(corpus)], out, vocab_size=first["vocab_size"], progress=False)
    assert again["skipped"] and again["train_tokens"] == first["train_tokens"] and snapshot(out) == before
    assert split_counts(out) == (first["train_tokens"], first["val_tokens"])


def test_opening_a_split_reads_headers_not_ids(tmp_path, tok_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", 6, 20_000)
    out = tmp_path / "d"
    preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)
    tok = Tokenizer.load(tok_path)
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE : HEADER_SIZE + 2] = (65535).to_bytes(2, "little")  # corrupt one id
    shard.write_bytes(bytes(raw))
    tokens = open_split(out, "train", tok.vocab_size, tok.fingerprint())  # no scan: opens
    with pytest.raises(UserError, match="outside"):
        tokens.windows([0], 8)  # ...and the batch holding the bad id is refused
    meta = json.loads((out / "meta.json").read_text())
    meta["shards"]["train"][0]["tokens"] += 1
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="meta.json says"):
        open_split(out, "train", tok.vocab_size, tok.fingerprint())


# ----------------------------------------------------------------------------- issue 20: nothing destroyed


def test_a_refused_prepare_deletes_nothing(tmp_path, tok_path):
    """Another vocabulary size, another given tokenizer, another corpus, another validation fraction:
    refused, every file as it was."""
    corpus = make_corpus(tmp_path / "c", 6, 20_000)
    out = tmp_path / "d"
    preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)
    before = snapshot(out)
    other = tmp_path / "other.json"
    Tokenizer.train([lines(np.random.default_rng(5), 100_000)], vocab_size=400, allow_smaller=True).save(other)
    with pytest.raises(UserError, match="ids but 700 were asked"):
        preparation.prepare([str(corpus)], out, vocab_size=700, progress=False)
    with pytest.raises(UserError, match="a prepared directory keeps its split"):
        preparation.prepare([str(corpus)], out, val_fraction=0.2, progress=False, tokenizer=tok_path)
    with pytest.raises(UserError, match="another tokenizer"):
        preparation.prepare([str(corpus)], out, progress=False, tokenizer=other)
    with pytest.raises(UserError, match="another corpus"):
        preparation.prepare([str(corpus / "d0")], out, progress=False)
    assert snapshot(out) == before
    assert preparation.prepare([str(corpus)], out, progress=False, tokenizer=tok_path)["skipped"]


def test_a_directory_andrea_did_not_make_is_left_alone(tmp_path, tok_path):
    corpus = make_corpus(tmp_path / "c", 3, 20_000)
    for name, content in (("meta.json", '{"step": 3, "tokenizer_fingerprint": "x"}'), ("train.bin", "mine")):
        d = tmp_path / name
        d.mkdir()
        (d / name).write_text(content)
        (d / "tokenizer.json").write_bytes(tok_path.read_bytes())
        before = snapshot(d)
        with pytest.raises(UserError, match="choose another --data-dir"):
            preparation.prepare([str(corpus)], d, progress=False, tokenizer=tok_path)
        assert snapshot(d) == before


# ----------------------------------------------------------------------------- issue 20 class 7: the tokenizer


def test_one_large_document_reaches_the_trainer_in_bounded_pieces(tmp_path, monkeypatch):
    text = lines(np.random.default_rng(3), 6_000_000)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    seen = []
    train = Tokenizer.train.__func__

    def recording(cls, texts, *args, **kwargs):
        return train(cls, (seen.append(len(t.encode())) or t for t in texts), *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "train", classmethod(recording))
    preparation.prepare([str(tmp_path / "one.txt")], tmp_path / "d", progress=False, allow_smaller_vocab=True,
                        vocab_size=600)
    assert len(seen) > 5 and max(seen) <= 2 * stream.MAX_BLOCK and sum(seen) > 0.9 * len(text.encode())


def test_the_tokenizer_sample_is_bounded_and_spread(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", 20, 30_000)
    seen = []
    train = Tokenizer.train.__func__

    def recording(cls, texts, *args, **kwargs):
        return train(cls, (seen.append(len(t.encode())) or t for t in texts), *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "train", classmethod(recording))
    preparation.prepare([str(corpus)], tmp_path / "d", progress=False, allow_smaller_vocab=True, vocab_size=600,
                        tokenizer_sample=200_000)
    assert 200_000 <= sum(seen) < 200_000 + 2 * 64 * 1024 and len(seen) < 20


def test_ctrl_c_while_the_tokenizer_reads_stops_within_a_second(tmp_path, monkeypatch, ctrl_c_after):
    corpus = make_corpus(tmp_path / "c", 200, 3_000)
    read = stream.read_block
    monkeypatch.setattr(stream, "read_block", lambda *a: time.sleep(0.02) or read(*a))
    ctrl_c_after(0.5)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        preparation.prepare([str(corpus)], tmp_path / "d", progress=False, allow_smaller_vocab=True)
    assert time.perf_counter() - t0 < 1.5
    assert not (tmp_path / "d" / "tokenizer.json").exists()


def test_a_corpus_of_binary_files_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(5):
        (tmp_path / "c" / f"blob{i}.dat").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"blob{i}.dat").write_bytes(rng.integers(0, 256, 400_000, dtype=np.uint8).tobytes())
    with pytest.raises(UserError, match="does not look like text"):
        preparation.prepare([str(tmp_path / "c")], tmp_path / "d", progress=False, allow_smaller_vocab=True)
    assert not (tmp_path / "d" / "tokenizer.json").exists()


# ----------------------------------------------------------------------------- issue 20 class 5: resume


def test_a_resume_whose_data_directory_is_gone_uses_the_runs_own_tokenizer(tmp_path, monkeypatch):
    import yaml

    from andrea import train
    from andrea.cli import run_cli

    corpus = make_corpus(tmp_path / "c", 8, 40_000)
    cfg = {
        "model": {"vocab_size": 8449, "context_length": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
        "train": {"batch_size": 2, "max_steps": 2, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "log_interval": 1,
                  "eval_interval": 2, "eval_batches": 1, "checkpoint_interval": 2, "sample_tokens": 0,
                  "device": "cpu"},
        "data": {"inputs": [str(corpus)], "data_dir": str(tmp_path / "data"), "allow_smaller_vocab": True},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"

    def run(argv):
        with pytest.raises(SystemExit) as info:
            run_cli(train.main, argv)
        return info.value.code

    assert run(["--config", str(tmp_path / "run.yaml"), "--out", str(out)]) == 0
    shutil.rmtree(tmp_path / "data")
    (corpus / "new.txt").write_text(lines(np.random.default_rng(9), 30_000))  # a new tokenizer would differ

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed run trained a new tokenizer")

    monkeypatch.setattr(Tokenizer, "train", no_training)
    assert run(["--out", str(out), "--resume", "--max-steps", "3"]) == 0
    assert Tokenizer.load(tmp_path / "data" / "tokenizer.json").fingerprint() == \
        Tokenizer.load(out / "tokenizer.json").fingerprint()


def test_sizes_and_workers_on_the_command_line(tmp_path, capsys):
    from andrea.cli import run_cli

    assert [prepare.byte_count(t) for t in ("100MB", "1.5GB", "5000", "64kB", "2 gb")] == \
        [100_000_000, 1_500_000_000, 5000, 64_000, 2_000_000_000]
    for bad in (["--workers", "0"], ["--tokenizer-sample", "lots"], ["--tokenizer-sample", "0"]):
        with pytest.raises(SystemExit) as info:
            run_cli(prepare.main, ["--input", str(tmp_path), "--data-dir", str(tmp_path / "d"), *bad])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


def test_a_data_directory_of_the_older_single_file_layout_is_refused_in_one_line(tmp_path, tok_path, capsys):
    """meta_version 1 (one train.bin, one val.bin): prepare, a run's data check and opening a split
    each refuse it with one line saying to prepare it again, and nothing in it is touched."""
    from andrea.cli import run_cli

    corpus = make_corpus(tmp_path / "c", 3, 20_000)
    tok = Tokenizer.load(tok_path)
    out = tmp_path / "old"
    out.mkdir()
    tok.save(out / "tokenizer.json")
    for split, n in (("train", 500), ("val", 60)):
        with token_writer(out / f"{split}.bin", tok.vocab_size, tok.fingerprint()) as sink:
            sink.write(np.arange(n) % tok.eot_id)
    meta = {"meta_version": 1, "inputs": [str(corpus)], "requested_vocab_size": tok.vocab_size, "val_fraction": 0.01,
            "train_tokens": 500, "val_tokens": 60, "vocab_size": tok.vocab_size,
            "tokenizer_fingerprint": tok.fingerprint()}
    (out / "meta.json").write_text(json.dumps(meta))
    before = snapshot(out)
    wanted = (f"error: {out} holds data of an older layout (one train.bin and val.bin, meta_version 1): delete it "
              "and prepare it again (python -m andrea.prepare), or use the andrea version that wrote it\n")
    for argv in (["--input", str(corpus), "--data-dir", str(out)], ["--verify", "--data-dir", str(out)]):
        with pytest.raises(SystemExit) as info:
            run_cli(prepare.main, argv)
        assert info.value.code == 2 and capsys.readouterr().err == wanted
    with pytest.raises(UserError, match="older layout"):
        split_counts(out)
    with pytest.raises(UserError, match="older layout"):
        open_split(out, "train", tok.vocab_size, tok.fingerprint())
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- memory


def test_trainer_pieces_cut_only_where_the_pretokenizer_splits_anyway():
    """The trainer is fed blocks in ~64 KiB pieces (a batch of 256 whole 1 MiB blocks would be
    0.25 GB): joined they give the block, and GPT-2's regex finds the same words in the pieces as in
    the whole, so the tokenizer learnt from them is the same."""
    from andrea.data.tokenizer import _hf_pre_tokenizer

    rng = np.random.default_rng(3)
    text = lines(rng, 60_000) + "x  \n  y\n\nz \n" * 500 + "é" * 3000 + "\n" + lines(rng, 20_000)
    pieces = list(trainer_pieces(text, limit=500))
    assert "".join(pieces) == text and len(pieces) > 50
    assert all(len(p) <= 500 + 200 for p in pieces[:-1] if "é" * 3000 not in p)
    pre = _hf_pre_tokenizer()  # the trainer's own

    def words(t):
        return [w for w, _ in pre.pre_tokenize_str(t)]

    assert [w for p in pieces for w in words(p)] == words(text)
    assert list(trainer_pieces("")) == [] and list(trainer_pieces("short")) == ["short"]

    # indented text has no line starting with a non-space character: it is cut between kinds of
    # character ("x(", "1a", ".b"), never inside a word, a number, a run of spaces or after an apostrophe
    code = "".join(f"    def f{i}(x_{i}, y='it's'):\n        return {{'k{i}': [x_{i}, y.e9]}}  \n" for i in range(400))
    cut = list(trainer_pieces(code, limit=300))
    assert "".join(cut) == code and len(cut) > 50 and max(map(len, cut[:-1])) <= 330
    assert [w for p in cut for w in words(p)] == words(code)


# the characters whose neighbours decide a cut: letters, digits, punctuation, an apostrophe and the
# contractions it starts, spaces of several kinds, non-ASCII letters and symbols
PIECE_TEXT = st.lists(st.sampled_from(list("ab1 9\n\t\r'.(_-é中😀\u00a0") + ["'s", "'ll", "<|endoftext|>"]),
                      max_size=200).map("".join)


@settings(max_examples=300)
@given(PIECE_TEXT, st.integers(1, 40))
def test_trainer_pieces_give_the_words_of_the_whole_text(text, limit):
    from andrea.data.tokenizer import _hf_pre_tokenizer

    pre = _hf_pre_tokenizer()  # the trainer's own
    pieces = list(trainer_pieces(text, limit=limit))
    assert "".join(pieces) == text and all(pieces)
    assert [w for p in pieces for w, _ in pre.pre_tokenize_str(p)] == [w for w, _ in pre.pre_tokenize_str(text)]


def test_a_tokenizer_trained_on_pieces_equals_one_trained_on_whole_blocks():
    rng = np.random.default_rng(4)
    texts = [lines(rng, 200_000) for _ in range(4)]
    whole = Tokenizer.train(texts, 350)
    cut = Tokenizer.train((p for t in texts for p in trainer_pieces(t, limit=2_000)), 350)
    assert cut.fingerprint() == whole.fingerprint()


def test_the_plan_is_compact_and_reads_as_blocks(tmp_path):
    corpus = make_corpus(tmp_path / "c", 12, 5_000)
    files = FileList(corpus, sorted(corpus.rglob("*.txt")))
    assert [files[i] for i in range(len(files))] == sorted(corpus.rglob("*.txt")) and files[-1] == files[11]
    sizes = np.array([p.stat().st_size for p in files])
    blocks = stream.plan_blocks(files, sizes, corpus, 0.2)
    assert isinstance(blocks.file, np.ndarray) and len(blocks) == len(blocks[:])
    assert blocks.nominal_bytes() == sizes.sum() == sum(b.nominal_end - b.nominal_start for b in blocks[:])
    assert [b.file for b in blocks[:] if b.last] == list(range(12))
