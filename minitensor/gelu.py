"""GELU, the tanh approximation (SPEC 1), on every backend.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

The formulas live in `kernels.py`: a NumPy version and the CuPy ElementwiseKernels 'gelu_fwd'
and 'gelu_bwd' that must equal it. Shapes: any; y has the shape of x. `forward(h, bias=b)` is
GELU(h + b), with the Linear's bias added in the same pass (the MLP's c_fc runs with bias=False).
"""

from minitensor import kernels
from minitensor.layer import Layer


class GELU(Layer):
    def forward(self, x, bias=None):
        """GELU(x), or GELU(x + bias) for bias (C,) over the last axis: then x += bias in place first,
        in the same pass (the bias of the Linear before, left out of its epilogue)."""
        if bias is not None:
            y = kernels.gelu_forward(x, bias=bias)
            self._save(x)                                    # now x + bias, what backward needs
            return y
        self._save(x)
        return kernels.gelu_forward(x)

    def backward(self, dy):
        (x,) = self._pop()
        return kernels.gelu_backward(x, dy)
