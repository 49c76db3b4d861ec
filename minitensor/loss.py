"""Softmax cross-entropy, fused: loss = mean over all N positions of logsumexp(z) - z[target].

Shapes: logits (..., V), targets (...) integer ids in [0, V). backward(dloss=1) returns
dlogits = dloss * (softmax(z) - onehot(target)) / N. The log-sum-exp subtracts the row maximum
first, so large logits cannot overflow. The forward caches the probabilities already divided by
N (one array of the size of the logits; with `inplace=True` written over the logits to save that
memory), so backward only subtracts 1/N at each target and, for dloss != 1, scales.

The generic path (NumPy and CuPy) takes the row softmax from minitensor.softmax.exp_rows, over
blocks of rows that stay in cache on NumPy. Two other implementations, checked against it by the
tests: on the CPU with numba (minitensor.cpu), `softmax_rows_cpu` below makes each row's passes
(exp and sum, scale) in one kernel, in place, while the row's V values sit in cache; on CuPy,
the fused kernels 'softmax_xent_fwd' / '_bwd'.
"""

import numpy as np

from minitensor import cpu, cuda
from minitensor.backend import array_module
from minitensor.embedding import check_ids
from minitensor.layer import Layer
from minitensor.parallel import parallel_for
from minitensor.softmax import exp_rows

ROWS_IN_CACHE = 1 << 18  # elements per block of rows on NumPy (1 MiB of float32)


