"""Turn a corpus into what training reads (SPEC 3): tokenizer.json, train.bin, val.bin, meta.json.

    python -m andrea.prepare                                  # Python's stdlib -> data/stdlib
    python -m andrea.prepare --input 'books/**/*.txt'         # -> data/books
    python -m andrea.prepare --input a.txt notes/ --data-dir data/mine

The steps: list the files (one file = one document) -> put ~1% of them, chosen by a hash of their
path, in validation (a single-file corpus gives its last tokens instead) -> train the BPE
tokenizer on the training files, or load `tokenizer.json` if the directory already has one ->
encode every document, EOT after each -> write the token files -> write `meta.json` last, so its
presence means the directory is complete. Running again on the same corpus with the same
settings does nothing (`force=True` re-encodes; an existing tokenizer.json is always kept,
since checkpoints depend on it: delete it to train a new one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.data import (
    Document,
    atomic_writer,
    read_documents,
    read_token_header,
    resolve_inputs,
    split_validation,
    stdlib_corpus_files,
    stdlib_root,
    token_writer,
    unigram_entropy,
)
from andrea.errors import UserError
from andrea.preflight import check_directory
from andrea.tokenizer import DEFAULT_VOCAB_SIZE, Tokenizer

META_VERSION = 1
BATCH_BYTES = 1 << 20  # documents per encode_batch call: parallel enough, small Encoding objects
PIECE_CHARS = 1 << 20  # longer documents are encoded in pieces cut after a newline
CLEAR_TO_EOL = "\x1b[K"  # a redrawn progress line may be shorter than the last one


@dataclass(frozen=True)
class Corpus:
    files: list[Path]
    root: Path  # validation membership hashes the path relative to this
    description: str


def load_corpus(inputs: list[str] | None) -> Corpus:
    if not inputs:
        root = stdlib_root()
        return Corpus(stdlib_corpus_files(), root, f"Python {platform.python_version()} standard library ({root})")
    files = resolve_inputs(inputs)
    root = Path(os.path.commonpath([p.parent for p in files]))
    return Corpus(files, root, f"{len(files)} files from {' '.join(inputs)}")


def _signature(corpus: Corpus) -> str:
    """A hash of every file's relative path, size and mtime: what changes when the corpus does."""
    listing = []
    for p in corpus.files:
        st = p.stat()
        listing.append([p.relative_to(corpus.root).as_posix(), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(listing).encode("utf-8", errors="surrogateescape")).hexdigest()


def prepare(
    inputs: list[str] | None,
    data_dir,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = 0.01,
    progress: bool = True,
    allow_smaller_vocab: bool = False,
    force: bool = False,
) -> dict:
    """Prepare `data_dir` from `inputs` (None: the stdlib) and return the stats saved in meta.json.

    The result has `"skipped": True` when the directory was already up to date.
    """
    t0 = time.perf_counter()
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    data_dir = Path(data_dir)
    log = _Log(progress)
    corpus = load_corpus(inputs)
    settings = {"signature": _signature(corpus), "requested_vocab_size": vocab_size, "val_fraction": val_fraction}
    old = None if force else _existing_meta(data_dir, settings)
    if old is not None:
        return {**old, "skipped": True}
    sizes = {p: p.stat().st_size for p in corpus.files}
    nonempty = [p for p in corpus.files if sizes[p]]  # an empty file must not become the val set
    if not nonempty:
        raise UserError(f"the corpus is empty: {len(corpus.files)} files, all of them empty")

    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "meta.json").unlink(missing_ok=True)
    if len(nonempty) == 1:
        train_files, val_files = nonempty, []
    else:
        train_files, val_files = split_validation(nonempty, corpus.root, val_fraction)

    t1 = time.perf_counter()
    tok, origin = _tokenizer(data_dir / "tokenizer.json", train_files, sizes, vocab_size, allow_smaller_vocab, log)
    t2 = time.perf_counter()
    counts = _encode_corpus(tok, corpus.files, set(val_files), val_fraction, data_dir, sizes, log)
    t3 = time.perf_counter()

    meta = {
        "meta_version": META_VERSION,
        "corpus": corpus.description,
        "inputs": list(inputs) if inputs else None,
        "root": str(corpus.root),
        **settings,
        "files": len(corpus.files),
        "train_files": len(train_files),
        "val_files": len(val_files),
        "val_file_names": [p.relative_to(corpus.root).as_posix() for p in val_files],
        **counts,
        "vocab_size": tok.vocab_size,
        "tokenizer": origin,
        "tokenizer_fingerprint": tok.fingerprint(),
        "uniform_nats": math.log(tok.vocab_size),
        "seconds": {"tokenizer": round(t2 - t1, 2), "encode": round(t3 - t2, 2), "total": round(t3 - t0, 2)},
    }
    with atomic_writer(data_dir / "meta.json") as f:
        f.write((json.dumps(meta, indent=2) + "\n").encode("utf-8", errors="surrogateescape"))
    return {**meta, "skipped": False}


