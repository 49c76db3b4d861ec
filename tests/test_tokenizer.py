"""The byte-level BPE tokenizer: its id layout, exact round trips, EOT handling, files.

One full-size tokenizer (8449 ids) is trained per module on ~1.5 MB of stdlib source (~1-2 s);
a small one (allow_smaller) serves the tests where the size does not matter.
"""

import json
import math
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from andrea import files
from andrea.data import tokenizer
from andrea.data.inputs import stdlib_corpus_files
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

EOT = Tokenizer.EOT_TEXT
unicode_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)
tricky = [
    "",
    "café naïve Ångström ñ",
    "emoji 😀👍🏽 👨‍👩‍👧 flags 🇵🇹",
    "中文字符 日本語 한국어",
    "nul\x00 bell\x07 esc\x1b del\x7f c1\x85 bom\ufeff",
    "\r\n\t  \n\n    indented\n",
    f"a{EOT}b {EOT}\n{EOT}",
    "\U0010ffff\ue000",
]


def stdlib_texts(n_bytes):
    texts, total = [], 0
    for path in stdlib_corpus_files():
        raw = path.read_bytes()
        texts.append(raw.decode("utf-8", errors="replace"))  # as the corpus is read: bad bytes are U+FFFD
        total += len(raw)
        if total >= n_bytes:
            return texts
    return texts


@pytest.fixture(scope="module")
def full():
    t0 = time.perf_counter()
    tok = Tokenizer.train(stdlib_texts(1_500_000))
    print(f"\ntrained the 8449-id tokenizer on 1.5 MB in {time.perf_counter() - t0:.1f} s")
    return tok


@pytest.fixture(scope="module")
def small():
    return Tokenizer.train(stdlib_texts(60_000), vocab_size=1000, allow_smaller=True)


