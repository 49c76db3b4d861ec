"""Textbook forms of the maths the layers, the numba kernels and the CUDA kernels compute, for the
tests only: written plainly in float64 NumPy (new arrays, no in-place tricks, no folded
constants), so that a test compares a layer's code or a kernel with the maths as a reader knows it.

    softmax(z)                               p = softmax(z) by rows, lse = log(sum(exp(z)))  (..., V)
    causal_softmax(s, scale)                 p = softmax(scale s + mask) by rows, lse   (..., T, T)
    causal_softmax_backward(dp, p, scale)    ds = scale p (dp - rowsum(dp p))
    causal_softmax_recompute(s, lse, scale)  p = exp(scale s + mask - lse)
    softmax_xent_forward(logits, targets)    loss = mean(logsumexp(z) - z[target])       (..., V)
    softmax_xent_backward(probs, targets)    dz = dloss (probs - onehot(target)) / N
    adamw(p, g, m, v, mask, ...)             one AdamW step (Loshchilov & Hutter), bias-corrected
    gelu(x)                                  y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
    gelu_backward(x, dy)                     dx = dy GELU'(x); bias + GELU is gelu(x + b)
    layernorm_forward(x, w, b, eps)          (y, mean, rstd) for rows x (N, C)
    layernorm_backward(dy, x, w, mean, rstd) (dx, dw, db)
"""

import numpy as np


def _causal_mask(T):
    return np.triu(np.full((T, T), -np.inf), k=1)


def softmax(z):
    """(p, lse): p = softmax(z) by rows of z (..., V), lse (..., 1) each row's log-sum-exp."""
    top = z.max(axis=-1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    return e / total, top + np.log(total)


def causal_softmax(s, scale=1.0):
    """(p, lse): p = softmax(scale s + mask) by rows, lse (..., T, 1) each row's log-sum-exp."""
    return softmax(scale * s + _causal_mask(s.shape[-1]))


def causal_softmax_backward(dp, p, scale=1.0):
    """ds = scale p (dp - rowsum(dp p)): through p = softmax(z), z = scale s + mask."""
    return scale * (p * (dp - (dp * p).sum(axis=-1, keepdims=True)))


def causal_softmax_recompute(s, lse, scale=1.0):
    """The probabilities again from the scores and each row's log-sum-exp."""
    return np.exp(scale * s + _causal_mask(s.shape[-1]) - lse)


def softmax_xent_forward(logits, targets):
    """(loss, probs, losses): losses = logsumexp(z) - z[target] per row, loss their mean."""
    z = logits.reshape(-1, logits.shape[-1])
    t = np.asarray(targets).reshape(-1)
    top = z.max(axis=1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=1, keepdims=True)
    losses = np.log(total[:, 0]) + top[:, 0] - z[np.arange(len(t)), t]
    return losses.mean(), (e / total).reshape(logits.shape), losses


def softmax_xent_backward(probs, targets, dloss=1.0):
    """dlogits = dloss (probs - onehot(target)) / N, N = the number of rows."""
    d = probs.reshape(-1, probs.shape[-1]).copy()
    t = np.asarray(targets).reshape(-1)
    d[np.arange(len(t)), t] -= 1.0
    return (d * (dloss / len(t))).reshape(probs.shape)


def adamw(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step; returns the new (p, m, v). Decoupled decay where mask == 1; t counts from 1."""
    gs = g * grad_scale
    m = beta1 * m + (1.0 - beta1) * gs
    v = beta2 * v + (1.0 - beta2) * gs * gs
    m_hat = m / (1.0 - beta1**t)
    v_hat = v / (1.0 - beta2**t)
    return p * (1.0 - lr * weight_decay * mask) - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def gelu(x):
    """GELU, the tanh approximation (Hendrycks & Gimpel 2016), elementwise."""
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))
    return 0.5 * x * (1.0 + t)


def gelu_backward(x, dy):
    """dx = dy dGELU/dx: the product rule on 0.5 x (1 + tanh(u)), with tanh' = 1 - tanh^2."""
    t = np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))
    du = np.sqrt(2.0 / np.pi) * (1.0 + 3.0 * 0.044715 * x**2)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t**2) * du)


def layernorm_forward(x, w, b, eps=1e-5):
    """(y, mean, rstd) for rows x (N, C): y = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps)
    with the biased variance; mean and rstd (N, 1)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean) * rstd * w + b, mean, rstd


def layernorm_backward(dy, x, w, mean, rstd):
    """(dx, dw, db): dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w and xhat = (x - mean)
    rstd; dw = sum over rows of dy xhat, db = sum over rows of dy."""
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)
