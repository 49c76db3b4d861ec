"""Each layer as a test case: its parameters, its inputs, and a slow reference written the obvious way.

A case builder takes (xp, dtype, seed, dims) and returns a Case whose forward()/backward(dy) run
the layer on the arrays held in the case (so the gradient checker can perturb them in place), and
whose reference() recomputes the forward in float64 NumPy with plain loops. The layers run on
dims["ops"] if given (a backend of minitensor.backends.ops), else on get_ops(xp), the default one.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from andrea.model.block import MLP
from minitensor.backends import get_ops
from minitensor.backends.ops import Ops
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.layers.attention import CausalSelfAttention
from minitensor.layers.embedding import Embedding, PositionEmbedding, TiedHead
from minitensor.layers.gelu import GELU
from minitensor.layers.layernorm import LayerNorm
from minitensor.layers.linear import Linear
from minitensor.layers.loss import SoftmaxCrossEntropy
from minitensor.layers.relu import ReLU
from minitensor.layers.rmsnorm import RMSNorm
from minitensor.layers.swiglu import SwiGLU


@dataclass
class Case:
    layer: object
    params: Params
    inputs: dict                       # differentiable inputs by name
    forward: object                    # () -> y
    backward: object                   # dy -> {input name: dx}
    reference: object                  # () -> y in float64, from plain loops
    out_shape: tuple
    extra: dict = field(default_factory=dict)

    def param_pairs(self):
        return {n: (self.params[n], self.params.grad(n)) for n in self.params.names()}


def _ops(xp, dims):
    return dims.get("ops") or get_ops(xp)


def all_ops(xp):
    """Every backend for arrays of xp: the Ops reference and each optimised one."""
    if xp is np:
        from minitensor.backends.numpy_ops import NumpyOps

        return [Ops(np), NumpyOps(numba=False), NumpyOps(numba=True)]
    return [Ops(xp), get_ops(xp)]


def _params(xp, dtype, rng, shapes, scale=1.0, ops=None):
    p = Params(shapes, xp=xp, dtype=dtype, ops=ops)
    for _, view in p.items():
        view[...] = xp.asarray(rng.standard_normal(view.shape) * scale)
    return p


def _np(a):
    return to_numpy(a).astype(np.float64)


def gelu_scalar(x):
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def relu_scalar(x):
    return x if x > 0 else 0.0


def swiglu_reference(h):
    """SiLU(a) * b for h = [a | b] over the last axis, each entry by math.exp."""
    F = h.shape[-1] // 2
    silu = np.vectorize(lambda a: a / (1 + math.exp(-a)))
    return silu(h[..., :F]) * h[..., F:]


SCALAR = {"gelu": gelu_scalar, "relu": relu_scalar}
# the activation over a whole (..., n) array: elementwise, or SwiGLU's halves (..., 2F) -> (..., F)
REFERENCE = {name: np.vectorize(f) for name, f in SCALAR.items()} | {"swiglu": swiglu_reference}
WIDTH = {"gelu": 1, "relu": 1, "swiglu": 2}   # c_fc's width over the activation's output

# ReLU's kink at 0: finite differences step parameters and inputs by up to 2e-4 (gradcheck's
# fourth-order stencil), which moves a pre-activation of these cases by well under KINK_MARGIN;
# so a draw with every pre-activation at least this far from 0 is differentiable where checked
KINK_MARGIN = 2e-3


def off_kinks(draw, pre_activation, activation, seed):
    """draw(rng) -> values, redrawn (from seed, seed + 1000, ...) until every pre_activation(values)
    is KINK_MARGIN away from ReLU's kink (Chainer's "move inputs off kinks"); GELU needs no redraw."""
    for attempt in range(1000):
        values = draw(np.random.default_rng(seed + 1000 * attempt))
        if activation != "relu" or np.abs(pre_activation(values)).min(initial=np.inf) > KINK_MARGIN:
            return values
    raise AssertionError("no draw off ReLU's kink in 1000 attempts")


def linear_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    B, T, n_in, n_out = dims["B"], dims["T"], dims["n_in"], dims["n_out"]
    p = _params(xp, dtype, rng, {"w": (n_in, n_out), "b": (n_out,)})
    layer = Linear(p["w"], p.grad("w"), p["b"], p.grad("b"), ops=_ops(xp, dims))
    x = xp.asarray(rng.standard_normal((B, T, n_in)), dtype=dtype)

    def reference():
        xs, W, b = _np(x), _np(p["w"]), _np(p["b"])
        y = np.zeros((B, T, n_out))
        for i in np.ndindex(B, T):
            for j in range(n_out):
                y[i + (j,)] = sum(xs[i + (k,)] * W[k, j] for k in range(n_in)) + b[j]
        return y

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, (B, T, n_out))


def layernorm_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    B, T, C = dims["B"], dims["T"], dims["C"]
    p = _params(xp, dtype, rng, {"w": (C,), "b": (C,)})
    layer = LayerNorm(p["w"], p.grad("w"), p["b"], p.grad("b"), ops=_ops(xp, dims))
    # a per-row offset and scale, so the statistics matter; the linspace keeps every row's variance
    # away from 0, where rstd -> 1/sqrt(eps) amplifies float32 rounding 300-fold (ill-conditioned)
    x = rng.permuted(np.broadcast_to(np.linspace(-1.5, 1.5, C), (B, T, C)), axis=-1)
    x = x + 0.3 * rng.standard_normal((B, T, C))
    x = x * rng.uniform(0.5, 3, (B, T, 1)) + rng.standard_normal((B, T, 1))
    x = xp.asarray(x, dtype=dtype)

    def reference():
        xs, w, b = _np(x), _np(p["w"]), _np(p["b"])
        y = np.zeros_like(xs)
        for i in np.ndindex(B, T):
            row = xs[i]
            mu = sum(row) / C
            var = sum((r - mu) ** 2 for r in row) / C
            y[i] = [(r - mu) / math.sqrt(var + 1e-5) * w[j] + b[j] for j, r in enumerate(row)]
        return y

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, (B, T, C))


def rmsnorm_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    B, T, C = dims["B"], dims["T"], dims["C"]
    p = _params(xp, dtype, rng, {"w": (C,)})
    layer = RMSNorm(p["w"], p.grad("w"), ops=_ops(xp, dims))
    # every entry at least ~0.2 from 0, so every row's root mean square is far above sqrt(eps), where
    # rstd -> 1/sqrt(eps) would make the row ill-conditioned; random signs, so rows keep a mean
    magnitude = rng.permuted(np.broadcast_to(np.linspace(0.5, 2.0, C), (B, T, C)), axis=-1)
    x = magnitude * rng.uniform(0.8, 1.2, (B, T, C)) * rng.choice([-1.0, 1.0], (B, T, C))
    x = xp.asarray(x * rng.uniform(0.5, 3, (B, T, 1)), dtype=dtype)

    def reference():
        xs, w = _np(x), _np(p["w"])
        y = np.zeros_like(xs)
        for i in np.ndindex(B, T):
            rms = math.sqrt(sum(r * r for r in xs[i]) / C + 1e-5)
            y[i] = [r / rms * w[j] for j, r in enumerate(xs[i])]
        return y

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, (B, T, C))


def gelu_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    shape = (dims["B"], dims["T"], dims["C"])
    layer = GELU(ops=_ops(xp, dims))
    p = Params({}, xp=xp, dtype=dtype)
    x = xp.asarray(rng.standard_normal(shape) * 2, dtype=dtype)

    def reference():
        return np.vectorize(gelu_scalar)(_np(x))

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, shape)


def relu_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    shape = (dims["B"], dims["T"], dims["C"])
    layer = ReLU(ops=_ops(xp, dims))
    p = Params({}, xp=xp, dtype=dtype)
    x = rng.standard_normal(shape) * 2
    x = xp.asarray(np.sign(x) * (np.abs(x) + 0.05), dtype=dtype)        # off the kink at 0

    def reference():
        return np.vectorize(relu_scalar)(_np(x))

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, shape)


def swiglu_case(xp, dtype, seed, dims):
    """h (B, T, 2C) -> (B, T, C); the gate's values spread to +-6, where SiLU bends most."""
    rng = np.random.default_rng(seed)
    shape = (dims["B"], dims["T"], 2 * dims["C"])
    layer = SwiGLU(ops=_ops(xp, dims))
    p = Params({}, xp=xp, dtype=dtype)
    h = xp.asarray(rng.standard_normal(shape) * 2.5, dtype=dtype)

    def reference():
        return swiglu_reference(_np(h))

    return Case(layer, p, {"h": h}, lambda: layer.forward(h), lambda dy: {"h": layer.backward(dy)},
                reference, shape[:2] + (dims["C"],))