@pytest.fixture(scope="module")
def merges(full, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    full.save(path)
    return [tuple(m) for m in json.loads(path.read_text())["merges"]]


# ----------------------------------------------------------------------------- layout


def test_byte_ids_are_the_bytes_in_order(full):
    for b in range(256):
        assert full.token_bytes(b) == bytes([b])
    assert full.decode(list(range(128))) == "".join(map(chr, range(128)))


def test_full_vocabulary_layout(full, merges):
    assert (full.vocab_size, full.eot_id) == (8449, 8448)
    assert full.token_bytes(full.eot_id) == EOT.encode()
    assert full.decode([full.eot_id]) == EOT
    assert len(merges) == 8192
    merged = [full.token_bytes(i) for i in range(256, 8448)]
    assert len(set(merged)) == 8192 and all(len(t) >= 2 for t in merged)


def test_merged_ids_follow_merge_order(full, merges):
    next_id = 256
    for left, right in merges:
        assert left < next_id and right < next_id
        assert full.token_bytes(next_id) == full.token_bytes(left) + full.token_bytes(right)
        next_id += 1


def test_byte_symbols_are_hf_byte_level_alphabet():
    assert sorted(tokenizer.BYTE_SYMBOLS) == sorted(pre_tokenizers.ByteLevel.alphabet())


def reference_encode(tok, merges, text):
    """Plain BPE: split like GPT-2, then apply the lowest-ranked merge, leftmost first, until none."""
    rank = {pair: r for r, pair in enumerate(merges)}
    merged_id = {pair: 256 + r for r, pair in enumerate(merges)}
    to_byte = {s: b for b, s in enumerate(tokenizer.BYTE_SYMBOLS)}
    ids = []
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for piece, _ in pre.pre_tokenize_str(text):
        word = [to_byte[c] for c in piece]
        while len(word) > 1:
            r, i = min((rank.get(pair, math.inf), i) for i, pair in enumerate(zip(word, word[1:])))
            if r == math.inf:
                break
            word[i : i + 2] = [merged_id[(word[i], word[i + 1])]]
        ids.extend(word)
    return ids


@settings(max_examples=40, deadline=None)
@given(text=unicode_text)
@example(text="def forward(self, x):\n    return self.proj(x) + 1  # résumé\n")
def test_encode_equals_reference_bpe(full, merges, text):
    assert full.encode(text) == reference_encode(full, merges, text)


# The fast encoder (tiktoken) against the trainer's own (tokenizers): the same ids, id for id.
emoji_and_scripts = st.lists(
    st.sampled_from([*"aZ09 _.\n\t", "é", "ß", "中", "😀", "👍🏽", "\u200d", "🇵🇹", "\ufeff", EOT, "  ", "'s", "'ll"]),
    max_size=80,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(unicode_text, emoji_and_scripts))
@example(text=f"x{EOT}y {EOT}\n")
@example(text=" " * 200_000)  # past tiktoken's regex stack: the reference encoder takes over
def test_fast_encoder_equals_tokenizers(full, small, text):
    for tok in (full, small):
        assert tok.encode(text) == tok.encode_reference(text)
        assert tok.encode_array(text).tolist() == tok.encode_reference(text)


def test_fast_encoder_equals_tokenizers_on_the_default_corpus(full):
    """Every file of a 3 MB slice of the stdlib (the default corpus), past the 1.5 MB trained on."""
    texts = stdlib_texts(4_500_000)[-600:]
    assert sum(map(len, texts)) > 2_000_000
    mismatched = [i for i, t in enumerate(texts) if full.encode(t) != full.encode_reference(t)]
    assert mismatched == []


# ----------------------------------------------------------------------------- round trips and EOT


@settings(max_examples=150, deadline=None)
@given(text=unicode_text)
def test_round_trip_any_text(full, text):
    ids = full.encode(text)
    assert full.decode(ids) == text
    assert all(0 <= i < full.eot_id for i in ids)


@pytest.mark.parametrize("text", tricky)
def test_round_trip_tricky_text(full, small, text):
    for tok in (full, small):
        assert tok.decode(tok.encode(text)) == text


def test_literal_eot_is_ordinary_text(full):
    for text in (EOT, f"x{EOT}y", EOT * 3):
        ids = full.encode(text)
        assert full.eot_id not in ids
        assert full.decode(ids) == text


def test_encode_batch_equals_encode(full):
    assert full.encode_batch(tricky) == [full.encode(t) for t in tricky]


def test_lone_surrogate_is_a_user_error(full):
    with pytest.raises(UserError, match="lone surrogate"):
        full.encode("ok \udc80")
    with pytest.raises(UserError, match="lone surrogate"):
        full.encode_batch(["fine", "\ud800"])
    with pytest.raises(TypeError):
        full.encode(b"bytes")


# ----------------------------------------------------------------------------- decoding


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 8448), max_size=60))
def test_decode_never_fails_and_streams_the_same(full, ids):
    text = full.decode(ids)
    assert text == b"".join(full.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
    stream = full.stream_decoder()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text


def test_stream_decoder_waits_for_complete_characters(full):
    ids = list("é😀".encode())  # byte ids: every character is split across tokens
    stream = full.stream_decoder()
    assert [stream.feed(i) for i in ids] == ["", "é", "", "", "", "😀"]
    assert stream.feed(ids[0]) == "" and stream.flush() == "\ufffd"
    assert stream.feed(ord("a")) == "a"


def test_decode_accepts_arrays_and_rejects_bad_ids(full):
    ids = full.encode("hello world")
    for arr in (np.array(ids, np.uint16), np.array(ids, np.int64), tuple(ids)):
        assert full.decode(arr) == "hello world"
    assert full.decode([]) == ""
    for bad in ([8449], [-1], [0, 70000]):
        with pytest.raises(UserError, match="out of range"):
            full.decode(bad)
    with pytest.raises(UserError, match="integers"):
        full.decode([1.5])
    with pytest.raises(UserError, match="out of range"):
        full.stream_decoder().feed(8449)


# ----------------------------------------------------------------------------- training


def test_training_is_deterministic(tmp_path):
    texts = stdlib_texts(150_000)
    a, b = (Tokenizer.train(texts, vocab_size=2000, allow_smaller=True) for _ in range(2))
    assert a.fingerprint() == b.fingerprint()
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_small_corpus_needs_allow_smaller():
    with pytest.raises(UserError, match="too small"):
        Tokenizer.train(["tiny corpus, tiny corpus"])
    tok = Tokenizer.train(["tiny corpus, tiny corpus"], allow_smaller=True)
    assert 257 < tok.vocab_size < 8449 and tok.eot_id == tok.vocab_size - 1
    assert tok.decode(tok.encode("corpus 😀")) == "corpus 😀"


def test_vocab_size_bounds():
    for bad in (256, 70000):
        with pytest.raises(UserError, match="vocab_size"):
            Tokenizer.train(["abc"], vocab_size=bad)


# ----------------------------------------------------------------------------- files


def test_save_load_round_trip(small, tmp_path):
    path = tmp_path / "tokenizer.json"
    small.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.fingerprint() == small.fingerprint() and loaded.vocab_size == small.vocab_size
    assert [loaded.encode(t) for t in tricky] == [small.encode(t) for t in tricky]
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]


def test_fingerprint_tells_tokenizers_apart(full, small):
    assert full.fingerprint() != small.fingerprint()
    assert len(full.fingerprint()) == 64


def test_load_refuses_missing_corrupt_and_foreign_files(small, tmp_path):
    path = tmp_path / "tokenizer.json"
    with pytest.raises(UserError, match="tokenizer.json does not exist"):
        Tokenizer.load(path)
    path.write_text('{"format": "andrea-bpe", "merg')
    with pytest.raises(UserError, match="cannot read tokenizer file .*tokenizer.json"):
        Tokenizer.load(path)
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    with pytest.raises(UserError, match="not an andrea tokenizer"):
        Tokenizer.load(path)
    small.save(path)
    obj = json.loads(path.read_text())
    obj["merges"][3] = [5, 7]
    path.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="corrupt"):
        Tokenizer.load(path)
    obj["merges"][3] = [5, 99999]
    path.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="corrupt"):
        Tokenizer.load(path)


def test_failed_save_leaves_nothing(small, tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        small.save(path)
    assert list(tmp_path.iterdir()) == []
