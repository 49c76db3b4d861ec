"""The contract every layer follows, and the one piece of it that is shared: the forward cache.

A layer's `forward(x)` returns y and keeps what its backward needs (a named tuple); `backward(dy)`
accumulates (`+=`) the parameter gradients into the gradient views it was given, returns dx, and
drops the cache, so a second backward without a new forward fails at once instead of reusing
stale state. `infer(...)` is the same forward keeping nothing (inference and sampling): one
formula per layer, and a backward still pending from a training forward keeps its cache.

Every layer computes through `self.ops` (minitensor.ops), the backend chosen when the model was
built; without one it takes the CPU backend (`get_ops()`).
"""

from minitensor.backends import get_ops


class Layer:
    _cache = None

    def __init__(self, ops=None):
        self.ops = ops or get_ops()

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
