"""The embedding's backward on the GPU: dW[id] += the rows at that id's positions, summed in position
order, the RawKernel of kernels/embedding.cu (always on, CupyOps.scatter_add_rows: no record)."""

import numpy as np

from minitensor.backends import cuda
from minitensor.device import array_module

SCATTER_ADD_ROWS = cuda.register(cuda.RawSpec("scatter_add_rows", "embedding.cu"))


def scatter_add_rows_gpu(dW, idx, rows):
    """dW[idx[i]] += rows[i] for dW (V, C) contiguous and rows (n, C) of its dtype: the positions sorted
    by (id, position), then one thread per id and column adds that id's rows in position order."""
    xp, n = array_module(dW), idx.shape[0]
    if n == 0:
        return
    ids = xp.ascontiguousarray(idx, dtype=np.int64)
    order = xp.argsort(ids * n + xp.arange(n, dtype=np.int64))  # unique keys: any sort gives this order
    C = dW.shape[1]
    block = cuda.threads(C, 256)
    cuda.launch(SCATTER_ADD_ROWS, dW.dtype, (n, -(-C // block)), (block,),
                (dW, xp.ascontiguousarray(rows), order, ids[order], np.int64(n), np.int32(C)))
