"""GELU, the tanh approximation (SPEC 1), on every backend.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

The formulas live in `kernels.py`: a NumPy version and the CuPy ElementwiseKernels 'gelu_fwd'
and 'gelu_bwd' that must equal it. Shapes: any; y has the shape of x.
"""

from minitensor import kernels
from minitensor.layer import Layer


class GELU(Layer):
    def forward(self, x):
        self._save(x)
        return kernels.gelu_forward(x)

    def backward(self, dy):
        (x,) = self._pop()
        return kernels.gelu_backward(x, dy)
