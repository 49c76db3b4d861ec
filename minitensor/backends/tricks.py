"""The optimisations the CPU and GPU backends share, kept out of the `Ops` textbook (ops.py).

    GELU_AC, GELU_AC3     GELU's constants folded for the sigmoid form (the numba and CUDA kernels):
                          0.5 (1 + tanh u) = sigmoid(2u), u = x (AC x^2 + C), du/dx = AC3 x^2 + C
    adamw_scalars         AdamW's two bias corrections folded into two scalars
    adamw_update          the AdamW update in that folded form, over arrays of one shape, a workspace w
    GradWrites            which bytes of the gradient buffer have been written since the last fill_zero,
                          kept by every write into a gradient view (keep_grad_writes): a view none of
                          whose bytes were written may take its first gradient from the GEMM itself
                          instead of having it added through a temporary
"""

import bisect
import inspect
import math

import numpy as np

from minitensor.backends.ops import GELU_A, GELU_C, Ops

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


def _span(a):
    """[first byte, one past the last byte) that a NumPy or CuPy array reaches."""
    start = a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr
    if a.flags.c_contiguous:                       # every gradient view the layers hand over
        return start, start + a.nbytes
    low = sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s < 0 and n)
    high = sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s > 0 and n)
    return start + low, start + high + (a.itemsize if a.size else 0)


class GradWrites:
    """The writes into the gradient buffer since a backend's fill_zero zeroed it: which of its bytes
    have been written. Every write into a gradient view goes through `first(view)` (keep_grad_writes
    below sees to it), which answers whether none of the view's bytes have been written since the
    fill (the view still holds its zeros) and counts them as written from then on.

    A writer that adds uses it only for the count; the backends' linear_weight_grads writes its GEMM's
    output into the view where the answer is yes (no temporary of the gradient's size, no add:
    BENCHMARKS.md, "The CPU kernels"), and adds to it otherwise: the later micro-batches, and a view
    that another writer reached first, whatever the order of the layers' backward (the tied head's
    GEMM and the token embedding's scatter-add share wte's gradient). Writing x into zeros equals
    0 + x except that it keeps the sign of a -0.0. A view outside the buffer, or not contiguous, is
    never answered yes."""

    def __init__(self):
        self.buffer, self.lo, self.hi = None, 0, 0      # no buffer: no view lies in [0, 0)
        self.starts, self.stops = [], []   # the written bytes: sorted, disjoint [start, stop) runs

    def zeroed(self, buffer):
        """buffer (held, so that its memory is not reused) holds zeros: nothing in it is written."""
        self.buffer, (self.lo, self.hi) = buffer, _span(buffer)
        self.starts, self.stops = [], []

    def first(self, view):
        """Whether no byte of view has been written since the fill; its bytes are written from now on."""
        lo, hi = _span(view)
        if not self.lo <= lo < hi <= self.hi:
            return False
        starts, stops = self.starts, self.stops
        i = bisect.bisect_right(starts, lo)              # runs [0, i) start at or before lo
        j = bisect.bisect_left(starts, hi, i)            # runs [i, j) start inside the view
        if i == j and not (i and stops[i - 1] > lo):     # none reaches into the view: a new run
            starts.insert(i, lo)
            stops.insert(i, hi)
            return view.flags.c_contiguous
        k = i - 1 if i and stops[i - 1] > lo else i      # the overlapping runs [k, j) and the view: one run
        starts[k:j], stops[k:j] = [min(lo, starts[k])], [max(hi, stops[j - 1])]
        return False


# The names Ops gives the parameter gradient views its methods write (linear_weight_grads' dW and db,
# add_bias_grad's db, layernorm_backward's dw, db and dres_db, scatter_add_rows' dW, add_batch_sum's dW);
# the layers hand their views to these methods and never write one themselves
# (tests/engine/test_grad_writes.py checks both).
GRAD_VIEWS = ("dW", "dw", "db", "dres_db")


def grad_writers():
    """{Ops method name: the positions of its gradient-view arguments (after self)}: every Ops method
    with a parameter named in GRAD_VIEWS."""
    writers = {}
    for name, fn in inspect.getmembers(Ops, inspect.isfunction):
        params = list(inspect.signature(fn).parameters)[1:]
        if any(p in GRAD_VIEWS for p in params):
            writers[name] = tuple((p, i) for i, p in enumerate(params) if p in GRAD_VIEWS)
    return writers


def keep_grad_writes(ops):
    """Gives the backend instance `ops` its GradWrites (ops.grad_writes), and makes each of its methods
    that write gradient views (grad_writers) count the views it wrote once it returns, whichever code
    runs it: the backend's own, a fused piece's bound over it, or Ops'. A backend that writes first
    gradients (its linear_weight_grads asking ops.grad_writes.first) calls it last in its __init__,
    and tells ops.grad_writes.zeroed in its fill_zero."""
    ops.grad_writes = GradWrites()
    for name, views in grad_writers().items():
        setattr(ops, name, _counted(getattr(ops, name), views, ops.grad_writes))


def _counted(method, views, writes):
    def counted(*args, **kwargs):
        out = method(*args, **kwargs)
        for name, i in views:
            view = kwargs.get(name, args[i] if i < len(args) else None)
            if view is not None:
                writes.first(view)
        return out

    counted.__name__, counted.__doc__, counted.__wrapped__ = method.__name__, method.__doc__, method
    return counted
