"""Byte-level BPE with a fixed id layout: 8449 ids, the same for every corpus.

    ids 0..255            the raw bytes, id == byte value
    ids 256..V-2          merged tokens, in the order the merges first created them
    id  V-1               <|endoftext|> (EOT), placed between documents by the data code

V is 8449 (8192 merges) unless a corpus too small to reach it is trained with `allow_smaller`.

Training runs in Hugging Face `tokenizers` (GPT-2's ByteLevel pre-tokenizer: the GPT-2 regex
split, no prefix space). Its trainer numbers the 256 byte symbols in Unicode order, so its output is
translated into the layout above. Encoding runs in `tiktoken`, given the same regex and each token's
byte string ranked by its id. Ids follow merge order, so "apply the earliest-learned merge first"
(`tokenizers`) and "form the lowest-id token first" (tiktoken) pick the same merge at each step
for merges learned this way; tests/test_tokenizer.py checks the ids are equal on the stdlib and on
drawn text. tiktoken is faster (BENCHMARKS.md, "Data preparation") and releases the GIL, so threads encode in
parallel. The `tokenizers` encoder stays as `encode_reference`, the definition the fast
one is tested against. EOT is never registered with either encoder: a literal "<|endoftext|>" in a
document is ordinary text.
Decoding is our own table lookup (id -> bytes, then UTF-8 with U+FFFD for invalid sequences),
so it never fails.

The saved form is our own JSON: the merges as pairs of ids. Everything else (the byte string of
each id, the HF vocabulary) follows from them, and the fingerprint is a hash of them.

`load_tokenizer` reads either kind of tokenizer.json: andrea's, or a Hugging Face byte-level BPE
(GPT-2's kind, `PretrainedTokenizer`, as --init-from and prepare --tokenizer give), behind the same
interface; decoding is the same table lookup for both.

Reference: Sennrich et al. 2016 (BPE for subwords); Radford et al. 2019 (GPT-2, byte-level BPE).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from andrea.data.tokenfile import MAX_VOCAB
from andrea.errors import UserError
from andrea.files import atomic_writer, read_json

FORMAT = "andrea-bpe"
FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 8449
# GPT-2's pre-tokenisation regex, the one HF's ByteLevel(use_regex=True) applies: contractions, letters,
# digits, other symbols (each with one leading space), then whitespace runs.
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_symbols() -> list[str]:
    """The printable character GPT-2's byte-level BPE uses for each byte (index = byte value).

    Bytes that are visible Latin-1 characters stand for themselves; the other 68 (controls,
    space, NBSP, soft hyphen) are given the characters from U+0100 on, in byte order.
    """
    visible = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, n_moved = [], 0
    for b in range(256):
        if b in visible:
            symbols.append(chr(b))
        else:
            symbols.append(chr(0x100 + n_moved))
            n_moved += 1
    return symbols


BYTE_SYMBOLS = _byte_symbols()
_SYMBOL_TO_BYTE = {s: b for b, s in enumerate(BYTE_SYMBOLS)}


def _symbols(token: bytes) -> str:
    return "".join(BYTE_SYMBOLS[b] for b in token)


def _hf_pre_tokenizer():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class IdDecoding:
    """Decoding shared by andrea's tokenizer and a pretrained one: a table of each id's bytes
    (`self._token_bytes`, `self.vocab_size` ids), joined and read as UTF-8."""

    def decode(self, ids) -> str:
        """Text of any sequence of ids in range (list or 1-D array); bad UTF-8 becomes U+FFFD."""
        ids = self._checked_ids(ids)
        return b"".join(self._token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes id `token_id` stands for (EOT: the ASCII of its text)."""
        return self._token_bytes[self._checked_ids([token_id])[0]]

    def text_bytes(self) -> np.ndarray:
        """(vocab_size,) int64: the bytes of text each id stands for, 0 for EOT (it separates
        documents, it is no text): summed over a split's ids, the size of its UTF-8 text."""
        n = np.array([len(b) for b in self._token_bytes], dtype=np.int64)
        n[self.eot_id] = 0
        return n

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def _checked_ids(self, ids) -> list[int]:
        arr = np.asarray(ids)
        if arr.size == 0:
            return []
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise UserError(f"token ids must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            raise UserError(
                f"token id {int(arr[bad][0])} is out of range for a tokenizer of {self.vocab_size} ids "
                f"(0..{self.vocab_size - 1})"
            )
        return arr.tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a 1-D integer array (what the data pipeline writes)."""
        return np.asarray(self.encode(text), dtype=np.int64)


class Tokenizer(IdDecoding):
    EOT_TEXT = "<|endoftext|>"

    def __init__(self, merges: list[tuple[int, int]]):
        """Build from merges given as (left id, right id) pairs in merge order.

        The merged token of each pair that is new gets the next id; a pair that rebuilds a byte
        string an earlier merge already made (possible in HF's trainer) adds no id.
        """
        token_bytes = [bytes([b]) for b in range(256)]
        index = {t: i for i, t in enumerate(token_bytes)}
        for left, right in merges:
            if not (0 <= left < len(token_bytes) and 0 <= right < len(token_bytes)):
                raise ValueError(f"merge ({left}, {right}) refers to an id not yet defined")
            joined = token_bytes[left] + token_bytes[right]
            if joined not in index:
                index[joined] = len(token_bytes)
                token_bytes.append(joined)
        if len(token_bytes) + 1 > MAX_VOCAB:
            raise ValueError(f"{len(token_bytes) + 1} ids do not fit the uint16 token files")
        self._merges = [(int(a), int(b)) for a, b in merges]
        self._token_bytes = token_bytes + [self.EOT_TEXT.encode("ascii")]
        self.vocab_size = len(self._token_bytes)
        self.eot_id = self.vocab_size - 1
        self._fingerprint = hashlib.sha256(self._canonical().encode("ascii")).hexdigest()
        self._hf = self._build_encoder(token_bytes)
        self._fast = tiktoken.Encoding(
            "andrea", pat_str=GPT2_SPLIT, mergeable_ranks={t: i for i, t in enumerate(token_bytes)}, special_tokens={}
        )

    @property
    def merges(self) -> list[tuple[int, int]]:
        """The merges as (left id, right id) pairs, in merge order (what `Tokenizer(merges)` takes)."""
        return list(self._merges)

    def _canonical(self) -> str:
        return json.dumps({"format": FORMAT, "eot": self.EOT_TEXT, "merges": self._merges}, separators=(",", ":"))

    def _build_encoder(self, token_bytes: list[bytes]) -> HFTokenizer:
        vocab = {_symbols(t): i for i, t in enumerate(token_bytes)}
        merges = [(_symbols(token_bytes[a]), _symbols(token_bytes[b])) for a, b in self._merges]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = _hf_pre_tokenizer()
        return hf

    # --------------------------------------------------------------------------- training

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, allow_smaller: bool = False
    ) -> Tokenizer:
        """Learn `vocab_size - 257` merges from `texts` (deterministic: same texts, same merges).

        A corpus too small to yield that many merges (about 1 MB of text is needed for 8449 ids)
        is a UserError, unless `allow_smaller`, which keeps the merges found: then `vocab_size`
        of the result is smaller, and EOT is still the last id.
        """
        if not 257 <= vocab_size <= MAX_VOCAB:
            raise UserError(f"vocab_size must be in 257..{MAX_VOCAB} (256 bytes, merges, EOT), got {vocab_size}")
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = _hf_pre_tokenizer()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 1,  # EOT is added by us, after the merges
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        try:
            hf.train_from_iterator(iter(texts), trainer)
        except TypeError as e:
            raise UserError(f"training text must be str that UTF-8 can represent (no lone surrogates): {e}") from e
        tok = cls(_merges_from_hf(json.loads(hf.to_str())["model"]))
        if tok.vocab_size < vocab_size and not allow_smaller:
            raise UserError(
                f"the corpus is too small for {vocab_size} token ids: BPE ran out of pairs after "
                f"{tok.vocab_size - 257} merges ({tok.vocab_size} ids); about 1 MB of text is needed "
                "(python -m andrea.prepare --allow-smaller-vocab keeps fewer ids)"
            )
        return tok

    # --------------------------------------------------------------------------- files

    @classmethod
    def load(cls, path) -> Tokenizer:
        """Read a tokenizer saved by `save`; a missing, foreign or corrupt file is a UserError."""
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"tokenizer file {path} does not exist: run python -m andrea.prepare") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read tokenizer file {path}: {e}; re-run python -m andrea.prepare --force") from e
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise UserError(f"{path} is not an andrea tokenizer file (made by python -m andrea.prepare)")
        if obj.get("version") != FORMAT_VERSION:
            raise UserError(
                f"{path} is tokenizer format version {obj.get('version')}; this andrea reads {FORMAT_VERSION}"
            )
        try:
            tok = cls([(a, b) for a, b in obj["merges"]])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"tokenizer file {path} is corrupt ({e}): re-run python -m andrea.prepare --force") from e
        if obj.get("vocab_size") != tok.vocab_size or obj.get("fingerprint") != tok.fingerprint():
            raise UserError(
                f"tokenizer file {path} is corrupt (its merges do not give its vocab_size/fingerprint): "
                "re-run python -m andrea.prepare --force"
            )
        return tok

    def save(self, path) -> None:
        """Write the tokenizer as JSON, one merge per line, atomically."""
        head = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "eot": self.EOT_TEXT,
            "fingerprint": self._fingerprint,
        }
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        merges = ",\n".join(f"    [{a}, {b}]" for a, b in self._merges)
        text = "{\n" + "\n".join(lines) + '\n  "merges": [\n' + merges + "\n  ]\n}\n"
        with atomic_writer(path) as f:
            f.write(text.encode("ascii"))

    def fingerprint(self) -> str:
        """sha256 hex of the merges (which fix every id): equal fingerprints, equal tokenizers."""
        return self._fingerprint

    # --------------------------------------------------------------------------- encode / decode

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, which must be a str UTF-8 can represent (no lone surrogates).

        Never yields `eot_id`, whatever the text contains.
        """
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a 1-D integer array, without a Python list in between. tiktoken releases the
        GIL while it works, so several threads encode at once."""
        _check_text(text)
        try:
            return self._fast.encode_to_numpy(text, disallowed_special=())
        except ValueError:
            # tiktoken's regex engine gives up on pathological runs (~100k spaces in a row: its
            # backtracking stack is exhausted); the reference encoder gives the same ids, slower
            return np.array(self._hf.encode(text).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts."""
        return [self.encode(text) for text in texts]

    def encode_reference(self, text: str) -> list[int]:
        """The ids of Hugging Face `tokenizers`' BPE on the same merges: what `encode` must equal."""
        _check_text(text)
        return self._hf.encode(text).ids

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, fingerprint={self._fingerprint[:12]})"


