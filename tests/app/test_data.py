"""The data pipeline: corpus files, the split, token files and their refusals, batches, prepare."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from documents import split_documents
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea.cli import run_cli
from andrea.data.corpus import FileList
from andrea.data.inputs import SKIPPED_DIRS, _binary_suffix, iter_input_names, resolve_inputs, stdlib_corpus_files
from andrea.data.loader import BatchLoader, iter_eval_batches
from andrea.data.manifest import DATA_FORMAT, META_VERSION, TokenShards, open_split, split_counts
from andrea.data.preparation import prepare
from andrea.data.shards import unigram_entropy
from andrea.data.tokenfile import (
    _HEADER,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    TokenFileHeader,
    open_tokens,
    read_token_header,
    token_writer,
)
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError
from andrea.prepare import default_data_dir, main

FP = "ab" * 32


# ----------------------------------------------------------------------------- corpus files


def test_stdlib_corpus_files():
    files = stdlib_corpus_files()
    assert len(files) > 500 and files == sorted(files)
    assert all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    assert any(p.name == "os.py" for p in files)


def make_tree(root):
    files = {
        "a.txt": "alpha\n",
        "sub/b.md": "beta\n",
        "sub/deep/c.py": "gamma = 3\n",
        "sub/.hidden.txt": "no",
        ".git/config": "no",
        "sub/__pycache__/c.cpython-311.pyc": "no",
        "img.png": "no",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_resolve_directory_recurses_and_skips_non_text(tmp_path):
    root = make_tree(tmp_path)
    found = resolve_inputs([str(root)])
    assert [p.relative_to(root).as_posix() for p in found] == ["a.txt", "sub/b.md", "sub/deep/c.py"]


def test_resolve_globs_files_sorted_and_deduplicated(tmp_path):
    root = make_tree(tmp_path)
    specs = [root / "sub/**/*.py", root / "a.txt", root / "sub", root / "*.txt"]
    found = resolve_inputs([str(s) for s in specs])
    assert [p.relative_to(root).as_posix() for p in found] == ["a.txt", "sub/b.md", "sub/deep/c.py"]
    assert resolve_inputs([str(root / "img.png")]) == [root / "img.png"]  # named: taken as is
    star = resolve_inputs([str(root / "*")])  # globbed: filtered like a directory
    assert [p.relative_to(root).as_posix() for p in star] == ["a.txt", "sub/b.md", "sub/deep/c.py"]
    with pytest.raises(UserError, match="matches no file"):
        resolve_inputs([str(root / "**/*.pyc")])


def test_resolve_refuses_specs_matching_nothing(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "empty_dir").mkdir()
    for spec in (str(tmp_path / "missing.txt"), str(tmp_path / "*.rst"), str(tmp_path / "empty_dir")):
        with pytest.raises(UserError, match="matches no file"):
            resolve_inputs([str(tmp_path / "a.txt"), spec])


def walked_by_os_walk(top):
    """What a directory input takes, listed the plain way: os.walk, filtered, then sorted as Paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIPPED_DIRS]
        found += [os.path.join(dirpath, n) for n in filenames if not n.startswith(".") and n not in SKIPPED_DIRS
                  and not _binary_suffix(n) and os.path.isfile(os.path.join(dirpath, n))]
    return [str(p) for p in sorted(map(Path, found))]


def test_the_walk_gives_the_order_of_sorting_every_path_at_once(tmp_path):
    # names that order differently as whole strings than part by part ("a/x" against "a.b", "a-b")
    for rel in ("a.b", "a-b", "a/x", "a/y/z.txt", "a0", "ab/c", "B", "é.txt", "z/a/b/c/d.md", "a/.hid",
                "a/__pycache__/m.py", "data.bin", "node_modules"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "linked").symlink_to(tmp_path / "a", target_is_directory=True)  # not followed, as os.walk
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.b")  # a link to a file is taken
    (tmp_path / "broken.txt").symlink_to(tmp_path / "missing")
    names = list(iter_input_names([str(tmp_path)]))
    assert names == walked_by_os_walk(tmp_path)
    assert [os.path.relpath(n, tmp_path) for n in names][:5] == ["B", "a/x", "a/y/z.txt", "a-b", "a.b"]
    assert list(iter_input_names([str(tmp_path / "a"), str(tmp_path / "a.b"), str(tmp_path)])) == names


