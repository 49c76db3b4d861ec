"""The model's sizes, from its config alone (nothing is allocated): every parameter's shape, written
once, and what is derived from the shapes.

    param_shapes(cfg)              {GPT-2 name: shape} in the order of the flat buffer
    parameter_breakdown(cfg)       {part: count} and "total", summed from param_shapes by the part
                                   each name belongs to; the tied token matrix is counted once
    flops_per_token(cfg, T, N)     training FLOPs per token, 6 N + 12 n_layer d T
    run_sizes(cfg, batch, precision)  the sizes the GPU start-up self-check times the fused kernels at
"""

import dataclasses
import math
from collections import defaultdict

from andrea.model.block import NORMS


def param_shapes(cfg):
    """{GPT-2 name: shape} in the order of the flat buffer: GPT-2's, but for each norm the parameters its
    kind has (LayerNorm's weight and bias: GPT-2's; andrea.model.block.NORMS), none with
    norm_position=none."""
    C, V, F = cfg.d_model, cfg.vocab_size, cfg.mlp_dim
    F_in = 2 * F if cfg.activation == "swiglu" else F     # SwiGLU's gate and value halves
    kind = () if cfg.norm_position == "none" else NORMS[cfg.norm].params

    def norm(name):
        return {f"{name}.{p}": (C,) for p in kind}

    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.context_length, C)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        shapes.update({
            **norm(h + "ln_1"),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            **norm(h + "ln_2"),
            h + "mlp.c_fc.weight": (C, F_in), h + "mlp.c_fc.bias": (F_in,),
            h + "mlp.c_proj.weight": (F, C), h + "mlp.c_proj.bias": (C,),
        })
    shapes.update(norm("transformer.ln_f"))
    return shapes


def _part(name):
    """The part of the breakdown a parameter belongs to: wte, wpe, ln_f, or a block's norms,
    attention or mlp."""
    if not name.startswith("transformer.h."):
        return name.split(".")[1]                         # transformer.<wte|wpe|ln_f>.<weight|bias>
    sublayer = name.split(".")[3]                         # transformer.h.<i>.<sublayer>...
    return "norms" if sublayer.startswith("ln_") else {"attn": "attention", "mlp": "mlp"}[sublayer]


def parameter_breakdown(cfg):
    """The exact count by part, summed from param_shapes; the tied matrix is counted once. The shapes are
    those of the same model with one block, every block being alike: a config's count costs the same
    whatever its depth (preflight refuses n_layer=1e9 from this count, before anything is allocated)."""
    counts = defaultdict(int)
    for name, shape in param_shapes(dataclasses.replace(cfg, n_layer=1)).items():
        counts[_part(name)] += math.prod(shape)
    n = cfg.n_layer
    norms, attn, mlp = (counts[part] for part in ("norms", "attention", "mlp"))  # one block's
    block = norms + attn + mlp
    blocks = f"{n} {'block' if n == 1 else 'blocks'}"
    norm = NORMS[cfg.norm].__name__
    parts = {
        "token embedding (tied with the output head)": counts["wte"],
        "position embedding": counts["wpe"],
        f"{blocks} ({block:,} each: 2 {norm}s {norms:,} + attention {attn:,} + MLP {mlp:,})": n * block,
        f"final {norm}": counts["ln_f"],
    }
    parts["total"] = sum(parts.values())
    return parts


def format_breakdown(cfg):
    parts = parameter_breakdown(cfg)
    width = max(len(k) for k in parts)
    return "\n".join(f"  {k:<{width}}  {v:>13,}" for k, v in parts.items())


def flops_per_token(cfg, T, n_params):
    """Training FLOPs per token: 6 N + 12 n_layer d T (the nanoGPT/PaLM convention): 6 per
    parameter (2 forward, 4 backward) plus the attention scores' and outputs' products."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.d_model * T


def run_sizes(cfg, batch, precision="float32"):
    """The sizes the start-up self-check times the fused kernels at (minitensor.backends.cuda.Sizes):
    batch sequences of the context length, in the run's train.precision."""
    from minitensor.backends.cuda import Sizes

    return Sizes(B=batch, T=cfg.context_length, C=cfg.d_model, n_head=cfg.n_head, F=cfg.mlp_dim,
                 V=cfg.vocab_size, P=parameter_breakdown(cfg)["total"], precision=precision or "float32")
