"""Training the BPE tokenizer on a sample of the corpus's training text (andrea.data.tokenizer holds
the tokenizer itself).

The sample is at most `--tokenizer-sample` bytes (100 MB: why not less, BENCHMARKS.md, "Data
preparation"), blocks taken by a hash of (path, index) so it spreads over the whole corpus; of each,
the training parts (a source's validation documents are never seen by the tokenizer). The
trainer runs in a helper thread, so the main thread answers Ctrl-C at once and reports progress,
and is fed the blocks in pieces (`trainer_pieces`) that keep its working memory small without
changing the words it counts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

from andrea.data import stream
from andrea.data.progress import PROGRESS_SECONDS, Log
from andrea.data.tokenizer import Tokenizer
from andrea.errors import UserError

TOKENIZER_SAMPLE = 100_000_000  # bytes of training text the tokenizer is trained on, at most (BENCHMARKS.md, data)

# The trainer is fed pieces of at most ~64 KiB: `tokenizers` holds a batch of 256 texts at a time, and
# its pre-tokenizer's working memory grows with the text in hand (offsets for every byte, a string per
# word): the 1 GB corpus's sample with its indented 1 MiB blocks left whole peaked higher than in
# pieces (BENCHMARKS.md, "Data preparation").
# A piece ends only where GPT-2's regex ends a word whatever comes next (the regex looks forward only),
# so the words counted, hence the tokenizer, are those of the whole block: after a newline between two
# non-space characters, or between two ASCII non-space characters of different kinds (letter, digit,
# punctuation: "x(", "1a", ".b"), except after an apostrophe ("'s" is one word). The second kind is
# what cuts indented text (code, JSON), where no line starts with a non-space character.
TRAINER_PIECE = 1 << 16
_LETTER, _DIGIT, _PUNCT = "A-Za-z", "0-9", r"!-/:-@\[-`{-~"
_PUNCT_BUT_APOSTROPHE = r"!-&(-/:-@\[-`{-~"
PIECE_CUT = re.compile(
    r"(?<=\S\n)(?=\S)"
    rf"|(?<=[{_LETTER}])(?=[{_DIGIT}{_PUNCT}])"
    rf"|(?<=[{_DIGIT}])(?=[{_LETTER}{_PUNCT}])"
    rf"|(?<=[{_PUNCT_BUT_APOSTROPHE}])(?=[{_LETTER}{_DIGIT}])"
)


def _sample_blocks(files, blocks: stream.Blocks, sample: int) -> list[int]:
    """The training blocks the tokenizer learns from, in corpus order: all of them when they hold
    at most `sample` bytes, else blocks taken in the order of a hash of (path, index) until they do,
    which spreads the sample over the whole corpus."""
    train = np.flatnonzero(~blocks.val)
    nbytes = blocks.nominal_end - blocks.nominal_start
    if nbytes[train].sum() <= sample:
        return train.tolist()
    keys = np.array([stream.split_key(f"{files.relative(int(blocks.file[j]))}#tokenizer#{int(blocks.index[j])}")
                     for j in train])
    by_key = train[np.argsort(keys, kind="stable")]
    before = np.cumsum(nbytes[by_key]) - nbytes[by_key]  # bytes chosen before each block
    return sorted(by_key[before < sample].tolist())


def train_tokenizer(plan, vocab_size, allow_smaller, sample, log: Log) -> Tokenizer:
    """Train on the sample of the planned corpus `plan` (a source's, andrea.data.sources) in a helper
    thread, so that the main thread answers Ctrl-C at once (the `tokenizers` trainer does not return
    to Python while it counts or merges) and reports progress."""
    blocks, files = plan.blocks, plan.source.files
    chosen = _sample_blocks(files, blocks, sample)
    total = int((blocks.nominal_end[chosen] - blocks.nominal_start[chosen]).sum())
    log.line(f"training a {vocab_size}-id BPE tokenizer on {len(chosen)} blocks of the training files "
             f"({total / 1e6:.1f} MB)...")
    bar = log.progress("tokenizer: reading", len(chosen), total, unit="blocks")
    stop, read_all = threading.Event(), threading.Event()
    seen = {"bytes": 0, "bad": 0, "bad_lines": 0, "first_bad": None}
    result = {}

    def texts():
        for i, j in enumerate(chosen):
            if stop.is_set():
                return
            block = plan.read(j)
            n = block.n_bytes
            seen["bytes"] += n
            if block.bad_lines:  # counted line by line: one bad line is that line, not its block
                seen["bad"] += block.bad_bytes
                seen["bad_lines"] += block.bad_lines
                seen["first_bad"] = seen["first_bad"] or block.first_bad
                if seen["bytes"] >= (1 << 20) and 2 * seen["bad"] > seen["bytes"]:
                    return  # mostly not text: stop reading, refused below
            bar.update(i + 1, n)
            yield from _training_pieces(block)
        read_all.set()

    def train():
        try:
            result["tok"] = Tokenizer.train(texts(), vocab_size, allow_smaller=True)
        except BaseException as e:  # handed to the main thread
            result["error"] = e

    worker = threading.Thread(target=train, name="andrea-tokenizer", daemon=True)
    announced, last = False, time.perf_counter()
    try:
        worker.start()  # inside: a Ctrl-C while it starts finds the thread running
        while worker.is_alive():
            worker.join(0.25)
            if read_all.is_set() and not announced:
                bar.done()
                log.line(f"tokenizer: computing {vocab_size - 257} merges...")
                announced, last = True, time.perf_counter()
            elif announced and time.perf_counter() - last >= PROGRESS_SECONDS:
                last = time.perf_counter()
                log.line(f"tokenizer: still computing merges ({last - bar.start:.0f} s since reading began)")
    except BaseException as e:
        stop.set()  # the reading ends at the next block; the thread dies with the process
        _exit_before_finalizing(130 if isinstance(e, KeyboardInterrupt) else e.code if isinstance(e, SystemExit)
                                and isinstance(e.code, int) else 1)
        raise
    return _trained(result, seen, blocks, vocab_size, allow_smaller, total, sample, log)


def _trained(result: dict, seen: dict, blocks, vocab_size: int, allow_smaller: bool, total: int, sample: int,
             log: Log) -> Tokenizer:
    """The tokenizer the trainer's thread made, or what went wrong: text that is not UTF-8, the
    trainer's error, or fewer ids than asked for (the sample's fault, or the corpus's)."""
    if seen["bytes"] and 2 * seen["bad"] > seen["bytes"]:
        raise UserError(f"the corpus does not look like text: {seen['bad_lines']:,} lines of {byte_size(seen['bad'])}, "
                        f"most of the {byte_size(seen['bytes'])} read, are not UTF-8 (the first: {seen['first_bad']}): "
                        "give text files, or convert them to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    if "error" in result:
        raise result["error"]
    tok = result["tok"]
    if tok.vocab_size < vocab_size and not allow_smaller:
        train_bytes = int((blocks.nominal_end - blocks.nominal_start)[~blocks.val].sum())
        raise UserError(_too_few_ids(tok.vocab_size, vocab_size, total, train_bytes, sample))
    if tok.vocab_size < vocab_size:
        log.line(f"note: the corpus is too small for {vocab_size} ids; the tokenizer has {tok.vocab_size}")
    return tok


def byte_size(n: int) -> str:
    """`n` bytes for a message: 312 bytes, 38.1 kB, 2.5 MB."""
    return f"{n} bytes" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1_000_000 else f"{n / 1e6:.1f} MB"


def _too_few_ids(found: int, wanted: int, read: int, train_bytes: int, sample: int) -> str:
    """What to change when the tokenizer reached `found` of `wanted` ids on `read` bytes of the
    corpus's `train_bytes` of training text: the sample when it left text out, else the corpus."""
    ran_out = f"BPE ran out of pairs after {found - 257} merges ({found} of {wanted} ids)"
    if read < train_bytes:
        return (f"the tokenizer sample is too small for {wanted} token ids: {ran_out} on the {read / 1e6:.2f} MB that "
                f"--tokenizer-sample {sample} took of the corpus's {train_bytes / 1e6:.1f} MB of training text; about "
                f"1 MB is needed: raise --tokenizer-sample (default {TOKENIZER_SAMPLE // 1_000_000}MB), or keep "
                "fewer ids with --allow-smaller-vocab")
    return (f"the corpus is too small for {wanted} token ids: {ran_out}; about 1 MB of text is needed "
            "(python -m andrea.prepare --allow-smaller-vocab keeps fewer ids)")


def _exit_before_finalizing(code: int) -> None:
    """In a process that is one of andrea's commands (whose shell turns the interruption into its
    exit code), end it with `code` once it has unwound (every file closed or removed, the shell's
    line printed) but before the interpreter finalizes: the tokenizers trainer's threads (Rust:
    the trainer's own and rayon's, which call back for text) would meet a finalizing interpreter,
    which aborts the process ('FATAL: exception not rethrown', SIGABRT), seen even after the
    trainer's thread had returned. A library caller's process is left alone (it may go on)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # None unless started with python -m
    if spec is None or not spec.name.startswith("andrea."):
        return

    def exit_now() -> None:
        for stream_ in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream_.flush()
        os._exit(code)

    atexit.register(exit_now)


def _training_pieces(block) -> Iterator[str]:
    """The trainer's pieces of the training documents of a block read (andrea.data.sources.BlockText)."""
    for part in block.parts:
        if not part.val:
            for text in part.texts:
                yield from trainer_pieces(text)


def trainer_pieces(text: str, limit: int = TRAINER_PIECE) -> Iterator[str]:
    """`text` in pieces of about `limit` characters, cut only at PIECE_CUT (a text with no such
    place past `limit` stays whole); nothing for an empty text. Joined, the pieces are `text`."""
    start = 0
    while len(text) - start > limit:
        cut = PIECE_CUT.search(text, start + limit)
        if cut is None:
            break
        yield text[start:cut.start()]
        start = cut.start()
    if start < len(text):
        yield text[start:]
