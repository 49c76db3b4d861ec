"""The contract every layer follows, and the one piece of it that is shared: the forward cache.

A layer's `forward(x)` returns y and keeps what its backward needs (a named tuple); `backward(dy)`
accumulates the parameter gradients into the gradient views it was given, through the `ops` methods
that take them (parameters named dW, dw, db: the backends count those writes, never a layer itself),
returns dx, and drops the cache, so a second backward without a new forward fails at once instead
of reusing stale state. `infer(...)` is the same forward keeping nothing (inference and sampling): one
formula per layer, and a backward still pending from a training forward keeps its cache.

A norm (`Norm`, LayerNorm for one) normalises each row of x (..., C) by statistics of that row,
and promises two things more, which the model's blocks and andrea.trace rely on:

    backward(dy, skip=None) -> dx (+ skip)   with skip (x's shape), the gradient that reaches x
                                             around the norm (a pre-norm block's residual path) is
                                             added in the same pass: x1 = x + f(norm(x)) gives
                                             dx = norm.backward(f.backward(dx1), skip=dx1)
    infer_stats(x) -> (y, {name: (..., 1)})  infer(x), and the per-row statistics it normalised by,
                                             named by the class's `stats`: LayerNorm's mean and rstd;
                                             a norm that subtracts no mean has no mean to report

Every layer computes through `self.ops` (minitensor.backends.ops), the backend chosen when the model was
built. A layer built without one takes, at each forward, the backend of the arrays it is given
(`get_ops(xp)` for their module, NumPy's or CuPy's, as the model's is built); one built with a
backend refuses arrays of another module. Importing a layer loads no backend.
"""

from minitensor.device import array_module


class Layer:
    _cache = None

    def __init__(self, ops=None):
        self.ops = ops              # None until a forward: the backend of its arrays (_take_ops)
        self._ops_given = ops is not None

    def _take_ops(self, x):
        """The backend for this forward, whose input x is an array: the one the layer was built
        with, or, built without one, the backend of x's array module, kept for the backward."""
        xp = array_module(x)
        if not self._ops_given:
            from minitensor.backends import get_ops  # here: importing a layer builds no backend

            self.ops = get_ops(xp)
        elif self.ops.xp is not xp:
            raise TypeError(f"{type(self).__name__} was built with the {self.ops.xp.__name__} backend but given "
                            f"{xp.__name__} arrays: build it with ops=get_ops({xp.__name__}) "
                            "(minitensor.backends) or without ops=")
        return self.ops

    def _save(self, cache):
        self._cache = cache

    def _pop(self):
        cache = self._cache
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a forward (or twice)")
        self._cache = None
        return cache

    def infer(self, *args, **kwargs):
        """forward(*args, **kwargs) for inference: the same formula, nothing kept for a backward."""
        pending = self._cache
        y = self.forward(*args, **kwargs)
        self._cache = pending
        return y

    @property
    def has_cache(self):
        return self._cache is not None


class Norm(Layer):
    """A norm over the last axis (the module's docstring): forward, backward(dy, skip=None) and
    infer_stats(x) -> (y, stats). `params` names its parameters, each of shape (C,), in the order its
    constructor takes them, each followed by its gradient: Norm(w, dw, b, db, eps, ops=ops) for
    ("weight", "bias"). `stats` names the statistics infer_stats returns."""

    params = ()
    stats = ()

    def forward_joined(self, x, bias, residual):
        """forward of the residual join x += bias + residual, made in place in x (x: a sublayer's last
        product, bias its bias, residual the stream it joins; the adds of its epilogue: Ops.add_epilogue).
        Here by the backend's add_epilogue then forward; a norm whose backend joins in its own first pass
        over x overrides it (LayerNorm)."""
        C = x.shape[-1]
        self._take_ops(x).add_epilogue(x.reshape(-1, C), bias, residual.reshape(-1, C))
        return self.forward(x)

    def backward_and_sum_skip(self, dy, skip, linear):
        """backward(dy, skip), and linear.db += the column sums of skip (unless linear.db is None): in a
        pre-norm block the skip is the gradient of the sublayer's output, so these are the gradient of
        the bias of its last Linear (c_proj), `linear`. Here by the backend's add_bias_grad; a norm whose
        backend sums them in the pass that reads skip anyway overrides it (LayerNorm)."""
        self.ops.add_bias_grad(skip.reshape(-1, skip.shape[-1]), linear.db)
        return self.backward(dy, skip)
