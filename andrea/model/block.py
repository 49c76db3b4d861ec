"""The transformer block and its MLP, the composites that own the fusion schedule.

    norm_position=pre (ANDREA, GPT-2):  x1 = x + attn(ln_1(x)),   x2 = x1 + mlp(ln_2(x1))
    norm_position=post (2017):          x1 = ln_1(x + attn(x)),   x2 = ln_2(x1 + mlp(x1))
    norm_position=none:                 pre-norm's, ln_1 and ln_2 the identity (NoNorm)
    ln_1, ln_2 (and the model's ln_f): the kind model.norm says, a layer of NORMS below
    mlp(x) = c_proj(act(c_fc(x))), act GELU, ReLU or SwiGLU

The residual adds run in the epilogue of each branch's last product, c_fc's bias in the
activation's pass, and c_proj's input is recomputed in backward instead of kept. A block is built
from views of the model's flat buffers (minitensor.flat) under its GPT-2 names: the weights the layers
read (Params.compute_view: bfloat16 under precision bf16) and the gradients (float32 under bf16).
"""

from typing import NamedTuple

from andrea.errors import check_key
from minitensor.layers.attention import CausalSelfAttention
from minitensor.layers.layer import Layer, Norm
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.linear import Linear
from minitensor.layers.rmsnorm import RMSNorm


def _linear(p, name, ops):
    return Linear(p.compute_view(name + ".weight"), p.grad(name + ".weight"), p.compute_view(name + ".bias"),
                  p.grad(name + ".bias"), ops=ops)


# model.norm -> its layer, a Norm (minitensor.layers.layer): the config's values, the parameters'
# names and shapes (andrea.model.sizes) and the layers built below all come from here
NORMS = {"layernorm": LayerNorm, "rms": RMSNorm}


def check_norm(kind: str, note: str = "") -> None:
    """A UserError unless kind is a norm of NORMS (model.norm's check, in andrea.config), note said
    after the kinds."""
    check_key(NORMS, kind, "model.norm", note)


def norm_layer(p, name, cfg, ops):
    """The norm named name (ln_1, ln_2, ln_f) over its views in p, of the kind cfg.norm, its parameters
    name.weight, name.bias, ... as the kind's `params` says; NoNorm where p has none (norm_position=none)."""
    if name + ".weight" not in p.shapes:
        return NoNorm(ops)
    kind = NORMS[cfg.norm]
    views = [v for s in kind.params for v in (p.compute_view(f"{name}.{s}"), p.grad(f"{name}.{s}"))]
    return kind(*views, cfg.ln_eps, ops=ops)