def test_the_listing_streams_one_directory_at_a_time(tmp_path):
    for d in ("d1", "d2"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.txt").write_text("x")
    names = iter_input_names([str(tmp_path)])
    assert next(names) == str(tmp_path / "d1" / "x.txt")
    (tmp_path / "d2" / "y.txt").write_text("y")  # d2 is listed only now that the walk reaches it
    assert list(names) == [str(tmp_path / "d2" / n) for n in ("x.txt", "y.txt")]


def test_a_file_list_under_the_common_root_equals_one_given_the_root(tmp_path):
    make_tree(tmp_path)
    names = list(iter_input_names([str(tmp_path / "sub")]))
    files = FileList.under_common_root(iter(names))
    root = Path(os.path.commonpath([os.path.dirname(n) for n in names]))
    assert files.root == root == tmp_path / "sub"
    assert [files.relative(i) for i in range(len(files))] == ["b.md", "deep/c.py"]
    assert files[:] == FileList(root, names)[:] == [Path(n) for n in names]
    one = FileList.under_common_root([str(tmp_path / "sub" / "deep" / "c.py")])
    assert (one.root, one.relative(0)) == (tmp_path / "sub" / "deep", "c.py")
    assert FileList.under_common_root(["/top.txt"]).relative(0) == "top.txt"


def test_unigram_entropy():
    V = 8
    assert unigram_entropy(np.zeros(V), np.ones(V)) == pytest.approx(math.log(V))
    train = np.array([3, 1, 0, 0])  # p = (4, 2, 1, 1) / 8
    assert unigram_entropy(train, np.array([1, 1, 0, 0])) == pytest.approx((math.log(2) + math.log(4)) / 2)


# ----------------------------------------------------------------------------- token files


def test_token_file_round_trip(tmp_path):
    tokens = np.array([0, 1, 299, 42, 7], dtype=np.int64)
    write_tokens(tmp_path / "t.bin", tokens, 300, FP)
    got = open_tokens(tmp_path / "t.bin", vocab_size=300, fingerprint=FP)
    assert got.dtype == np.uint16 and not got.flags.writeable
    np.testing.assert_array_equal(got, tokens)
    assert (tmp_path / "t.bin").stat().st_size == HEADER_SIZE + 2 * len(tokens)
    assert read_token_header(tmp_path / "t.bin") == TokenFileHeader(1, 300, 5, FP)


def test_token_writer_streams_and_empty_files_read_back(tmp_path):
    with token_writer(tmp_path / "t.bin", 65536, FP) as sink:
        for chunk in ([1, 2], np.array([], np.int64), np.array([65535], np.uint16)):
            sink.write(chunk)
    np.testing.assert_array_equal(open_tokens(tmp_path / "t.bin"), [1, 2, 65535])
    write_tokens(tmp_path / "e.bin", np.zeros(0, np.int64), 10, FP)
    assert len(open_tokens(tmp_path / "e.bin", vocab_size=10)) == 0


def write_tokens(path, tokens, vocab_size, fingerprint):
    """A token file as the encoder writes one: through token_writer."""
    with token_writer(path, vocab_size, fingerprint) as sink:
        sink.write(tokens)


def patched(path, offset, new_bytes):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(new_bytes)] = new_bytes
    path.write_bytes(bytes(raw))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "train.bin"
    write_tokens(path, np.arange(100) % 300, 300, FP)
    return path


def test_refuses_wrong_magic(token_file, tmp_path):
    patched(token_file, 0, b"NOTANDRE")
    with pytest.raises(UserError, match="not an andrea token file"):
        open_tokens(token_file)
    (tmp_path / "short.bin").write_bytes(b"abc")
    with pytest.raises(UserError, match="not an andrea token file"):
        open_tokens(tmp_path / "short.bin")


def test_refuses_unknown_version(token_file):
    patched(token_file, 8, (7).to_bytes(4, "little"))
    with pytest.raises(UserError, match="version 7"):
        open_tokens(token_file)


def test_refuses_other_vocab(token_file):
    expected = "made with a tokenizer of 300 ids, this model has 8449: re-run python -m andrea.prepare"
    with pytest.raises(UserError, match=expected):
        open_tokens(token_file, vocab_size=8449)


def test_refuses_other_fingerprint(token_file):
    with pytest.raises(UserError, match="different tokenizer"):
        open_tokens(token_file, vocab_size=300, fingerprint="cd" * 32)


def test_refuses_truncated(token_file):
    token_file.write_bytes(token_file.read_bytes()[:-1])
    with pytest.raises(UserError, match="truncated"):
        open_tokens(token_file)
    token_file.write_bytes(token_file.read_bytes()[:50])
    with pytest.raises(UserError, match="truncated"):
        open_tokens(token_file)


