"""NumpyOps' Linear pieces: the epilogue (y += b, y += r) in cache-sized row blocks over the threads, and
the weight and bias gradients (dW += x^T dy by BLAS, db += sum_n dy as a GEMV). No numba kernel: BLAS
does the work.
"""

import numpy as np

from minitensor.parallel import parallel_for

EPILOGUE_BLOCK = 1 << 15  # elements of y per row block of a Linear's epilogue (128 KiB of float32)


class LinearCPU:
    """Ops.add_epilogue and Ops.linear_weight_grads on the CPU (a mixin of NumpyOps)."""

    def add_epilogue(self, y, b=None, r=None):
        """In cache-sized row blocks over the threads: 2-5x NumPy's one-thread broadcast add."""
        if b is None and r is None:
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

    def linear_weight_grads(self, x, dy, dW, db):
        """dW += x^T dy, db += sum_n dy; into a view nothing has written since fill_zero
        (tricks.GradWrites, self.grad_writes), the GEMM writes dW itself instead of a temporary that
        is then added, and the GEMV db."""
        if self.grad_writes.first(dW):
            np.matmul(x.T, dy, out=dW)
        else:
            dW += x.T @ dy
        self.add_bias_grad(dy, db)

    def add_bias_grad(self, dy, db):
        """db += sum_n dy by the GEMV bias_grad, written instead of added into a view nothing has
        written since fill_zero (nothing where db is None)."""
        if db is None:
            return
        if self.grad_writes.first(db):
            db[...] = self.bias_grad(dy)
        else:
            db += self.bias_grad(dy)

    def bias_grad(self, dy):
        """A GEMV (ones @ dy): multi-threaded BLAS, 2-5x NumPy's axis-0 sum at these sizes."""
        return np.ones(dy.shape[0], dtype=dy.dtype) @ dy
