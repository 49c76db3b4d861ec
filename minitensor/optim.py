"""AdamW over the flat parameter and gradient buffers, in a few vectorised passes.

    m = b1 m + (1 - b1) g                      g = the gradient times grad_scale (clipping)
    v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd [decayed]) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Decoupled weight decay (Loshchilov & Hutter) applied before the Adam step, as PyTorch's AdamW
does, and only to the tensors `decays` selects (by default those of 2+ dimensions: matmul
weights and embeddings).

`adamw_update` is the update, written once against xp: it is what NumPy and CuPy run without a
fused kernel, and the formula the kernels are checked against. On NumPy it runs over chunks of
the buffers (a scalar decay factor per chunk, so no buffer-sized mask), spread over the CPU
threads, so its temporaries stay in cache instead of streaming whole-buffer intermediates
through memory; on CuPy over the whole buffer, with a 0/1 decay mask.

Two other implementations of the same update, checked against it by the tests: on the CPU with
numba (minitensor.cpu), `adamw_cpu` makes it in one pass (it reads g, m, v, p once and writes m,
v, p once per element, where the NumPy chunks make ~12 passes over cache-resident chunks), in the
arithmetic of the buffers' dtype; on CuPy, the fused kernel 'adamw_step' (ADAMW_STEP).
"""

import math

import numpy as np

from minitensor import cpu, cuda
from minitensor.backend import array_module
from minitensor.parallel import parallel_for
from minitensor.params import Params

CHUNK = 1 << 16


def global_norm(grads):
    """sqrt(sum(g^2)) over a flat buffer: a float accumulated in float64 chunk by chunk on NumPy, a
    0-d array on CuPy."""
    xp = array_module(grads)
    if xp is not np:  # a 0-d device array: reading it would wait for the whole step
        return xp.sqrt(xp.dot(grads, grads))
    total = 0.0
    for start in range(0, grads.size, 1 << 20):
        g = grads[start:start + (1 << 20)]
        total += float(np.dot(g, g))
    return math.sqrt(total)


def clip_scale(norm, clip, loss):
    """(scale, finite) on norm's device, read nothing: scale = clip / (norm + 1e-6) when clip and
    norm > clip, else 1; finite says whether both the loss and the norm are finite (the step's
    guard). The AdamW step takes scale as it is; the host reads only finite."""
    xp = array_module(norm)
    norm = xp.asanyarray(norm)  # asanyarray: a NumPy float becomes 0-d, any array stays what it is
    scale = xp.where(norm > clip, clip / (norm + 1e-6), 1.0) if clip else xp.ones((), norm.dtype)
    return scale, xp.isfinite(norm) & xp.isfinite(xp.asanyarray(loss))


