"""Token and position embeddings, and the tied output head that reuses the token matrix.

Shapes: idx (B, T) integer ids, W (V, C), out (B, T, C); positions use rows 0..T-1 of a
(context_length, C) table. The head computes logits = x @ W.T (B, T, V) over the SAME weight and
gradient views as the token embedding: two layer objects, one matrix, and both gradient
contributions add into dW.

    Embedding:          out[b, t] = W[idx[b, t]]      dW[idx[b, t]] += dy[b, t]  (repeated ids add up)
    PositionEmbedding:  out[b, t] = W[t]              dW[t] += sum over b of dy[b, t]
    TiedHead:           logits = x W^T                dx = dlogits W,  dW += dlogits^T x

A GPU backend computes the head over a vocabulary padded to a multiple of 128 (ops.vocab_padding,
8449 -> 8576: aligned GEMMs) when asked (`forward(x, padded=True)`, the training loss): a copy of W
with zero rows after its V, so the padded logits are zero, the loss gives them probability 0 and
no gradient, and the padded rows' gradient is dropped before it reaches dW. The parameters, their
count and everything saved stay V rows.
"""

from typing import NamedTuple

from minitensor.layers.layer import Layer


def check_ids(idx, V, what="token id"):
    """Refuses ids outside [0, V) with a message naming the worst one."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= V):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise ValueError(f"{what} {bad} is out of range: ids must be in [0, {V})")


class Embedding(Layer):
    def __init__(self, W, dW, check=True, ops=None):
        """check=False skips the id range check (a host sync on a GPU) for callers that validated ids."""
        super().__init__(ops)
        self.W, self.dW, self.check = W, dW, check

    def forward(self, idx):
        self._take_ops(idx)
        if self.check:
            check_ids(idx, self.W.shape[0])
        self._save(idx)
        return self.W[idx]                                   # (B, T, C)

    def backward(self, dy):
        idx = self._pop().reshape(-1)
        # forward was: out[b, t] = W[idx[b, t]]
        self.ops.scatter_add_rows(self.dW, idx, dy.reshape(idx.shape[0], -1))


class PositionEmbedding(Layer):
    """out[b, t] = W[t]; the same rows for every sequence in the batch."""

    def __init__(self, W, dW, ops=None):
        super().__init__(ops)
        self.W, self.dW = W, dW

    def forward(self, B, T):
        if self.W.shape[0] < T:
            raise ValueError(f"sequence length {T} exceeds the context length {self.W.shape[0]}")
        self._save(T)
        return self.W[:T]                                    # (T, C), broadcast over B

    def backward(self, dy):
        T = self._pop()
        # forward was: out[b, t] = W[t] for every b
        self.dW[:T] += dy.sum(axis=0) if dy.ndim == 3 else dy


class TiedHeadCache(NamedTuple):
    x: object          # (N, C), the input as rows
    shape: tuple
    padded: object     # the (Vp, C) padded copy of W the logits were computed with, or None


class TiedHead(Layer):
    """logits = x @ W.T, with W the token embedding's matrix and dW its gradient."""

    def __init__(self, W, dW, ops=None):
        super().__init__(ops)
        self.W, self.dW = W, dW
        self._padded_W = None                                # (Vp, C): W, then zero rows (padded=True)

    def forward(self, x, padded=False):
        """logits (..., V); with padded, (..., Vp) over ops.vocab_padding(V) columns (V on the CPU), the
        columns past V zero, for a loss that masks them (SoftmaxCrossEntropy.forward(valid=V))."""
        self._take_ops(x)
        x2 = x.reshape(-1, self.W.shape[1])                  # (N, C)
        V = self.W.shape[0]
        Vp = self.ops.vocab_padding(V) if padded else V
        W = self.W if Vp == V else self._padded(Vp)
        self._save(TiedHeadCache(x2, x.shape, None if Vp == V else W))
        return (x2 @ W.T).reshape(*x.shape[:-1], Vp)

    def _padded(self, Vp):
        """W's current values in the first V rows of the (Vp, C) padded copy; the rows after stay zero."""
        if self._padded_W is None or self._padded_W.shape[0] != Vp:
            self._padded_W = self.ops.xp.zeros((Vp, self.W.shape[1]), dtype=self.W.dtype)
        self._padded_W[:self.W.shape[0]] = self.W
        return self._padded_W

    def backward(self, dlogits):
        """dx from dlogits (..., V), or (..., Vp) after forward(padded=True)."""
        x2, x_shape, Wp = self._pop()
        W = self.W if Wp is None else Wp
        dl2 = dlogits.reshape(-1, W.shape[0])                # (N, V) or (N, Vp)
        # forward was: logits = x @ W.T
        if Wp is not None:                                   # the padded rows' gradient is dropped here
            self.dW += (dl2.T @ x2)[:self.W.shape[0]]        # (Vp, C) -> (V, C)
        else:                                                # dW += dlogits^T x, a Linear's weight gradient
            self.ops.linear_weight_grads(dl2, x2, self.dW, None)
        return (dl2 @ W).reshape(x_shape)
