"""Loss of any model on any text (nats per token, bits per byte), and multiple-choice benchmarks:
`python -m andrea.eval MODEL (--data-dir DIR | --input FILES | --task NAME --data PATH)`.

    python -m andrea.eval out/andrea-tiny --data-dir data/stdlib          # its validation split
    python -m andrea.eval export/gpt2 --input notes/*.md                   # text, encoded here
    python -m andrea.eval out/andrea-tiny --task hellaswag --data hellaswag_val.jsonl
    python -m andrea.eval out/andrea-tiny --task core --data eval_bundle    # DCLM's CORE

--task scores a multiple-choice benchmark from the user's files (andrea.tasks says how): HellaSwag's
JSON Lines (acc, acc_norm and acc_token, each with a 95% interval) or DCLM's CORE bundle (each
task's accuracy and centred accuracy, and CORE); --max-items keeps the first N items (of each
task, after CORE's shuffle).

MODEL is a training run directory (its newest good checkpoint), one of its ckpt-* directories, or
a Hugging Face GPT-2 directory (andrea's export or transformers' save_pretrained, with the
tokenizer.json it was trained with beside the weights). --data-dir reads a split of a prepared
data directory (--split, default val): data encoded with the model's own tokenizer is used as it
is, any other is decoded back to its documents' text (decoding is exact) and encoded with the
model's tokenizer, so two models with different tokenizers see the same text. --input reads
files, directories or globs of UTF-8 text, each file a document followed by EOT, as prepare does.

Every token of the text is evaluated once: the token stream is cut into consecutive windows of
--seq-len tokens (default: the run's train.seq_len, else the model's context), each token predicted
from the ones before it in its window; the first token of the stream is never a target. Nats are
summed over all targets; bits per byte = that sum / (ln 2 x the targets' bytes of text), each
token counting the bytes it stands for (EOT none): the byte count is exactly the evaluated
tokens', and over a whole split it is the split's UTF-8 size less its first token's bytes. With
--max-tokens only the first N tokens are read, and both figures are of them alone.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from andrea import tasks as benchmarks
from andrea.cli import ArgumentParser, run_cli
from andrea.config import make_config
from andrea.data.inputs import resolve_inputs
from andrea.data.manifest import open_split, read_data_meta
from andrea.data.stream import decode
from andrea.data.tokenizer import load_tokenizer
from andrea.errors import UserError
from andrea.interop import hf
from andrea.model.transformer import ANDREA
from andrea.run import preflight
from andrea.sample import load_model
from minitensor.device import GPUUnavailable

HF_WEIGHTS = (hf.WEIGHTS, hf.WEIGHTS_INDEX, "pytorch_model.bin")  # from_pretrained refuses the pickle by name
LOGIT_FLOATS = 1 << 26  # a batch's logits at most (256 MiB of float32): the batch size's default bound


class Loaded(NamedTuple):
    model: ANDREA
    tokenizer: object
    source: str       # what the weights are, for the first line printed
    seq_len: int      # the window the model was trained on


def load_any(path, device="cpu") -> Loaded:
    """A model and its tokenizer from a run directory, a ckpt-* directory or a GPT-2 directory."""
    path = Path(path)
    if path.is_dir() and any((path / name).exists() for name in HF_WEIGHTS):
        try:
            model = ANDREA.from_pretrained(path, device=device)
        except GPUUnavailable as e:
            raise UserError(str(e)) from e
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{path} has no tokenizer.json: save the model's tokenizer beside its weights "
                            "(tokenizer.save_pretrained) so that text can be encoded as it was in training")
        tokenizer = load_tokenizer(path)
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise UserError(f"{path / 'tokenizer.json'} has {tokenizer.vocab_size} ids, more than the model's "
                            f"{model.cfg.vocab_size}: it is not this model's tokenizer")
        return Loaded(model, tokenizer, f"{path} (Hugging Face GPT-2)", model.cfg.context_length)
    model, tokenizer, meta = load_model(path, device)
    seq_len = make_config(meta["config"]).train.sequence_length(model.cfg)
    return Loaded(model, tokenizer, f"{meta['checkpoint']} (step {meta.get('step', '?')})", seq_len)


# ----------------------------------------------------------------------------- the text as tokens


def data_tokens(data_dir, split: str, tokenizer) -> tuple[np.ndarray, str]:
    """The split's ids in `tokenizer`'s ids, and a line saying what they are."""
    data_dir = Path(data_dir)
    meta = read_data_meta(data_dir)
    if meta is None:
        raise UserError(f"{data_dir} holds no complete prepared data (meta.json): give a directory written by "
                        "python -m andrea.prepare, or the text itself with --input")
    own = load_tokenizer(data_dir / "tokenizer.json")
    shards = open_split(data_dir, split, own.vocab_size, own.fingerprint())
    ids = shards.windows(np.array([0]), len(shards))[0] if len(shards) else np.zeros(0, np.int64)
    what = f"the {split} split of {data_dir}"
    if own.fingerprint() == tokenizer.fingerprint():
        return ids.astype(np.int64), what
    # another tokenizer's ids: the documents' text back (EOT separates them), encoded with the model's
    ends = np.flatnonzero(ids == own.eot_id)
    starts = np.concatenate([[0], ends + 1])
    stops = np.concatenate([ends, [len(ids)]])
    texts = [own.decode(ids[a:b]) for a, b in zip(starts, stops) if b > a]
    return encode_documents(texts, tokenizer), f"{what}, re-encoded from its own tokenizer with the model's"


def input_tokens(specs, tokenizer) -> tuple[np.ndarray, str]:
    """Files, directories or globs of text as the model's ids, each file a document ended by EOT."""
    paths = resolve_inputs(specs)
    texts = []
    for p in paths:
        try:
            texts.append(decode(p.read_bytes())[0])
        except OSError as e:
            raise UserError(f"cannot read {p}: {e.strerror or e}") from None
    return encode_documents(texts, tokenizer), f"{len(paths)} file{'s' if len(paths) != 1 else ''} of --input"


