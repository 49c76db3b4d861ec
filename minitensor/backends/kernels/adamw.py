"""AdamW over the whole flat parameter buffer on the GPU, one elementwise pass: the ElementwiseKernels of
kernels/adamw.cu, their wrappers and the fused piece adamw's record.

Under the bf16 policy the pass also writes the bfloat16 copy of the updated weights that the forward
reads (`copy`: adamw_step_copy), rounded to nearest even with ml_dtypes' bits, so that no second pass
over the weights is needed (llm.c's adamw_kernel3 writes its copy the same way)."""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.tricks import adamw_scalars, adamw_update
from minitensor.device import array_module


def _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    """ADAMW_STEP's operation through tricks.adamw_update (Ops.adamw_step folded), on copies of p, m, v."""
    p, m, v = p_in.copy(), m_in.copy(), v_in.copy()
    scale = np.asarray(grad_scale).reshape(-1)[0]  # the kernel reads grad_scale[0]
    adamw_update(np, p, g, m, v, np.empty_like(p), beta1, beta2, scale, step_size, eps_hat, 1.0 - decay * mask)
    return p, m, v




def _adamw_copy_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    """ADAMW_STEP_COPY's: ADAMW_STEP's, and the bits of the updated p rounded to bfloat16 (ml_dtypes) as numbers."""
    p, m, v = _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay)
    bits = p.astype(np.float32).astype(precision.bfloat16()).view(np.uint16)
    return p, m, v, bits.astype(np.float64)


_ADAMW_PARAMS = ("T p_in, T m_in, T v_in, T g, T mask, T beta1, T beta2, raw T grad_scale, T step_size, T eps_hat, "
                 "T decay")
_ADAMW_SCALARS = (("beta1", 0.9), ("beta2", 0.95), ("step_size", 1e-3), ("eps_hat", 1e-8), ("decay", 1e-4))
_ADAMW_DOMAINS = (("v_in", np.abs), ("mask", lambda a: (a > 0).astype(a.dtype)))

# The kernels (their form, adamw_update's, explained there): kernels/adamw.cu.
ADAMW_STEP = cuda.ElementwiseSpec("adamw_step", _ADAMW_PARAMS, "T p, T m, T v", "adamw.cu",
                                  reference=_adamw_op_reference, scalars=_ADAMW_SCALARS, domains=_ADAMW_DOMAINS)
# the same update, and the bfloat16 copy of p as its bits (a uint16 view of the bfloat16 buffer)
ADAMW_STEP_COPY = cuda.ElementwiseSpec("adamw_step_copy", _ADAMW_PARAMS, "T p, T m, T v, uint16 copy", "adamw.cu",
                                       reference=_adamw_copy_reference, scalars=_ADAMW_SCALARS,
                                       domains=_ADAMW_DOMAINS, writes_bf16=True)


def adamw_step_gpu(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, copy=None):
    """One AdamW step, in place over the flat CuPy buffers p, m, v (same shape and dtype as g and
    mask, mask 1 where weight decay applies, 0 elsewhere); t counts steps from 1. Equals
    Ops.adamw_step: the gradient is g * grad_scale (clipping), grad_scale a number or a
    one-element device array. copy (a contiguous bfloat16 buffer as long as p, p float32): after the
    update copy[:] = p rounded to bfloat16, nearest even, in the same pass."""
    fn = "adamw_step_gpu"
    if t < 1:
        raise ValueError(f"{fn}: t counts steps from 1, got {t}")
    cuda.check_operands(fn, p, None)
    for name, a in (("g", g), ("m", m), ("v", v), ("mask", mask)):
        cuda.like(fn, name, a, p, contiguous=False)
    cuda.on_cupy(fn, p, "Ops.adamw_step")
    if copy is not None and (p.dtype != precision.accumulate_of(precision.bfloat16()) or copy.shape != p.shape
                             or copy.dtype.name != precision.BF16 or not copy.flags.c_contiguous):
        raise ValueError(f"{fn}: copy must be a contiguous bfloat16 array of shape {p.shape} beside float32 "
                         f"weights; got {copy.dtype} {copy.shape} beside {p.dtype}")
    scale = array_module(p).asarray(grad_scale, dtype=p.dtype).reshape(1)
    step_size, eps_hat = adamw_scalars(lr, beta1, beta2, eps, t)
    args = (p, m, v, g, mask, beta1, beta2, scale, step_size, eps_hat, lr * weight_decay, p, m, v)
    if copy is None:
        ADAMW_STEP.kernel()(*args)
    else:
        ADAMW_STEP_COPY.kernel()(*args, copy.view(np.uint16))
    return p


