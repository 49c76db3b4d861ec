"""The optimisations the CPU and GPU backends share, kept out of the `Ops` textbook (ops.py).

    GELU_AC, GELU_AC3     GELU's constants folded for the sigmoid form (the numba and CUDA kernels):
                          0.5 (1 + tanh u) = sigmoid(2u), u = x (AC x^2 + C), du/dx = AC3 x^2 + C
    adamw_scalars         AdamW's two bias corrections folded into two scalars
    adamw_update          the AdamW update in that folded form, over arrays of one shape, a workspace w
    FreshGrads            which gradient views hold only the zeros of the last fill_zero: their first
                          gradient is written by the GEMM itself instead of added through a temporary
"""

import math

from minitensor.backends.ops import GELU_A, GELU_C

GELU_AC = GELU_A * GELU_C              # u = x (AC x^2 + C)
GELU_AC3 = 3.0 * GELU_A * GELU_C       # du/dx = AC3 x^2 + C


def adamw_scalars(lr, b1, b2, eps, t):
    """(step_size, eps_hat): m/c1 / (sqrt(v/c2) + eps) == (m * s) / (sqrt(v) + eps * sqrt(c2)) with
    s = sqrt(c2) / c1, c1 = 1 - b1^t, c2 = 1 - b2^t; step_size = lr s, eps_hat = eps sqrt(c2)."""
    c1 = 1.0 - b1 ** t
    c2 = 1.0 - b2 ** t
    return lr * math.sqrt(c2) / c1, eps * math.sqrt(c2)


def adamw_update(xp, p, g, m, v, w, b1, b2, grad_scale, step_size, eps_hat, keep):
    """In place over p, m, v from g (all one shape), w a workspace like them; keep is the decay
    factor 1 - lr wd where decayed: a number, or an array like p."""
    xp.multiply(g, (1.0 - b1) * grad_scale, out=w)       # (1 - b1) g
    m *= b1
    m += w
    xp.multiply(g, g, out=w)
    w *= (1.0 - b2) * grad_scale * grad_scale             # (1 - b2) g^2
    v *= b2
    v += w
    if not (isinstance(keep, float) and keep == 1.0):
        p *= keep                                         # decoupled weight decay
    xp.sqrt(v, out=w)
    w += eps_hat
    xp.divide(m, w, out=w)
    w *= step_size
    p -= w


def _address(a):
    """The first byte of a NumPy or CuPy array."""
    data = a.data
    return data.ptr if hasattr(data, "ptr") else a.__array_interface__["data"][0]


class FreshGrads:
    """The buffer a backend's fill_zero zeroed last (held, so its memory is not reused) and the
    views of it whose first gradient was taken since: `take(view)` says True once per view of that
    buffer, so the first micro-batch after zero_grad writes its GEMM's output into the gradient (no
    temporary of the gradient's size, no add: BENCHMARKS.md, "The CPU kernels"), and the later ones,
    and a second user of a shared view (the tied embedding), add to it. Writing x into zeros equals
    0 + x except that it keeps the sign of a -0.0."""

    def __init__(self):
        self.buffer, self.start, self.stop, self.taken = None, 0, 0, set()

    def zeroed(self, buffer):
        self.buffer, self.taken = buffer, set()
        self.start = _address(buffer)
        self.stop = self.start + buffer.nbytes

    def take(self, view):
        if self.buffer is None or not view.flags.c_contiguous:
            return False
        key = (_address(view), view.nbytes)
        if key in self.taken or not (self.start <= key[0] and key[0] + key[1] <= self.stop):
            return False
        self.taken.add(key)
        return True
