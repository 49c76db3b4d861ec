"""NumpyOps' GELU and bias + GELU: with numba, one compiled pass over rows (forward, backward, and the
backward recomputing the output); without, NumPy over cache-sized chunks spread over the threads.
Both through the sigmoid form (below), both equal to Ops' tanh form to rounding.
"""

import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.ops import GELU_A, GELU_C
from minitensor.backends.tricks import GELU_AC, GELU_AC3
from minitensor.parallel import parallel_for

CHUNK = 1 << 16           # elements per elementwise chunk: its operands stay in cache


class GeluCPU:
    """Ops.gelu_forward / _backward and Ops.bias_gelu_forward / _backward on the CPU (a mixin of NumpyOps)."""

    # Written through 0.5 (1 + tanh u) = sigmoid(2u), one exp instead of a tanh:
    #   sig = 1 / (1 + exp(-2u)),  y = x sig
    #   dy/dx = sig + x sig (1 - sig) 2 du/dx = sig (1 + (1 - sig) 2 x du/dx),
    #   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    # For x below about -10, exp(-2u) overflows to inf: y = x / inf = -0 and dx = 0, as they should.

    @staticmethod
    def _gelu_sigmoid(x):
        with np.errstate(over="ignore"):
            e = np.exp(x * (x * x * (-2.0 * GELU_AC) - 2.0 * GELU_C))   # exp(-2u)
        return x / (1.0 + e)

    @staticmethod
    def _gelu_backward_sigmoid(x, dy):
        x2 = x * x
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + np.exp(x * (x2 * (-2.0 * GELU_AC) - 2.0 * GELU_C)))
        two_x_du = x * (x2 * (2.0 * GELU_AC3) + 2.0 * GELU_C)                # 2 x du/dx
        return ((1.0 - sig) * two_x_du + 1.0) * sig * dy

    def gelu_forward(self, x):
        if self.numba and numba_jit.takes(x) and x.ndim >= 1 and x.size:
            return self._gelu_forward_cpu(x, None)
        y = np.empty_like(x)
        self._chunks(lambda xs, ys: np.copyto(ys, self._gelu_sigmoid(xs)), x, y)
        return y

    def bias_gelu_forward(self, x, b):
        if self.numba and numba_jit.takes(x, b) and x.ndim >= 1 and x.size and b.shape == x.shape[-1:]:
            return self._gelu_forward_cpu(x, b)
        x += b                                               # x becomes h = x + b (bias_gelu_backward)
        return self.gelu_forward(x)

    def bias_gelu_backward(self, x, b, dy, recompute_output=False, db=None):
        """The gradient at h = x + b, which bias_gelu_forward left in x; db as Ops'."""
        out = self.gelu_backward(x, dy, recompute_output)
        self._add_dh_sums(out[0] if recompute_output else out, db)
        return out

    def gelu_backward(self, x, dy, recompute_output=False):
        if self.numba and numba_jit.takes(x, dy) and x.ndim >= 1 and x.size and dy.shape == x.shape:
            dx = np.empty_like(x)
            C = x.shape[-1]
            x2, dy2, dx2 = x.reshape(-1, C), dy.reshape(-1, C), dx.reshape(-1, C)
            parallel_for(x2.shape[0], lambda s, e: gelu_backward_cpu(x2[s:e], dy2[s:e], dx2[s:e], recompute_output),
                         cost_per_item=C)
            return (dx, x) if recompute_output else dx   # with recompute_output, x now holds GELU(x)
        dx = np.empty_like(x)
        self._chunks(lambda xs, dys, dxs: np.copyto(dxs, self._gelu_backward_sigmoid(xs, dys)), x, dy, dx)
        return (dx, self.gelu_forward(x)) if recompute_output else dx

    def _gelu_forward_cpu(self, x, b):
        """GELU(x), or x += b then GELU(x), one pass over rows of C."""
        y = np.empty_like(x)
        C = x.shape[-1]
        bias = b if b is not None else np.zeros(C, x.dtype)
        x2, y2 = x.reshape(-1, C), y.reshape(-1, C)
        parallel_for(x2.shape[0], lambda s, e: gelu_forward_cpu(x2[s:e], bias, b is not None, y2[s:e]),
                     cost_per_item=C)
        return y

    def _chunks(self, fn, *arrays):
        """fn over matching CHUNK-element pieces of same-shape arrays (whose temporaries then stay
        in cache: BENCHMARKS.md, "The CPU kernels"), spread over the threads; whole arrays when they are
        not all C-contiguous."""
        size = arrays[0].size
        if size <= CHUNK or not all(a.flags.c_contiguous for a in arrays):
            fn(*arrays)
            return
        flat = [a.reshape(-1) for a in arrays]

        def run(first, last):
            for start in range(first * CHUNK, min(last * CHUNK, size), CHUNK):
                fn(*[f[start:start + CHUNK] for f in flat])

        parallel_for(-(-size // CHUNK), run, min_work=0)


@numba_jit.kernel()
def gelu_forward_cpu(x, b, add_bias, y):
    """Ops.gelu_forward (Ops.bias_gelu_forward if add_bias: x += b in place first); x, y (N, C), b (C,)."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * GELU_C), t(-2 * GELU_A * GELU_C), t(1)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            if add_bias:
                xi += b[j]
                x[i, j] = xi
            y[i, j] = xi / (one + numba_jit.exp(xi * (m2c + m2ac * xi * xi)))  # x sigmoid(2u); exp = inf gives -0


@numba_jit.kernel()
def gelu_backward_cpu(x, dy, dx, output):
    """Ops.gelu_backward: x, dy, dx (N, C); sig = sigmoid(2u), GELU'(x) = sig (1 + (1 - sig) 2 x du/dx).
    With output, x is overwritten by GELU(x) = x sig, from the same sig."""
    t = x.dtype.type
    m2c, m2ac, one = t(-2 * GELU_C), t(-2 * GELU_A * GELU_C), t(1)
    c2, ac6 = t(2 * GELU_C), t(6 * GELU_A * GELU_C)
    N, C = x.shape
    for i in range(N):
        for j in range(C):
            xi = x[i, j]
            sig = one / (one + numba_jit.exp(xi * (m2c + m2ac * xi * xi)))
            dx[i, j] = dy[i, j] * sig * (one + (one - sig) * xi * (c2 + ac6 * xi * xi))
            if output:
                x[i, j] = xi * sig
