"""The embedding's backward on the GPU: dW[id] += the rows at that id's positions, summed in position
order, the RawKernel of kernels/embedding.cu (always on, CupyOps.scatter_add_rows: no record)."""

import numpy as np

from minitensor.backends import cuda
from minitensor.device import array_module


def _scatter_model(m):
    """The token embedding's backward at the model's sizes: N rows into the vocabulary's (minitensor.checks.counts)."""
    ids = np.random.default_rng(0).integers(0, m.V, m.N)
    scatter_add_rows_gpu(np.zeros((m.V, m.C), np.float32), ids, np.zeros((m.N, m.C), np.float32))


def _every_64th_position(grid, block, args):
    """A sample, not every block: those of every 64th position of the sorted order (a block's work is
    its id's run, if it starts one), each standing for its share of the positions."""
    sampled = range(0, grid[0], 64)
    return [(x + grid[0] * y, grid[0] / len(sampled)) for y in range(grid[1]) for x in sampled]


# Built for bfloat16 too (bf16=True): the rows in T, dW (the weight gradient) in ACC, float32 for bfloat16.
SCATTER_ADD_ROWS = cuda.register(cuda.RawSpec("scatter_add_rows", "embedding.cu", model=_scatter_model,
                                              count_blocks=_every_64th_position, bf16=True))


def scatter_add_rows_gpu(dW, idx, rows):
    """dW[idx[i]] += rows[i] for dW (V, C) contiguous and rows (n, C) of the dtype dW sums (dW's, or
    bfloat16 rows into a float32 dW: precision.accumulate_of): the positions sorted by (id, position),
    then one thread per id and column adds that id's rows in position order."""
    xp, n = array_module(dW), idx.shape[0]
    if n == 0:
        return
    ids = xp.ascontiguousarray(idx, dtype=np.int64)
    order = xp.argsort(ids * n + xp.arange(n, dtype=np.int64))  # unique keys: any sort gives this order
    C = dW.shape[1]
    block = cuda.threads(C, 256)
    cuda.launch(SCATTER_ADD_ROWS, rows.dtype, (n, -(-C // block)), (block,),
                (dW, xp.ascontiguousarray(rows), order, ids[order], np.int64(n), np.int32(C)))
