"""One token through the model, block by block: `python -m andrea.trace --checkpoint MODEL --prompt TEXT`.

    python -m andrea.trace --checkpoint out/andrea-tiny --prompt "def __init__(self" [--position N] [--out DIR]

The design document's last section, "Rastreando Um Token Através De Um Bloco" (tracing one token
through a block), made live. MODEL is what andrea.eval takes: a run directory, a ckpt-* directory
or a Hugging Face GPT-2 directory with its tokenizer. The prompt runs through the model's own
layers (ANDREA.trace: each block's `infer` path, the norms' statistics and the attention
probabilities kept on the way), and for one token (--position, default the last; negative counts
from the end) it prints, per block:

    residual |x|   the size (L2 norm) of the token's residual stream entering the block, after
                   attention and after the MLP: x1 = x + attn(ln_1(x)), x2 = x1 + mlp(ln_2(x1))
    ln_1, ln_2     what each norm normalised this token by, the statistics its kind has (its
                   `stats`): a LayerNorm's mean and rstd = 1 / sqrt(var + eps)
    attention      |attn(ln_1(x))|, the delta attention adds, and per head the positions this
                   token attends to most, with their text and probability
    MLP            |mlp(ln_2(x1))|, the MLP's delta
    logit lens     the stream after the block through the final norm and the tied head, as if
                   the model stopped there: its top predictions for the next token

and last the model's own next-token distribution (its generation path, forward_kv), which the
logit lens of the last block equals. --out DIR also draws DIR/trace.png: each head's attention
row for the token, and the logit lens as a table of top-1 tokens by depth and position (the
`plot` extra). Post-norm variants are traced too; there the norms follow the adds; a model
without norms (model.norm_position=none) shows "none" for their statistics.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from andrea.cli import ArgumentParser, run_cli
from andrea.errors import UserError
from andrea.eval import load_any
from andrea.files import atomic_writer
from andrea.run import preflight
from andrea.run.figure import new_figure, require_matplotlib
from minitensor.backends.softmax import exp_rows
from minitensor.device import to_numpy

FIGURE = "trace.png"
SOFTWARE = "andrea.trace"  # the PNG's Software text: an existing trace.png is replaced only when it carries it
ATTENTION_TOP = 3          # positions shown per head
TABLE_POSITIONS = 16       # columns of the logit-lens table: the positions up to the traced one


class BlockTrace(NamedTuple):
    norms: tuple[float, float, float]     # |x| entering, after attention, after the MLP
    ln_1: dict[str, float]                # the norm's statistics by name (Norm.stats): mean and rstd, or rstd
    ln_2: dict[str, float]
    attn_delta: float
    mlp_delta: float
    attention: np.ndarray                 # (n_head, t + 1): the token's attention row per head
    lens: np.ndarray                      # (V,) the logit lens's distribution at the token
    lens_top1: list[tuple[int, float]]    # (id, probability) at every position


def softmax(logits) -> np.ndarray:
    p = np.asarray(to_numpy(logits), dtype=np.float64)
    total, _ = exp_rows(p)
    return p / total


def trace(model, ids, t: int) -> list[BlockTrace]:
    """Each block's figures for position t of ids (a list of at most context_length ids)."""
    blocks = []
    for step in model.trace(np.array([ids])):
        row = {k: to_numpy(v[0, t]) for k, v in step.items() if k in ("x", "x1", "x2", "attn", "mlp")}
        lens = softmax(model.head.infer(model.ln_f.infer(step["x2"][0])))     # (T, V)
        top1 = lens.argmax(axis=-1)
        blocks.append(BlockTrace(
            norms=tuple(float(np.linalg.norm(row[k])) for k in ("x", "x1", "x2")),
            ln_1={k: float(to_numpy(s)[0, t, 0]) for k, s in step["ln_1"].items()},
            ln_2={k: float(to_numpy(s)[0, t, 0]) for k, s in step["ln_2"].items()},
            attn_delta=float(np.linalg.norm(row["attn"])),
            mlp_delta=float(np.linalg.norm(row["mlp"])),
            attention=np.asarray(to_numpy(step["probs"][0, :, t, :t + 1]), dtype=np.float64),
            lens=lens[t],
            lens_top1=[(int(i), float(lens[p, i])) for p, i in enumerate(top1)],
        ))
    return blocks


