"""Token and position embeddings, and the tied output head that reuses the token matrix.

Shapes: idx (B, T) integer ids, W (V, C), out (B, T, C); positions use rows 0..T-1 of a
(context_length, C) table. The head computes logits = x @ W.T (B, T, V) over the SAME weight and
gradient views as the token embedding: two layer objects, one matrix, and both gradient
contributions add into dW.

    Embedding:          out[b, t] = W[idx[b, t]]      dW[idx[b, t]] += dy[b, t]  (repeated ids add up)
    PositionEmbedding:  out[b, t] = W[t]              dW[t] += sum over b of dy[b, t]
    TiedHead:           logits = x W^T                dx = dlogits W,  dW += dlogits^T x

A GPU backend computes the head over a vocabulary padded to a multiple of 128 (ops.vocab_padding,
8449 -> 8576: aligned GEMMs) when asked (`forward(x, padded=True)`, the training loss): the logits
are (N, Vp) rows, 16-byte multiples long, of which the GEMM writes the first V columns and leaves
the padding unwritten (the loss, told valid=V, never reads it, gives it probability 0 and no
gradient); backward reads the first V columns of dlogits only (ops.gemm takes the longer rows as
they are). The parameters, their count and everything saved stay V rows.
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
        self.ops.add_batch_sum(self.dW[:T], dy)


class TiedHeadCache(NamedTuple):
    x: object          # (N, C), the input as rows
    shape: tuple
    width: int         # the logits' columns: V, or Vp after forward(padded=True)


class TiedHead(Layer):
    """logits = x @ W.T, with W the token embedding's matrix and dW its gradient."""

    def __init__(self, W, dW, ops=None):
        super().__init__(ops)
        self.W, self.dW = W, dW

    def forward(self, x, padded=False):
        """logits (..., V); with padded, (..., Vp) over ops.vocab_padding(V) columns (V on the CPU), the
        columns past V not written, for a loss that never reads them (SoftmaxCrossEntropy.forward(valid=V))."""
        self._take_ops(x)
        x2 = x.reshape(-1, self.W.shape[1])                  # (N, C)
        V = self.W.shape[0]
        Vp = self.ops.vocab_padding(V) if padded else V
        self._save(TiedHeadCache(x2, x.shape, Vp))
        if Vp == V:
            logits = self.ops.matmul(x2, self.W.T)
        else:
            logits = self.ops.xp.empty((x2.shape[0], Vp), dtype=x2.dtype)
            self.ops.gemm(x2, self.W.T, logits[:, :V])      # rows Vp long, their first V columns
        return logits.reshape(*x.shape[:-1], Vp)

    def backward(self, dlogits):
        """dx from dlogits (..., V), or (..., Vp) after forward(padded=True)."""
        x2, x_shape, Vp = self._pop()
        V = self.W.shape[0]
        dl2 = dlogits.reshape(-1, Vp)                        # (N, V) or (N, Vp)
        dl = dl2 if Vp == V else dl2[:, :V]                  # the padded columns (no gradient) not read
        # forward was: logits = x @ W.T
        self.ops.linear_weight_grads(dl, x2, self.dW, None)  # dW += dlogits^T x, a Linear's weight gradient
        if Vp == V:
            return self.ops.matmul(dl2, self.W).reshape(x_shape)
        dx = self.ops.xp.empty(x2.shape, dtype=x2.dtype)
        self.ops.gemm(dl, self.W, dx)
        return dx.reshape(x_shape)
