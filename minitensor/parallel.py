"""Elementwise and row-wise NumPy work split across CPU threads.

NumPy runs a ufunc on one core; BLAS uses them all. Large ufunc calls release the GIL, so the
elementwise parts of a step (GELU, LayerNorm, softmax, cross-entropy, AdamW) can run on every
core by handing contiguous slices of the same arrays to a few Python threads:

    parallel_for(n_rows, lambda start, stop: work(rows[start:stop]))

Each call splits [0, n) into one range per thread and waits for all of them. Work smaller than
`min_items` runs inline: below that, thread hand-off costs more than it saves. The thread count
is ANDREA_NUM_THREADS, else the CPUs this process may use; 1 disables threading.
"""

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

_pool = None
_threads = None
_blas = None


def num_threads():
    global _threads
    if _threads is None:
        env = os.environ.get("ANDREA_NUM_THREADS")
        if env:
            try:
                _threads = max(1, int(env))
            except ValueError:
                raise ValueError(f"ANDREA_NUM_THREADS={env!r} is not a whole number: set it to the number of "
                                 "threads to use (1: no threading), or unset it") from None
        else:
            _threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return _threads


def _get_pool():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=num_threads(), thread_name_prefix="minitensor")
    return _pool


def parallel_for(n, fn, min_items=1, cost_per_item=1, min_work=1 << 15):
    """Calls fn(start, stop) over a split of range(n) into up to num_threads() contiguous parts.

    Runs inline when there is one thread, one item too few, or n * cost_per_item < min_work
    (elements of work). The calling thread takes the first part itself.
    """
    k = min(num_threads(), n // max(1, min_items))
    if k <= 1 or n * cost_per_item < min_work:
        fn(0, n)
        return
    bounds = [n * i // k for i in range(k + 1)]
    futures = [_get_pool().submit(fn, bounds[i], bounds[i + 1]) for i in range(1, k)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


def forget_blas():
    """Makes the next blas_single_threaded() look for the loaded BLAS libraries again (after one
    more was loaded, e.g. SciPy's for the numba kernels)."""
    global _blas
    _blas = None


def blas_single_threaded():
    """A context in which BLAS runs each call on one thread (threadpoolctl), for work that is split
    over minitensor's own threads: many small GEMMs (attention heads) run faster two at a time on
    one core each than one at a time on two cores that must be woken for every call."""
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas")
        except Exception:  # no threadpoolctl, or a BLAS it does not know: leave BLAS as it is
            _blas = False
    if not _blas or num_threads() == 1:
        return contextlib.nullcontext()
    return _blas.limit(limits=1)
