"""The row softmax, written once against xp (NumPy or CuPy); every softmax in andrea runs it.

    z (..., V)  ->  e = exp(z - max(z)) by rows, total = sum(e), lse = max(z) + log(total)
    softmax(z) = e / total,  log(sum(exp(z))) = lse               total and lse (..., 1)

Subtracting the row maximum first means exp never overflows: every e <= 1, and the maximum's
own term is 1, so total >= 1 and its log is finite. A row may hold -inf (a mask) as long as one
entry is finite: exp(-inf - max) is exactly 0. The division by total is left to the callers,
since each folds something into it or needs only lse: the cross-entropy (minitensor.layers.loss)
divides by total N, backward's 1/N folded in; attention (minitensor.layers.attention's block_exp, after
the causal mask) keeps lse to recompute the probabilities in backward; sampling (andrea.sample)
divides by total.

The numba and CUDA kernels of those layers are other implementations of this maths; the tests
check them against the layers' generic code, which is this function.
"""

from minitensor.device import array_module


def exp_rows(z, out=None):
    """z (..., V) -> out (..., V) = exp(z - max(z)) by rows, in place over z unless out (same shape
    and dtype) is given; returns (total, lse), each (..., 1): total = sum(out) by rows and lse =
    log(sum(exp(z))) by rows."""
    xp = array_module(z)
    out = z if out is None else out
    top = z.max(axis=-1, keepdims=True)
    xp.subtract(z, top, out=out)
    xp.exp(out, out=out)
    total = out.sum(axis=-1, keepdims=True)
    return total, top + xp.log(total)