class AdamW:
    def __init__(self, params, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decays=None):
        """params: a minitensor Params; decays(name, shape) -> bool says which tensors are decayed
        (default: those of 2+ dimensions)."""
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        xp = params.xp
        self.m = xp.zeros_like(params.data)
        self.v = xp.zeros_like(params.data)
        self.decays = decays or (lambda name, shape: len(shape) >= 2)
        # NumPy: (start, stop, decayed) pieces of at most CHUNK elements, tensor by tensor (the
        # padding between tensors is never touched); CuPy: a 0/1 mask for one fused pass.
        self._pieces = []
        for name, shape in params.shapes.items():
            start, size = params.offsets[name], math.prod(shape)
            flag = bool(self.decays(name, shape))
            self._pieces += [(s, min(s + CHUNK, start + size), flag) for s in range(start, start + size, CHUNK)]
        self._decay_mask = None if xp is np else params.mask(self.decays)
        self._piece_arrays = None  # the pieces as (starts, stops, decayed) arrays, for adamw_cpu
        self.t = 0

    def step(self, lr=None, grad_scale=1.0):
        """One update from params.grads (times grad_scale); lr overrides the default for this step.

        grad_scale may be a 0-d array on the parameters' device (the clipping scale computed
        there), so a GPU step needs no host read."""
        lr = self.lr if lr is None else lr
        self.t += 1
        b1, b2 = self.betas
        c1 = 1.0 - b1 ** self.t
        c2 = 1.0 - b2 ** self.t
        p, g, m, v = self.params.data, self.params.grads, self.m, self.v
        # m/c1 / (sqrt(v/c2) + eps) == (m * s) / (sqrt(v) + eps * sqrt(c2)) with s = sqrt(c2) / c1
        step_size = lr * math.sqrt(c2) / c1
        eps_hat = self.eps * math.sqrt(c2)
        decay = lr * self.weight_decay
        if cuda.uses("adamw", p):
            adamw_step_gpu(p, g, m, v, self._decay_mask, lr=lr, beta1=b1, beta2=b2, eps=self.eps,
                           weight_decay=self.weight_decay, t=self.t, grad_scale=grad_scale)
            return
        if array_module(p) is not np:  # one pass over the whole buffer; grad_scale stays on the device
            adamw_update(p, g, m, v, array_module(p).empty_like(p), b1, b2, grad_scale, step_size, eps_hat,
                         1.0 - decay * self._decay_mask)
            return
        if cpu.enabled(p, g, m, v):
            self._step_cpu(p, g, m, v, b1, b2, float(grad_scale), step_size, eps_hat, decay)
            return
        args = (b1, b2, float(grad_scale), step_size, eps_hat)  # on the host already: no sync
        pieces = self._pieces

        def run(first, last):
            w = np.empty(CHUNK, p.dtype)
            for s, e, decayed in pieces[first:last]:
                adamw_update(p[s:e], g[s:e], m[s:e], v[s:e], w[:e - s], *args, 1.0 - decay if decayed else 1.0)

        parallel_for(len(pieces), run, min_work=0)

    def _step_cpu(self, p, g, m, v, b1, b2, grad_scale, step_size, eps_hat, decay):
        if self._piece_arrays is None:
            self._piece_arrays = tuple(np.array(col, dtype=np.int64) for col in zip(*self._pieces))
        starts, stops, decayed = self._piece_arrays
        t = p.dtype.type                                     # Python floats would make the kernel float64
        scalars = (t(b1), t(b2), t(grad_scale), t(step_size), t(eps_hat), t(decay))
        parallel_for(len(starts), lambda s, e: adamw_cpu(p, g, m, v, starts[s:e], stops[s:e], decayed[s:e],
                                                         *scalars), min_work=0)

    def state_dict(self):
        return {"m": self.m, "v": self.v, "t": self.t}

    def load_state_dict(self, state):
        if state["m"].shape != self.m.shape or state["v"].shape != self.v.shape:
            raise ValueError(f"optimizer state of size {state['m'].shape} does not fit {self.m.shape}")
        self.m[...] = self.params.xp.asarray(state["m"])
        self.v[...] = self.params.xp.asarray(state["v"])
        self.t = int(state["t"])


def adamw_update(p, g, m, v, w, b1, b2, grad_scale, step_size, eps_hat, keep):
    """In place over p, m, v from g, all of one shape and on one device, w a workspace like them:
    the update of the module docstring with step_size = lr sqrt(c2) / c1, eps_hat = eps sqrt(c2)
    (c1 = 1 - b1^t, c2 = 1 - b2^t) and keep = 1 - lr wd where decayed: a number, or an array like
    p. grad_scale is a number or a 0-d array on p's device (never read on the host)."""
    xp = array_module(p)
    xp.multiply(g, (1.0 - b1) * grad_scale, out=w)           # (1 - b1) g
    m *= b1
    m += w
    xp.multiply(g, g, out=w)
    w *= (1.0 - b2) * grad_scale * grad_scale                 # (1 - b2) g^2
    v *= b2
    v += w
    if not (isinstance(keep, float) and keep == 1.0):       # a mask reaches here as an array
        p *= keep                                             # decoupled weight decay
    xp.sqrt(v, out=w)
    w += eps_hat
    xp.divide(m, w, out=w)
    w *= step_size
    p -= w


@cpu.kernel()
def adamw_cpu(p, g, m, v, starts, stops, decayed, b1, b2, grad_scale, step_size, eps_hat, decay):
    """p, g, m, v flat (P,); pieces [starts[k], stops[k]) of them, decayed[k] 0 or 1; the update
    of the module docstring with step_size = lr sqrt(c2) / c1 and eps_hat = eps sqrt(c2)."""
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