def model_output(model, ids, t: int) -> np.ndarray:
    """The model's own next-token distribution after ids[:t + 1], from its generation path."""
    return softmax(model.forward_kv(np.array([ids[:t + 1]]), model.new_kv_cache(1), 0))[0]


# ----------------------------------------------------------------------------- printing


def piece(tokenizer, token_id: int) -> str:
    """A token's text as Python writes a string (quotes, escapes): spaces and newlines show."""
    return repr(tokenizer.token_bytes(int(token_id)).decode("utf-8", errors="replace"))


def top(tokenizer, probs, k: int) -> str:
    best = np.argsort(-probs, kind="stable")[:k]
    return " | ".join(f"{piece(tokenizer, i)} {probs[i]:.3f}" for i in best)


def ln_stats(stats: dict) -> str:
    """The statistics a norm has (its kind's `stats`: a LayerNorm's mean and rstd), or "none" without norms."""
    if not stats:
        return "none (model.norm_position=none: no norm)"
    return " | ".join(f"{name} {value:+.4f}" if name == "mean" else f"{name} {value:.4f}"
                      for name, value in stats.items())


def block_lines(i: int, b: BlockTrace, ids, tokenizer, k: int) -> list[str]:
    lines = [f"block {i}",
             f"  residual |x|   in {b.norms[0]:.4f} | after attention {b.norms[1]:.4f} | after MLP {b.norms[2]:.4f}",
             f"  ln_1           {ln_stats(b.ln_1)}",
             f"  attention      |delta| {b.attn_delta:.4f}"]
    for h, row in enumerate(b.attention):
        best = np.argsort(-row, kind="stable")[:ATTENTION_TOP]
        lines.append(f"    head {h:<2}      " + " | ".join(
            f"@{p} {piece(tokenizer, ids[p])} {row[p]:.3f}" for p in best))
    lines += [f"  ln_2           {ln_stats(b.ln_2)}",
              f"  MLP            |delta| {b.mlp_delta:.4f}",
              f"  logit lens     {top(tokenizer, b.lens, k)}"]
    return lines


