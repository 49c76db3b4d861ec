"""The reference the kernel tests compare with: `Ops` (minitensor.backends.ops, the textbook) in
float64 NumPy, in the call shapes those tests use, and the few forms Ops does not hold, written here
plainly (new arrays, no folded constants):

    softmax(z)                               p = softmax(z) by rows, lse = log(sum(exp(z)))  (..., V)
    causal_softmax(s, scale)                 (Ops.causal_softmax(scale s), its rows' log-sum-exp)
    causal_softmax_backward(dp, p, scale)    scale Ops.causal_softmax_backward(p, dp)
    causal_softmax_recompute(s, lse, scale)  p = exp(scale s + mask - lse): the blocked core's recompute
    softmax_xent_forward(logits, targets)    (Ops' loss, Ops' probabilities, the per-row losses)
    softmax_xent_backward(probs, targets)    Ops.softmax_xent_backward
    adamw(p, g, m, v, mask, ...)             one AdamW step in PyTorch's order (decay, then Adam): an
                                             independent check of Ops.adamw_step
    gelu(x), gelu_backward(x, dy)            Ops.gelu_forward, Ops.gelu_backward
    layernorm_forward(x, w, b, eps)          Ops.layernorm_forward
    layernorm_backward(dy, x, w, mean, rstd) (dx, dw, db) from Ops.layernorm_backward

Ops itself is checked against scalar formulas and finite differences in test_ops.py.
"""

import numpy as np

from minitensor.backends.ops import Ops, causal_mask

OPS = Ops(np)


def softmax(z):
    """(p, lse): p = softmax(z) by rows of z (..., V), lse (..., 1) each row's log-sum-exp."""
    top = z.max(axis=-1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, top + np.log(total)


def causal_softmax(s, scale=1.0):
    """(p, lse): p = softmax(scale s + mask) by rows, lse (..., T, 1) each row's log-sum-exp."""
    z = scale * s + causal_mask(np, s.shape[-2], s.shape[-1], s.dtype)
    top = z.max(axis=-1, keepdims=True)
    return OPS.causal_softmax(scale * s), top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


def causal_softmax_backward(dp, p, scale=1.0):
    """ds through p = softmax(z), z = scale s + mask."""
    return scale * OPS.causal_softmax_backward(p, dp)


def causal_softmax_recompute(s, lse, scale=1.0):
    """The probabilities again from the scores and each row's log-sum-exp."""
    return np.exp(scale * s + causal_mask(np, s.shape[-2], s.shape[-1], s.dtype) - lse)


def softmax_xent_forward(logits, targets):
    """(loss, probs, losses): losses = logsumexp(z) - z[target] per row, loss Ops' mean of them."""
    z = logits.reshape(-1, logits.shape[-1])
    t = np.asarray(targets).reshape(-1)
    loss, probs = OPS.softmax_xent_forward(z.copy(), t)
    _, lse = softmax(z)
    return loss, probs.reshape(logits.shape), lse[:, 0] - z[np.arange(len(t)), t]


def softmax_xent_backward(probs, targets, dloss=1.0):
    """dlogits = dloss (probs - onehot(target)) / N, N = the number of rows."""
    p = probs.reshape(-1, probs.shape[-1])
    return OPS.softmax_xent_backward(p.copy(), np.asarray(targets).reshape(-1), dloss).reshape(probs.shape)


def adamw(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step as PyTorch orders it (decay first, then the Adam step); returns the new (p, m, v).
    Decoupled decay where mask == 1; t counts from 1."""
    gs = g * grad_scale
    m = beta1 * m + (1.0 - beta1) * gs
    v = beta2 * v + (1.0 - beta2) * gs * gs
    m_hat = m / (1.0 - beta1**t)
    v_hat = v / (1.0 - beta2**t)
    return p * (1.0 - lr * weight_decay * mask) - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def gelu(x):
    return OPS.gelu_forward(x)


def gelu_backward(x, dy):
    return OPS.gelu_backward(x, dy)


def layernorm_forward(x, w, b, eps=1e-5):
    return OPS.layernorm_forward(x, w, b, eps)


def layernorm_backward(dy, x, w, mean, rstd):
    dw, db = np.zeros(x.shape[-1]), np.zeros(x.shape[-1])
    dx = OPS.layernorm_backward(dy, x, mean, rstd, w, dw, db)
    return dx, dw, db
