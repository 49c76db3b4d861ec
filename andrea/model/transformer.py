"""ANDREA: a GPT-2-architecture decoder-only transformer built from minitensor layers.

    x = wte[idx] + wpe[0..T-1]                   # (B, T, C)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T                     # (B, T, V), the head tied to the token embedding
    loss = mean cross-entropy(logits, targets)

Parameters carry the key names of a Hugging Face GPT2LMHeadModel state dict, weights stored
(in, out), all inside one flat buffer (minitensor.params). Backward runs the blocks in reverse,
with the residual joins written out: dx = dx + sublayer.backward(dx).

The design document's variants (model.norm, model.residual, model.activation, model.mlp_ratio;
docs/experiments.md) change the Block and its MLP only, never a primitive layer:

    norm=post:        x = ln_1(x + attn(x));  x = ln_2(x + mlp(x))    (the 2017 arrangement)
    residual=false:   the "x +" above dropped, in either arrangement
    activation=relu:  mlp(x) = c_proj(ReLU(c_fc(x)))
    norm=none:        x = x + attn(x);  x = x + mlp(x);  logits = x @ wte.T    (no LayerNorm anywhere)
    activation=swiglu: mlp(x) = c_proj(SwiGLU(c_fc(x))), c_fc (C, 2F) the gate and value halves,
                      F = 8/3 C by default (minitensor.layers.swiglu)

They keep GPT-2's parameter names (post-norm keeps ln_f too), and, but for norm=none (which has no
LayerNorm parameters) and swiglu (whose c_fc is twice as wide), its count, so a variant's
checkpoint has the same layout; the Hugging Face export refuses them (transformers' GPT-2
computes pre-norm GELU).
With `record_flow(True)` the model measures, for the next forward and backward, how the residual
stream and its gradient change through the blocks (GradFlow; train.log_grad_flow).

The backend (minitensor.backends.ops: NumPy with or without numba kernels, or CuPy) is chosen once, here,
from the device, and handed to every layer. The Block and its MLP own the fusion schedule: the
residual adds run in the epilogue of each branch's last product, c_fc's bias in GELU's pass,
and c_proj's input is recomputed in backward instead of kept.
"""

import math
from typing import NamedTuple

import numpy as np

from andrea.config import ModelConfig
from andrea.errors import UserError
from minitensor.backends import get_ops
from minitensor.device import get_backend, resolve_dtype, to_numpy
from minitensor.layers.attention import CausalSelfAttention
from minitensor.layers.embedding import Embedding, PositionEmbedding, TiedHead
from minitensor.layers.layer import Layer
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.linear import Linear
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.params import Params


def run_sizes(cfg, batch):
    """The sizes the start-up self-check times the fused kernels at (minitensor.backends.cuda.Sizes):
    batch sequences of the context length."""
    from minitensor.backends.cuda import Sizes

    return Sizes(B=batch, T=cfg.context_length, C=cfg.d_model, n_head=cfg.n_head, F=cfg.mlp_dim,
                 V=cfg.vocab_size, P=sum(int(np.prod(shape)) for shape in param_shapes(cfg).values()))


def param_shapes(cfg):
    """{GPT-2 name: shape} in the order of the flat buffer."""
    C, V, F = cfg.d_model, cfg.vocab_size, cfg.mlp_dim
    F_in = 2 * F if cfg.activation == "swiglu" else F     # SwiGLU's gate and value halves
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (cfg.context_length, C)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, F_in), h + "mlp.c_fc.bias": (F_in,),
            h + "mlp.c_proj.weight": (F, C), h + "mlp.c_proj.bias": (C,),
        })
    shapes["transformer.ln_f.weight"] = (C,)
    shapes["transformer.ln_f.bias"] = (C,)
    if cfg.norm == "none":
        return {name: shape for name, shape in shapes.items() if ".ln_" not in name}
    return shapes