def report(blocks, output, ids, t: int, tokenizer, k: int) -> str:
    listing = " ".join(f"{p}:{piece(tokenizer, i)}" for p, i in enumerate(ids))
    lines = [f"prompt   {len(ids)} tokens  {listing}",
             f"token    position {t}, {piece(tokenizer, ids[t])}: what it carries on its way up, and what the "
             "model would predict after it"]
    for i, b in enumerate(blocks):
        lines += block_lines(i, b, ids, tokenizer, k)
    lines.append(f"output   {top(tokenizer, output, k)}  (the model's next-token distribution)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the figure


def draw(blocks, ids, t: int, tokenizer):
    """Left: every head's attention row for the token; right: the logit lens's top-1 table."""
    n_head = blocks[0].attention.shape[0]
    first = max(0, t + 1 - TABLE_POSITIONS)
    cols = list(range(first, t + 1))
    rows = np.concatenate([b.attention for b in blocks])                  # (n_layer * n_head, t + 1)
    # GPT-2's 144 heads fit in 30 inches, in smaller type
    fig = new_figure("andrea.trace", figsize=(6 + 0.9 * len(cols), 1.5 + min(0.28 * len(rows), 30)))
    ax_att, ax_lens = fig.subplots(1, 2, width_ratios=[1, 1.6])
    image = ax_att.imshow(rows, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax_att.set_yticks(range(len(rows)), [f"block {i} head {h}" for i in range(len(blocks)) for h in range(n_head)],
                      fontsize=7 if len(rows) <= 100 else 5)
    labels = [piece(tokenizer, ids[p]) for p in range(t + 1)]
    ax_att.set_xticks(range(t + 1), labels if t < 40 else [""] * (t + 1), rotation=90, fontsize=7)
    ax_att.set_title(f"attention of position {t} ({piece(tokenizer, ids[t])})", fontsize=9)
    fig.colorbar(image, ax=ax_att, shrink=0.6, label="probability")
    probs = np.array([[b.lens_top1[p][1] for p in cols] for b in blocks])
    ax_lens.imshow(probs, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    for r, b in enumerate(blocks):
        for c, p in enumerate(cols):
            text = piece(tokenizer, b.lens_top1[p][0])
            ax_lens.text(c, r, text if len(text) <= 10 else text[:9] + "…", ha="center", va="center", fontsize=7,
                         color="white" if probs[r, c] > 0.6 else "black")
    ax_lens.set_xticks(range(len(cols)), [f"{p}:{piece(tokenizer, ids[p])}" for p in cols], rotation=90, fontsize=7)
    ax_lens.set_yticks(range(len(blocks)), [f"after block {i}" for i in range(len(blocks))], fontsize=7)
    ax_lens.set_title("logit lens: top-1 next token by depth and position (shade: its probability)", fontsize=9)
    return fig


def write_figure(fig, out) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": SOFTWARE})
    with atomic_writer(out / FIGURE) as f:
        f.write(buffer.getvalue())
    return out / FIGURE


def check_out(out) -> None:
    """--out must be (or become) a directory whose trace.png, if any, this command drew."""
    preflight.check_directory(out, "--out")
    path = Path(out) / FIGURE
    if path.is_dir():
        raise UserError(f"{path} is a directory: choose another --out")
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(4096)  # a PNG's text chunks precede its image data
        if not (head.startswith(b"\x89PNG") and b"Software\x00" + SOFTWARE.encode() in head):
            raise UserError(f"{path} exists and was not drawn by andrea.trace: choose another --out, or move it away")
    require_matplotlib("andrea.trace --out")


# ----------------------------------------------------------------------------- the command


def prompt_ids(tokenizer, prompt: str, ctx: int) -> list[int]:
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UserError("--prompt encodes to no tokens: give at least one character")
    if len(ids) > ctx:
        print(f"note: the prompt is {len(ids)} tokens; only its last {ctx} (the context length) are traced",
              file=sys.stderr)
    return ids[-ctx:]


def main(argv=None):
    ap = ArgumentParser(prog="python -m andrea.trace", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="a run directory, a ckpt-* directory or a GPT-2 directory")
    ap.add_argument("--prompt", required=True, help="the text whose token is traced")
    ap.add_argument("--position", type=int, default=-1, help="the token to trace (0 = first; default -1, the last)")
    ap.add_argument("--top-k", type=int, default=5, help="predictions shown per logit lens (5)")
    ap.add_argument("--out", help="a directory to draw trace.png into (created if missing)")
    ap.add_argument("--device", help="cpu, gpu or auto (default: $ANDREA_DEVICE, else cpu)")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    args = ap.parse_args(argv)
    if not args.prompt:
        raise UserError("--prompt is empty: give at least one character")
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {args.top_k}")
    if args.out is not None:
        check_out(args.out)  # before the model is read
    model, tokenizer, source, _ = load_any(args.checkpoint, preflight.choose_device(args.device, fallback="cpu"))
    ids = prompt_ids(tokenizer, args.prompt, model.cfg.context_length)
    if not -len(ids) <= args.position < len(ids):
        raise UserError(f"--position {args.position} is outside the prompt's {len(ids)} tokens "
                        f"(0..{len(ids) - 1}, or -1..-{len(ids)} from the end)")
    t = args.position % len(ids)
    blocks = trace(model, ids, t)
    m = model.cfg
    print(f"model    {source}: {m.n_layer} blocks, d_model {m.d_model}, {m.n_head} heads, vocab {m.vocab_size}")
    print(report(blocks, model_output(model, ids, t), ids, t, tokenizer, args.top_k))
    if args.out is not None:
        print(f"wrote {write_figure(draw(blocks, ids, t, tokenizer), args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
