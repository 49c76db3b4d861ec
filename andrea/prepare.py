"""Turn a corpus into what training reads: a data directory of tokenizer.json, the token files in
shards and meta.json, its manifest.

    python -m andrea.prepare                                  # Python's stdlib -> data/stdlib
    python -m andrea.prepare --input 'books/**/*.txt'         # -> data/books
    python -m andrea.prepare --input a.txt notes/ --data-dir data/mine
    python -m andrea.prepare --input web.jsonl --text-field text   # one document a line -> data/web

The preparation itself, phase by phase, is andrea.data.preparation's `prepare`: list the source's
files (andrea.data.sources), cut them into blocks and choose the validation split, train the BPE
tokenizer on a sample (or use the directory's, or --tokenizer), encode every block on every core
into shards of ~100M tokens, write meta.json last. An interrupted preparation continues from its
last finished shard (Ctrl-C stops within a second in every phase, exit 130); a complete directory
is kept as it is (--force re-encodes the corpus with the directory's tokenizer.json); `--verify`
reads every shard against its checksum. A refused run deletes nothing.

Under `mpiexec`, `andrea.train` prepares on rank 0 while the other ranks wait; every rank then
opens the same shards from the manifest.
"""

from __future__ import annotations

import os
import signal


def _interrupted_at_start(signum, frame):
    """Ctrl-C before the command's shell (andrea/cli.py) is up, while the imports below run (a second
    or so on a busy machine): nothing is written yet, so the process ends at once, as the shell would."""
    os.write(2, b"interrupted\n")
    os._exit(130)


if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_at_start)  # main() gives Python's handler back

import argparse  # after the handler above, on purpose
import re
from pathlib import Path

