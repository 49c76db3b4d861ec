"""Linear: y = x @ W + b over the last axis, with any leading dimensions.

Shapes: x (..., n_in), W (n_in, n_out) stored (in, out) as GPT-2's Conv1D, b (n_out,) or None,
y (..., n_out). Leading dimensions are folded into one, so every product is a single 2-D GEMM.

    forward:   y = x W + b
    backward:  dx = dy W^T,   dW += x^T dy,   db += sum over rows of dy

`weight_grads` is the backward's parameter half on its own, for composites that schedule it
(an MLP recomputes c_proj's input instead of keeping it).
"""

from typing import NamedTuple

from minitensor.layers.layer import Layer


class LinearCache(NamedTuple):
    x: object          # (N, n_in), the input as rows
    shape: tuple       # the input's shape


class Linear(Layer):
    def __init__(self, W, dW, b=None, db=None, ops=None):
        super().__init__(ops)
        self.W, self.dW, self.b, self.db = W, dW, b, db

    def forward(self, x):
        self._take_ops(x)
        x2 = x.reshape(-1, self.W.shape[0])                  # (N, n_in)
        y = self.ops.matmul(x2, self.W)                      # (N, n_out)
        self.ops.add_epilogue(y, self.b)
        self._save(LinearCache(x2, x.shape))
        return y.reshape(*x.shape[:-1], self.W.shape[1])

    def backward(self, dy):
        x2, x_shape = self._pop()
        dy2 = dy.reshape(-1, self.W.shape[1])                # (N, n_out)
        self.weight_grads(x2, dy2)
        return self.ops.matmul(dy2, self.W.T).reshape(x_shape)  # dx = dy W^T

    def weight_grads(self, x2, dy2, bias=True):
        """dW += x^T dy, db += sum over rows of dy (unless bias is False: a pass that reads dy anyway sums
        it, as a pre-norm block's norm does for c_proj's), for x2 (N, n_in) and dy2 (N, n_out)."""
        self._take_ops(x2)  # also called without a forward (by an attention or MLP layer)
        if bias:
            self.ops.linear_weight_grads(x2, dy2, self.dW, self.db)
        else:
            self.ops.linear_weight_grads(x2, dy2, self.dW, None)
