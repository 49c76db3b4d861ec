"""Linear: y = x @ W + b over the last axis, with any leading dimensions.

Shapes: x (..., n_in), W (n_in, n_out) stored (in, out) as GPT-2's Conv1D, b (n_out,), y (..., n_out).
Leading dimensions are folded into one, so every product is a single 2-D GEMM.

The epilogue after the GEMM can take two more terms in the same pass over y:
`forward(x, residual=r)` returns x @ W + b + r (a transformer block's skip connection), and
`forward(x, bias=False)` leaves the bias out for the next layer to add where it passes over y
anyway (GELU, attention's head copies); the bias gradient is accumulated here either way. On
NumPy the epilogue is split over minitensor's threads in cache-sized row blocks, and the bias
gradient is a GEMV (ones @ dy): each beats NumPy's single-threaded broadcast add and axis-0 sum
by 2-5x at these sizes.
"""

import numpy as np

from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.parallel import parallel_for

EPILOGUE_BLOCK = 1 << 15  # elements of y per row block of the epilogue (128 KiB of float32)


class Linear(Layer):
    # True when dW and db hold nothing to keep (just zeroed): the next weight gradient is written
    # by the GEMM itself instead of into a temporary added to them (120m: ~1.5 ms per layer and
    # step); it goes back to False there, so later micro-batches accumulate.
    fresh = False

    def __init__(self, W, dW, b=None, db=None):
        self.W, self.dW, self.b, self.db = W, dW, b, db

    def forward(self, x, residual=None, bias=True, keep_input=True):
        """y = x @ W (+ b unless bias=False) (+ residual, an array of y's shape, if given).

        keep_input=False keeps nothing of x for backward: the caller hands it back to
        backward_weights (an MLP's c_proj, whose input GELU's backward recomputes anyway, so a
        (N, 4C) activation per block is not held from forward to backward)."""
        x2 = x.reshape(-1, self.W.shape[0])                  # (N, n_in)
        y = x2 @ self.W                                      # (N, n_out)
        b = self.b if bias else None
        r = None if residual is None else residual.reshape(y.shape)
        if b is not None or r is not None:
            add_epilogue(y, b, r)
        self._save(x2 if keep_input else None, x.shape)
        return y.reshape(*x.shape[:-1], self.W.shape[1])

    def backward(self, dy):
        """dx; dW and db accumulate. After forward(keep_input=False): dx only, and dy is kept
        for backward_weights(x)."""
        x2, x_shape = self._pop()
        dy2 = dy.reshape(-1, self.W.shape[1])                # (N, n_out)
        if x2 is None:
            self._save(dy2)
        else:
            self._weight_grads(x2, dy2)
        dx = dy2 @ self.W.T                                  # (N, n_in)
        return dx.reshape(x_shape)

    def backward_weights(self, x):
        """dW and db from the forward's input x, given back after backward (keep_input=False)."""
        (dy2,) = self._pop()
        self._weight_grads(x.reshape(-1, self.W.shape[0]), dy2)

    def _weight_grads(self, x2, dy2):
        # forward was: y = x @ W + b (+ residual, whose gradient dy the caller keeps)
        xp = array_module(dy2)
        if self.fresh:
            xp.matmul(x2.T, dy2, out=self.dW)                # (n_in, n_out)
        else:
            self.dW += x2.T @ dy2
        if self.b is not None:
            db = xp.ones(dy2.shape[0], dtype=dy2.dtype) @ dy2 if xp is np else dy2.sum(axis=0)
            if self.fresh:
                self.db[...] = db
            else:
                self.db += db
        self.fresh = False


def add_epilogue(y, b=None, r=None):
    """In place over y (N, C): y += b (C,) and y += r (N, C), either optional, in one pass on NumPy."""
    if array_module(y) is not np:
        if b is not None:
            y += b
        if r is not None:
            y += r
        return
    rows = max(1, EPILOGUE_BLOCK // max(1, y.shape[1]))

    def blocks(s, e):
        for i in range(s, e, rows):
            yb = y[i:min(i + rows, e)]
            if b is not None:
                yb += b
            if r is not None:
                yb += r[i:min(i + rows, e)]

    parallel_for(y.shape[0], blocks, cost_per_item=y.shape[1])
