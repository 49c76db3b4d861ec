"""ANDREA in PyTorch: the same GPT-2 model (GPT-2's parameter names and
layout, tanh GELU, tied embeddings), for cross-checking gradients and for benchmarking.

    model = build_torch_model(cfg, dtype="float64")
    load_andrea_state(model, andrea_model.state_dict())
    loss = model(idx, targets); loss.backward()
    grads = torch_grads(model)                 # {GPT-2 name: NumPy array}, andrea's layout

Layout: every matmul weight is stored (in, out) and applied as `x @ W + b` through `torch.addmm`,
as GPT-2's Conv1D (and Hugging Face's port of it) does. So parameter names AND shapes are the same
as andrea's, and loading weights or reading gradients is a name lookup with no transposes. The
head is tied: `logits = x @ wte.T`, and autograd adds both of wte's contributions into one grad.

PyTorch is optional (not a project dependency). From the command line

    python -m andrea.interop.torch_reference --config tiny --batch 16 --seq 128 --steps 20 --warmup 3

trains on random tokens in float32 with AdamW and prints one JSON line of throughput and peak
memory; run in a fresh process, its peak RSS is that of PyTorch training this model alone. Exit
status 3 when torch cannot be imported, 2 for a bad config.
"""

import json
import math
import resource
import statistics
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    _Module = nn.Module
except ImportError:  # torch is optional: the module still imports, building a model explains
    torch = F = nn = None
    _Module = object

TORCH_MISSING = "PyTorch is not installed in this environment (pip install torch==2.13.0; a CPU build is enough)"


def _require_torch():
    if torch is None:
        raise ImportError(TORCH_MISSING)


class Conv1D(_Module):
    """y = x @ W + b with W (in, out): GPT-2's layout, so names and shapes match andrea's."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):                                    # (..., in) -> (..., out)
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], y.shape[-1])


class CausalSelfAttention(_Module):
    def __init__(self, cfg, sdpa=False):
        super().__init__()
        self.n_head, self.sdpa = cfg.n_head, sdpa
        self.c_attn = Conv1D(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = Conv1D(cfg.d_model, cfg.d_model)
        T = cfg.context_length
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)             # each (B, T, C), in this order
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))        # (B, nh, T, T)
            att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v                                 # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)     # heads concatenated back in order
        return self.c_proj(y)


class MLP(_Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = Conv1D(cfg.d_model, cfg.mlp_dim)
        self.c_proj = Conv1D(cfg.mlp_dim, cfg.d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(_Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg, sdpa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg, sdpa)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(_Module):
    def __init__(self, cfg, sdpa=False):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            wpe=nn.Embedding(cfg.context_length, cfg.d_model),
            h=nn.ModuleList(Block(cfg, sdpa) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps),
        ))

    def forward(self, idx, targets=None):
        """Logits (B, T, V) without targets; with targets, the mean cross-entropy (a 0-d tensor)."""
        B, T = idx.shape
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(T, device=idx.device))      # (B, T, C)
        for block in tr.h:
            x = block(x)
        logits = F.linear(tr.ln_f(x), tr.wte.weight)                       # (B, T, V), tied head
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def build_torch_model(cfg, dtype="float32", sdpa=False, seed=0):
    """andrea's GPT-2 model in PyTorch for an andrea ModelConfig, GPT-2-initialised; sdpa: fused attention."""
    _require_torch()
    torch.manual_seed(seed)
    model = GPT(cfg, sdpa=sdpa)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:   # matmul weights and both embeddings; LayerNorm and biases keep 1 / 0
                p.normal_(0.0, residual_std if name.endswith("c_proj.weight") else 0.02)
    return model.to(getattr(torch, dtype))


def load_andrea_state(torch_model, state_dict):
    """Copies andrea's state_dict() ({GPT-2 name: NumPy array (in, out)}) into the torch model."""
    params = dict(torch_model.named_parameters())
    if set(params) != set(state_dict):
        raise ValueError(f"state dict does not fit: missing {sorted(set(params) - set(state_dict))[:3]}, "
                         f"unexpected {sorted(set(state_dict) - set(params))[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            value = torch.from_numpy(np.ascontiguousarray(state_dict[name]))
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, the torch model needs {tuple(p.shape)}")
            p.copy_(value)


def torch_grads(torch_model):
    """{GPT-2 name: NumPy gradient}, already in andrea's (in, out) layout; zeros where none was computed."""
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().numpy().copy()
            for name, p in torch_model.named_parameters()}


def make_adamw(model, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=False):
    """PyTorch's AdamW with decay on tensors of 2+ dimensions only, as andrea's; `fused` selects
    its one-kernel implementation (the fastest on the CPU too; the default is the multi-tensor
    `foreach` one, a few passes over the parameters)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if fused else {}))


def benchmark(cfg, batch_size, seq_len, steps, warmup, threads=2, seed=0, sdpa=False, device="cpu", tf32=False):
    """Full float32 training steps on random tokens; per-step times after `warmup` untimed steps.
    device "cuda": the same on the GPU, each step synchronised, with TF32 GEMMs if `tf32`, and the
    caching allocator's peak; the token ids are drawn on the host and copied."""
    _require_torch()
    if not 1 <= seq_len <= cfg.context_length:
        raise ValueError(f"seq_len must be in [1, {cfg.context_length}], got {seq_len}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    torch.set_num_threads(threads)
    cuda = device != "cpu"
    if cuda:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")  # "high": TF32 GEMMs
        torch.cuda.reset_peak_memory_stats(device)
    model = build_torch_model(cfg, "float32", sdpa=sdpa, seed=seed).to(device)
    model.train()
    opt = make_adamw(model, fused=True)  # PyTorch at its fastest: its fused AdamW kernel
    gen = torch.Generator().manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        idx = torch.randint(cfg.vocab_size, (batch_size, seq_len), generator=gen).to(device)
        targets = torch.randint(cfg.vocab_size, (batch_size, seq_len), generator=gen).to(device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    tokens = batch_size * seq_len
    step_s = statistics.median(times)
    return {
        "tokens_per_s_median": tokens / step_s,
        "tokens_per_s_min": tokens / max(times),
        "tokens_per_s_max": tokens / min(times),
        "step_s_median": step_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device, "tf32": bool(tf32) and cuda, "loss": float(loss.detach()),
        **({"cuda_peak_bytes": torch.cuda.max_memory_allocated(device)} if cuda else {}),
    }


def main(argv=None):
    from andrea.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m andrea.interop.torch_reference",
                                 description="Train ANDREA in PyTorch eager on random tokens; print one JSON line.")
    ap.add_argument("--config", default="tiny", help="tiny, small, 120m or a .yaml path")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the context length)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdpa", action="store_true", help="F.scaled_dot_product_attention instead of explicit math")
    args = ap.parse_args(argv)
    if torch is None:
        print(f"error: {TORCH_MISSING}", file=sys.stderr)
        return 3
    from andrea.config import load_config
    from andrea.errors import UserError
    try:
        cfg = load_config(args.config).model
        result = benchmark(cfg, args.batch, args.seq or cfg.context_length, args.steps, args.warmup,
                           threads=args.threads, seed=args.seed, sdpa=args.sdpa)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