def cosine_lr(step, max_lr, min_lr, warmup_steps, total_steps):
    """Linear warmup from max_lr / warmup_steps to max_lr, then cosine decay to min_lr at total_steps.

    step counts from 0; past total_steps the rate stays at min_lr.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# CUDA: AdamW over the whole flat buffer, one elementwise pass


def _adamw_op_reference(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale, step_size, eps_hat, decay):
    """ADAMW_STEP's operation through adamw_update, on copies of p, m, v; returns the new (p, m, v)."""
    p, m, v = p_in.copy(), m_in.copy(), v_in.copy()
    scale = np.asarray(grad_scale).reshape(-1)[0]  # the kernel reads grad_scale[0]
    adamw_update(p, g, m, v, np.empty_like(p), beta1, beta2, scale, step_size, eps_hat, 1.0 - decay * mask)
    return p, m, v


# adamw_update's form: m_hat / (sqrt(v_hat) + eps) = (m sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)),
# so the bias corrections are two host scalars (step_size, eps_hat). grad_scale is a one-element
# device array (the clipping scale, computed on the device: reading it would stall the step).
# Each output is computed from the inputs before any is written, so p, m, v may be passed as
# their own outputs (in place).
ADAMW_STEP = cuda.register(cuda.ElementwiseSpec(
    "adamw_step",
    "T p_in, T m_in, T v_in, T g, T mask, T beta1, T beta2, raw T grad_scale, T step_size, T eps_hat, T decay",
    "T p, T m, T v",
    "const T gs = g * grad_scale[0];\n"
    "const T m1 = beta1 * m_in + ((T)1 - beta1) * gs;\n"
    "const T v1 = beta2 * v_in + ((T)1 - beta2) * gs * gs;\n"
    "const T p1 = p_in * ((T)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));\n"
    "m = m1;\nv = v1;\np = p1;",
    reference=_adamw_op_reference,
    scalars=(("beta1", 0.9), ("beta2", 0.95), ("step_size", 1e-3), ("eps_hat", 1e-8), ("decay", 1e-4)),
    domains=(("v_in", np.abs), ("mask", lambda a: (a > 0).astype(a.dtype))),
))


def adamw_step_gpu(p, g, m, v, mask, *, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step, in place over the flat CuPy buffers p, m, v (same shape and dtype as g and
    mask, mask 1 where weight decay applies, 0 elsewhere); t counts steps from 1. Equals
    minitensor.optim.AdamW.step: the gradient is g * grad_scale (clipping), grad_scale a number
    or a one-element device array."""
    fn = "adamw_step_gpu"
    cuda.check_operands(fn, p, None)
    for name, a in (("g", g), ("m", m), ("v", v), ("mask", mask)):
        cuda.like(fn, name, a, p, contiguous=False)
    if t < 1:
        raise ValueError(f"{fn}: t counts steps from 1, got {t}")
    c1, c2 = 1.0 - beta1**t, 1.0 - beta2**t
    step_size = lr * math.sqrt(c2) / c1
    eps_hat = eps * math.sqrt(c2)
    cuda.on_cupy(fn, p, "minitensor.optim.AdamW")
    scale = array_module(p).asarray(grad_scale, dtype=p.dtype).reshape(1)
    ADAMW_STEP.kernel()(p, m, v, g, mask, beta1, beta2, scale, step_size, eps_hat, lr * weight_decay, p, m, v)
    return p


@cuda.self_check("adamw")
def _self_check(xp, rng):
    """Two AdamW steps over a small flat buffer of a decayed matrix and an undecayed vector."""
    params = Params({"w": (7, 33), "b": (33,)}, xp=xp, dtype=np.float32)
    params.data[...] = xp.asarray(rng.standard_normal(params.data.shape).astype(np.float32))
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    for scale in (1.0, 0.5):
        for name in params.names():  # through the views: the padding between tensors keeps g = 0
            view = params.grad(name)
            view[...] = xp.asarray(rng.standard_normal(view.shape).astype(np.float32))
        opt.step(grad_scale=xp.asarray(scale, dtype=np.float32))
    return params.data, opt.m, opt.v