def attention_case(xp, dtype, seed, dims):
    """dims["block"]: query rows per block; dims["recompute"]: recompute the probabilities in backward;
    dims["dense"]: the dense core (one GEMM per product, no blocks) forced on or off; by default the
    layer chooses (dense on CuPy), and a case with blocks or recomputation keeps to the blocks."""
    rng = np.random.default_rng(seed)
    B, T, C, nh = dims["B"], dims["T"], dims["C"], dims["n_head"]
    shapes = {"c_attn.weight": (C, 3 * C), "c_attn.bias": (3 * C,), "c_proj.weight": (C, C), "c_proj.bias": (C,)}
    p = _params(xp, dtype, rng, shapes, scale=0.5)
    ops = _ops(xp, dims)
    c_attn = Linear(p["c_attn.weight"], p.grad("c_attn.weight"), p["c_attn.bias"], p.grad("c_attn.bias"), ops=ops)
    c_proj = Linear(p["c_proj.weight"], p.grad("c_proj.weight"), p["c_proj.bias"], p.grad("c_proj.bias"), ops=ops)
    layer = CausalSelfAttention(c_attn, c_proj, nh, ops=ops)
    layer.block = dims.get("block", layer.block)
    if dims.get("recompute"):
        layer.keep_probs_max_bytes = 0
    layer.dense = dims.get("dense", False if "block" in dims or dims.get("recompute") else None)
    x = xp.asarray(rng.standard_normal((B, T, C)), dtype=dtype)

    def reference():
        xs = _np(x)
        Wa, ba, Wp, bp = (_np(p[n]) for n in shapes)
        hs = C // nh
        y = np.zeros((B, T, C))
        for b in range(B):
            qkv = xs[b] @ Wa + ba
            for h in range(nh):
                q = qkv[:, h * hs:(h + 1) * hs]
                k = qkv[:, C + h * hs:C + (h + 1) * hs]
                v = qkv[:, 2 * C + h * hs:2 * C + (h + 1) * hs]
                for t in range(T):
                    scores = [float(q[t] @ k[s]) / math.sqrt(hs) for s in range(t + 1)]
                    m = max(scores)
                    w = [math.exp(sc - m) for sc in scores]
                    y[b, t, h * hs:(h + 1) * hs] = sum(wi * v[s] for s, wi in enumerate(w)) / sum(w)
            y[b] = y[b] @ Wp + bp
        return y

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, (B, T, C))


