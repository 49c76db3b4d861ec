"""NumpyOps' AdamW over the flat buffers, in the folded form of minitensor.backends.tricks.adamw_update:
over cache-sized pieces of the runs of equal decay flags (a scalar decay factor per piece, the mask
read only where it changes), with numba one pass per element, without it NumPy over the threads.
"""

import numpy as np

from minitensor.backends import numba_jit
from minitensor.backends.tricks import adamw_scalars, adamw_update
from minitensor.parallel import parallel_for

CHUNK = 1 << 16           # elements per piece: its operands stay in cache


class AdamWCPU:
    """Ops.adamw_step on the CPU (a mixin of NumpyOps)."""

    mask_dtype = np.uint8        # the decay mask: adamw_step reads only where it changes (92 MB at 120m, not 369)
    _pieces = (None, None)       # the last decay mask and its pieces (_adamw_pieces)

    def _adamw_pieces(self, decayed):
        """(starts, stops, flags) of pieces of at most CHUNK elements over the runs of equal values of
        the 0/1 decay mask: a scalar decay factor per piece instead of the mask. Kept for the last mask."""
        if self._pieces[0] is not decayed:
            flags = np.asarray(decayed) != 0
            edges = np.concatenate(([0], np.flatnonzero(flags[1:] != flags[:-1]) + 1, [flags.size]))
            pieces = [(s, min(s + CHUNK, e), bool(flags[a])) for a, e in zip(edges[:-1].tolist(), edges[1:].tolist())
                      for s in range(a, e, CHUNK)]
            self._pieces = (decayed, tuple(np.array(col, dtype=np.int64) for col in zip(*pieces)) if pieces else
                            tuple(np.empty(0, np.int64) for _ in range(3)))
        return self._pieces[1]

    def adamw_step(self, p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale=1.0):
        """numba: one pass reading g, m, v, p once and writing m, v, p once per element; NumPy: the
        update over the cache-sized pieces, spread over the threads. Both in the folded form
        (minitensor.backends.tricks.adamw_update)."""
        starts, stops, flags = self._adamw_pieces(decayed)
        step_size, eps_hat = adamw_scalars(lr, b1, b2, eps, t)
        decay = lr * weight_decay
        if self.numba and numba_jit.takes(p, g, m, v):
            f = p.dtype.type                                 # Python floats would make the kernel float64
            scalars = (f(b1), f(b2), f(grad_scale), f(step_size), f(eps_hat), f(decay))
            parallel_for(len(starts), lambda s, e: adamw_cpu(p, g, m, v, starts[s:e], stops[s:e], flags[s:e],
                                                             *scalars), min_work=0)
            return
        args = (b1, b2, float(grad_scale), step_size, eps_hat)

        def run(first, last):
            w = np.empty(CHUNK, p.dtype)
            for s, e, d in zip(starts[first:last].tolist(), stops[first:last].tolist(), flags[first:last].tolist()):
                adamw_update(np, p[s:e], g[s:e], m[s:e], v[s:e], w[:e - s], *args, 1.0 - decay if d else 1.0)

        parallel_for(len(starts), run, min_work=0)


@numba_jit.kernel()
def adamw_cpu(p, g, m, v, starts, stops, decayed, b1, b2, grad_scale, step_size, eps_hat, decay):
    """Ops.adamw_update over pieces [starts[k], stops[k]) of the flat p, g, m, v (decayed[k] 0 or 1)."""
    t = p.dtype.type
    one = t(1)
    for k in range(starts.size):
        keep = one - decay if decayed[k] else one           # decoupled weight decay
        # views of the piece, indexed from 0: an index numba cannot prove >= 0 costs a
        # wrap-around check per element, which stops LLVM from vectorising the loop
        s, e = starts[k], stops[k]
        pk, gk, mk, vk = p[s:e], g[s:e], m[s:e], v[s:e]
        for i in range(pk.size):
            gi = gk[i] * grad_scale
            mi = b1 * mk[i] + (one - b1) * gi
            vi = b2 * vk[i] + (one - b2) * gi * gi
            mk[i] = mi
            vk[i] = vi
            pk[i] = pk[i] * keep - step_size * mi / (np.sqrt(vi) + eps_hat)