def test_refuses_out_of_range_ids(token_file):
    """The header is all that opening reads; each batch's ids are checked as they are gathered."""
    patched(token_file, HEADER_SIZE + 2 * 10, (300).to_bytes(2, "little"))
    split = TokenShards([open_tokens(token_file, vocab_size=300)], 300, ["train.bin"])
    assert split.windows([0], 10).max() < 300
    with pytest.raises(UserError, match=r"holds an id outside 0\.\.299 \(one of train.bin"):
        split.windows([5], 10)


def test_refuses_missing(tmp_path):
    with pytest.raises(UserError, match="nope.bin does not exist"):
        open_tokens(tmp_path / "nope.bin")


def test_failed_write_leaves_no_file_and_keeps_the_old_one(token_file):
    before = token_file.read_bytes()
    with pytest.raises(ValueError, match="outside"):
        write_tokens(token_file, np.array([1, 2, 300]), 300, FP)
    assert token_file.read_bytes() == before
    with pytest.raises(RuntimeError), token_writer(token_file.with_name("new.bin"), 300, FP) as sink:
        sink.write([1, 2, 3])
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in token_file.parent.iterdir()) == ["train.bin"]
    with pytest.raises(ValueError, match="uint16"):
        write_tokens(token_file.with_name("big.bin"), [1], 70000, FP)


# ----------------------------------------------------------------------------- batches


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 8449, size=5000).astype(np.uint16)


def test_batches_are_shifted_windows_of_the_data(tokens):
    x, y = BatchLoader(tokens, batch_size=4, seq_len=16, seed=1).next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
    for row_x, row_y in zip(x, y):
        starts = [o for o in range(len(tokens) - 16) if (tokens[o : o + 16] == row_x).all()]
        assert any((tokens[o + 1 : o + 17] == row_y).all() for o in starts)


@settings(max_examples=50)
@given(n=st.integers(2, 60), B=st.integers(1, 5), T=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_windows_stay_inside_the_data(n, B, T, seed):
    tokens = np.arange(n, dtype=np.uint16)
    if n < T + 1:
        with pytest.raises(UserError, match="too few for the context length"):
            BatchLoader(tokens, B, T, seed)
        return
    x, y = BatchLoader(tokens, B, T, seed).next_batch()
    np.testing.assert_array_equal(y, x + 1)  # arange data: each target is the next token
    assert x.min() >= 0 and y.max() <= n - 1


def test_same_seed_same_batches_other_seed_other_batches(tokens):
    a, b, c = (BatchLoader(tokens, 4, 16, seed) for seed in (5, 5, 6))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        assert not np.array_equal(xa, xc)


def test_resume_continues_exactly(tokens):
    run = BatchLoader(tokens, 4, 16, seed=3)
    for _ in range(3):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))
    expected = [run.next_batch() for _ in range(3)]
    resumed = BatchLoader(tokens, 4, 16, seed=999)
    resumed.load_state_dict(state)
    assert resumed.windows == 3 * 4
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(3))):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    with pytest.raises(UserError, match="cannot resume|not one"):
        resumed.load_state_dict({"batches": 1})
    older = {k: v for k, v in state.items() if k != "windows"} | {"batches": 3}  # before the data-parallel split
    with pytest.raises(UserError, match="not one this version can resume from .*the andrea version that wrote it"):
        resumed.load_state_dict(older)


def test_eval_batches_are_fixed_full_and_disjoint(tokens):
    batches = list(iter_eval_batches(tokens, 4, 16, max_batches=5))
    again = list(iter_eval_batches(tokens, 4, 16, max_batches=5))
    assert len(batches) == 5 and all(x.shape == (4, 16) for x, _ in batches)
    for (x, y), (x2, _) in zip(batches, again):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    rows = np.concatenate([x for x, _ in batches])
    np.testing.assert_array_equal(rows[0], tokens[:16])
    np.testing.assert_array_equal(batches[-1][1][-1], tokens[-16:])  # the last target is the last token
    few = list(iter_eval_batches(np.arange(50), 4, 16, max_batches=5))  # only 3 windows fit
    assert len(few) == 1 and few[0][0].shape == (3, 16)
    assert len(np.unique(few[0][0][:, 0])) == 3 and np.diff(few[0][0][:, 0]).min() >= 16
    with pytest.raises(UserError, match="context length"):
        list(iter_eval_batches(np.arange(10), 4, 16, 5))


