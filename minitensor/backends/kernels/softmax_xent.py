"""Softmax cross-entropy over (N, V) logits on the GPU: the kernels of kernels/softmax_xent.cu, their
wrappers and the fused piece softmax_xent's record."""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.device import array_module


def _softmax_xent_fwd_traffic(z, targets, losses, V, n_valid, **_):
    """The logits' first n_valid columns read, every column overwritten by the probabilities (in place),
    the targets read, the losses written."""
    return z.nbytes * int(n_valid) // int(V) + targets.nbytes, z.nbytes + losses.nbytes


def _softmax_xent_model(m):
    """The tied head's loss at the model's sizes: N rows of the padded vocabulary, V of them logits
    (minitensor.checks.counts)."""
    targets = np.random.default_rng(0).integers(0, m.V, m.N)
    softmax_xent_forward_gpu(np.zeros((m.N, m.V_padded), np.float32), targets, valid=m.V)


# Built for bfloat16 too (bf16=True): the logits and probabilities in T, the max, the sum and the losses in
# ACC (float32 for bfloat16).
SOFTMAX_XENT_FWD = cuda.RawSpec("softmax_xent_fwd", "softmax_xent.cu", traffic=_softmax_xent_fwd_traffic,
                                model=_softmax_xent_model, bf16=True)

SOFTMAX_XENT_BWD = cuda.ElementwiseSpec(
    "softmax_xent_bwd", "T probs, raw int64 targets, int32 V, T scale", "T dz", "softmax_xent.cu",
    reference=lambda probs, targets, V, scale: _xent_bwd_flat(probs, targets, int(V), scale),
    scalars=(("V", 5), ("scale", 0.25)),
)


XENT16_THREADS = 256


