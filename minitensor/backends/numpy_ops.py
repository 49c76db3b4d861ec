"""The CPU backend: NumPy work split over threads, and numba kernels for the hot pieces.

`NumpyOps` overrides pieces of `minitensor.backends.ops.Ops` (the textbook) with the same maths in
forms that run fast here, and takes the attention core over query blocks from
minitensor.backends.blocked. Each piece's code, its NumPy path and its numba kernels, is one module of
minitensor/backends/cpu/ (linear, layernorm, gelu, attention, softmax_xent, embedding, adamw: a mixin
of NumpyOps each); this module puts them together and holds what they share: the threads, the
gradient buffer's fill and its norm. Two levels, chosen once when a model is built:

    NumpyOps(numba=False)   ANDREA_CPU_KERNELS=numpy, or numba not installed: the maths in NumPy,
                            in place where it can be, its rows, heads and chunks spread over
                            minitensor's threads; GELU in its sigmoid form (one exp, no tanh)
    NumpyOps(numba=True)    the default with numba: compiled kernels (below) for LayerNorm,
                            GELU, the attention core, the cross-entropy, the embedding's
                            scatter-add and AdamW

Why each piece is faster here:
- NumPy runs a ufunc on one core; large ufunc calls release the GIL, so rows (LayerNorm,
  cross-entropy) and chunks (GELU, AdamW) go to a few threads (minitensor.parallel).
- A compiled kernel makes one pass over memory where NumPy makes one per operation, with the
  arithmetic in registers (minitensor.backends.numba_jit: the decorator, a vectorisable float32 exp).
- Attention runs head by head, each head's blocks on one core with single-threaded BLAS, so the
  block of scores a GEMM writes is still in cache when the softmax and the next GEMM read it;
  with SciPy's BLAS reachable from numba, a head's whole core is one compiled call.

Each override is checked against the Ops method it replaces (tests/engine/test_cpu_kernels.py). Kernels
run in the arrays' dtype: a Python constant would promote a float32 loop to float64, so every
constant is written t(c) with t = x.dtype.type. Every reduction stays within one row or one
fixed block of rows on one thread: results are bit-reproducible at a fixed thread count.
"""

import math

import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.blocked import BlockedAttention
from minitensor.backends.cpu.adamw import AdamWCPU
from minitensor.backends.cpu.attention import AttentionCPU
from minitensor.backends.cpu.embedding import EmbeddingCPU
from minitensor.backends.cpu.gelu import GeluCPU
from minitensor.backends.cpu.layernorm import LayerNormCPU
from minitensor.backends.cpu.linear import LinearCPU
from minitensor.backends.cpu.softmax_xent import SoftmaxXentCPU
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import keep_grad_writes
from minitensor.parallel import blas_single_threaded, parallel_for


class NumpyOps(LinearCPU, LayerNormCPU, GeluCPU, AttentionCPU, SoftmaxXentCPU, EmbeddingCPU, AdamWCPU,
               BlockedAttention, Ops):
    def __init__(self, numba=True):
        super().__init__(np)
        self.numba = bool(numba) and numba_jit.numba is not None
        self.name = "numba" if self.numba else "numpy"
        self.kernels_line = ("kernels: numba-compiled CPU kernels (ANDREA_CPU_KERNELS=numpy for NumPy alone)"
                             if self.numba else
                             "kernels: NumPy (pip install -e '.[fast]' adds numba's compiled CPU kernels)")
        keep_grad_writes(self)            # linear_weight_grads writes first gradients: every write counted

    # --- threads ---

    def over_rows(self, n, fn, cost_per_item=1):
        parallel_for(n, fn, cost_per_item=cost_per_item)

    def over_heads(self, B, n_head, fn):
        """One head at a time, the heads split over the threads, each running its small GEMMs on
        one BLAS thread (two small GEMMs on a core each beat one on two cores woken per call)."""
        def each(start, stop):
            for h in range(start, stop):
                fn(h, h + 1)

        with blas_single_threaded():
            parallel_for(B * n_head, each, min_work=0)

    def row_dot(self, a, b):
        """sum(a * b) over the last axis, (N, C) -> (N,)."""
        return np.einsum("ij,ij->i", a, b)

    def col_dot(self, a, b):
        """sum(a * b) over the rows, (N, C) -> (C,)."""
        return np.einsum("ij,ij->j", a, b)

    def fill_zero(self, a):
        # one thread's memset cannot fill the memory bandwidth (BENCHMARKS.md, "The CPU kernels")
        parallel_for(a.size, lambda s, e: a.reshape(-1)[s:e].fill(0), min_work=1 << 20)
        self.grad_writes.zeroed(a)

    # --- gradient clipping ---

    def global_norm(self, grads):
        """A float: the squares accumulated in float64 a million at a time, so a float32 buffer's
        norm loses nothing to its length, and no float64 copy of it is made."""
        total = 0.0
        for start in range(0, grads.size, 1 << 20):
            g = grads[start:start + (1 << 20)]
            total += float(np.dot(g, g))
        return math.sqrt(total)