# ----------------------------------------------------------------------------- prepare


DOCS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\n" * 20,
    "b.py": "def add(x, y):\n    return x + y  # café ☕\n" * 15,
    "sub/c.md": f"# Title\n\nA literal {Tokenizer.EOT_TEXT} stays text. 中文 😀\n" * 10,
    "sub/d.txt": "lorem ipsum dolor sit amet " * 30,
    "e.txt": "",
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def split_ids(data_dir, split):
    """Every id of a split of a prepared directory, its shards joined."""
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    shards = open_split(data_dir, split, tok.vocab_size, tok.fingerprint()).shards
    return np.concatenate([np.asarray(a) for a in shards]) if shards else np.zeros(0, np.uint16)


def test_prepare_end_to_end(corpus, tmp_path):
    out = tmp_path / "data"
    stats = prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True)
    tok = Tokenizer.load(out / "tokenizer.json")
    train, val = split_ids(out, "train"), split_ids(out, "val")
    val_names = set(stats["val_file_names"])
    assert stats["val_files"] == len(val_names) == 1 and "e.txt" not in val_names
    expected_train = [t for rel, t in sorted(DOCS.items()) if t and rel not in val_names]
    expected_val = [t for rel, t in sorted(DOCS.items()) if t and rel in val_names]
    assert split_documents(tok, train) == expected_train
    assert split_documents(tok, val) == expected_val
    assert stats["files"] == 5 and stats["empty_files"] == 1 and stats["not_utf8_files"] == 0
    assert (stats["train_tokens"], stats["val_tokens"]) == (len(train), len(val))
    assert stats["bytes"] == sum(len(t.encode()) for t in DOCS.values())
    assert stats["vocab_size"] == tok.vocab_size < 8449 and stats["tokenizer"] == "trained"
    assert stats["unigram_val_nats"] > 0 and stats["bytes_per_token"] > 1
    assert json.loads((out / "meta.json").read_text())["train_tokens"] == len(train)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train-00000.bin", "val-00000.bin"]


def test_prepare_fast_path_force_and_other_corpus(corpus, tmp_path):
    out = tmp_path / "data"
    first = prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True)
    assert not first["skipped"]
    assert prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True)["skipped"]
    forced = prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True, force=True)
    assert not forced["skipped"] and forced["tokenizer"] == "loaded"
    assert forced["tokenizer_fingerprint"] == first["tokenizer_fingerprint"]
    (out / "val-00000.bin").unlink()  # a damaged directory is said, naming the shard, and rebuilt with --force
    with pytest.raises(UserError, match="val-00000.bin does not exist"):
        prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True)
    assert not prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True, force=True)["skipped"]
    (corpus / "new.txt").write_text("a new document\n")  # a changed corpus changes nothing until --force
    assert prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True)["skipped"]
    with pytest.raises(UserError, match="another corpus"):
        prepare([str(corpus / "a.txt")], out, progress=False, allow_smaller_vocab=True)
    assert prepare([str(corpus)], out, progress=False, allow_smaller_vocab=True, force=True)["files"] == 6


def test_prepare_single_file_splits_its_tokens(tmp_path):
    text = "".join(f"line {i}: some words to tokenize\n" for i in range(300))
    (tmp_path / "one.txt").write_text(text)
    stats = prepare([str(tmp_path / "one.txt")], tmp_path / "data", progress=False, allow_smaller_vocab=True)
    tok = Tokenizer.load(tmp_path / "data" / "tokenizer.json")
    train, val = split_ids(tmp_path / "data", "train"), split_ids(tmp_path / "data", "val")
    assert stats["val_tokens"] >= 2 and stats["train_tokens"] > 50 * stats["val_tokens"]
    assert "".join(split_documents(tok, train) + split_documents(tok, val)) == text


def test_prepare_counts_bad_utf8_and_refuses_empty_corpora(tmp_path, corpus):
    (corpus / "latin1.txt").write_bytes("ação\n".encode("latin-1") * 50)
    stats = prepare([str(corpus)], tmp_path / "data", progress=False, allow_smaller_vocab=True)
    assert stats["not_utf8_files"] == 1
    (tmp_path / "empty").mkdir()
    for name in ("x.txt", "y.txt"):
        (tmp_path / "empty" / name).write_text("")
    with pytest.raises(UserError, match="corpus is empty"):
        prepare([str(tmp_path / "empty")], tmp_path / "data2", progress=False)
    with pytest.raises(UserError, match="too small"):
        prepare([str(corpus)], tmp_path / "data3", progress=False)
    assert not (tmp_path / "data3" / "tokenizer.json").exists()


