"""GELU, the tanh approximation GPT-2 uses, elementwise over any shape.

    y  = 0.5 x (1 + tanh(u)),   u = sqrt(2/pi) (x + 0.044715 x^3)
    dx = dy (0.5 (1 + tanh u) + 0.5 x (1 - tanh(u)^2) du/dx),   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)

(Hendrycks & Gimpel 2016.) These two lines, as written, are `Ops.gelu_forward` / `gelu_backward`
(minitensor.backends.ops); the numba and CUDA kernels compute them through 0.5 (1 + tanh u) =
sigmoid(2u), one exp instead of a tanh. An MLP fuses the bias of the Linear before into GELU's pass
through `ops.bias_gelu_forward` (andrea.model.transformer.MLP).
"""

from typing import NamedTuple

from minitensor.layers.layer import Layer


class GELUCache(NamedTuple):
    x: object


class GELU(Layer):
    def forward(self, x):
        self._take_ops(x)
        self._save(GELUCache(x))
        return self.ops.gelu_forward(x)

    def backward(self, dy):
        (x,) = self._pop()
        return self.ops.gelu_backward(x, dy)