def parameter_breakdown(cfg):
    """The exact count by part; the tied matrix is counted once."""
    C, F = cfg.d_model, cfg.mlp_dim
    F_in = 2 * F if cfg.activation == "swiglu" else F
    ln = 0 if cfg.norm == "none" else 2 * C
    attn = C * 3 * C + 3 * C + C * C + C
    mlp = C * F_in + F_in + F * C + C
    block = 2 * ln + attn + mlp
    blocks = f"{cfg.n_layer} {'block' if cfg.n_layer == 1 else 'blocks'}"
    parts = {
        "token embedding (tied with the output head)": cfg.vocab_size * C,
        "position embedding": cfg.context_length * C,
        f"{blocks} ({block:,} each: 2 LayerNorms {2 * ln:,} + attention {attn:,} + MLP {mlp:,})":
            cfg.n_layer * block,
        "final LayerNorm": ln,
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


def _linear(p, name, ops):
    return Linear(p[name + ".weight"], p.grad(name + ".weight"), p[name + ".bias"], p.grad(name + ".bias"),
                  ops=ops)


def _layernorm(p, name, eps, ops):
    if name + ".weight" not in p.shapes:                 # model.norm=none
        return NoNorm(ops)
    return LayerNorm(p[name + ".weight"], p.grad(name + ".weight"), p[name + ".bias"], p.grad(name + ".bias"), eps,
                     ops=ops)


class NoNorm(Layer):
    """Where a LayerNorm would be with model.norm=none: the identity, no parameters.

    forward:   y = x                     backward:  dx = dy (+ the skip's gradient, as LayerNorm's)
    infer_stats gives NaN for the mean and rstd it does not compute (andrea.trace says "none")."""

    def forward(self, x):
        return x

    def backward(self, dy, skip=None):
        return dy if skip is None else dy + skip

    def infer_stats(self, x):
        nan = self.ops.xp.full((*x.shape[:-1], 1), math.nan, dtype=x.dtype)
        return x, nan, nan


class MLPCache(NamedTuple):
    x: object          # (N, C), c_fc's input
    h: object          # (N, 4C), c_fc's output as the activation's bias pass left it (a backend may add b in place)
    shape: tuple


class MLP(Layer):
    """c_proj(act(c_fc(x))) (+ residual), act GELU (GPT-2), ReLU or SwiGLU (whose c_fc is twice as
    wide: h (N, 2F) -> g (N, F), minitensor.layers.swiglu), in three passes over the (N, 4C) activation
    instead of five:

    forward:   h = x W_fc  (c_fc's bias is added in the activation's pass),  g = act(h + b_fc),
               out = g W_proj + b_proj + residual  (one epilogue)
    backward:  dg = dout W_proj^T;  the activation's backward recomputes g in the pass it makes
               anyway (so no (N, 4C) activation per block waits from forward to backward besides h),
               dW_proj += g^T dout;  dW_fc += x^T dh;  dx = dh W_fc^T
    """

    def __init__(self, c_fc, c_proj, ops, activation="gelu"):
        super().__init__(ops)
        self.c_fc, self.c_proj = c_fc, c_proj
        pieces = {"gelu": (ops.bias_gelu_forward, ops.bias_gelu_backward),
                  "relu": (ops.bias_relu_forward, ops.bias_relu_backward),
                  "swiglu": (ops.bias_swiglu_forward, ops.bias_swiglu_backward)}
        if activation not in pieces:
            raise ValueError(f"activation must be one of {sorted(pieces)}, got {activation!r}")
        self.act_forward, self.act_backward = pieces[activation]

    def forward(self, x, residual=None):
        C = x.shape[-1]
        x2 = x.reshape(-1, C)
        h = x2 @ self.c_fc.W                                 # (N, 4C)
        g = self.act_forward(h, self.c_fc.b)
        out = g @ self.c_proj.W                              # (N, C)
        self.ops.add_epilogue(out, self.c_proj.b, None if residual is None else residual.reshape(out.shape))
        self._save(MLPCache(x2, h, x.shape))
        return out.reshape(x.shape)

    def backward(self, dout):
        x2, h, shape = self._pop()
        dout2 = dout.reshape(-1, shape[-1])
        dg = dout2 @ self.c_proj.W.T
        dh, g = self.act_backward(h, self.c_fc.b, dg, recompute_output=True)
        self.c_proj.weight_grads(g, dout2)
        self.c_fc.weight_grads(x2, dh)
        return (dh @ self.c_fc.W.T).reshape(shape)


class Block:
    """A transformer block: attention then MLP, each a sublayer f with its LayerNorm and skip.

    pre-norm (ANDREA, GPT-2):  x1 = x + attn(ln_1(x)),   x2 = x1 + mlp(ln_2(x1))
    post-norm (2017):          x1 = ln_1(x + attn(x)),   x2 = ln_2(x1 + mlp(x1))
    norm=none:                 pre-norm's, ln_1 and ln_2 the identity (NoNorm)
    without residuals the "x +" and "x1 +" are dropped.
    """

    def __init__(self, p, prefix, cfg, ops):
        self.norm, self.residual = cfg.norm, cfg.residual
        self.ln_1 = _layernorm(p, prefix + "ln_1", cfg.ln_eps, ops)
        self.attn = CausalSelfAttention(_linear(p, prefix + "attn.c_attn", ops),
                                        _linear(p, prefix + "attn.c_proj", ops), cfg.n_head, ops=ops)
        self.ln_2 = _layernorm(p, prefix + "ln_2", cfg.ln_eps, ops)
        self.mlp = MLP(_linear(p, prefix + "mlp.c_fc", ops), _linear(p, prefix + "mlp.c_proj", ops), ops,
                       cfg.activation)
        self.flow = None                                     # (GradFlow, this block's index) while recording

    def forward(self, x):
        skip = self.residual
        if self.norm != "post":
            # the residual adds run in the epilogue of each branch's last product
            s1 = x1 = self.attn.forward(self.ln_1.forward(x), residual=x if skip else None)
            s2 = x2 = self.mlp.forward(self.ln_2.forward(x1), residual=x1 if skip else None)
        else:
            s1 = self.attn.forward(x, residual=x if skip else None)          # x + attn(x)
            x1 = self.ln_1.forward(s1)
            s2 = self.mlp.forward(x1, residual=x1 if skip else None)         # x1 + mlp(x1)
            x2 = self.ln_2.forward(s2)
        if self.flow is not None:
            flow, i = self.flow
            flow.forward(i, x, s1, x1, s2, skip)
        return x2

    def infer(self, x, kv, pos):
        """forward for inference at positions pos.., with this block's key/value cache kv: the same
        layers through their cache-free `infer`."""
        skip = self.residual
        if self.norm != "post":
            x1 = self.attn.forward_kv(self.ln_1.infer(x), kv, pos, residual=x if skip else None)
            return self.mlp.infer(self.ln_2.infer(x1), residual=x1 if skip else None)
        x1 = self.ln_1.infer(self.attn.forward_kv(x, kv, pos, residual=x if skip else None))
        return self.ln_2.infer(self.mlp.infer(x1, residual=x1 if skip else None))

    def trace(self, x, kv, pos):
        """infer(x, kv, pos), keeping what andrea.trace shows, as a dict of arrays: "x" the stream
        entering, "ln_1" and "ln_2" each LayerNorm's (mean, rstd) (..., 1), "probs" the attention
        probabilities (B, nh, T, pos + T), "attn" and "mlp" each sublayer's output before its skip
        adds it (its delta), "x1" the stream after attention, "x2" after the MLP. The skips are
        added here after each sublayer instead of in its epilogue: the same float adds, so x2 is
        infer's to the bit."""
        skip, t = self.residual, {"x": x}
        if self.norm != "post":
            h, *t["ln_1"] = self.ln_1.infer_stats(x)
            t["attn"] = self.attn.forward_kv(h, kv, pos, record=t)
            t["x1"] = x + t["attn"] if skip else t["attn"]
            h, *t["ln_2"] = self.ln_2.infer_stats(t["x1"])
            t["mlp"] = self.mlp.infer(h)
            t["x2"] = t["x1"] + t["mlp"] if skip else t["mlp"]
        else:
            t["attn"] = self.attn.forward_kv(x, kv, pos, record=t)
            t["x1"], *t["ln_1"] = self.ln_1.infer_stats(x + t["attn"] if skip else t["attn"])
            t["mlp"] = self.mlp.infer(t["x1"])
            t["x2"], *t["ln_2"] = self.ln_2.infer_stats(t["x1"] + t["mlp"] if skip else t["mlp"])
        return t

    def backward(self, dx2):
        skip = self.residual
        if self.norm != "post":
            # forward was: x2 = x1 + mlp(ln_2(x1)); x1 = x + attn(ln_1(x)); each skip's gradient is
            # added in the pass of the LayerNorm backward it goes around
            dx1 = self.ln_2.backward(self.mlp.backward(dx2), skip=dx2 if skip else None)
            dx = self.ln_1.backward(self.attn.backward(dx1), skip=dx1 if skip else None)
        else:
            # forward was: x2 = ln_2(s2), s2 = x1 + mlp(x1); x1 = ln_1(s1), s1 = x + attn(x): every
            # gradient passes through a LayerNorm before it reaches the skip that goes around f
            ds2 = self.ln_2.backward(dx2)
            dx1 = self.mlp.backward(ds2)                     # a fresh array
            if skip:
                dx1 += ds2
            ds1 = self.ln_1.backward(dx1)
            dx = self.attn.backward(ds1)
            if skip:
                dx += ds1
        if self.flow is not None:
            flow, i = self.flow
            flow.backward(i, dx)
        return dx


class GradFlow:
    """How the residual stream and its gradient change through the blocks, in one forward and
    backward (the last micro-batch's when there are several). Per block i, from its input x:

        stream_rms[i]   sqrt(mean(x^2)), the size of the stream entering block i
        attn_delta[i]   |attn's change to the stream| / |x|: |s1 - x| / |x| with a skip, |s1| / |x|
                        without (s1: x + attn(...) pre-norm, before ln_1 post-norm)
        mlp_delta[i]    the same for the MLP, relative to the stream it changes (x1)
        grad_in[i]      |dL/dx|, the gradient reaching block i's input; grad_in[0] is the one that
                        reaches the embeddings
        grad_top        |dL/dx| at the top of the stack (the last block's output)

    Norms are Frobenius norms over the whole (B, T, C) tensor, read to the host: a few
    synchronisations per recorded step, none when not recording.
    """

    def __init__(self, n_layer):
        self.stream_rms, self.attn_delta, self.mlp_delta, self.grad_in = ([None] * n_layer for _ in range(4))
        self.grad_top = None

    @staticmethod
    def _norm(a):
        return float(a.ravel() @ a.ravel()) ** 0.5

    def forward(self, i, x, s1, x1, s2, skip):
        nx, nx1 = self._norm(x), self._norm(x1)
        self.stream_rms[i] = nx / x.size ** 0.5
        self.attn_delta[i] = self._norm(s1 - x if skip else s1) / max(nx, 1e-30)
        self.mlp_delta[i] = self._norm(s2 - x1 if skip else s2) / max(nx1, 1e-30)

    def backward(self, i, dx):
        self.grad_in[i] = self._norm(dx)

    def top(self, dx):
        self.grad_top = self._norm(dx)

    def as_dict(self):
        return {"grad_top": self.grad_top, "grad_in": self.grad_in, "stream_rms": self.stream_rms,
                "attn_delta": self.attn_delta, "mlp_delta": self.mlp_delta}


class ANDREA:
    def __init__(self, cfg: ModelConfig, device="cpu", dtype="float32", seed=0, kernels=None, ops=None, batch=None):
        """kernels: on the CPU 'numba' or 'numpy' (default: ANDREA_CPU_KERNELS, else numba when
        installed); on a GPU the fused kernels, 'auto' (the default: those that pass the start-up
        self-check, and with `batch`, are not slower than the generic code at batch x context_length),
        'fused' or 'generic' (train.kernels); chosen here once, like the device
        (minitensor.backends.get_ops). ops: a minitensor.backends.ops backend to use instead of the device's
        (tests)."""
        self.cfg = cfg
        self.backend = get_backend(device)
        self.ops = ops = ops or get_ops(self.backend.xp, kernels, run_sizes(cfg, batch) if batch else None)
        self.xp = ops.xp
        self.dtype = resolve_dtype(dtype)
        self.params = Params(param_shapes(cfg), xp=self.xp, dtype=self.dtype, ops=ops)
        p = self.params
        # ids are validated on the host in _ids, so the layers skip their own (device-syncing) checks
        self.wte = Embedding(p["transformer.wte.weight"], p.grad("transformer.wte.weight"), check=False, ops=ops)
        self.wpe = PositionEmbedding(p["transformer.wpe.weight"], p.grad("transformer.wpe.weight"), ops=ops)
        self.blocks = [Block(p, f"transformer.h.{i}.", cfg, ops) for i in range(cfg.n_layer)]
        self.ln_f = _layernorm(p, "transformer.ln_f", cfg.ln_eps, ops)
        self.head = TiedHead(p["transformer.wte.weight"], p.grad("transformer.wte.weight"), ops=ops)
        self.loss_fn = SoftmaxCrossEntropy(check=False, ops=ops)
        self.flow = None
        self.init_weights(seed)

    def record_flow(self, on=True):
        """Measure the next forward/backward(s) into a fresh GradFlow (self.flow), or stop (on=False)."""
        self.flow = GradFlow(self.cfg.n_layer) if on else None
        for i, block in enumerate(self.blocks):
            block.flow = (self.flow, i) if on else None
        return self.flow

    def init_weights(self, seed):
        """GPT-2 initialisation, drawn in float64 on the CPU so every device and dtype starts alike."""
        rng = np.random.default_rng(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, view in self.params.items():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                view[...] = 1
            elif name.endswith(".bias"):
                view[...] = 0
            else:
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                view[...] = self.xp.asarray(rng.normal(0.0, std, view.shape).astype(self.dtype))

    # --- inputs ---

    def _ids(self, a, what):
        """Validates ids (B, T) or (T,) on the host and moves them to the model's device as int64."""
        return self._to_device(self._host_ids(a, what))[0]

    def _to_device(self, *ids):
        """Host ids of one shape on the model's device as int64, all in one copy (views of one array).
        On CuPy that copy is asynchronous: cupy.asarray stages host data in pinned memory and copies
        it on the current stream (CuPy 14.2's _array_default), so the host does not wait for it."""
        if len(ids) == 1:
            return (self.xp.asarray(ids[0], dtype=np.int64),)
        both = self.xp.asarray(np.stack(ids), dtype=np.int64)
        return tuple(both[i] for i in range(len(ids)))

    def _host_ids(self, a, what):
        """ids (B, T) or (T,) validated on the host, as a (B, T) integer array."""
        a = np.asarray(to_numpy(a))
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise UserError(f"{what} must have shape (B, T), got {a.shape}")
        if a.dtype.kind not in "iu":
            raise UserError(f"{what} must be integers, got {a.dtype}")
        if a.shape[1] > self.cfg.context_length:
            raise UserError(f"{what} has {a.shape[1]} positions; the context length is {self.cfg.context_length}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= self.cfg.vocab_size):
            bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
            raise UserError(f"{what} contains id {bad}, outside [0, {self.cfg.vocab_size})")
        return a

    # --- training ---

    def forward(self, idx, targets=None):
        """Logits (B, T, V) without targets; with targets, the mean cross-entropy as a Python float."""
        if targets is None:
            return self.logits(idx)
        return float(self.loss(idx, targets))

    def logits(self, idx):
        return self.head.forward(self._trunk(self._ids(idx, "idx")))

    def loss(self, idx, targets):
        """The mean cross-entropy as a 0-d device array (no host synchronisation); keeps what backward needs."""
        idx, targets = self._host_ids(idx, "idx"), self._host_ids(targets, "targets")
        if targets.shape != idx.shape:
            raise UserError(f"targets of shape {targets.shape} do not match idx of shape {idx.shape}")
        idx, targets = self._to_device(idx, targets)                 # one copy for both
        logits = self.head.forward(self._trunk(idx), padded=True)  # over the backend's padded vocabulary
        return self.loss_fn.forward(logits, targets, inplace=True, valid=self.cfg.vocab_size)

    def _trunk(self, idx):
        B, T = idx.shape
        x = self.wte.forward(idx)                            # (B, T, C), a fresh array
        x += self.wpe.forward(B, T)
        for block in self.blocks:
            x = block.forward(x)
        return self.ln_f.forward(x)

    def backward(self, dloss=1.0):
        """Accumulates the gradients of the last loss into the gradient buffer."""
        dx = self.ln_f.backward(self.head.backward(self.loss_fn.backward(dloss)))
        if self.flow is not None:
            self.flow.top(dx)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
        self.wpe.backward(dx)
        self.wte.backward(dx)

    def zero_grad(self):
        self.params.zero_grad()

    # --- parameters ---

    def named_parameters(self):
        return self.params.items()

    def named_grads(self):
        return self.params.grad_items()

    def num_parameters(self):
        return self.params.num_elements()

    def state_dict(self):
        """{GPT-2 name: NumPy array copy}, weights (in, out)."""
        return {name: to_numpy(view).copy() for name, view in self.params.items()}

    def load_state_dict(self, state):
        expected = self.params.shapes
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(expected))
        if missing or unknown:
            raise UserError(f"state dict does not fit this model: missing {missing[:3]}, unexpected {unknown[:3]}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise UserError(f"{name} has shape {tuple(state[name].shape)}, this model needs {shape}")
        for name, view in self.params.items():
            view[...] = self.xp.asarray(state[name], dtype=self.dtype)

    # --- the Hugging Face format (andrea.interop.hf, which never imports this module; imported here, on
    # first use, so that a model without them loads neither tokenizers nor safetensors) ---

    @classmethod
    def from_pretrained(cls, directory, device="cpu", dtype="float32"):
        """A model from a GPT-2 directory: andrea's export or transformers' save_pretrained (safetensors).

        The config and the weights are checked (types, sizes, the files' headers, shapes, finite
        values) before the model is built, so a damaged directory costs no allocation."""
        from andrea.interop import hf
        cfg = hf.read_model_config(directory)
        state = hf.read_state(directory, param_shapes(cfg))
        model = cls(cfg, device=device, dtype=dtype)
        model.load_state_dict(state)
        return model

    def save_pretrained(self, directory, tokenizer=None):
        """Write a directory that transformers' AutoModelForCausalLM (and AutoTokenizer) load."""
        from andrea.interop import hf
        return hf.save_pretrained(self, directory, tokenizer=tokenizer)

    # --- inference with a key/value cache ---

    def new_kv_cache(self, batch_size=1):
        shape = (batch_size, self.cfg.n_head, self.cfg.context_length, self.cfg.head_size)
        return [(self.xp.zeros(shape, self.dtype), self.xp.zeros(shape, self.dtype)) for _ in self.blocks]

    def forward_kv(self, idx, cache, pos, every=False):
        """Logits (B, V) of the last of the new tokens idx (B, T_new) at positions pos..pos+T_new-1
        (with `every`, (B, T_new, V) of each of them). Each new token costs one row of attention over
        the cached keys and values.
        """
        idx = self._ids(idx, "idx")
        B, T = idx.shape
        if pos + T > self.cfg.context_length:
            raise UserError(f"positions {pos}..{pos + T - 1} exceed the context length {self.cfg.context_length}")
        x = self.wte.W[idx] + self.wpe.W[pos:pos + T]
        for block, kv in zip(self.blocks, cache):
            x = block.infer(x, kv, pos)
        return self.head.infer(self.ln_f.infer(x if every else x[:, -1]))

    def trace(self, idx):
        """forward_kv's computation over idx (B, T) from position 0, block by block: a list of each
        block's Block.trace, the first one's "x" the embedding (andrea.trace; its logit lens is ln_f
        and the head applied to a block's "x2")."""
        idx = self._ids(idx, "idx")
        x = self.wte.W[idx] + self.wpe.W[:idx.shape[1]]
        steps = []
        for block, kv in zip(self.blocks, self.new_kv_cache(idx.shape[0])):
            steps.append(block.trace(x, kv, 0))
            x = steps[-1]["x2"]
        return steps