class SoftmaxCrossEntropy(Layer):
    def __init__(self, check=True):
        """check=False skips the target range check (a host sync on a GPU) for validated targets."""
        self.check = check

    def forward(self, logits, targets, inplace=False):
        xp = array_module(logits)
        V = logits.shape[-1]
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets of shape {targets.shape} do not match logits of shape {logits.shape}")
        if self.check:
            check_ids(targets, V, what="target id")
        if cuda.uses("softmax_xent", logits):
            return self._forward_fused(logits, targets, inplace)
        z = logits.reshape(-1, V)                            # (N, V)
        t = targets.reshape(-1)                              # (N,)
        N = z.shape[0]
        probs = z if inplace else xp.empty_like(z)
        logsumexp = xp.empty(N, dtype=z.dtype)
        picked = z[xp.arange(N), t].astype(z.dtype)          # z[target], before z is overwritten
        rows = max(1, ROWS_IN_CACHE // V) if xp is np else N
        if cpu.enabled(z, probs) and probs.flags.c_contiguous:
            # the row maxima from NumPy's SIMD max (a compiled max loop is one compare per cycle)
            def rows_cpu(s, e):
                if probs is not z:
                    probs[s:e] = z[s:e]
                softmax_rows_cpu(probs[s:e], z[s:e].max(axis=1), N, logsumexp[s:e])

            parallel_for(N, rows_cpu, cost_per_item=V)
            loss = (logsumexp - picked).mean()
            self._save(probs, t, logits.shape)
            return loss

        def blocks(first, last):                             # row blocks that stay in cache for all passes
            for s in range(first * rows, min(last * rows, N), rows):
                pb = probs[s:s + rows]
                total, lse = exp_rows(z[s:s + rows], out=pb)
                xp.divide(pb, total * N, out=pb)                # softmax / N: backward's scale, folded in
                logsumexp[s:s + rows] = lse[:, 0]

        if xp is np:
            parallel_for(-(-N // rows), blocks, cost_per_item=rows * V)
        else:
            blocks(0, 1)
        loss = (logsumexp - picked).mean()
        self._save(probs, t, logits.shape)
        return loss

    def backward(self, dloss=1.0):
        cache = self._pop()
        if len(cache) == 4:                                  # the fused forward: plain softmax(z)
            probs, t, shape, _ = cache
            return softmax_xent_backward_gpu(probs, t, dloss).reshape(shape)
        scaled, t, shape = cache                             # scaled = softmax(z) / N
        xp = array_module(scaled)
        N = scaled.shape[0]
        # forward was: loss = mean_n(logsumexp(z_n) - z_n[t_n]); d/dz_n = (softmax(z_n) - onehot(t_n)) / N
        dz = scaled
        dz[xp.arange(N), t] -= 1.0 / N
        if not (isinstance(dloss, (int, float)) and dloss == 1.0):
            if xp is np:
                parallel_for(N, lambda s, e: dz[s:e].__imul__(dloss), cost_per_item=dz.shape[1])
            else:
                dz *= dloss
        return dz.reshape(shape)

    def _forward_fused(self, logits, targets, inplace):
        """forward through softmax_xent_fwd: the probabilities (not divided by N) over the logits."""
        xp = array_module(logits)
        z = logits.reshape(-1, logits.shape[-1])
        z = z if inplace and z.flags.c_contiguous else xp.array(z, order="C")
        t = targets.reshape(-1)
        loss, _ = softmax_xent_forward_gpu(z, t)
        self._save(z, t, logits.shape, "fused")
        return loss


# ---------------------------------------------------------------------------------------------
# CUDA: softmax cross-entropy over (N, V) logits


# One block per row. The probabilities overwrite the logits; z[target] is read by thread 0 before
# any write (the writes come after two barriers). A target outside [0, V) makes the row's loss
# NaN rather than reading out of bounds: the check costs no host synchronisation.
SOFTMAX_XENT_FWD = cuda.register(cuda.RawSpec("softmax_xent_fwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void softmax_xent_fwd(T *z, const long long *targets, T *losses, const int V) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  T *zr = z + row * V;
  const long long t = targets[row];
  const bool valid = t >= 0 && t < V;
  const T picked = threadIdx.x == 0 && valid ? zr[t] : (T)0;
  T top = lowest_of(picked);
  for (int j = threadIdx.x; j < V; j += blockDim.x) top = zr[j] > top ? zr[j] : top;
  top = block_max(top, buf);
  T total = 0;
  for (int j = threadIdx.x; j < V; j += blockDim.x) total += exp_of(zr[j] - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < V; j += blockDim.x) zr[j] = exp_of(zr[j] - top) / total;
  if (threadIdx.x == 0) losses[row] = valid ? log_of(total) + top - picked : nan_of(top);
}
"""))

SOFTMAX_XENT_BWD = cuda.register(cuda.ElementwiseSpec(
    "softmax_xent_bwd", "T probs, raw int64 targets, int32 V, T scale", "T dz",
    "const unsigned int row = (unsigned int)i / (unsigned int)V;\n"
    "const long long col = (long long)((unsigned int)i - row * (unsigned int)V);\n"
    "dz = (probs - (col == targets[row] ? (T)1 : (T)0)) * scale;",
    reference=lambda probs, targets, V, scale: _xent_bwd_flat(probs, targets, int(V), scale),
    scalars=(("V", 5), ("scale", 0.25)),
))


def _xent_bwd_flat(probs, targets, V, scale):
    i = np.arange(probs.size)
    onehot = i % V == targets.astype(np.int64)[i // V]
    return (probs - onehot) * scale


def softmax_xent_forward_gpu(logits, targets):
    """Softmax cross-entropy of logits (..., V) (CuPy, contiguous, overwritten by the
    probabilities) against integer targets (...); returns (loss, losses): the mean as a 0-d
    device array (no host synchronisation) and the per-row terms. A target outside [0, V) gives
    a NaN loss."""
    fn = "softmax_xent_forward_gpu"
    z, t = _xent_operands(fn, logits, targets)
    xp = array_module(logits)
    losses = xp.empty(z.shape[0], dtype=z.dtype)
    if z.shape[0]:
        cuda.launch(SOFTMAX_XENT_FWD, z.dtype, (z.shape[0],), (cuda.threads(z.shape[1], 512),),
                (z, t, losses, np.int32(z.shape[1])))
    return losses.mean(), losses


def softmax_xent_backward_gpu(probs, targets, dloss=1.0):
    """In place over probs (..., V) from softmax_xent_forward_gpu: dlogits = dloss (probs -
    onehot(targets)) / N, N the number of rows; returns it."""
    fn = "softmax_xent_backward_gpu"
    z, t = _xent_operands(fn, probs, targets)
    if z.size >= 2**31:
        raise ValueError(f"{fn}: {z.size} logits; at most 2**31 - 1 are supported")
    cuda.on_cupy(fn, probs, "minitensor.loss.SoftmaxCrossEntropy")
    if z.shape[0]:
        SOFTMAX_XENT_BWD.kernel()(probs, t, np.int32(z.shape[1]), float(dloss) / z.shape[0], probs)
    return probs


def _xent_operands(fn, logits, targets):
    dtype = getattr(logits, "dtype", None)
    if dtype not in (np.float32, np.float64) or not logits.flags.c_contiguous or logits.ndim < 1:
        raise ValueError(f"{fn}: logits must be a contiguous float32 or float64 array (..., V)")
    if targets.shape != logits.shape[:-1] or targets.dtype.kind not in "iu":
        raise ValueError(f"{fn}: targets must be integers of shape {logits.shape[:-1]}, got "
                         f"{targets.dtype} {targets.shape}")
    xp = array_module(logits)
    t = xp.ascontiguousarray(targets.reshape(-1), dtype=np.int64)
    return logits.reshape(-1, logits.shape[-1]), t


@cuda.self_check("softmax_xent")
def _self_check(xp, rng):
    """Cross-entropy forward and backward (dloss 0.5) over 48 rows of 1000 logits."""
    logits = xp.asarray((3.0 * rng.standard_normal((6, 8, 1000))).astype(np.float32))
    targets = xp.asarray(rng.integers(0, 1000, (6, 8)))
    fn = SoftmaxCrossEntropy()
    loss = fn.forward(logits, targets, inplace=True)
    return xp.asarray(loss).reshape(1), fn.backward(0.5)


@cpu.kernel()
def softmax_rows_cpu(p, top, N, logsumexp):
    """p (n, V) holding the logits z, top (n,) their row maxima, logsumexp (n,): in place,
    p = softmax(z) / N per row, and logsumexp = log(sum(exp(z - top))) + top (no overflow)."""
    t = p.dtype.type
    n, V = p.shape
    for i in range(n):
        m = top[i]
        total = t(0)
        for j in range(V):
            e = cpu.exp(p[i, j] - m)
            p[i, j] = e
            total += e
        scale = t(1) / (total * t(N))                        # softmax / N: backward's scale, folded in
        for j in range(V):
            p[i, j] *= scale
        logsumexp[i] = np.log(total) + m