def _softmax_xent_bwd16_model(m):
    """The tied head's loss backward at the model's sizes in bfloat16, as a bf16 step launches it
    (minitensor.checks.counts; float32 runs the ElementwiseKernel)."""
    bf16 = precision.bfloat16()
    z, targets = np.zeros((m.N, m.V_padded), bf16), np.random.default_rng(0).integers(0, m.V, m.N)
    cuda.launch(SOFTMAX_XENT_BWD16, z.dtype, (-(-z.size // XENT16_THREADS),), (XENT16_THREADS,),
                (z, targets, np.int32(m.V_padded), np.float32(1.0 / m.N), np.int32(z.size)))


# bfloat16's backward (one thread per element, in place; the default traffic: each array read or written once)
SOFTMAX_XENT_BWD16 = cuda.RawSpec("softmax_xent_bwd16", "softmax_xent.cu", model=_softmax_xent_bwd16_model,
                                  bf16=True)


def _xent_bwd_flat(probs, targets, V, scale):
    i = np.arange(probs.size)
    onehot = i % V == targets.astype(np.int64)[i // V]
    return (probs - onehot) * scale


def softmax_xent_forward_gpu(logits, targets, valid=None):
    """Softmax cross-entropy of logits (..., V) (CuPy, contiguous, overwritten by the
    probabilities) against integer targets (...); returns (loss, losses): the mean as a 0-d
    device array (no host synchronisation) and the per-row terms. With valid (1..V), only the
    first `valid` columns are logits, the others padding given probability 0. A target outside
    [0, valid) gives a NaN loss."""
    fn = "softmax_xent_forward_gpu"
    z, t = _xent_operands(fn, logits, targets, SOFTMAX_XENT_FWD)
    V = z.shape[1]
    valid = V if valid is None else int(valid)
    if not 1 <= valid <= V:
        raise ValueError(f"{fn}: valid must be in [1, {V}], got {valid}")
    xp = array_module(logits)
    losses = xp.empty(z.shape[0], dtype=precision.accumulate_of(z.dtype))  # float32 for bfloat16 logits
    if z.shape[0]:
        cuda.launch(SOFTMAX_XENT_FWD, z.dtype, (z.shape[0],), (cuda.threads(valid, 512),),
                (z, t, losses, np.int32(V), np.int32(valid)))
    return losses.mean(), losses


def softmax_xent_backward_gpu(probs, targets, dloss=1.0):
    """In place over probs (..., V) from softmax_xent_forward_gpu: dlogits = dloss (probs -
    onehot(targets)) / N, N the number of rows; returns it."""
    fn = "softmax_xent_backward_gpu"
    bf16 = getattr(probs, "dtype", None) is not None and probs.dtype.name == precision.BF16
    z, t = _xent_operands(fn, probs, targets, SOFTMAX_XENT_BWD16 if bf16 else SOFTMAX_XENT_BWD)
    if z.size >= 2**31:
        raise ValueError(f"{fn}: {z.size} logits; at most 2**31 - 1 are supported")
    scale = float(dloss) / z.shape[0] if z.shape[0] else 0.0
    if bf16:  # cuda.launch refuses NumPy arrays itself
        if z.size:
            cuda.launch(SOFTMAX_XENT_BWD16, z.dtype, (-(-z.size // XENT16_THREADS),), (XENT16_THREADS,),
                        (z, t, np.int32(z.shape[1]), np.float32(scale), np.int32(z.size)))
        return probs
    cuda.on_cupy(fn, probs, "Ops.softmax_xent_backward")
    if z.shape[0]:
        SOFTMAX_XENT_BWD.kernel()(probs, t, np.int32(z.shape[1]), scale, probs)
    return probs


def _xent_operands(fn, logits, targets, spec=SOFTMAX_XENT_BWD):
    """(logits as rows, the targets as contiguous int64), after checking them: logits of a dtype the
    kernel `spec` is built for (the forward's RawKernel takes bfloat16; the backward's ElementwiseKernel does
    not, its RawKernel twin does)."""
    dtype = getattr(logits, "dtype", None)
    if dtype is None or dtype.name not in spec.dtypes or not logits.flags.c_contiguous or logits.ndim < 1:
        raise ValueError(f"{fn}: logits must be a contiguous {' or '.join(spec.dtypes)} array (..., V)")
    if targets.shape != logits.shape[:-1] or targets.dtype.kind not in "iu":
        raise ValueError(f"{fn}: targets must be integers of shape {logits.shape[:-1]}, got "
                         f"{targets.dtype} {targets.shape}")
    xp = array_module(logits)
    t = xp.ascontiguousarray(targets.reshape(-1), dtype=np.int64)
    return logits.reshape(-1, logits.shape[-1]), t


# --- the fused piece softmax_xent: the Ops methods it replaces, the self-check's sample, gpu_check's
# cases, its record ---


def _fused_vocab_padding(ops, V):
    """V rounded up to a multiple of 128 (the kernels mask the padding), as llm.c pads GPT-2's 50257 to
    50304: every leading dimension of the tied head's three GEMMs a multiple of 16 bytes (8449 -> 8576),
    so cuBLAS can use its aligned (TMA) kernels."""
    return -(-V // 128) * 128


def _fused_softmax_xent_forward(ops, z, t, inplace=False, valid=None):
    """Ops.softmax_xent_forward: the probabilities (not divided by N) over a contiguous z; with valid,
    over its first `valid` columns, the rest given probability 0 (the tied head's padding)."""
    z = z if inplace and z.flags.c_contiguous else ops.xp.array(z, order="C")
    loss, _ = softmax_xent_forward_gpu(z, t, valid)
    return loss, z


def _fused_softmax_xent_backward(ops, saved, t, dloss=1.0):
    """Ops.softmax_xent_backward, in place over what the forward kept: the probabilities (bfloat16 ones
    through softmax_xent_bwd16, float32 sums rounded once, as Ops' code)."""
    return softmax_xent_backward_gpu(saved, t, dloss)


def _softmax_xent_sample(ops, rng):
    """Cross-entropy forward and backward (dloss 0.5) over 48 rows of 1000 logits; then over the same
    logits padded as the tied head pads them (ops.vocab_padding: 1024 columns with the kernel, none
    without), whose padded columns must get no gradient."""
    from minitensor.layers.loss import SoftmaxCrossEntropy

    xp = ops.xp
    logits = draw(xp, rng, 6, 8, 1000, scale=3.0)
    targets = xp.asarray(rng.integers(0, 1000, (6, 8)))
    fn = SoftmaxCrossEntropy(ops=ops)
    loss = fn.forward(logits.copy(), targets, inplace=True)
    grad = fn.backward(0.5)
    padded = xp.zeros((6, 8, ops.vocab_padding(1000)), dtype=logits.dtype)
    padded[..., :1000] = logits
    padded_loss = fn.forward(padded, targets, inplace=True, valid=1000)
    padded_grad = fn.backward(0.5)
    return (xp.asarray(loss).reshape(1), grad, xp.asarray(padded_loss).reshape(1),
            xp.ascontiguousarray(padded_grad[..., :1000]), xp.abs(padded_grad[..., 1000:]).sum(axis=-1))


def _softmax_xent_cases(k):
    """Softmax cross-entropy forward and backward against the loss layer on the reference (k.ref: Ops'
    plain cross-entropy), which keeps the probabilities as the fused kernels take and give them."""
    from minitensor.layers.loss import SoftmaxCrossEntropy

    N, V = k.N, k.V

    def setup():
        k.reseed()
        z = k.rand(N, V, scale=2.0)
        t = k.xp.asarray(np.random.default_rng(0).integers(0, V, N))
        loss_fn = SoftmaxCrossEntropy(ops=k.ref)
        loss_fn.forward(z.copy(), t)
        return dict(z=z, t=t, probs=loss_fn._cache.saved.copy(), cache=loss_fn._cache, loss_fn=loss_fn)

    def generic_fwd(d):
        loss = d["loss_fn"].forward(d["z"], d["t"])
        return loss, d["loss_fn"]._cache.saved

    def generic_bwd(d):
        d["loss_fn"]._save(d["cache"])
        return (d["loss_fn"].backward(1.0),)

    return [
        ("cross-entropy fwd", setup, lambda d: (softmax_xent_forward_gpu(d["z"], d["t"])[0], d["z"]),
         generic_fwd, False),
        ("cross-entropy bwd", setup, lambda d: (softmax_xent_backward_gpu(d["probs"], d["t"]),),
         generic_bwd, True),
    ]


def _softmax_xent_timed(ops, sizes):
    """The loss over N rows of the vocabulary (padded as the backend pads it), forward and backward."""
    xp, V = ops.xp, sizes.V
    z = cuda.normals(xp, sizes.N, ops.vocab_padding(V))
    t = xp.asarray(np.random.default_rng(0).integers(0, V, sizes.N))

    def run():
        _, probs = (ops.softmax_xent_forward(z, t, valid=V) if z.shape[1] != V else ops.softmax_xent_forward(z, t))
        return ops.softmax_xent_backward(probs, t)
    return run


SOFTMAX_XENT = cuda.fused_piece(
    "softmax_xent",
    replaces={"vocab_padding": _fused_vocab_padding, "softmax_xent_forward": _fused_softmax_xent_forward,
              "softmax_xent_backward": _fused_softmax_xent_backward},
    kernels=(SOFTMAX_XENT_FWD, SOFTMAX_XENT_BWD, SOFTMAX_XENT_BWD16),
    sample=_softmax_xent_sample,
    cases=_softmax_xent_cases,
    timed=_softmax_xent_timed,
)
