"""Text generation from a trained ANDREA, streamed token by token with a key/value cache.

    python -m andrea.sample --checkpoint out/andrea-tiny --prompt "def " --max-new-tokens 200

--checkpoint takes a run directory (its newest good checkpoint is used) or one ckpt-* directory.
The prompt is encoded, run through the model once (prefill), and every new token then costs one
position of attention over the cached keys and values. When the sequence reaches the context
length, the cache is rebuilt from the last half of the context (positions are absolute, so the
cached keys cannot simply slide), which keeps the amortised cost near one position per token.
`Decoder` is that cache for one sequence; andrea.serve steps it too, so that a served completion
and this command give the same tokens for the same seed and settings.
"""

import os

if __name__ == "__main__":  # before NumPy loads OpenBLAS: its threads sleep after each GEMM (BENCHMARKS.md)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import math  # after the setting above, on purpose
import sys
from pathlib import Path

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.config import make_config
from andrea.data.tokenizer import load_tokenizer
from andrea.errors import UserError
from andrea.model.transformer import ANDREA
from andrea.run import preflight
from andrea.run.checkpoint import latest_checkpoint, load_checkpoint
from minitensor.backends.softmax import exp_rows
from minitensor.device import GPUUnavailable, to_numpy
from minitensor.memory import keep_freed_memory


def sample_next(logits, rng, temperature=1.0, top_k=None, top_p=1.0):
    """One id per row of logits (B, V): greedy at temperature 0, else softmax(logits / T) over the top k,
    and of those the fewest most likely whose probabilities add up to top_p (nucleus sampling).

    Any positive temperature is safe, down to the smallest double (5e-324): the largest logit comes off
    before the division, so every scaled logit is <= 0 (an overflow is -inf, probability 0) and the
    largest is exactly 0. A tiny T leaves only the ids within ~745 T of the largest: greedy, but that
    ids tied for the largest are drawn among rather than the lowest taken."""
    logits = np.asarray(to_numpy(logits), dtype=np.float64)
    if temperature <= 0:
        return logits.argmax(axis=-1)
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        z /= temperature
    total, _ = exp_rows(z)                              # z <- exp(z - max) = exp(z), in place
    probs = z / total
    if top_p < 1.0:
        probs = nucleus(probs, top_p)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])


def nucleus(probs, top_p):
    """probs (B, V) kept on each row's most likely ids, down to the first whose running total reaches
    top_p (so always at least one), and renormalised. Ids of equal probability rank by id, the lower
    first: a cut among tied ids keeps the lower ones, and an id whose predecessors' total is exactly
    top_p is not kept (the total was reached before it)."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked        # the mass of the ids ranked above each
    keep = np.empty(probs.shape, dtype=bool)
    np.put_along_axis(keep, order, before < top_p, axis=-1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(axis=-1, keepdims=True)


class Decoder:
    """One sequence's key/value cache: `logits` (1, V) scores the token after the ids so far, and
    push(id) appends one. The prompt (a list of ids, at least one) runs through the model at once."""

    def __init__(self, model, prompt_ids):
        if not len(prompt_ids):
            raise UserError("the prompt encodes to no tokens: give at least one character")
        self.model, self.ids = model, list(prompt_ids)
        self._prefill(self.ids[-model.cfg.context_length:])

    def _prefill(self, window):
        self.cache = self.model.new_kv_cache(1)
        self.logits = self.model.forward_kv(np.array([window]), self.cache, 0)
        self.pos = len(window)

    def push(self, token_id):
        self.ids.append(token_id)
        ctx = self.model.cfg.context_length
        if self.pos == ctx:  # full: rebuild the cache from the last half of the context
            self._prefill(self.ids[-(ctx // 2 or 1):])
        else:
            self.logits = self.model.forward_kv(np.array([[token_id]]), self.cache, self.pos)
            self.pos += 1


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, seed=0, n_ids=None, top_p=1.0):
    """Yields new token ids one at a time after the prompt (a list of ids, at least one), each below
    `n_ids` (the tokenizer's size; default the model's: a padded vocabulary's extra ids decode to nothing)."""
    sequence = Decoder(model, prompt_ids)
    rng = np.random.default_rng(seed)
    for _ in range(max_new_tokens):
        nxt = int(sample_next(sequence.logits[:, :n_ids], rng, temperature, top_k, top_p)[0])
        yield nxt
        sequence.push(nxt)


def load_model(checkpoint, device="cpu"):
    """(model, tokenizer, meta) from a run directory (its newest good checkpoint) or a ckpt-*
    directory; meta["checkpoint"] is the directory the weights came from."""
    path = Path(checkpoint)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise UserError(f"--checkpoint {path} is a file: give a run directory or one of its ckpt-* directories")
    if path.name.startswith("ckpt-") or (path / "meta.json").exists():
        tensors, meta = load_checkpoint(path)
        run_dir = path.parent
    else:
        path, tensors, meta = latest_checkpoint(path)
        run_dir = path.parent
    if not isinstance(meta.get("config"), dict):
        raise UserError(f"{path} holds no model config in its meta.json: it was not written by andrea.train")
    cfg = make_config(meta["config"], source=f"{path}/meta.json")
    tok_path = run_dir / "tokenizer.json"
    tokenizer = load_tokenizer(tok_path)
    if tokenizer.fingerprint() != meta.get("tokenizer_fingerprint"):
        raise UserError(f"{tok_path} is not the tokenizer this checkpoint was trained with")
    try:
        model = ANDREA(cfg.model, device=device, dtype=cfg.train.dtype)
    except GPUUnavailable as e:
        raise UserError(str(e)) from e
    model.load_state_dict({k: v for k, v in tensors.items() if k.startswith("transformer.")})
    return model, tokenizer, dict(meta, checkpoint=str(path))


def stream(model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed, out=None, top_p=1.0):
    """Writes the prompt and then each new piece of text, as soon as it is complete UTF-8, to `out`
    (default: sys.stdout as it is at the call, so a redirection made after import is followed)."""
    out = sys.stdout if out is None else out
    ids = tokenizer.encode(prompt)
    ctx = model.cfg.context_length
    if len(ids) > ctx:
        print(f"note: the prompt is {len(ids)} tokens; only its last {ctx} (the context length) are used",
              file=sys.stderr)
    out.write(prompt)
    out.flush()
    decoder = tokenizer.stream_decoder()
    for nxt in generate(model, ids, max_new_tokens, temperature, top_k, seed, n_ids=tokenizer.vocab_size, top_p=top_p):
        piece = decoder.feed(nxt)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.flush() + "\n")
    out.flush()


def _check_args(args):
    """Every flag's domain, before a model is loaded (each message names the flag)."""
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (1: no limit), got {args.top_p}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in [0, 2^63), got {args.seed}")
    if not args.prompt:
        raise UserError("--prompt is empty: give at least one character")
    preflight.choose_device(args.device)  # an unknown name fails here, before the checkpoint is read


def main(argv=None):
    keep_freed_memory()  # an entry point's choice: see minitensor/memory.py
    ap = ArgumentParser(prog="python -m andrea.sample", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory or a ckpt-* directory")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (1: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="cpu, gpu or auto (default: $ANDREA_DEVICE, else cpu)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    _check_args(args)
    model, tokenizer, meta = load_model(args.checkpoint, preflight.choose_device(args.device, fallback="cpu"))
    # on stderr, so that stdout is the text alone
    print(f"sampling from {meta['checkpoint']} (step {meta.get('step', '?')})", file=sys.stderr, flush=True)
    stream(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
           top_p=args.top_p)


if __name__ == "__main__":
    run_cli(main)
