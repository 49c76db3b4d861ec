"""The self-checks of CupyOps' fused pieces, registered in minitensor.backends.cuda.CHECKS.

Each runs one piece forward and backward on small random float32 inputs through the backend
`ops` it is given and returns its outputs; minitensor.checks.selfcheck runs it with a CupyOps that has
the piece off (the Ops code) and one that has it on (the kernel) and compares. They build the
layers themselves, so they live apart from the kernels (minitensor/backends/cupy_ops.py), which the
layers' backend chooser imports.
"""

import numpy as np

from minitensor.backends import cuda


def _draw(xp, rng, *shape, scale=1.0, shift=0.0):
    return xp.asarray((shift + scale * rng.standard_normal(shape)).astype(np.float32))


@cuda.self_check("bias_gelu")
def _check_bias_gelu(ops, rng):
    """GELU(x + b) forward and backward over (150, 70), wide enough to reach the tails; the backward
    also with the output recomputed (as MLP.backward asks)."""
    xp = ops.xp
    x, b, dy = _draw(xp, rng, 150, 70, scale=4.0), _draw(xp, rng, 70), _draw(xp, rng, 150, 70)
    y = ops.bias_gelu_forward(x, b)
    return y, ops.bias_gelu_backward(x, b, dy), *ops.bias_gelu_backward(x, b, dy, recompute_output=True)


@cuda.self_check("layernorm")
def _check_layernorm(ops, rng):
    """LayerNorm forward and backward (with a skip gradient) over 40 rows of 100 columns."""
    from minitensor.layers.layernorm import LayerNorm

    xp = ops.xp
    C = 100  # not a multiple of the 32-thread warps
    dw, db = xp.zeros(C, np.float32), xp.zeros(C, np.float32)
    ln = LayerNorm(_draw(xp, rng, C, shift=1.0), dw, _draw(xp, rng, C), db, ops=ops)
    y = ln.forward(_draw(xp, rng, 4, 10, C, scale=3.0, shift=0.5))
    dx = ln.backward(_draw(xp, rng, 4, 10, C), skip=_draw(xp, rng, 4, 10, C))
    return y, dx, dw, db


@cuda.self_check("causal_softmax")
def _check_causal_softmax(ops, rng):
    """A 4-head attention layer's dense core, forward and backward, over 2 x 40 positions."""
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.layers.linear import Linear

    xp = ops.xp
    B, T, C, nh = 2, 40, 48, 4
    grads = [xp.zeros(shape, np.float32) for shape in ((C, 3 * C), (3 * C,), (C, C), (C,))]
    attn = CausalSelfAttention(Linear(_draw(xp, rng, C, 3 * C, scale=0.3), grads[0], _draw(xp, rng, 3 * C), grads[1],
                                      ops=ops),
                               Linear(_draw(xp, rng, C, C, scale=0.3), grads[2], _draw(xp, rng, C), grads[3], ops=ops),
                               nh, ops=ops)
    attn.dense = True
    out = attn.forward(_draw(xp, rng, B, T, C))
    return (out, attn.backward(_draw(xp, rng, B, T, C)), *grads)


@cuda.self_check("softmax_xent")
def _check_softmax_xent(ops, rng):
    """Cross-entropy forward and backward (dloss 0.5) over 48 rows of 1000 logits; then over the same
    logits padded as the tied head pads them (ops.vocab_padding: 1024 columns with the kernel, none
    without), whose padded columns must get no gradient."""
    from minitensor.layers.loss import SoftmaxCrossEntropy

    xp = ops.xp
    logits = _draw(xp, rng, 6, 8, 1000, scale=3.0)
    targets = xp.asarray(rng.integers(0, 1000, (6, 8)))
    fn = SoftmaxCrossEntropy(ops=ops)
    loss = fn.forward(logits.copy(), targets, inplace=True)
    grad = fn.backward(0.5)
    padded = xp.zeros((6, 8, ops.vocab_padding(1000)), dtype=logits.dtype)
    padded[..., :1000] = logits
    padded_loss = fn.forward(padded, targets, inplace=True, valid=1000)
    padded_grad = fn.backward(0.5)
    return (xp.asarray(loss).reshape(1), grad, xp.asarray(padded_loss).reshape(1),
            xp.ascontiguousarray(padded_grad[..., :1000]), xp.abs(padded_grad[..., 1000:]).sum(axis=-1))


@cuda.self_check("adamw")
def _check_adamw(ops, rng):
    """Two AdamW steps over a small flat buffer of a decayed matrix and an undecayed vector."""
    from minitensor.optim import AdamW
    from minitensor.params import Params

    xp = ops.xp
    params = Params({"w": (7, 33), "b": (33,)}, xp=xp, dtype=np.float32, ops=ops)
    params.data[...] = xp.asarray(rng.standard_normal(params.data.shape).astype(np.float32))
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for scale in (1.0, 0.5):
        for name in params.names():  # through the views: the padding between tensors keeps g = 0
            view = params.grad(name)
            view[...] = xp.asarray(rng.standard_normal(view.shape).astype(np.float32))
        opt.step(grad_scale=xp.asarray(scale, dtype=np.float32))
    return params.data, opt.m, opt.v
