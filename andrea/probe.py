"""Probes of a trained model for andrea.experiment: what each depth predicts and where each head looks.

    probe = probe_run(RUN_DIR)      # a finished andrea.train run: its checkpoint and validation split

measures, over `windows` windows of the run's validation tokens (seq_len each, spread evenly over
the split), through ANDREA.trace (the inference path andrea.trace walks: no gradient, nothing
kept):

    lens_loss[k]       the logit lens's mean cross-entropy (nats/token) of the stream after k blocks
                       (k = 0: the embeddings alone) through the final norm and the tied head,
                       as if the model stopped there; lens_loss[n_layer] is the model's own loss
    lens_top[k]        for the prompt PROMPT's last token, the lens's top predictions after block k
                       (andrea.trace.trace, the same numbers the trace command prints)
    distance[i][h]     head h of block i: its mean attention distance, sum_j p_ij (i - j) averaged
                       over the query positions i (0: attends to itself; the farthest is i)
    previous[i][h]     the share of head h's attention on the token just before, p_{i, i-1},
                       averaged over the positions i >= 1 (1: a previous-token head)
    uniform_distance   the same two for uniform causal attention over the same windows (p_ij =
    uniform_previous   1/(i+1)): (T-1)/4 and the mean of 1/(i+1) over i >= 1, what a head that
                       has not specialised reads
    norms[i]           block i's norms, {"ln_1": {statistic: mean over every token}, "ln_2": ...},
                       with the statistics each norm has (minitensor.layers.layer.Norm): a
                       LayerNorm's mean and rstd, an RMSNorm's rstd alone, none without norms

Every number is computed in float64 from the model's float32 (or float64) activations.
"""

from __future__ import annotations

import numpy as np

from andrea.errors import UserError
from minitensor.device import to_numpy

PROMPT = "def __init__(self"
TOP = 3


def lens_losses(model, idx, targets) -> list[float]:
    """The logit lens's mean cross-entropy after 0, 1, ..., n_layer blocks for idx (B, T)."""
    steps = model.trace(idx)
    streams = [steps[0]["x"]] + [s["x2"] for s in steps]
    t = np.asarray(targets)
    losses = []
    for x in streams:
        z = np.asarray(to_numpy(model.head.infer(model.ln_f.infer(x))), dtype=np.float64)[..., :model.cfg.vocab_size]
        z -= z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        losses.append(float(-np.take_along_axis(logp, t[..., None], axis=-1).mean()))
    return losses


def attention_stats(model, idx) -> tuple[list[list[float]], list[list[float]]]:
    """(distance, previous): per block, per head, as the module's docstring defines them."""
    distance, previous = [], []
    for step in model.trace(idx):
        p = np.asarray(to_numpy(step["probs"]), dtype=np.float64)         # (B, nh, T, T), causal
        T = p.shape[-1]
        gap = np.subtract.outer(np.arange(T), np.arange(T)).clip(min=0)     # i - j where j <= i
        distance.append((p * gap).sum(axis=-1).mean(axis=(0, 2)).tolist())
        if T > 1:
            prev = p[..., np.arange(1, T), np.arange(T - 1)].mean(axis=(0, 2))
        else:
            prev = np.zeros(p.shape[1])
        previous.append(prev.tolist())
    return distance, previous


def norm_stats(model, idx) -> list[dict]:
    """Per block, each norm's statistics averaged over every token of idx (B, T) (the docstring's norms)."""
    return [{ln: {k: float(np.asarray(to_numpy(v), dtype=np.float64).mean()) for k, v in step[ln].items()}
             for ln in ("ln_1", "ln_2")} for step in model.trace(idx)]


def windows_of(ids, seq_len: int, n: int):
    """Up to n windows (x, y) of seq_len tokens, evenly spread over ids."""
    if len(ids) < seq_len + 1:
        raise UserError(f"the validation split has {len(ids)} tokens, fewer than one window of {seq_len} + 1")
    starts = np.linspace(0, len(ids) - seq_len - 1, num=min(n, len(ids) - seq_len)).astype(np.int64)
    x = np.stack([ids[s:s + seq_len] for s in starts])
    y = np.stack([ids[s + 1:s + seq_len + 1] for s in starts])
    return x, y


def probe_run(run_dir, windows: int = 16) -> dict:
    """The probes of the finished run in run_dir (its latest checkpoint), on its validation split."""
    from andrea import trace as tracing
    from andrea.config import make_config
    from andrea.eval import data_tokens, load_any
    from andrea.run.runlog import read_saved_config

    model, tokenizer, _, seq_len = load_any(run_dir)
    ids, _ = data_tokens(make_config(read_saved_config(run_dir)).data.resolved_dir(), "val", tokenizer)
    x, y = windows_of(ids, min(seq_len, model.cfg.context_length), windows)
    distance, previous = attention_stats(model, x)
    prompt = tokenizer.encode(PROMPT)[-model.cfg.context_length:]
    blocks = tracing.trace(model, prompt, len(prompt) - 1)
    T = x.shape[1]
    return {"lens_loss": lens_losses(model, x, y), "distance": distance, "previous": previous,
            "uniform_distance": (T - 1) / 4, "uniform_previous": float(np.mean(1.0 / np.arange(2, T + 1)))
            if T > 1 else 0.0, "lens_top": [tracing.top(tokenizer, b.lens, TOP) for b in blocks],
            "norms": norm_stats(model, x)}