def _existing_meta(data_dir: Path, settings: dict) -> dict | None:
    """The saved stats when `data_dir` already holds this corpus, prepared with these settings.

    None when there is nothing there or it must be rebuilt; a UserError when it holds another
    corpus, which a rebuild would overwrite.
    """
    meta = _read_meta(data_dir / "meta.json")
    if meta is None:
        return None
    if meta.get("signature") != settings["signature"]:
        raise UserError(
            f"{data_dir} holds data prepared from another corpus ({meta.get('corpus')}): choose another "
            "--data-dir, or pass --force to re-encode this corpus there with its existing tokenizer.json"
        )
    return meta if _is_current(meta, data_dir, settings) else None


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or damaged: the directory gets rebuilt
    return meta if isinstance(meta, dict) and meta.get("meta_version") == META_VERSION else None


def _is_current(meta: dict, data_dir: Path, settings: dict) -> bool:
    """True when meta.json describes this corpus and settings and every file it names is intact."""
    if any(meta.get(k) != v for k, v in settings.items()):
        return False
    try:
        fingerprint = Tokenizer.load(data_dir / "tokenizer.json").fingerprint()
        train, val = (read_token_header(data_dir / name) for name in ("train.bin", "val.bin"))
    except UserError:
        return False
    same_tokenizer = fingerprint == meta.get("tokenizer_fingerprint") == train.fingerprint == val.fingerprint
    same_counts = (train.count, val.count) == (meta.get("train_tokens"), meta.get("val_tokens"))
    return same_tokenizer and same_counts


def _tokenizer(
    path: Path, train_files: list[Path], sizes: dict, vocab_size: int, allow_smaller: bool, log: _Log
) -> tuple[Tokenizer, str]:
    """Load `path` if it exists, else train on the training files and save it there."""
    if path.exists():
        tok = Tokenizer.load(path)
        if tok.vocab_size != vocab_size and not (allow_smaller and tok.vocab_size < vocab_size):
            raise UserError(
                f"{path} has {tok.vocab_size} ids but {vocab_size} were asked for: delete it to train a new tokenizer"
            )
        log.line(f"using the existing tokenizer {path} ({tok.vocab_size} ids)")
        return tok, "loaded"
    mb = sum(sizes[p] for p in train_files) / 1e6
    log.line(f"training a {vocab_size}-id BPE tokenizer on {len(train_files)} files ({mb:.1f} MB)...")
    bar = log.progress("tokenizer: reading", len(train_files), sum(sizes[p] for p in train_files))

    def texts():
        # the tokenizers library counts pairs as it reads, then merges: the bar shows the reading,
        # one line announces the merging, which is the shorter part
        for i, d in enumerate(read_documents(train_files)):
            bar.update(i + 1, d.n_bytes)
            if d.text:
                yield d.text
        bar.done()
        log.line(f"tokenizer: computing {vocab_size - 257} merges...")

    tok = Tokenizer.train(texts(), vocab_size, allow_smaller)
    if tok.vocab_size < vocab_size:
        log.line(f"note: the corpus is too small for {vocab_size} ids; the tokenizer has {tok.vocab_size}")
    tok.save(path)
    return tok, "trained"