def embedding_case(xp, dtype, seed, dims):
    """Token plus position embedding; ids drawn from a small vocabulary so they repeat."""
    rng = np.random.default_rng(seed)
    B, T, C, V = dims["B"], dims["T"], dims["C"], dims["V"]
    p = _params(xp, dtype, rng, {"wte": (V, C), "wpe": (T + 2, C)})
    tok = Embedding(p["wte"], p.grad("wte"), ops=_ops(xp, dims))
    pos = PositionEmbedding(p["wpe"], p.grad("wpe"), ops=_ops(xp, dims))
    idx = xp.asarray(rng.integers(0, V, (B, T)))

    def forward():
        return tok.forward(idx) + pos.forward(B, T)

    def backward(dy):
        tok.backward(dy)
        pos.backward(dy)
        return {}

    def reference():
        wte, wpe, ids = _np(p["wte"]), _np(p["wpe"]), to_numpy(idx)
        return np.array([[wte[ids[b, t]] + wpe[t] for t in range(T)] for b in range(B)])

    return Case(tok, p, {}, forward, backward, reference, (B, T, C), {"idx": idx, "pos": pos})


def head_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    B, T, C, V = dims["B"], dims["T"], dims["C"], dims["V"]
    p = _params(xp, dtype, rng, {"wte": (V, C)})
    layer = TiedHead(p["wte"], p.grad("wte"), ops=_ops(xp, dims))
    x = xp.asarray(rng.standard_normal((B, T, C)), dtype=dtype)

    def reference():
        xs, W = _np(x), _np(p["wte"])
        return np.array([[[xs[b, t] @ W[v] for v in range(V)] for t in range(T)] for b in range(B)])

    return Case(layer, p, {"x": x}, lambda: layer.forward(x), lambda dy: {"x": layer.backward(dy)},
                reference, (B, T, V))


