"""minitensor: layers with hand-derived forward and backward passes over NumPy or CuPy arrays.

Importing it before NumPy asks OpenBLAS to put its idle threads to sleep almost at once
(OPENBLAS_THREAD_TIMEOUT=4, in 2^4 cycles) instead of spinning for a long while after each GEMM:
the elementwise work between GEMMs runs on minitensor's own threads (minitensor.parallel), and
spinning BLAS threads would steal their cores. Measured on the 2-core bench: tiny trains ~10%
faster. A value already in the environment is left alone; it has no effect if NumPy was
imported first.
"""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
