"""Token and position embeddings, and the tied output head that reuses the token matrix.

Shapes: idx (B, T) integer ids, W (V, C), out (B, T, C); positions use rows 0..T-1 of a
(context_length, C) table. The head computes logits = x @ W.T (B, T, V) over the SAME weight and
gradient views as the token embedding: two layer objects, one matrix, and both gradient
contributions add into dW.

On the CPU with numba (minitensor.cpu), `scatter_add_rows_cpu` adds the rows one by one in
token order, the columns split over the threads: each element's sum runs in the same order
whatever the thread count.
"""

import numpy as np

from minitensor import cpu
from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.parallel import parallel_for


def scatter_add_rows(dW, idx, rows):
    """dW[idx[i]] += rows[i] for every i, summing repeated ids (which `dW[idx] += rows` drops).

    NumPy: sort the ids, sum each run of equal ids with one reduceat, then add the sums to
    distinct rows, which is correct fancy-index assignment; much faster than np.add.at.
    CuPy: add.at, which uses atomic adds.
    """
    xp = array_module(dW)
    idx = idx.reshape(-1)
    rows = rows.reshape(idx.shape[0], -1)
    if xp is not np:
        xp.add.at(dW, idx, rows)
        return
    if cpu.enabled(dW, rows) and dW.flags.c_contiguous and rows.flags.c_contiguous and dW.ndim == 2:
        ids = idx.astype(np.int64, copy=False)
        C = dW.shape[1]
        # 1024 rows of 768 take ~0.3 ms on one core: split only well above that
        parallel_for(C, lambda s, e: scatter_add_rows_cpu(dW, ids, rows, s, e), cost_per_item=ids.shape[0],
                     min_work=1 << 21)
        return
    order = np.argsort(idx, kind="stable")
    sorted_idx = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_idx[1:] != sorted_idx[:-1])))
    sums = np.add.reduceat(rows[order], starts, axis=0)
    dW[sorted_idx[starts]] += sums


@cpu.kernel()
def scatter_add_rows_cpu(dW, idx, rows, c0, c1):
    """dW (V, C), idx (n,), rows (n, C): dW[idx[i], c0:c1] += rows[i, c0:c1] for i = 0, 1, ..."""
    for i in range(idx.shape[0]):
        dst, src = dW[idx[i], c0:c1], rows[i, c0:c1]        # views indexed from 0 vectorise
        for j in range(dst.size):
            dst[j] += src[j]


def check_ids(idx, V, what="token id"):
    """Refuses ids outside [0, V) with a message naming the worst one."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= V):
        bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
        raise ValueError(f"{what} {bad} is out of range: ids must be in [0, {V})")


class Embedding(Layer):
    def __init__(self, W, dW, check=True):
        """check=False skips the id range check (a host sync on a GPU) for callers that validated ids."""
        self.W, self.dW, self.check = W, dW, check

    def forward(self, idx):
        if self.check:
            check_ids(idx, self.W.shape[0])
        self._save(idx)
        return self.W[idx]                                   # (B, T, C)

    def backward(self, dy):
        (idx,) = self._pop()
        # forward was: out[b, t] = W[idx[b, t]]
        scatter_add_rows(self.dW, idx, dy)


class PositionEmbedding(Layer):
    """out[b, t] = W[t]; the same rows for every sequence in the batch."""

    def __init__(self, W, dW):
        self.W, self.dW = W, dW

    def forward(self, B, T):
        if self.W.shape[0] < T:
            raise ValueError(f"sequence length {T} exceeds the context length {self.W.shape[0]}")
        self._save(T)
        return self.W[:T]                                    # (T, C), broadcast over B

    def backward(self, dy):
        (T,) = self._pop()
        # forward was: out[b, t] = W[t] for every b
        self.dW[:T] += dy.sum(axis=0) if dy.ndim == 3 else dy


class TiedHead(Layer):
    """logits = x @ W.T, with W the token embedding's matrix and dW its gradient."""

    # as Linear.fresh: dW holds nothing to keep, so the next gradient GEMM writes it directly
    # (the model's backward reaches the head before the token embedding adds its rows)
    fresh = False

    def __init__(self, W, dW):
        self.W, self.dW = W, dW

    def forward(self, x):
        x2 = x.reshape(-1, self.W.shape[1])                  # (N, C)
        self._save(x2, x.shape)
        return (x2 @ self.W.T).reshape(*x.shape[:-1], self.W.shape[0])

    def backward(self, dlogits):
        x2, x_shape = self._pop()
        dl2 = dlogits.reshape(-1, self.W.shape[0])           # (N, V)
        # forward was: logits = x @ W.T
        if self.fresh:
            array_module(dl2).matmul(dl2.T, x2, out=self.dW)  # (V, C)
            self.fresh = False
        else:
            self.dW += dl2.T @ x2
        return (dl2 @ self.W).reshape(x_shape)
