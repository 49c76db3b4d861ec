"""Preparing a data directory from a corpus: the whole preparation, phase by phase.

The steps: list the source's files (andrea.data.sources: text files, one a document, or records such
as JSON Lines, one document each) -> cut them into blocks and choose the validation split (~1% of
the corpus, 5% of the stdlib: for files by a hash of each block's path and index, andrea.data.stream;
for records by a hash of each document's id) -> train the BPE tokenizer on a sample of the training
text (andrea.data.bpe_training), or load `tokenizer.json` if the directory already has one -> encode
every block on every core (threads; tiktoken releases the GIL), in corpus order, EOT after each
document -> write the ids into shards of ~100M tokens (`train-00000.bin`, ...,
`val-00000.bin`, ...; andrea.data.shards) -> write `meta.json` last: the manifest (each shard's token
count, largest id and the sha256 of its ids; andrea.data.manifest), so its presence means the
directory is complete, and training needs nothing else: not the corpus, not a scan of the ids.

Memory stays flat: every phase handles one block (<= ~2 MiB) per thread at a time, and the tokenizer
sees at most the sample. After each full training shard the work done so far is recorded in
`prepare-state.json`, so an interrupted preparation continues from its last finished shard (Ctrl-C
stops within a second in every phase, exit 130). What the directory holds, and what may be removed,
is andrea.data.datadir's. A complete directory is kept as it is, its split included (a fraction
left unset is the directory's, another one is refused): running again does nothing, whatever
happened to the corpus since (`force` re-encodes the corpus as it is now, with the
directory's tokenizer.json, which is always kept since checkpoints depend on it).
One process prepares a directory at a time (andrea.data.lock): another waits, then finds it complete.
`check_preparation` makes every check of a preparation without writing (`train --dry-run` calls it).

A refused run deletes nothing: every check (the directory is an andrea data directory or empty of
its file names; the tokenizer, vocabulary and corpus fit) comes before any file is removed.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.data import datadir, lock
from andrea.data.bpe_training import TOKENIZER_SAMPLE, train_tokenizer
from andrea.data.corpus import corpus_signature
from andrea.data.manifest import DATA_FORMAT, META_VERSION
from andrea.data.progress import Log
from andrea.data.request import STDLIB_VAL_FRACTION, VAL_FRACTION, check_val_fraction, default_val_fraction
from andrea.data.shards import STATE_FILE, Encoder, new_state
from andrea.data.sources import Plan, Source
from andrea.data.sources.opening import open_source
from andrea.data.sources.records import default_text_field
from andrea.data.tokenizer import DEFAULT_VOCAB_SIZE, Tokenizer, load_tokenizer
from andrea.errors import UserError
from andrea.files import write_json

__all__ = ["STDLIB_VAL_FRACTION", "VAL_FRACTION", "Preparation", "check_preparation", "prepare"]
SHARD_TOKENS = 100_000_000  # a training shard is closed at the first block end past this (~200 MB)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class Preparation:
    """What a preparation of `data_dir` will do, decided from the request and the directory as it is,
    before anything is written (`check_preparation`): `done`, the manifest, when the directory is
    complete and answers the request (nothing to do); else the corpus listed (`corpus`, the source)
    and planned (`planned`, its blocks and split), and what the directory holds that the writing
    replaces or continues."""

    data_dir: Path
    done: dict | None = None
    corpus: Source | None = None
    sizes: np.ndarray | None = None
    planned: Plan | None = None
    settings: dict | None = None
    given: object = None           # the tokenizer given, loaded
    source: object = None          # where it came from
    existing: Tokenizer | None = None
    meta: dict | None = None       # the complete manifest this one replaces (--force, other settings)
    state: dict | None = None      # the partial preparation this one continues or replaces
    vocab_size: int = DEFAULT_VOCAB_SIZE
    allow_smaller_vocab: bool = False
    tokenizer_sample: int = TOKENIZER_SAMPLE
    shard_tokens: int = SHARD_TOKENS


def prepare(inputs: list[str] | None, data_dir, vocab_size: int = DEFAULT_VOCAB_SIZE,
            val_fraction: float | None = None, progress: bool = True, allow_smaller_vocab: bool = False,
            force: bool = False, tokenizer=None, tokenizer_sample: int = TOKENIZER_SAMPLE,
            workers: int | None = None, shard_tokens: int = SHARD_TOKENS, text_field: str | None = None,
            skip_bad_records: bool = False) -> dict:
    """Prepare `data_dir` from `inputs` (None: the stdlib) and return the stats saved in meta.json.
    With `text_field`, the inputs are records (JSON Lines, Parquet) whose documents are that field's
    text; without it, inputs that are all `.jsonl`, `.ndjson` or `.parquet` are records of `text`.
    With `skip_bad_records`, a record that cannot be read is left out and counted instead of stopping.

    `tokenizer` (a tokenizer.json, or a directory holding one: andrea's or a Hugging Face
    byte-level BPE) is used instead of training one; `vocab_size` is then its size. The result
    has `"skipped": True` when the directory was already complete. The directory is held
    (andrea/data/lock.py) from before it is read until the manifest is written: another process
    preparing it waits.
    """
    t0 = time.perf_counter()
    data_dir = Path(data_dir)
    log = Log(progress)
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    with lock.writing(data_dir, log.line) as created:
        try:
            plan = check_preparation(inputs, data_dir, vocab_size, val_fraction, allow_smaller_vocab, force,
                                     tokenizer, tokenizer_sample, shard_tokens, log, text_field, skip_bad_records)
            if plan.done is not None:
                return {**plan.done, "skipped": True}
            return _write(plan, workers or default_workers(), t0, log)
        except BaseException:
            if created and data_dir.is_dir() and not any(data_dir.iterdir()):
                data_dir.rmdir()  # a refused or interrupted first preparation leaves nothing behind
            raise


def check_preparation(inputs: list[str] | None, data_dir, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      val_fraction: float | None = None, allow_smaller_vocab: bool = False, force: bool = False,
                      tokenizer=None, tokenizer_sample: int = TOKENIZER_SAMPLE, shard_tokens: int = SHARD_TOKENS,
                      log: Log | None = None, text_field: str | None = None,
                      skip_bad_records: bool = False) -> Preparation:
    """Every check of a preparation, reading only: the request, the directory's state and tokenizer,
    the corpus (listed and cut into blocks, each split holding text). A UserError on what would fail;
    the Preparation to write otherwise. `prepare` and `train --dry-run` both call this."""
    data_dir, log = Path(data_dir), log or Log(False)
    text_field = default_text_field(inputs, text_field)  # `text` for inputs of records given without one
    # the request: its numbers in range; a tokenizer given is loaded and sets the vocabulary
    fraction = _check_request(inputs, val_fraction, None, tokenizer_sample)
    given = load_tokenizer(tokenizer) if tokenizer is not None else None
    vocab_size = given.vocab_size if given is not None else vocab_size
    # the directory as it is: a complete preparation of the same request is kept; a fraction left
    # unset is the split the directory was made with, one given and different is refused there
    meta, state = datadir.our_files(data_dir)
    if val_fraction is None and meta is not None and isinstance(meta.get("val_fraction"), float):
        fraction = meta["val_fraction"]
    wanted = {"inputs": list(inputs) if inputs else None, "requested_vocab_size": vocab_size,
              "val_fraction": fraction, **({"text_field": text_field} if text_field is not None else {})}
    if meta is not None and datadir.up_to_date(data_dir, meta, wanted, given, force, allow_smaller_vocab):
        return Preparation(data_dir, done=meta)
    # the corpus listed, cut into blocks and split; the directory's tokenizer checked against the request
    corpus, sizes = _list_corpus(inputs, text_field, log)
    corpus.skip_bad_records = skip_bad_records
    existing = datadir.existing_tokenizer(data_dir, vocab_size, allow_smaller_vocab, given)
    planned = corpus.plan(sizes, fraction, log)
    planned.check()
    settings = {"signature": corpus_signature(corpus, sizes), **wanted, "shard_tokens": shard_tokens,
                "blocks": len(planned.blocks)}
    return Preparation(data_dir, None, corpus, sizes, planned, settings, given, tokenizer, existing, meta,
                       state, vocab_size, allow_smaller_vocab, tokenizer_sample, shard_tokens)


def _write(plan: Preparation, workers: int, t0: float, log: Log) -> dict:
    """The preparation `plan` describes, written into its directory (held by the caller)."""
    data_dir, planned, settings = plan.data_dir, plan.planned, plan.settings
    # every check is done: from here on only files of this data directory are replaced or removed
    resumable = datadir.claim(data_dir, plan.meta, plan.state, settings, plan.existing)
    # the tokenizer: the one given, the directory's, or one trained on a sample of the training blocks
    t1 = time.perf_counter()
    if plan.given is not None:
        tok, origin = _save_given(data_dir / "tokenizer.json", plan.given, plan.source, log)
    elif plan.existing is not None:
        tok, origin = plan.existing, "loaded"
        log.line(f"using the existing tokenizer {data_dir / 'tokenizer.json'} ({tok.vocab_size} ids)")
    else:
        tok = train_tokenizer(planned, plan.vocab_size, plan.allow_smaller_vocab, plan.tokenizer_sample, log)
        tok.save(data_dir / "tokenizer.json")
        origin = "trained"
    t2 = time.perf_counter()
    # the encoding, into shards, continued after the last finished shard of an interrupted run
    settings["tokenizer_fingerprint"] = tok.fingerprint()
    state = datadir.resumed(plan.state, len(planned.blocks), log) if resumable else new_state(settings, tok.vocab_size)
    counts = Encoder(tok, planned, data_dir, state, plan.shard_tokens, log).run(workers)
    t3 = time.perf_counter()
    # the manifest, written last: its presence says that the directory is complete
    seconds = {"tokenizer": round(t2 - t1, 2), "encode": round(t3 - t2, 2), "total": round(t3 - t0, 2)}
    meta = _manifest(plan.corpus, planned, settings, counts, tok, origin, seconds)
    write_json(data_dir / "meta.json", meta)
    (data_dir / STATE_FILE).unlink(missing_ok=True)  # after the manifest: a leftover beside it is ignored
    return {**meta, "skipped": False}


def _check_request(inputs: list[str] | None, val_fraction: float | None, workers: int | None,
                   tokenizer_sample: int) -> float:
    """Refuse numbers out of range; return the validation fraction, fraction for the corpus."""
    if val_fraction is None:
        val_fraction = default_val_fraction(inputs)
    check_val_fraction(val_fraction, "--val-fraction")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if tokenizer_sample < 1:
        raise UserError(f"--tokenizer-sample must be a positive number of bytes, got {tokenizer_sample}")
    return val_fraction


def _list_corpus(inputs: list[str] | None, text_field: str | None, log: Log) -> tuple[Source, np.ndarray]:
    """The source the request names and each of its files' size in bytes; a UserError when all are empty."""
    corpus = open_source(inputs, text_field, log.every(lambda n: f"listing the corpus: {n} files so far"))
    sizes = corpus.sizes()
    # the later lines count blocks (a file of up to 1 MiB is one; empty files have none), train and val apart
    empty = int((sizes == 0).sum())
    log.line(f"corpus: {len(corpus.files)} files ({empty} empty), {sizes.sum() / 1e6:.1f} MB; later lines count "
             "blocks (pieces of at most 1 MiB), training and validation apart")
    if not sizes.any():
        raise UserError(f"the corpus is empty: {len(corpus.files)} files, all of them empty")
    return corpus, sizes


def _manifest(corpus: Source, planned: Plan, settings: dict, counts: dict, tok: Tokenizer, origin: str,
              seconds: dict) -> dict:
    """meta.json: the corpus, the settings, the source's own account of its files or documents, the
    shards and counts the encoder made, the tokenizer."""
    source = planned.manifest(counts)
    counts = {k: v for k, v in counts.items() if k not in ("documents", "empty_documents")}
    return {
        "format": DATA_FORMAT,
        "meta_version": META_VERSION,
        "corpus": corpus.description,
        "root": str(corpus.root),
        **settings,
        **source,
        **counts,
        "vocab_size": tok.vocab_size,
        "tokenizer": origin,
        "tokenizer_fingerprint": tok.fingerprint(),
        "uniform_nats": math.log(tok.vocab_size),
        "seconds": seconds,
    }


def _save_given(path: Path, tok, source, log: Log):
    log.line(f"encoding with the tokenizer of {source} ({tok.vocab_size} ids)")
    tok.save(path)
    return tok, f"given: {source}"
