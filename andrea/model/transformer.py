"""ANDREA: a GPT-2-architecture decoder-only transformer built from minitensor layers.

    x = wte[idx] + wpe[0..T-1]                   # (B, T, C)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T                     # (B, T, V), the head tied to the token embedding
    loss = mean cross-entropy(logits, targets)

Parameters carry the key names of a Hugging Face GPT2LMHeadModel state dict, weights stored
(in, out), all inside one flat buffer (minitensor.flat), with the shapes andrea.model.sizes
writes. Backward runs the blocks in reverse, with the residual joins written out:
dx = dx + sublayer.backward(dx).

The variants (model.norm_position, model.norm, model.residual, model.activation, model.mlp_ratio;
docs/experiments.md) change the Block and its MLP (andrea.model.block) and which norm layer
ln_1, ln_2 and ln_f are, never a primitive layer:

    norm_position=post: x = ln_1(x + attn(x));  x = ln_2(x + mlp(x))    (the 2017 arrangement)
    norm_position=none: x = x + attn(x);  x = x + mlp(x);  logits = x @ wte.T    (no norm anywhere)
    norm=KIND:          every norm (ln_1, ln_2, ln_f) of that kind (andrea.model.block.NORMS)
    residual=false:     the "x +" above dropped, in either arrangement
    activation=relu:    mlp(x) = c_proj(ReLU(c_fc(x)))
    activation=swiglu:  mlp(x) = c_proj(SwiGLU(c_fc(x))), c_fc (C, 2F) the gate and value halves,
                        F = 8/3 C by default (minitensor.layers.swiglu)

They keep GPT-2's parameter names (post-norm keeps ln_f too), and, but for norm_position=none (no
norm parameters), a norm without a bias and swiglu (whose c_fc is twice as wide), its count;
the Hugging Face export refuses them by name (transformers' GPT-2 computes pre-norm LayerNorm GELU).
With `record_flow(recorder)` the model reports, in the next forward and backward, the residual
stream and its gradient at every block to the recorder (andrea.run.gradflow; train.log_grad_flow).

The backend (minitensor.backends.ops: NumPy with or without numba kernels, or CuPy) is chosen once, here,
from the device, and handed to every layer. So is the precision (minitensor.precision): float32 or
float64 throughout, or bf16 on a GPU, where the layers read a bfloat16 copy of the float32 master
weights (Params.compute_view), the activations are bfloat16, every sum is carried in float32 (the
backend's pieces, minitensor.backends.ops) and the loss is float32.
"""

import math

import numpy as np

from andrea.config import ModelConfig
from andrea.errors import UserError
from andrea.model.block import Block, norm_layer
from andrea.model.sizes import param_shapes, run_sizes
from minitensor import precision as policies
from minitensor.backends import get_ops
from minitensor.device import get_device, resolve_dtype, to_numpy
from minitensor.flat import ALIGN, Params
from minitensor.layers.embedding import Embedding, PositionEmbedding, TiedHead
from minitensor.layers.loss import SoftmaxCrossEntropy


class ANDREA:
    def __init__(self, cfg: ModelConfig, device="cpu", dtype="float32", seed=0, kernels=None, ops=None, batch=None,
                 flat_multiple=ALIGN, precision=None):
        """kernels: on the CPU 'numba' or 'numpy' (default: ANDREA_CPU_KERNELS, else numba when
        installed); on a GPU the fused kernels, 'auto' (the default: those that pass the start-up
        self-check, and with `batch`, are not slower than the generic code at batch x context_length),
        'fused' or 'generic' (train.kernels); chosen here once, like the device
        (minitensor.backends.get_ops). ops: a minitensor.backends.ops backend to use instead of the device's
        (tests). flat_multiple: the flat buffers' size is rounded up to it (minitensor.flat.Params; a
        run that shards them over N ranks asks for 16 N). precision: a policy's name of minitensor.precision
        (train.precision: "bf16" on a GPU, float32 masters and bfloat16 activations; refused on the CPU);
        None: dtype's own (float32 or float64 throughout)."""
        self.cfg = cfg
        self.device = get_device(device)
        self.ops = ops = ops or get_ops(self.device.xp, kernels, run_sizes(cfg, batch, precision) if batch else None)
        self.xp = ops.xp
        self.dtype = resolve_dtype(dtype)
        try:
            self.policy = policies.for_arrays(precision or self.dtype.name, self.xp)
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.policy.master_dtype != self.dtype:
            raise UserError(f"precision {self.policy.name} keeps {self.policy.master} master weights: use dtype "
                            f"{self.policy.master} with it, not {self.dtype}")
        self.params = Params(param_shapes(cfg), xp=self.xp, dtype=self.dtype, ops=ops, multiple=flat_multiple,
                             compute=self.policy.compute_dtype)
        p = self.params
        # the layers read the weights as the policy computes with them (p.compute_view: p's own views but
        # under bf16); ids are validated on the host in _ids, so the layers skip their own (device-syncing) checks
        self.wte = Embedding(p.compute_view("transformer.wte.weight"), p.grad("transformer.wte.weight"), check=False,
                             ops=ops)
        self.wpe = PositionEmbedding(p.compute_view("transformer.wpe.weight"), p.grad("transformer.wpe.weight"), ops=ops)
        self.blocks = [Block(p, f"transformer.h.{i}.", cfg, ops) for i in range(cfg.n_layer)]
        self.ln_f = norm_layer(p, "transformer.ln_f", cfg, ops)
        self.head = TiedHead(p.compute_view("transformer.wte.weight"), p.grad("transformer.wte.weight"), ops=ops)
        self.loss_fn = SoftmaxCrossEntropy(check=False, ops=ops)
        self.flow = None
        self.init_weights(seed)

    def record_flow(self, recorder):
        """Report the next forward(s) and backward(s) to recorder, or stop (None): its forward(i, x,
        s1, x1, s2, skip) and backward(i, dx) per block i, top(dx) at the top of the stack
        (andrea.run.gradflow.GradFlow says what each is)."""
        self.flow = recorder
        for i, block in enumerate(self.blocks):
            block.flow = None if recorder is None else (recorder, i)

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
        self.params.refresh_compute()

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
        if not all(block.opens for block in self.blocks):
            for block in self.blocks:
                x = block.forward(x)
            return self.ln_f.forward(x)
        # pre-norm: each residual join is made by the norm that follows it, in its first pass (the last
        # block's MLP's by ln_f)
        joined = None
        for block in self.blocks:
            joined = block.forward_open(x, joined)
        return self.ln_f.forward_joined(*joined)

    def backward(self, dloss=1.0, on_block=None):
        """Accumulates the gradients of the last loss into the gradient buffer. on_block(i), if given, is
        called after block i's backward, when its gradients are complete (the overlapped reduction,
        andrea.run.overlap, starts reducing them there)."""
        dx = self.ln_f.backward(self.head.backward(self.loss_fn.backward(dloss)))
        if self.flow is not None:
            self.flow.top(dx)
        for i in reversed(range(len(self.blocks))):
            dx = self.blocks[i].backward(dx)
            if on_block is not None:
                on_block(i)
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
        self.params.refresh_compute()

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
        dtype = self.params.compute.dtype  # the activations' (bfloat16 under bf16)
        return [(self.xp.zeros(shape, dtype), self.xp.zeros(shape, dtype)) for _ in self.blocks]

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