# --- the fused piece adamw: the Ops method it replaces, the self-check's sample, gpu_check's cases, its
# record ---


def _fused_adamw_step(ops, p, g, m, v, decayed, lr, b1, b2, eps, weight_decay, t, grad_scale=1.0, copy=None):
    """Ops.adamw_step in one elementwise pass, in the folded form of tricks.adamw_update (with copy, the
    bfloat16 copy of p written in the same pass; bfloat16 weights or state themselves: Ops' code)."""
    if any(a.dtype.name == precision.BF16 for a in (p, g, m, v)):
        return cuda.FALLBACK
    adamw_step_gpu(p, g, m, v, decayed, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, t=t,
                   grad_scale=grad_scale, copy=copy)


def _adamw_sample(ops, rng):
    """Two AdamW steps over a small flat buffer of a decayed matrix and an undecayed vector, and (where
    ml_dtypes gives bfloat16) a third that writes the bfloat16 copy: its distance from the updated
    weights rounded by CuPy's astype, 0 where the copy is right."""
    from minitensor.flat import Params
    from minitensor.optim import AdamW

    xp = ops.xp
    params = Params({"w": (7, 33), "b": (33,)}, xp=xp, dtype=np.float32, ops=ops)
    params.data[...] = xp.asarray(rng.standard_normal(params.data.shape).astype(np.float32))
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for scale in (1.0, 0.5):
        for name in params.names():  # through the views: the padding between tensors keeps g = 0
            view = params.grad(name)
            view[...] = xp.asarray(rng.standard_normal(view.shape).astype(np.float32))
        opt.step(grad_scale=xp.asarray(scale, dtype=np.float32))
    state = opt.named_state()
    try:
        bf16 = precision.bfloat16()
    except ImportError:  # no bfloat16 here, so no copy is ever asked for
        return params.data, *state.values()
    copy = xp.zeros(params.data.shape, bf16)
    ops.adamw_step(params.data, params.grads, state["m"], state["v"], opt.decayed, 1e-2, 0.9, 0.999,
                   1e-8, 0.1, 3, grad_scale=1.0, copy=copy)
    return params.data, *state.values(), copy.astype(np.float32) - params.data.astype(bf16).astype(np.float32)


def _adamw_cases(k):
    """One AdamW step over the model's parameter layout (decay on 2+-D tensors) against the optimizer."""
    from minitensor.flat import Params
    from minitensor.optim import AdamW

    hyper = dict(lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def setup():
        k.reseed()
        params = Params(k.shapes, xp=k.xp, dtype=k.dtype, ops=k.ref)
        params.data[...] = k.rand(params.size, scale=0.02)
        params.grads[...] = k.rand(params.size, scale=1e-3)
        opt = AdamW(params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"])
        return dict(params=params, opt=opt, mask=params.mask(opt.decays))

    def generic(d):
        d["opt"].step(grad_scale=0.5)
        return d["params"].data, *d["opt"].named_state().values()

    def fused(d):
        p, state = d["params"], d["opt"].named_state()
        adamw_step_gpu(p.data, p.grads, state["m"], state["v"], d["mask"], t=1, grad_scale=0.5, **hyper)
        return p.data, *state.values()

    return [("adamw step", setup, fused, generic, True)]


def _adamw_timed(ops, sizes):
    """One AdamW step over P parameters (decay on every one), the gradient scale left on the device."""
    xp = ops.xp
    p, g = cuda.normals(xp, sizes.P, scale=0.02), cuda.normals(xp, sizes.P, scale=1e-3)
    m, v, decayed = xp.zeros(sizes.P, np.float32), xp.zeros(sizes.P, np.float32), xp.ones(sizes.P, np.float32)
    scale = xp.ones((), np.float32)
    return lambda: ops.adamw_step(p, g, m, v, decayed, 6e-4, 0.9, 0.95, 1e-8, 0.1, 1, grad_scale=scale)


ADAMW = cuda.fused_piece(
    "adamw",
    replaces={"adamw_step": _fused_adamw_step},
    kernels=(ADAMW_STEP, ADAMW_STEP_COPY),
    sample=_adamw_sample,
    cases=_adamw_cases,
    timed=_adamw_timed,
)