def encode_documents(texts, tokenizer) -> np.ndarray:
    eot = [tokenizer.eot_id]
    return np.array([i for ids in tokenizer.encode_batch(texts) for i in ids + eot], dtype=np.int64)


# ----------------------------------------------------------------------------- evaluation


class Result(NamedTuple):
    nats: float        # summed over the targets
    targets: int
    text_bytes: int    # the targets' bytes of text
    windows: int

    @property
    def loss(self) -> float:
        return self.nats / self.targets

    @property
    def bpb(self) -> float:
        return self.nats / (math.log(2) * self.text_bytes) if self.text_bytes else math.nan


def check_length(ids) -> None:
    if len(ids) < 2:
        raise UserError(f"the text is {len(ids)} token(s): at least 2 are needed to predict one")


def evaluate(model, tokenizer, ids, seq_len: int, batch_size: int) -> Result:
    """Every token of `ids` but the first as a target once, in consecutive windows of seq_len."""
    check_length(ids)
    lengths = tokenizer.text_bytes()
    starts = list(range(0, len(ids) - 1, seq_len))
    nats, targets, text_bytes = 0.0, 0, 0
    full = [s for s in starts if s + seq_len < len(ids)]
    batches = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [[s] for s in starts if s + seq_len >= len(ids)]  # the last, shorter window alone
    for batch in batches:
        T = min(seq_len, len(ids) - 1 - batch[0])
        x = np.stack([ids[s:s + T] for s in batch])
        y = np.stack([ids[s + 1:s + T + 1] for s in batch])
        nats += float(model.loss(x, y)) * y.size  # the mean over the batch's targets, as training's
        targets, text_bytes = targets + y.size, text_bytes + int(lengths[y].sum())
    return Result(nats, targets, text_bytes, len(starts))