from andrea.cli import ArgumentParser, run_cli
from andrea.data.bpe_training import TOKENIZER_SAMPLE
from andrea.data.datadir import check_intact
from andrea.data.manifest import read_data_meta, verify_shards
from andrea.data.preparation import prepare
from andrea.data.request import MAX_VAL_FRACTION, STDLIB_VAL_FRACTION, VAL_FRACTION, default_data_dir
from andrea.data.tokenizer import DEFAULT_VOCAB_SIZE
from andrea.errors import UserError
from andrea.run.paths import check_directory


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m andrea.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input",
        dest="inputs",
        nargs="+",
        action="extend",
        metavar="PATH_OR_GLOB",
        help="files, directories or glob patterns of UTF-8 text (default: Python's stdlib); with --text-field, "
        "JSON Lines or Parquet files (a directory or glob takes its .jsonl, .ndjson and .parquet files)",
    )
    p.add_argument("--text-field", metavar="NAME",
                   help="read the inputs as records, one document each (a JSON Lines line, a Parquet row): its "
                        "text is this field's string (default: text when every input is a .jsonl, .ndjson or "
                        ".parquet file or glob, else the inputs are text files)")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="records only: leave out a JSON Lines line that cannot be read (not JSON, no text field, not "
                        "a string), counted and the first named, instead of stopping at it")
    p.add_argument("--data-dir", type=Path, help="where to write (default: data/stdlib, or data/<input name>)")
    p.add_argument("--force", action="store_true", help="re-encode even if the directory is up to date")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="token ids, EOT included (8449)")
    p.add_argument(
        "--tokenizer",
        metavar="DIR_OR_JSON",
        help="encode with this tokenizer instead of training one: a tokenizer.json (andrea's, or a Hugging "
        "Face byte-level BPE such as GPT-2's) or a directory holding one; its ids must fit uint16",
    )
    p.add_argument("--val-fraction", type=float,
                   help=f"share of the corpus held out for validation, below {MAX_VAL_FRACTION:g}: blocks chosen by a "
                        f"hash of their file's path (the stdlib's files stay whole), or one file's tail; with "
                        f"--text-field, documents chosen by a hash of their file and line ({STDLIB_VAL_FRACTION} for "
                        f"the stdlib, else {VAL_FRACTION}); a prepared directory keeps its own unless --force is given")
    p.add_argument(
        "--allow-smaller-vocab",
        action="store_true",
        help="keep fewer ids when the corpus is too small to reach --vocab-size",
    )
    p.add_argument("--tokenizer-sample", type=byte_count, default=TOKENIZER_SAMPLE, metavar="SIZE",
                   help="train the tokenizer on at most this much of the training text, spread over the corpus "
                   "(default 100MB; accepts 500MB, 2GB, or bytes)")
    p.add_argument("--workers", type=int, help="encoding threads (default: every core this process may use)")
    p.add_argument("--verify", action="store_true",
                   help="read every shard of --data-dir and check it against the checksums in meta.json; "
                        "writes nothing")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def byte_count(text: str) -> int:
    """'100MB' -> 100_000_000 (kB, MB, GB, TB in powers of 1000; a plain number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 100MB, 1GB or 5000000")
    return int(float(m.group(1)) * 1000 ** " kmgt".index(m.group(2).lower() or " "))


def verify(data_dir) -> str:
    """`prepare --verify`: every shard of a complete `data_dir` read and checked against its manifest
    (size, header, the ids' sha256 and largest id); a UserError naming each shard that differs."""
    data_dir = Path(data_dir)
    meta = read_data_meta(data_dir)
    if meta is None:
        raise UserError(f"{data_dir} holds no complete prepared data (meta.json) to verify: "
                        "run python -m andrea.prepare")
    check_intact(data_dir, meta)
    checked, tokens, problems = verify_shards(data_dir, meta, meta["tokenizer_fingerprint"])
    if problems:
        raise UserError(f"{len(problems)} shard(s) of {data_dir} changed since they were written: "
                        f"{'; '.join(problems)}; prepare it again with --force")
    shards = sum(len(meta["shards"][s]) for s in ("train", "val"))
    if checked < shards:
        return (f"{data_dir}: {shards} shards, {tokens:,} tokens; sizes and headers match meta.json, but "
                f"{shards - checked} shards have no checksum (prepared before checksums were recorded): "
                "prepare --force records them")
    return f"{data_dir}: {shards} shards, {tokens:,} tokens: every checksum matches meta.json"


def format_summary(stats: dict, data_dir: Path) -> str:
    if "documents" in stats:  # a records source: documents, each on one side of the split
        docs = stats["documents"]
        files = (f"{docs['train'] + docs['val']:,} documents ({docs['train']:,} train, {docs['val']:,} val; "
                 f"{stats['empty_documents']:,} empty) in {stats['files']} files ({stats['not_utf8_files']} not UTF-8, "
                 "bad bytes read as U+FFFD)")
    else:
        files = (
            f"{stats['files']} ({stats['train_files']} train, {stats['val_files']} val; {stats['not_utf8_files']} "
            f"not UTF-8, bad bytes read as U+FFFD; {stats['empty_files']} empty)"
        )
    if stats.get("skipped_records"):
        files += f"; {stats['skipped_records']:,} records left out (the first: {stats['first_skipped_record']})"
    if stats.get("not_utf8_lines"):
        n = stats["not_utf8_lines"]
        files += f"; {n:,} line{'s' if n > 1 else ''} not UTF-8 (the first: {stats['first_not_utf8_line']})"
    left_out = stats.get("left_out_generated") or {}
    if left_out.get("files"):
        files += f"; {left_out['files']} generated tables ({left_out['bytes'] / 1e6:.1f} MB) left out"
    vocab = f"{stats['vocab_size']} ids ({stats['tokenizer']}, fingerprint {stats['tokenizer_fingerprint'][:12]})"
    unigram = f"{stats['unigram_val_nats']:.2f} nats/token on val (uniform: {stats['uniform_nats']:.2f})"
    if stats.get("skipped"):
        took = "nothing to do: already prepared (--force re-encodes the corpus as it is now)"
    else:
        s = stats["seconds"]
        took = f"{s['total']:.1f} s (tokenizer {s['tokenizer']:.1f} s, encoding {s['encode']:.1f} s)"
    rows = [
        ("corpus", stats["corpus"]),
        ("documents" if "documents" in stats else "files", files),
        ("size", f"{stats['bytes'] / 1e6:.1f} MB"),
        ("tokens", f"{stats['train_tokens']:,} train, {stats['val_tokens']:,} val"),
        ("vocab", vocab),
        ("bytes/token", f"{stats['bytes_per_token']:.2f}"),
        ("unigram", unigram),
        ("time", took),
        ("shards", f"{len(stats['shards']['train'])} train, {len(stats['shards']['val'])} val"
                   if "shards" in stats else "train.bin, val.bin"),
        ("data dir", str(data_dir)),
    ]
    return "\n".join(f"{name:<12}{value}" for name, value in rows)


MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, held fixed by the prepare command


def fixed_mmap_threshold() -> dict:
    """The prepare command's malloc setting: glibc's mmap threshold held at 128 KiB. Left dynamic,
    glibc raises it to the size of the largest buffer freed so far, so every later block's buffers
    (its bytes, its text, its ids: each the size of a block, which grows with the corpus up to 1 MiB,
    see stream.block_size) come from the threads' arenas, which keep what is freed, and the peak
    memory grows with the corpus (BENCHMARKS.md, "Peak memory against the corpus size").
    Not when the user set the threshold (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES) or off glibc;
    `train` keeps its own setting (minitensor/memory.py). Returns what it set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return {}
    try:
        import ctypes
        import ctypes.util

        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return {"mmap_threshold": MMAP_THRESHOLD} if mallopt(-3, MMAP_THRESHOLD) == 1 else {}  # -3: M_MMAP_THRESHOLD


def main(argv: list[str]) -> int:
    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the shell is up: Ctrl-C unwinds from here
    fixed_mmap_threshold()
    args = _parser().parse_args(argv)
    data_dir = args.data_dir or default_data_dir(args.inputs)
    if args.verify:
        print(verify(data_dir))
        return 0
    check_directory(data_dir, "--data-dir", writable=not data_dir.is_dir())  # else checked if it is written
    stats = prepare(
        args.inputs,
        data_dir,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        allow_smaller_vocab=args.allow_smaller_vocab,
        force=args.force,
        tokenizer=args.tokenizer,
        tokenizer_sample=args.tokenizer_sample,
        workers=args.workers,
        text_field=args.text_field,
        skip_bad_records=args.skip_bad_records,
    )
    print(format_summary(stats, data_dir))
    return 0


if __name__ == "__main__":
    run_cli(main)

