"""GELU, the tanh approximation (SPEC 1), on every backend.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

The formulas live in `kernels.py`: a NumPy version and the CuPy ElementwiseKernels 'gelu_fwd'
and 'gelu_bwd' that must equal it. Shapes: any; y has the shape of x. `forward(h, bias=b)` is
GELU(h + b), with the Linear's bias added in the same pass (the MLP's c_fc runs with bias=False);
on CuPy with the fused piece `bias_gelu` in use (minitensor.cuda), the kernels
'bias_gelu_fwd'/'bias_gelu_bwd' do that in one launch each, and h is kept without its bias.
"""

import numpy as np

from minitensor import cuda, kernels
from minitensor.layer import Layer


class GELU(Layer):
    def forward(self, x, bias=None):
        """GELU(x), or GELU(x + bias) for bias (C,) over the last axis: then x += bias in place first,
        in the same pass (the bias of the Linear before, left out of its epilogue)."""
        if bias is not None and cuda.uses("bias_gelu", x):
            self._save(x, bias)                              # h = x + bias is recomputed in backward
            return kernels.bias_gelu_forward_gpu(x, bias)
        if bias is not None:
            y = kernels.gelu_forward(x, bias=bias)
            self._save(x)                                    # now x + bias, what backward needs
            return y
        self._save(x)
        return kernels.gelu_forward(x)

    def backward(self, dy):
        cache = self._pop()
        if len(cache) == 2:                                  # the fused forward: (x, bias)
            return kernels.bias_gelu_backward_gpu(*cache, dy)
        (x,) = cache
        return kernels.gelu_backward(x, dy)


@cuda.self_check("bias_gelu")
def _self_check(xp, rng):
    """GELU(x + b) forward and backward over (3, 50, 70), wide enough to reach the tails."""
    x = xp.asarray((4.0 * rng.standard_normal((3, 50, 70))).astype(np.float32))
    b = xp.asarray(rng.standard_normal(70).astype(np.float32))
    gelu = GELU()
    y = gelu.forward(x, bias=b)
    return y, gelu.backward(xp.asarray(rng.standard_normal((3, 50, 70)).astype(np.float32)))