def _check_args(args, ap):
    if sum(v is not None for v in (args.data_dir, args.input, args.task)) != 1:
        ap.error("give exactly one of --data-dir DIR and --input FILES (or --task NAME --data PATH)")
    if (args.task is None) != (args.data is None):
        ap.error("--task and --data go together: --task hellaswag --data FILE.jsonl, --task core --data DIR")
    for flag, value in (("--seq-len", args.seq_len), ("--batch-size", args.batch_size),
                        ("--max-tokens", args.max_tokens), ("--max-items", args.max_items)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be a positive whole number, got {value}")
    preflight.choose_device(args.device)  # an unknown name fails here, before the model is read


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.eval", description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL", help="a run directory, a ckpt-* directory or a GPT-2 directory")
    ap.add_argument("--data-dir", help="a prepared data directory (python -m andrea.prepare)")
    ap.add_argument("--split", choices=("val", "train"), default="val", help="its split to evaluate (val)")
    ap.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB", help="files, directories or globs of text")
    ap.add_argument("--seq-len", type=int, help="tokens per window (default: the run's, else the context)")
    ap.add_argument("--batch-size", type=int, help="windows per forward (default: as many as fit 256 MiB of logits)")
    ap.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    ap.add_argument("--task", choices=("hellaswag", "core"), help="a multiple-choice benchmark read from --data")
    ap.add_argument("--data", help="the benchmark's file (hellaswag: JSON Lines) or directory (core: the bundle)")
    ap.add_argument("--max-items", type=int, help="score only the first N items (of each CORE task, after its shuffle)")
    ap.add_argument("--device", help="cpu, gpu or auto (default: $ANDREA_DEVICE, else cpu)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    _check_args(args, ap)
    model, tokenizer, source, seq_len = load_any(args.model, preflight.choose_device(args.device, fallback="cpu"))
    if args.seq_len is not None and args.seq_len > model.cfg.context_length:
        raise UserError(f"--seq-len {args.seq_len} exceeds the model's context length {model.cfg.context_length}")
    if args.task is not None:
        return run_task(args, model, tokenizer, source)
    seq_len = args.seq_len or seq_len
    batch_size = args.batch_size or max(1, min(64, LOGIT_FLOATS // (seq_len * model.cfg.vocab_size)))
    if args.data_dir is not None:
        ids, what = data_tokens(args.data_dir, args.split, tokenizer)
    else:
        ids, what = input_tokens(args.input, tokenizer)
    if args.max_tokens is not None and args.max_tokens < len(ids):
        ids, what = ids[:args.max_tokens], f"the first {args.max_tokens:,} tokens of {what}"
    check_length(ids)
    print(f"model  {source}: {model.num_parameters():,} parameters", file=sys.stderr)
    print(f"text   {what}: {len(ids):,} tokens", file=sys.stderr, flush=True)
    r = evaluate(model, tokenizer, ids, seq_len, batch_size)
    print(f"loss {r.loss:.4f} nats/token | {r.bpb:.4f} bits/byte | {r.targets:,} tokens predicted "
          f"({r.text_bytes:,} bytes of text) in {r.windows:,} windows of up to {seq_len}")
    return 0


def run_task(args, model, tokenizer, source) -> int:
    """--task: the benchmark's items read (every error before any scoring), then scored."""
    if args.task == "hellaswag":
        items = benchmarks.hellaswag_items(args.data, tokenizer, args.max_items)
        what = f"{len(items):,} HellaSwag items of {args.data}"
    else:
        found = benchmarks.core_tasks(args.data, tokenizer, args.max_items)
        what = f"{len(found)} CORE tasks of {args.data}, {sum(len(t.items) for t in found):,} items"
    print(f"model  {source}: {model.num_parameters():,} parameters", file=sys.stderr)
    print(f"data   {what}", file=sys.stderr, flush=True)
    scorer = benchmarks.Scorer(model, tokenizer)
    if args.task == "hellaswag":
        benchmarks.report_hellaswag(scorer, items, sys.stdout, sys.stderr)
    else:
        benchmarks.report_core(scorer, found, sys.stdout, sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