def test_prepare_progress_goes_to_stderr_only(corpus, tmp_path, capsys):
    prepare([str(corpus)], tmp_path / "data", progress=True, allow_smaller_vocab=True)
    out, err = capsys.readouterr()
    assert out == "" and "encoding" in err and "files" in err


# ----------------------------------------------------------------------------- command line


def test_cli_prepares_and_summarises(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["--input", str(corpus), "--data-dir", str(tmp_path / "d"), "--allow-smaller-vocab", "--quiet"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "bytes/token" in out and "unigram" in out and "nats/token" in out


def test_cli_user_error_is_one_line_exit_2(tmp_path, capsys):
    argv = ["--input", str(tmp_path / "missing"), "--data-dir", str(tmp_path / "d")]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: input") and err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(UserError):
        run_cli(main, [*argv, "--debug"])


def test_cli_interrupt_exits_130(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_info:
        run_cli(interrupted, [])
    assert exit_info.value.code == 130 and "interrupted" in capsys.readouterr().err


def test_default_data_dir():
    assert default_data_dir(None) == default_data_dir([]) == Path("data/stdlib")
    assert default_data_dir(["texts/shakespeare.txt"]).as_posix() == "data/shakespeare"
    assert default_data_dir(["~/books/**/*.txt"]).as_posix() == "data/books"
    assert default_data_dir(["corpus/"]).as_posix() == "data/corpus"
    assert default_data_dir(["a.txt", "b.txt"]).as_posix() == "data/custom"
    assert default_data_dir([os.path.join("x", "my corpus!")]).as_posix() == "data/my_corpus"


# ----------------------------------------------------------------------------- past 2^32 tokens


def forged_shard(path, count, vocab_size, fingerprint, writes):
    """A sparse token file whose header promises `count` tokens; `writes` puts ids at positions."""
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, vocab_size, count, fingerprint.encode()))
        f.truncate(HEADER_SIZE + 2 * count)
        for position, ids in writes.items():
            f.seek(HEADER_SIZE + 2 * position)
            f.write(np.asarray(ids, dtype="<u2").tobytes())


def test_a_split_past_2_32_tokens_reads_by_64_bit_offsets(tmp_path):
    """Two sparse shards of 2^32 + 9 tokens each (17 GB of holes): windows at offsets past 2^32,
    one of them across the shard end, come back with the ids put there."""
    V, fp, n = 1000, "f" * 64, 2**32 + 9
    forged_shard(tmp_path / "train-00000.bin", n, V, fp, {n - 3: [1, 2, 3]})
    forged_shard(tmp_path / "train-00001.bin", n, V, fp, {0: [4, 5], n - 4: [6, 7, 8, 9]})
    forged_shard(tmp_path / "val-00000.bin", 100, V, fp, {0: list(range(100))})
    shards = {"train": [{"file": f"train-0000{i}.bin", "tokens": n, "max_id": 9} for i in range(2)],
              "val": [{"file": "val-00000.bin", "tokens": 100, "max_id": 99}]}
    meta = {"format": DATA_FORMAT, "meta_version": META_VERSION, "train_tokens": 2 * n,
            "val_tokens": 100, "shards": shards}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    train = open_split(tmp_path, "train", V, fp)
    assert len(train) == 2 * n > 2**33 and split_counts(tmp_path) == (2 * n, 100)
    rows = train.windows([n - 3, 2 * n - 5, 2**32 + 1], 5)
    assert rows[0].tolist() == [1, 2, 3, 4, 5] and rows[1].tolist() == [0, 6, 7, 8, 9]
    assert rows[2].tolist() == [0] * 5
    loader = BatchLoader(train, batch_size=64, seq_len=8, seed=0)
    x, y = loader.next_batch()
    starts = np.random.Generator(np.random.PCG64(0)).integers(0, 2 * n - 8, size=64)
    assert (starts > 2**32).sum() > 32  # the loader draws from the whole range...
    assert np.array_equal(np.concatenate([x, y[:, -1:]], axis=1), train.windows(starts, 9))  # ...and reads there
    last = list(iter_eval_batches(train, 4, 3, max_batches=2))[-1][1]
    assert last[-1].tolist() == [7, 8, 9]  # evaluation windows reach the last token
