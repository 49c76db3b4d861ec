"""The GPU's kernels, each piece in two files side by side: NAME.cu (the CUDA source, one section
`// @kernel KERNEL` per kernel, read at its first use by minitensor.backends.cuda.cu_code) and NAME.py
(its specs, the wrappers that check and launch it, and, for a fused piece, its record
`cuda.fused_piece(...)`: the Ops methods it replaces, the self-check's sample, gpu_check's cases).
rows.cuh and flash.cuh are headers a section may `#include`. In the order a reader meets them:

    gelu            GELU (always on) and the fused piece bias_gelu
    linear          the residual branches' bias + residual add (always on)
    layernorm       the fused piece layernorm (rows.cuh)
    causal_softmax  the fused piece causal_softmax: the dense attention core's softmax (rows.cuh)
    attention       the fused piece flash_attention, FlashAttention-2 (flash.cuh)
    softmax_xent    the fused piece softmax_xent (rows.cuh)
    embedding       the embedding's deterministic backward (always on)
    adamw           the fused piece adamw

minitensor.backends.cupy_ops.CupyOps calls the wrappers and imports every module here, so the
registry (cuda.KERNELS, cuda.PIECES) is complete wherever CupyOps is.
"""
