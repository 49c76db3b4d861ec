"""Phase 7's workload: the training step gpu_check.sh runs under compute-sanitizer (memcheck, racecheck).

One step of a 1-layer model with every fused kernel, with the dense core (probabilities kept) and with
the blocked core recomputing them, CuPy's memory pool off so that each array is its own allocation.
"""

import time

import numpy as np
from gpu_check.common import KEEP_PROBS, gpu_here, log
from gpu_check.steps import train


def part_sanitize(dry):
    """One training step with every fused kernel in float32 on a 1-layer model, with the dense core
    (probabilities kept) and with the blocked core recomputing them, then AdamW: every project
    kernel launched, at a T that is not a multiple of anything (13). CuPy's memory pool is off, so
    an access past an array's end leaves its allocation and memcheck sees it."""
    import dataclasses

    from andrea.config import load_config
    from minitensor.backends import fused_pieces
    from minitensor.layers.attention import CausalSelfAttention

    on_gpu, pool = gpu_here(dry), "no CuPy"
    if on_gpu:
        import cupy

        pool = "CuPy's pool on: this CuPy has no cupy.cuda.set_allocator"  # the stand-in has none
        if hasattr(cupy.cuda, "set_allocator"):
            cupy.cuda.set_allocator(None)
            pool = "CuPy's pool off"
    cfg = dataclasses.replace(load_config("tiny").model, n_layer=1, context_length=16, vocab_size=61)
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14))
    start, losses = time.perf_counter(), []
    for dense in (True, False):
        CausalSelfAttention.dense = dense
        CausalSelfAttention.keep_probs_max_bytes = KEEP_PROBS if dense else 0
        step_losses, _, line = train(cfg, "gpu" if on_gpu else "cpu", "float32", [x, x], "fused" if on_gpu else None)
        losses.append(step_losses)
    CausalSelfAttention.dense, CausalSelfAttention.keep_probs_max_bytes = None, KEEP_PROBS
    if on_gpu:
        cupy.cuda.runtime.deviceSynchronize()  # a kernel's fault is reported here at the latest
    finite = all(np.isfinite(v) for v in sum(losses, []))
    log(f"figure: {'CuPy' if on_gpu else 'NumPy'} 1-layer step x 2, dense and blocked core ({line}; "
        f"{len(fused_pieces())} fused pieces; {pool}): losses {', '.join(f'{v:.4f}' for v in sum(losses, []))} "
        f"in {time.perf_counter() - start:.1f} s")
    return not finite