def loss_case(xp, dtype, seed, dims):
    rng = np.random.default_rng(seed)
    B, T, V = dims["B"], dims["T"], dims["V"]
    layer = SoftmaxCrossEntropy(ops=_ops(xp, dims))
    p = Params({}, xp=xp, dtype=dtype)
    logits = xp.asarray(rng.standard_normal((B, T, V)) * 3, dtype=dtype)
    targets = xp.asarray(rng.integers(0, V, (B, T)))

    def reference():
        z, t = _np(logits), to_numpy(targets)
        total = 0.0
        for i in np.ndindex(B, T):
            m = max(z[i])
            total += m + math.log(sum(math.exp(v - m) for v in z[i])) - z[i][t[i]]
        return np.float64(total / (B * T))

    return Case(layer, p, {"logits": logits}, lambda: layer.forward(logits, targets),
                lambda dy: {"logits": layer.backward(dy)}, reference, (), {"targets": targets})


def with_residual(base_case):
    """The same composite with a skip connection fused in: forward(x, residual=r) = layer(x) + r,
    r a second input whose gradient is dy."""

    def build(xp, dtype, seed, dims):
        case = base_case(xp, dtype, seed, dims)
        r = xp.asarray(np.random.default_rng(seed + 7).standard_normal(case.out_shape), dtype=dtype)
        x = case.inputs["x"]
        return Case(case.layer, case.params, {"x": x, "r": r}, lambda: case.layer.forward(x, residual=r),
                    lambda dy: {"x": case.layer.backward(dy), "r": dy}, lambda: case.reference() + _np(r),
                    case.out_shape)

    return build


def layernorm_skip_case(xp, dtype, seed, dims):
    """y = LayerNorm(x) + x, the skip's gradient added by backward(dy, skip=dy)."""
    case = layernorm_case(xp, dtype, seed, dims)
    x = case.inputs["x"]
    return Case(case.layer, case.params, {"x": x}, lambda: case.layer.forward(x) + x,
                lambda dy: {"x": case.layer.backward(dy, skip=dy)}, lambda: case.reference() + _np(x),
                case.out_shape)


def rmsnorm_skip_case(xp, dtype, seed, dims):
    """y = RMSNorm(x) + x, the skip's gradient added by backward(dy, skip=dy)."""
    case = rmsnorm_case(xp, dtype, seed, dims)
    x = case.inputs["x"]
    return Case(case.layer, case.params, {"x": x}, lambda: case.layer.forward(x) + x,
                lambda dy: {"x": case.layer.backward(dy, skip=dy)}, lambda: case.reference() + _np(x),
                case.out_shape)


def bias_act_case(activation):
    """y = act(x + b) through ops.bias_<act>_forward / _backward (the MLP's fused piece), with
    x = h @ W so that the pass that may update x in place is differentiated through a product."""

    def build(xp, dtype, seed, dims):
        B, T, n_in, n_out = dims["B"], dims["T"], dims["n_in"], dims["n_out"]
        ops = _ops(xp, dims)
        act_forward = getattr(ops, f"bias_{activation}_forward")
        act_backward = getattr(ops, f"bias_{activation}_backward")
        wide = WIDTH[activation] * n_out                    # c_fc's output: n_out, or SwiGLU's 2 n_out
        w, b, h = off_kinks(lambda rng: (rng.standard_normal((n_in, wide)), rng.standard_normal(wide),
                                         rng.standard_normal((B * T, n_in))),
                            lambda v: v[2] @ v[0] + v[1], activation, seed)
        p = Params({"w": (n_in, wide), "b": (wide,)}, xp=xp, dtype=dtype)
        p["w"][...], p["b"][...] = xp.asarray(w), xp.asarray(b)
        h = xp.asarray(h, dtype=dtype)
        kept = {}

        def forward():
            x = h @ p["w"]
            kept["x"] = x
            return act_forward(x, p["b"]).reshape(B, T, n_out)

        def backward(dy):
            if "x" not in kept:  # what a layer's cache says: the pair is forward then backward, once
                raise RuntimeError(f"bias_{activation}_backward without a forward")
            dx = act_backward(kept.pop("x"), p["b"], dy.reshape(B * T, n_out))     # (B * T, wide)
            p.grad("w")[...] += h.T @ dx
            p.grad("b")[...] += dx.sum(axis=0)
            return {"h": dx @ p["w"].T}

        def reference():
            return REFERENCE[activation](_np(h) @ _np(p["w"]) + _np(p["b"])).reshape(B, T, n_out)

        return Case(None, p, {"h": h}, forward, backward, reference, (B, T, n_out))

    return build


