"""GELU, the tanh approximation (SPEC 1), on every backend.

    y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

The formula lives in `kernels.py`: its NumPy code (`gelu_forward`, `gelu_backward`, the generic
path here) and the CuPy ElementwiseKernels 'gelu_fwd' and 'gelu_bwd' checked against that code.
Shapes: any; y has the shape of x. `forward(h, bias=b)` is GELU(h + b), with the Linear's bias
added in the same pass (the MLP's c_fc runs with bias=False); on CuPy with the fused piece
`bias_gelu` in use (minitensor.cuda), the kernels 'bias_gelu_fwd'/'bias_gelu_bwd' do that in one
launch each, and h is kept without its bias.

On the CPU with numba (minitensor.cpu), `gelu_forward_cpu` and `gelu_backward_cpu` below make
one pass each over rows of C, in the sigmoid form the NumPy blocks use:
0.5 (1 + tanh u) = sigmoid(2u), so y = x / (1 + exp(-2u)).
"""

import math

import numpy as np

from minitensor import cpu, cuda, kernels
from minitensor.layer import Layer
from minitensor.parallel import parallel_for

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


class GELU(Layer):
    def forward(self, x, bias=None):
        """GELU(x), or GELU(x + bias) for bias (C,) over the last axis: then x += bias in place first,
        in the same pass (the bias of the Linear before, left out of its epilogue)."""
        if bias is not None and cuda.uses("bias_gelu", x):
            self._save(x, bias)                              # h = x + bias is recomputed in backward
            return kernels.bias_gelu_forward_gpu(x, bias)
        if _fast(x, bias):
            y = np.empty_like(x)
            C = x.shape[-1]
            b = bias if bias is not None else np.zeros(C, x.dtype)
            x2, y2 = x.reshape(-1, C), y.reshape(-1, C)
            parallel_for(x2.shape[0], lambda s, e: gelu_forward_cpu(x2[s:e], b, bias is not None, y2[s:e]),
                         cost_per_item=C)
            self._save(x)                                    # x + bias when a bias was given
            return y
        if bias is not None:
            y = kernels.gelu_forward(x, bias=bias)
            self._save(x)                                    # now x + bias, what backward needs
            return y
        self._save(x)
        return kernels.gelu_forward(x)

    def backward(self, dy, output=False):
        """dx = dy GELU'(x). With output=True, returns (dx, y): y = GELU(x) again, written over the
        kept x where the kernels allow (the MLP's c_proj takes it for its weight gradient)."""
        cache = self._pop()
        if len(cache) == 2:                                  # the fused forward: (x, bias)
            dx = kernels.bias_gelu_backward_gpu(*cache, dy)
            return (dx, kernels.bias_gelu_forward_gpu(*cache)) if output else dx
        (x,) = cache
        if _fast(x, None, dy):
            dx = np.empty_like(x)
            C = x.shape[-1]
            x2, dy2, dx2 = x.reshape(-1, C), dy.reshape(-1, C), dx.reshape(-1, C)
            parallel_for(x2.shape[0], lambda s, e: gelu_backward_cpu(x2[s:e], dy2[s:e], dx2[s:e], output),
                         cost_per_item=C)
            return (dx, x) if output else dx                 # with output, x now holds GELU(x)
        dx = kernels.gelu_backward(x, dy)
        return (dx, kernels.gelu_forward(x)) if output else dx


def _fast(x, bias, dy=None):
    arrays = [a for a in (x, bias, dy) if a is not None]
    return (cpu.enabled(*arrays) and x.ndim >= 1 and x.size > 0 and all(a.flags.c_contiguous for a in arrays)
            and (dy is None or (dy.shape == x.shape and dy.dtype == x.dtype))
            and (bias is None or (bias.shape == x.shape[-1:] and bias.dtype == x.dtype)))


@cpu.kernel()
def gelu_forward_cpu(x, b, add_bias, y):
    """x (N, C), b (C,), y (N, C): if add_bias, x += b in place; then y = GELU(x)."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * _C), t(-2 * _A * _C), t(1)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            if add_bias:
                xi += b[j]
                x[i, j] = xi
            y[i, j] = xi / (one + cpu.exp(xi * (m2c + m2ac * xi * xi)))  # x sigmoid(2u); exp = inf gives -0


@cpu.kernel()
def gelu_backward_cpu(x, dy, dx, output):
    """x, dy, dx (N, C): dx = dy GELU'(x), with sig = sigmoid(2u) = 0.5 (1 + tanh u):
    GELU'(x) = sig (1 + (1 - sig) 2 x du/dx),  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    With output, x is overwritten by GELU(x) = x sig, from the same sig."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * _C), t(-2 * _A * _C), t(1)
    c2, ac6 = t(2 * _C), t(6 * _A * _C)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            sig = one / (one + cpu.exp(xi * (m2c + m2ac * xi * xi)))
            dx[i, j] = dy[i, j] * sig * (one + (one - sig) * xi * (c2 + ac6 * xi * xi))
            if output:
                x[i, j] = xi * sig


@cuda.self_check("bias_gelu")
def _self_check(xp, rng):
    """GELU(x + b) forward and backward over (3, 50, 70), wide enough to reach the tails."""
    x = xp.asarray((4.0 * rng.standard_normal((3, 50, 70))).astype(np.float32))
    b = xp.asarray(rng.standard_normal(70).astype(np.float32))
    gelu = GELU()
    y = gelu.forward(x, bias=b)
    return y, gelu.backward(xp.asarray(rng.standard_normal((3, 50, 70)).astype(np.float32)))
