"""minitensor: layers with hand-derived forward and backward passes over NumPy or CuPy arrays.

Importing it tunes two things of the process for a training step's pattern of work, each
measured on the 2-core bench and each left alone if the user set it already:

- OpenBLAS puts its idle threads to sleep almost at once (OPENBLAS_THREAD_TIMEOUT=4, in 2^4
  cycles) instead of spinning after each GEMM: the elementwise work between GEMMs runs on
  minitensor's own threads (minitensor.parallel), and spinning BLAS threads would steal their
  cores (tiny trains ~10% faster). It has no effect if NumPy was imported first.
- glibc's malloc keeps freed memory for reuse (see minitensor.memory): a step allocates and frees
  megabyte-sized temporaries by the hundred, and by default each one is a fresh mmap whose pages
  fault in one by one (small and 120m train 10-20% faster; peak memory the same on 120m, +16% on
  a tiny training run).
"""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from minitensor.memory import keep_freed_memory  # noqa: E402

keep_freed_memory()
