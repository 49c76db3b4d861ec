"""NumpyOps' embedding backward, dW[idx[i]] += rows[i]: with numba in token order, the columns split
over the threads; without, the ids sorted and each run of equal ids summed by one reduceat.
"""

import numpy as np

from minitensor.backends import numba_jit
from minitensor.parallel import parallel_for


class EmbeddingCPU:
    """Ops.scatter_add_rows on the CPU (a mixin of NumpyOps)."""

    def scatter_add_rows(self, dW, idx, rows):
        """numba: the rows added one by one in token order, the columns split over the threads (each
        element's sum in the same order whatever the thread count). NumPy: sort the ids, sum each
        run of equal ids with one reduceat, add the sums to distinct rows (much faster than add.at)."""
        if self.numba and numba_jit.takes(dW, rows) and dW.ndim == 2:
            ids = idx.astype(np.int64, copy=False)
            # 1024 rows of 768 take less than a thread's hand-off (BENCHMARKS.md): split only well above that
            parallel_for(dW.shape[1], lambda s, e: scatter_add_rows_cpu(dW, ids, rows, s, e),
                         cost_per_item=ids.shape[0], min_work=1 << 21)
            return
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_idx[1:] != sorted_idx[:-1])))
        sums = np.add.reduceat(rows[order], starts, axis=0)
        dW[sorted_idx[starts]] += sums


@numba_jit.kernel()
def scatter_add_rows_cpu(dW, idx, rows, c0, c1):
    """Ops.scatter_add_rows over columns c0..c1: dW (V, C), idx (n,), rows (n, C)."""
    for i in range(idx.shape[0]):
        dst, src = dW[idx[i], c0:c1], rows[i, c0:c1]        # views indexed from 0 vectorise
        for j in range(dst.size):
            dst[j] += src[j]