class StreamDecoder:
    """Decode ids one at a time, emitting only complete characters.

    A character whose UTF-8 bytes are split across tokens is held back until its last byte
    arrives; the concatenation of every `feed` and the final `flush` equals `decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Emit what is held back (an incomplete character becomes U+FFFD) and start afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def _check_text(text) -> None:
    error = _text_error(text)
    if error is not None:
        raise error


def _text_error(text) -> Exception | None:
    """Why HF refused `text`: not a str, or a str with a lone surrogate; None if neither."""
    if not isinstance(text, str):
        return TypeError(f"encode takes str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return UserError(
            f"text holds a lone surrogate (U+{ord(text[e.start]):04X} at index {e.start}), which UTF-8 "
            "cannot represent: decode your input with errors='replace' first"
        )
    return None


def _merges_from_hf(model: dict) -> list[tuple[int, int]]:
    """Translate the merges of a trained HF byte-level BPE model into pairs of our ids.

    HF writes each merge as a pair of symbol strings (older versions: one string "a b").
    """
    token_id = {bytes([b]): b for b in range(256)}
    merges = []
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        a, b = bytes(_SYMBOL_TO_BYTE[c] for c in left), bytes(_SYMBOL_TO_BYTE[c] for c in right)
        merges.append((token_id[a], token_id[b]))
        token_id.setdefault(a + b, len(token_id))
    return merges


# ----------------------------------------------------------------------------- loading either kind


class PretrainedTokenizer(IdDecoding):
    """andrea's tokenizer interface over a HF tokenizer.json of a byte-level BPE (GPT-2's kind).

    Encoding never yields the end-of-text id, as andrea's own tokenizer: special tokens in text
    are encoded as text. Decoding is a table lookup of each id's bytes, then UTF-8 with U+FFFD.
    """

    def __init__(self, text: str, source, eot_text: str | None = None):
        try:
            obj = json.loads(text)
            hf = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception on a malformed file
            raise UserError(f"{source} is not a readable tokenizer.json ({str(e).splitlines()[0]})") from None
        if (obj.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(obj.get("pre_tokenizer")):
            raise UserError(f"{source} is not a byte-level BPE tokenizer (GPT-2's kind), which is what andrea reads")
        hf.encode_special_tokens = True
        self._hf, self._json = hf, hf.to_str()
        vocab = hf.get_vocab(with_added_tokens=True)
        lacking = [s for s in BYTE_SYMBOLS if s not in vocab]
        if lacking:  # a byte without an id would be dropped from the text without a word
            raise UserError(f"{source}: its vocabulary lacks {len(lacking)} of the 256 byte-level symbols (e.g. "
                            f"{lacking[0]!r}), so some text could not be encoded: give a complete byte-level BPE")
        self.vocab_size = max(vocab.values()) + 1
        if self.vocab_size > MAX_VOCAB:
            raise UserError(f"{source} has {self.vocab_size} ids, but token files store ids as uint16: "
                            f"andrea needs a tokenizer of at most {MAX_VOCAB} ids")
        added = {t["id"]: t for t in obj.get("added_tokens", [])}
        self.eot_text = eot_text or _end_of_text(added.values(), source)
        self.eot_id = vocab.get(self.eot_text)
        if self.eot_id is None or self.eot_id not in added:
            raise UserError(f"{source}: the end-of-text token {self.eot_text!r} is not one of its added tokens")
        self._token_bytes = [b""] * self.vocab_size
        for piece, i in vocab.items():
            self._token_bytes[i] = added[i]["content"].encode("utf-8") if i in added else _piece_bytes(piece, source)
        self._fingerprint = hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def to_json(self) -> str:
        return self._json

    def fingerprint(self) -> str:
        return self._fingerprint

    def save(self, path) -> None:
        with atomic_writer(path) as f:
            f.write(self._json.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]
        except TypeError:
            raise UserError("text to encode must be str that UTF-8 can represent (no lone surrogates)") from None

    def __repr__(self) -> str:
        return f"PretrainedTokenizer(vocab_size={self.vocab_size}, eot={self.eot_text!r})"


def _end_of_text(added_tokens, source) -> str:
    """<|endoftext|> when the tokenizer has it, else its only special token."""
    special = [t["content"] for t in added_tokens if t.get("special")]
    if Tokenizer.EOT_TEXT in special:
        return Tokenizer.EOT_TEXT
    if len(special) == 1:
        return special[0]
    raise UserError(f"{source}: cannot tell its end-of-text token among the special tokens {special[:5]}; "
                    "put a tokenizer_config.json with eos_token beside it")


def _piece_bytes(piece: str, source) -> bytes:
    try:
        return bytes(_SYMBOL_TO_BYTE[c] for c in piece)
    except KeyError:
        raise UserError(f"{source}: token {piece!r} is not byte-level BPE text (GPT-2's byte alphabet)") from None


def load_tokenizer(path):
    """andrea's Tokenizer from its own tokenizer.json, or a PretrainedTokenizer from a HF one.

    `path` is the JSON file or a directory holding tokenizer.json (with tokenizer_config.json's
    eos_token naming the end-of-text token, when there is one).
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"tokenizer file {file} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
        obj = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read tokenizer file {file}: {e}") from None
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return Tokenizer.load(file)
    if not isinstance(obj, dict) or "model" not in obj:
        raise UserError(f"{file} is neither an andrea tokenizer nor a Hugging Face tokenizer.json")
    eos = None
    if (file.parent / "tokenizer_config.json").is_file():
        eos = read_json(file.parent / "tokenizer_config.json").get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    return PretrainedTokenizer(text, file, eos)