def _encode_corpus(
    tok: Tokenizer, files: list[Path], val_files: set, val_fraction: float, data_dir: Path, sizes: dict, log: _Log
) -> dict:
    """Encode every file into train.bin or val.bin (EOT after each document); return the counts.

    No val files means a corpus of one non-empty file, whose tokens are split instead.
    """
    V, eot = tok.vocab_size, np.array([tok.eot_id])
    counts = {"train": np.zeros(V, np.int64), "val": np.zeros(V, np.int64)}
    n_bytes = {"train": 0, "val": 0}
    not_utf8 = empty = documents = 0
    bar = log.progress("encoding", len(files), sum(sizes.values()))
    with (
        token_writer(data_dir / "train.bin", V, tok.fingerprint()) as train,
        token_writer(data_dir / "val.bin", V, tok.fingerprint()) as val,
    ):
        sinks = {"train": train, "val": val}
        for i, (doc, ids) in enumerate(_encode_documents(tok, read_documents(files))):
            bar.update(i + 1, doc.n_bytes)
            not_utf8 += not doc.valid_utf8
            if not doc.text:
                empty += 1
                continue
            split = "val" if doc.path in val_files else "train"
            parts = {split: ids} if val_files else _single_file_split(ids, val_fraction)
            for name, part in parts.items():
                sinks[name].write(part)
                sinks[name].write(eot)
                counts[name] += np.bincount(part, minlength=V)
                counts[name][tok.eot_id] += 1
                documents += 1
            n_bytes[split] += doc.n_bytes
    bar.done()
    if not_utf8 > max(10, len(files) // 10):
        log.line(f"note: {not_utf8} of {len(files)} files are not UTF-8: is the corpus binary in part?")
    n_tokens = {name: int(c.sum()) for name, c in counts.items()}
    total_bytes = sum(n_bytes.values())
    return {
        "bytes": total_bytes,
        "train_bytes": n_bytes["train"],
        "val_bytes": n_bytes["val"],
        "not_utf8_files": not_utf8,
        "empty_files": empty,
        "train_tokens": n_tokens["train"],
        "val_tokens": n_tokens["val"],
        "bytes_per_token": round(total_bytes / max(sum(n_tokens.values()) - documents, 1), 4),
        "unigram_val_nats": round(unigram_entropy(counts["train"], counts["val"]), 4),
    }


def _single_file_split(ids: np.ndarray, val_fraction: float) -> dict:
    """A one-file corpus cannot be split by files: its last `val_fraction` of tokens is val."""
    cut = len(ids) - max(1, round(len(ids) * val_fraction))
    return {"train": ids[:cut], "val": ids[cut:]}


def _encode_documents(tok: Tokenizer, docs: Iterable[Document]) -> Iterator[tuple[Document, np.ndarray]]:
    """Yield (document, its ids as uint16) in order, encoding ~BATCH_BYTES of documents per call."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += doc.n_bytes
        if size >= BATCH_BYTES:
            yield from _encode_batch(tok, batch)
            batch, size = [], 0
    yield from _encode_batch(tok, batch)


def _encode_batch(tok: Tokenizer, docs: list[Document]) -> Iterator[tuple[Document, np.ndarray]]:
    pieces, owner = [], []
    for i, doc in enumerate(docs):
        for piece in _pieces(doc.text):
            pieces.append(piece)
            owner.append(i)
    ids = tok.encode_batch(pieces)
    per_doc: list[list[int]] = [[] for _ in docs]
    for i, piece_ids in zip(owner, ids):
        per_doc[i].extend(piece_ids)
    for doc, doc_ids in zip(docs, per_doc):
        yield doc, np.array(doc_ids, dtype=np.uint16)


def _pieces(text: str) -> list[str]:
    """Cut a long text after newlines into pieces of at most PIECE_CHARS characters.

    Encoding the pieces in parallel keeps memory bounded; the ids differ from encoding the
    whole text only at the cuts, and decode still returns the text exactly.
    """
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind("\n", start, start + PIECE_CHARS) + 1
        cut = cut if cut > start else start + PIECE_CHARS
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


# ----------------------------------------------------------------------------- progress on stderr


class _Log:
    def __init__(self, enabled: bool, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def progress(self, label: str, total_files: int, total_bytes: int) -> _Progress:
        return _Progress(self, label, total_files, total_bytes)


class _Progress:
    """`label  files done/total  MB done/total  MB/s  ETA`: redrawn in place at most 4 times a
    second on a terminal; elsewhere (a log file) one line at each quarter of the work."""

    def __init__(self, log: _Log, label: str, total_files: int, total_bytes: int):
        self.log, self.label = log, label
        self.total_files, self.total_bytes = total_files, max(total_bytes, 1)
        self.tty = log.enabled and log.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.files = self.bytes = 0
        self.quarter = 0

    def update(self, files: int, add_bytes: int) -> None:
        self.files, self.bytes = files, self.bytes + add_bytes
        now = time.perf_counter()
        if self.tty and now - self.last >= 0.25:
            self.last = now
            print("\r" + self._text(now) + CLEAR_TO_EOL, end="", file=self.log.stream, flush=True)
        elif not self.tty and 4 * self.bytes >= (self.quarter + 1) * self.total_bytes:
            self.quarter = 4 * self.bytes // self.total_bytes
            self.log.line(self._text(now))

    def done(self) -> None:
        if self.tty:
            print("\r" + self._text(time.perf_counter()) + CLEAR_TO_EOL, file=self.log.stream, flush=True)

    def _text(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.bytes / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        # The first second's rate is mostly start-up: no ETA from it.
        eta = f"{left / rate:.0f}s" if left == 0 or (rate > 0 and elapsed > 1) else "?"
        return (
            f"{self.label} {self.files:>{len(str(self.total_files))}}/{self.total_files} files  "
            f"{self.bytes / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB  {rate / 1e6:.1f} MB/s  ETA {eta}"
        )


# ----------------------------------------------------------------------------- command line


def default_data_dir(inputs: list[str] | None) -> Path:
    """data/stdlib for the default corpus; data/<name> for one input (its file stem or directory
    name, up to any glob character); data/custom otherwise."""
    if not inputs:
        return Path("data/stdlib")
    if len(inputs) > 1:
        return Path("data/custom")
    fixed = re.split(r"[*?\[]", inputs[0], maxsplit=1)[0]
    path = Path(os.path.abspath(os.path.expanduser(fixed or ".")))
    name = path.stem if fixed and not fixed.endswith(("/", os.sep)) and path.suffix else path.name
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return Path("data") / (name or "custom")


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m andrea.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input",
        dest="inputs",
        nargs="+",
        action="extend",
        metavar="PATH_OR_GLOB",
        help="files, directories or glob patterns of UTF-8 text (default: Python's stdlib)",
    )
    p.add_argument("--data-dir", type=Path, help="where to write (default: data/stdlib, or data/<input name>)")
    p.add_argument("--force", action="store_true", help="re-encode even if the directory is up to date")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids, EOT included (8449)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of files for validation (0.01)")
    p.add_argument(
        "--allow-smaller-vocab",
        action="store_true",
        help="keep fewer ids when the corpus is too small to reach --vocab-size",
    )
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def format_summary(stats: dict, data_dir: Path) -> str:
    files = (
        f"{stats['files']} ({stats['train_files']} train, {stats['val_files']} val; {stats['not_utf8_files']} "
        f"not UTF-8, bad bytes read as U+FFFD; {stats['empty_files']} empty)"
    )
    vocab = f"{stats['vocab_size']} ids ({stats['tokenizer']}, fingerprint {stats['tokenizer_fingerprint'][:12]})"
    unigram = f"{stats['unigram_val_nats']:.2f} nats/token on val (uniform: {stats['uniform_nats']:.2f})"
    if stats.get("skipped"):
        took = "nothing to do: already up to date (--force re-encodes)"
    else:
        s = stats["seconds"]
        took = f"{s['total']:.1f} s (tokenizer {s['tokenizer']:.1f} s, encoding {s['encode']:.1f} s)"
    rows = [
        ("corpus", stats["corpus"]),
        ("files", files),
        ("size", f"{stats['bytes'] / 1e6:.1f} MB"),
        ("tokens", f"{stats['train_tokens']:,} train, {stats['val_tokens']:,} val"),
        ("vocab", vocab),
        ("bytes/token", f"{stats['bytes_per_token']:.2f}"),
        ("unigram", unigram),
        ("time", took),
        ("data dir", str(data_dir)),
    ]
    return "\n".join(f"{name:<12}{value}" for name, value in rows)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    data_dir = args.data_dir or default_data_dir(args.inputs)
    check_directory(data_dir, "--data-dir")
    stats = prepare(
        args.inputs,
        data_dir,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        allow_smaller_vocab=args.allow_smaller_vocab,
        force=args.force,
    )
    print(format_summary(stats, data_dir))
    return 0


if __name__ == "__main__":
    run_cli(main)
