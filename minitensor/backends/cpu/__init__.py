"""The CPU backend's pieces, one module per piece as the GPU's are in kernels/: each holds a mixin of
NumpyOps (minitensor/backends/numpy_ops.py) with the methods that override that piece's Ops methods,
its NumPy path and its numba kernels (`@numba_jit.kernel()`) side by side, and the constants they
tune. NumpyOps names each mixin among its bases; what the pieces share (the threads, the gradient
buffer's fill and norm) stays there.
"""
