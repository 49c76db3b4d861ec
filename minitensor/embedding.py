"""Token and position embeddings, and the tied output head that reuses the token matrix.

Shapes: idx (B, T) integer ids, W (V, C), out (B, T, C); positions use rows 0..T-1 of a
(context_length, C) table. The head computes logits = x @ W.T (B, T, V) over the SAME weight and
gradient views as the token embedding: two layer objects, one matrix, and both gradient
contributions add into dW.

    Embedding:          out[b, t] = W[idx[b, t]]      dW[idx[b, t]] += dy[b, t]  (repeated ids add up)
    PositionEmbedding:  out[b, t] = W[t]              dW[t] += sum over b of dy[b, t]
    TiedHead:           logits = x W^T                dx = dlogits W,  dW += dlogits^T x
"""

from typing import NamedTuple

from minitensor.layer import Layer


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


class TiedHead(Layer):
    """logits = x @ W.T, with W the token embedding's matrix and dW its gradient."""

    def __init__(self, W, dW, ops=None, zeroed=None):
        """zeroed as Linear's: the model's backward reaches the head before the token embedding
        adds its rows, so after zero_grad the head's GEMM writes dW."""
        super().__init__(ops)
        self.W, self.dW = W, dW
        self.zeroed = zeroed or (lambda dW: False)

    def forward(self, x):
        self._take_ops(x)
        x2 = x.reshape(-1, self.W.shape[1])                  # (N, C)
        self._save(TiedHeadCache(x2, x.shape))
        return (x2 @ self.W.T).reshape(*x.shape[:-1], self.W.shape[0])

    def backward(self, dlogits):
        x2, x_shape = self._pop()
        dl2 = dlogits.reshape(-1, self.W.shape[0])           # (N, V)
        # forward was: logits = x @ W.T
        if self.zeroed(self.dW):
            self.ops.xp.matmul(dl2.T, x2, out=self.dW)       # (V, C)
        else:
            self.dW += dl2.T @ x2
        return (dl2 @ self.W).reshape(x_shape)