class NoNorm(Norm):
    """Where a norm would be with model.norm_position=none: the identity, no parameters, no statistics.

    forward:   y = x                     backward:  dx = dy (+ skip, the Norm contract)"""

    def forward(self, x):
        return x

    def backward(self, dy, skip=None):
        return dy if skip is None else dy + skip

    def infer_stats(self, x):
        return x, {}


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
               and GELU's sums c_fc's bias gradient db_fc += sum over rows of dh in it too;
               dW_proj += g^T dout (db_proj += sum over rows of dout, unless a norm sums it);
               dW_fc += x^T dh;  dx = dh W_fc^T
    """

    def __init__(self, c_fc, c_proj, ops, activation="gelu"):
        super().__init__(ops)
        self.c_fc, self.c_proj = c_fc, c_proj
        pieces = {"gelu": (ops.bias_gelu_forward, ops.bias_gelu_backward),
                  "relu": (ops.bias_relu_forward, ops.bias_relu_backward),
                  "swiglu": (ops.bias_swiglu_forward, ops.bias_swiglu_backward)}
        if activation not in pieces:
            raise ValueError(f"activation must be one of {sorted(pieces)}, got {activation!r}")
        self.activation = activation
        self.act_forward, self.act_backward = pieces[activation]

    def forward(self, x, residual=None, epilogue=True):
        """out (+ residual); epilogue False: c_proj's product without its bias, for the caller to join
        (Norm.forward_joined)."""
        C = x.shape[-1]
        x2 = x.reshape(-1, C)
        h = self.ops.matmul(x2, self.c_fc.W)                 # (N, 4C)
        g = self.act_forward(h, self.c_fc.b)
        out = self.ops.matmul(g, self.c_proj.W)              # (N, C)
        if epilogue:
            self.ops.add_epilogue(out, self.c_proj.b, None if residual is None else residual.reshape(out.shape))
        self._save(MLPCache(x2, h, x.shape))
        return out.reshape(x.shape)

    def backward(self, dout, sum_bias=True):
        """dx from dout; sum_bias False leaves c_proj's bias gradient to the caller (as the attention's)."""
        x2, h, shape = self._pop()
        dout2 = dout.reshape(-1, shape[-1])
        dg = self.ops.matmul(dout2, self.c_proj.W.T)
        gelu = self.activation == "gelu"
        if gelu:  # c_fc's bias gradient summed in the activation's backward pass, which writes dh
            dh, g = self.ops.bias_gelu_backward(h, self.c_fc.b, dg, recompute_output=True, db=self.c_fc.db)
        else:
            dh, g = self.act_backward(h, self.c_fc.b, dg, recompute_output=True)
        self.c_proj.weight_grads(g, dout2, bias=sum_bias)
        self.c_fc.weight_grads(x2, dh, bias=not gelu)
        return self.ops.matmul(dh, self.c_fc.W.T).reshape(shape)


class Block:
    """A transformer block: attention then MLP, each a sublayer f with its norm and skip.

    pre-norm (ANDREA, GPT-2):  x1 = x + attn(ln_1(x)),   x2 = x1 + mlp(ln_2(x1))
    post-norm (2017):          x1 = ln_1(x + attn(x)),   x2 = ln_2(x1 + mlp(x1))
    norm_position=none:        pre-norm's, ln_1 and ln_2 the identity (NoNorm)
    without residuals the "x +" and "x1 +" are dropped. ln_1 and ln_2 are Norms (minitensor.layers.layer):
    the block relies on their skip and infer_stats (minitensor.layers.layer), not on their kind.
    """

    def __init__(self, p, prefix, cfg, ops):
        self.position, self.residual, self.ops = cfg.norm_position, cfg.residual, ops
        self.ln_1 = norm_layer(p, prefix + "ln_1", cfg, ops)
        self.attn = CausalSelfAttention(_linear(p, prefix + "attn.c_attn", ops),
                                        _linear(p, prefix + "attn.c_proj", ops), cfg.n_head, ops=ops)
        self.ln_2 = norm_layer(p, prefix + "ln_2", cfg, ops)
        self.mlp = MLP(_linear(p, prefix + "mlp.c_fc", ops), _linear(p, prefix + "mlp.c_proj", ops), ops,
                       cfg.activation)
        self.flow = None       # (a recorder, this block's index) while ANDREA.record_flow records

    @property
    def opens(self):
        """Whether forward_open applies: pre-norm with residuals, no flow being recorded."""
        return self.position != "post" and self.residual and self.flow is None

    def forward_open(self, x, joined=None):
        """forward(x) with the MLP's epilogue left open: (its product, c_proj's bias, x1), which the next
        norm joins in its first pass (Norm.forward_joined: x2 = product + bias + x1). joined: the previous
        block's open triple, joined here by ln_1 (x then unused: the join is x). Only where `opens`."""
        if joined is None:
            h = self.ln_1.forward(x)
        else:
            x, h = joined[0], self.ln_1.forward_joined(*joined)
        x1 = self.attn.forward(h, epilogue=False)
        h = self.ln_2.forward_joined(x1, self.attn.c_proj.b, x)
        return self.mlp.forward(h, epilogue=False), self.mlp.c_proj.b, x1

    def forward(self, x):
        skip = self.residual
        if self.position != "post":
            # the residual adds run in the epilogue of each branch's last product; the attention's in the
            # first pass of ln_2 over it (forward_joined: x1 = product + bias + x, in place, then normalised)
            if skip:
                s1 = x1 = self.attn.forward(self.ln_1.forward(x), epilogue=False)
                h = self.ln_2.forward_joined(x1, self.attn.c_proj.b, x)
            else:
                s1 = x1 = self.attn.forward(self.ln_1.forward(x))
                h = self.ln_2.forward(x1)
            s2 = x2 = self.mlp.forward(h, residual=x1 if skip else None)
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
        if self.position != "post":
            x1 = self.attn.forward_kv(self.ln_1.infer(x), kv, pos, residual=x if skip else None)
            return self.mlp.infer(self.ln_2.infer(x1), residual=x1 if skip else None)
        x1 = self.ln_1.infer(self.attn.forward_kv(x, kv, pos, residual=x if skip else None))
        return self.ln_2.infer(self.mlp.infer(x1, residual=x1 if skip else None))

    def trace(self, x, kv, pos):
        """infer(x, kv, pos), keeping what andrea.trace shows, as a dict of arrays: "x" the stream
        entering, "ln_1" and "ln_2" each norm's statistics ({name: (..., 1)}, the names its kind's
        `stats` gives: LayerNorm's mean and rstd; {} without norms), "probs" the attention
        probabilities (B, nh, T, pos + T), "attn" and "mlp" each sublayer's output before its skip
        adds it (its delta), "x1" the stream after attention, "x2" after the MLP. The skips are
        added here after each sublayer instead of in its epilogue: the same float adds, so x2 is
        infer's to the bit."""
        skip, t = self.residual, {"x": x}
        if self.position != "post":
            h, t["ln_1"] = self.ln_1.infer_stats(x)
            t["attn"] = self.attn.forward_kv(h, kv, pos, record=t)
            t["x1"] = x + t["attn"] if skip else t["attn"]
            h, t["ln_2"] = self.ln_2.infer_stats(t["x1"])
            t["mlp"] = self.mlp.infer(h)
            t["x2"] = t["x1"] + t["mlp"] if skip else t["mlp"]
        else:
            t["attn"] = self.attn.forward_kv(x, kv, pos, record=t)
            t["x1"], t["ln_1"] = self.ln_1.infer_stats(x + t["attn"] if skip else t["attn"])
            t["mlp"] = self.mlp.infer(t["x1"])
            t["x2"], t["ln_2"] = self.ln_2.infer_stats(t["x1"] + t["mlp"] if skip else t["mlp"])
        return t

    def backward(self, dx2):
        skip = self.residual
        if self.position != "post":
            # forward was: x2 = x1 + mlp(ln_2(x1)); x1 = x + attn(ln_1(x)); each skip's gradient is
            # added in the pass of the norm's backward it goes around, which also sums its columns: the
            # skip's gradient is the sublayer's output's, so they are the gradient of c_proj's bias; a
            # backend may leave c_fc's and c_attn's bias sums to the norm's backward after each (nothing reads
            # them before this block's backward returns: ops.deferred_bias_sums)
            if skip:
                with self.ops.deferred_bias_sums():
                    dx1 = self.ln_2.backward_and_sum_skip(self.mlp.backward(dx2, sum_bias=False), dx2, self.mlp.c_proj)
                    dx = self.ln_1.backward_and_sum_skip(self.attn.backward(dx1, sum_bias=False), dx1,
                                                         self.attn.c_proj)
            else:
                dx = self.ln_1.backward(self.attn.backward(self.ln_2.backward(self.mlp.backward(dx2))))
        else:
            # forward was: x2 = ln_2(s2), s2 = x1 + mlp(x1); x1 = ln_1(s1), s1 = x + attn(x): every
            # gradient passes through a norm before it reaches the skip that goes around f
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
