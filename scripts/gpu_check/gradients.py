"""Phase 4, gradients: a small ANDREA trained in float32 on CuPy against NumPy float64 from the same seed.

At T = 256 (4 layers, d 128; the dry run: 1 layer, T = 64, 2 steps), 3 AdamW steps, once as training
runs (dense attention core, self-checked fused kernels) and once with the generic kernels and the
blocked core (two query blocks of 128): per-step losses within 1e-4 relative, step-0 gradients within
1e-3 norm-wise.
"""

import statistics

import numpy as np
from gpu_check.common import gpu_here, log, normwise, verdict
from gpu_check.steps import train


def part_gradients(dry):
    import dataclasses

    from andrea.config import load_config
    from minitensor.device import set_tf32
    from minitensor.layers.attention import CausalSelfAttention

    cfg = dataclasses.replace(load_config("tiny").model, context_length=256, n_layer=1 if dry else 4)
    B, T, steps = (1, 64, 2) if dry else (2, 256, 3)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, cfg.vocab_size, (B, T + 1)) for _ in range(steps)]
    ref_losses, ref_grads, _ = train(cfg, "cpu", "float64", data)
    log(f"ANDREA {cfg.n_layer} layers, d {cfg.d_model}, {steps} AdamW steps of {B} x {T} from seed 0; "
        f"NumPy float64 losses: {', '.join(f'{v:.6f}' for v in ref_losses)}")
    on_gpu = gpu_here(dry)
    device = "gpu" if on_gpu else "cpu"
    if on_gpu:
        import cupy

        log(set_tf32(cupy, False))  # float32 GEMMs: TF32 would loosen the comparison to 1e-3
    failed = False
    variants = (("dense core, kernels auto", True), ("blocked core (2 query blocks), generic kernels", False))
    for variant, dense in variants:
        CausalSelfAttention.dense = dense
        losses, grads, kernels_line = train(cfg, device, "float32", data, "auto" if dense else "generic")
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        errs = {name: normwise(grads[name], ref_grads[name]) for name in ref_grads}
        worst = max(errs, key=errs.get)
        ok = loss_err <= 1e-4 and errs[worst] <= 1e-3
        failed |= not ok
        log(f"figure: {verdict(ok).strip()} {variant}: losses {loss_err:.1e}, gradients {errs[worst]:.1e} ({worst})")
        log(f"{verdict(ok)} {'CuPy' if on_gpu else 'NumPy'} float32, {variant} ({kernels_line}): losses within "
            f"{loss_err:.2e} relative (tolerance 1e-4); step-0 gradients within {errs[worst]:.2e} norm-wise "
            f"(worst tensor {worst}; median {statistics.median(errs.values()):.2e}; tolerance 1e-3)")
    CausalSelfAttention.dense = None
    return failed

