"""Softmax cross-entropy, fused: loss = mean over all N positions of logsumexp(z) - z[target].

Shapes: logits (..., V), targets (...) integer ids in [0, V).

    forward:   loss = mean_n (logsumexp(z_n) - z_n[t_n])     (the row maximum subtracted first)
    backward:  dz_n = dloss (softmax(z_n) - onehot(t_n)) / N

The forward keeps the probabilities (one array of the logits' size; with `inplace=True` a backend
may write them over the logits to save that memory), so backward only subtracts at each target and
scales. The arithmetic is `Ops.softmax_xent_forward` / `softmax_xent_backward` (minitensor.backends.ops).
"""

from typing import NamedTuple

from minitensor.layers.embedding import check_ids
from minitensor.layers.layer import Layer


class CrossEntropyCache(NamedTuple):
    saved: object      # what ops.softmax_xent_forward returned for ops.softmax_xent_backward
    targets: object    # (N,)
    shape: tuple       # the logits' shape


class SoftmaxCrossEntropy(Layer):
    def __init__(self, check=True, ops=None):
        """check=False skips the target range check (a host sync on a GPU) for validated targets."""
        super().__init__(ops)
        self.check = check

    def forward(self, logits, targets, inplace=False, valid=None):
        """The mean loss as a 0-d array (no host synchronisation). valid: how many of the logits'
        columns are the vocabulary's, the rest padding (the tied head's, TiedHead.forward(padded=True))
        that gets probability 0 and no gradient; None: all of them."""
        self._take_ops(logits)
        V = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets of shape {targets.shape} do not match logits of shape {logits.shape}")
        if self.check:
            check_ids(targets, V if valid is None else valid, what="target id")
        t = targets.reshape(-1)
        if valid is None or valid == V:
            loss, saved = self.ops.softmax_xent_forward(logits.reshape(-1, V), t, inplace)
        else:
            loss, saved = self.ops.softmax_xent_forward(logits.reshape(-1, V), t, inplace, valid=valid)
        self._save(CrossEntropyCache(saved, t, logits.shape))
        return loss

    def backward(self, dloss=1.0):
        saved, t, shape = self._pop()
        return self.ops.softmax_xent_backward(saved, t, dloss).reshape(shape)