def mlp_case_for(activation):
    """y = c_proj(act(c_fc(x))) as andrea's MLP runs it: c_fc's bias in the activation's pass,
    act(h) recomputed in backward for c_proj's weight gradient."""

    def build(xp, dtype, seed, dims):
        B, T, n_in, hidden = dims["B"], dims["T"], dims["n_in"], dims["n_out"]
        ops = _ops(xp, dims)
        wide = WIDTH[activation] * hidden
        shapes = {"fc.w": (n_in, wide), "fc.b": (wide,), "proj.w": (hidden, n_in), "proj.b": (n_in,)}
        values, x = off_kinks(lambda rng: ({n: rng.standard_normal(s) for n, s in shapes.items()},
                                           rng.standard_normal((B, T, n_in))),
                              lambda v: v[1] @ v[0]["fc.w"] + v[0]["fc.b"], activation, seed)
        p = Params(shapes, xp=xp, dtype=dtype)
        for name, view in p.items():
            view[...] = xp.asarray(values[name])
        fc = Linear(p["fc.w"], p.grad("fc.w"), p["fc.b"], p.grad("fc.b"), ops=ops)
        proj = Linear(p["proj.w"], p.grad("proj.w"), p["proj.b"], p.grad("proj.b"), ops=ops)
        mlp = MLP(fc, proj, ops, activation)
        x = xp.asarray(x, dtype=dtype)

        def reference():
            h = _np(x) @ _np(p["fc.w"]) + _np(p["fc.b"])
            return REFERENCE[activation](h) @ _np(p["proj.w"]) + _np(p["proj.b"])

        return Case(mlp, p, {"x": x}, lambda: mlp.forward(x), lambda dy: {"x": mlp.backward(dy)}, reference,
                    (B, T, n_in))

    return build


mlp_case = mlp_case_for("gelu")


CASES = {
    "linear": linear_case,
    "layernorm": layernorm_case,
    "rmsnorm": rmsnorm_case,
    "gelu": gelu_case,
    "attention": attention_case,
    "attention-blocks": lambda xp, dtype, seed, dims: attention_case(xp, dtype, seed, {**dims, "block": 2}),
    "attention-recompute": lambda xp, dtype, seed, dims: attention_case(xp, dtype, seed,
                                                                        {**dims, "block": 3, "recompute": True}),
    "attention-dense": lambda xp, dtype, seed, dims: attention_case(xp, dtype, seed, {**dims, "dense": True}),
    "bias+gelu": bias_act_case("gelu"),
    "mlp": mlp_case,
    "mlp+residual": with_residual(mlp_case),
    "relu": relu_case,
    "bias+relu": bias_act_case("relu"),
    "mlp-relu": mlp_case_for("relu"),
    "mlp-relu+residual": with_residual(mlp_case_for("relu")),
    "swiglu": swiglu_case,
    "bias+swiglu": bias_act_case("swiglu"),
    "mlp-swiglu": mlp_case_for("swiglu"),
    "mlp-swiglu+residual": with_residual(mlp_case_for("swiglu")),
    "layernorm+residual": layernorm_skip_case,
    "rmsnorm+residual": rmsnorm_skip_case,
    "attention+residual": with_residual(attention_case),
    "embedding": embedding_case,
    "head": head_case,
    "loss": loss_case,
}
