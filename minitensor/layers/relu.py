"""ReLU, elementwise over any shape: the design document's alternative to GELU (model.activation=relu).

    y  = max(x, 0)
    dx = dy where x > 0, else 0      (at the kink x = 0 the derivative is taken as 0)

The formula is `Ops.relu_forward` / `relu_backward` (minitensor.backends.ops); an MLP fuses the bias of
the Linear before into ReLU's pass through `ops.bias_relu_forward` (andrea.model.transformer.MLP).
"""

from typing import NamedTuple

from minitensor.layers.layer import Layer


class ReLUCache(NamedTuple):
    x: object


class ReLU(Layer):
    def forward(self, x):
        self._take_ops(x)
        self._save(ReLUCache(x))
        return self.ops.relu_forward(x)

    def backward(self, dy):
        (x,) = self._pop()
        return self.ops.relu_backward(x, dy)
