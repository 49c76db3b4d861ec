"""GELU and bias + GELU on the GPU: the ElementwiseKernels of kernels/gelu.cu, their wrappers and
the fused piece bias_gelu's record.

gelu_fwd / gelu_bwd run whenever CupyOps.gelu_forward / _backward get a float array (always on: no
record); bias_gelu_fwd, _bwd and _bwd_fwd (the output recomputed) are the fused piece bias_gelu,
which replaces Ops.bias_gelu_forward / _backward (its record names the functions below that run
them) when the self-check keeps it. Each elementwise kernel's host
reference is the Ops code itself, on flat arrays as the kernel sees them.

On bfloat16 arrays (train.precision=bf16) the piece's wrappers launch RawKernels instead,
bias_gelu_fwd16, _bwd16 and _bwd_fwd16 (the same formulas summed in float32, each output rounded
once: what Ops computes in bfloat16), since CuPy's ElementwiseKernel takes no bfloat16; float32 and
float64 keep the ElementwiseKernels.
"""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cuda import draw
from minitensor.backends.ops import Ops
from minitensor.device import array_module

_REFERENCE = Ops(np)  # what every elementwise kernel's host check compares with

# The formulas and their constants: kernels/gelu.cu. The references are the Ops methods themselves.
GELU_FWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_fwd", "T x", "T y", "gelu.cu",
    reference=lambda x: _REFERENCE.gelu_forward(x),
))

GELU_BWD = cuda.register(cuda.ElementwiseSpec(
    "gelu_bwd", "T x, T dy", "T dx", "gelu.cu",
    reference=lambda x, dy: _REFERENCE.gelu_backward(x, dy),
))


# ---------------------------------------------------------------------------------------------
# bias + GELU: y = GELU(x + b), b broadcast over the rows; x is the matmul output (N, C) ---


def column(n, C):
    """Column of each flat index of an (n / C, C) array: what `i % C` gives in the kernels."""
    return np.arange(n) % int(C)


# The references are GELU's Ops code applied to h = x + b, on flat arrays as the kernels see them,
# gathering the bias by i % C (the host check's flat samples, C = 7, are not whole rows).
BIAS_GELU_FWD = cuda.ElementwiseSpec(
    "bias_gelu_fwd", "T x, raw T b, int32 C", "T y", "gelu.cu",
    reference=lambda x, b, C: _REFERENCE.gelu_forward(x + b[column(x.size, C)]),
    scalars=(("C", 7),),
)

BIAS_GELU_BWD = cuda.ElementwiseSpec(
    "bias_gelu_bwd", "T x, raw T b, int32 C, T dy", "T dh", "gelu.cu",
    reference=lambda x, b, C, dy: _REFERENCE.gelu_backward(x + b[column(x.size, C)], dy),
    scalars=(("C", 7),),
)


BIAS_GELU_BWD_FWD = cuda.ElementwiseSpec(
    "bias_gelu_bwd_fwd", "T x, raw T b, int32 C, T dy", "T dh, T y", "gelu.cu",
    reference=lambda x, b, C, dy: (_REFERENCE.gelu_backward(x + b[column(x.size, C)], dy),
                                   _REFERENCE.gelu_forward(x + b[column(x.size, C)])),
    scalars=(("C", 7),),
)


# The bfloat16 forms (kernels/gelu.cu, RawKernels over T stored and ACC summed): one thread per element
# in blocks of GELU16_THREADS; every pointer read or written once (the default traffic). The backward with
# the output recomputed (the MLP's) goes down columns instead, GELU16_CHUNK_ROWS rows a block, so that it
# sums the bias gradient too: 128 chunks of 64 rows at 8 x 1024, their partial sums 128 x 4C float32
# values (1.5 MB at C = 768, against the pass's 201 MB), which column_sums_add adds up.
GELU16_THREADS = 256
GELU16_CHUNK_ROWS = 64


def _bias_gelu16_model(m):
    """The MLP's bias + GELU at the model's sizes in bfloat16, as a bf16 step launches them: forward, backward
    with the output recomputed and the bias gradient summed, and the plain backward
    (minitensor.checks.counts; bfloat16 alone: float32 runs the ElementwiseKernels)."""
    bf16 = precision.bfloat16()
    x, dy, out = (np.zeros((m.N, m.F), bf16) for _ in range(3))
    b, C, n = np.zeros(m.F, bf16), np.int32(m.F), np.int32(m.N * m.F)
    launch_elementwise16(BIAS_GELU_FWD16, x, (x, b, out, C, n))
    launch_bwd_fwd16(x, b, dy, out, out.copy(), np.zeros(m.F, np.float32))
    launch_elementwise16(BIAS_GELU_BWD16, x, (x, b, dy, out, C, n))


BIAS_GELU_FWD16 = cuda.RawSpec("bias_gelu_fwd16", "gelu.cu", model=_bias_gelu16_model, bf16=True)
BIAS_GELU_BWD16 = cuda.RawSpec("bias_gelu_bwd16", "gelu.cu", model=_bias_gelu16_model, bf16=True)
BIAS_GELU_BWD_FWD16 = cuda.RawSpec("bias_gelu_bwd_fwd16", "gelu.cu", model=_bias_gelu16_model, bf16=True)
COLUMN_SUMS_ADD = cuda.RawSpec("column_sums_add", "gelu.cu", model=_bias_gelu16_model, bf16=True)


def is_bf16(x):
    """Whether x is a bfloat16 array (the RawKernels' case)."""
    return x.dtype.name == precision.BF16


def launch_elementwise16(spec, x, args):
    """Launches a bfloat16 elementwise RawKernel over x's elements, one thread each (none for an empty x)."""
    if x.size:
        cuda.launch(spec, x.dtype, (-(-x.size // GELU16_THREADS),), (GELU16_THREADS,), args)


def add_column_sums(part, out, dtype):
    """out += the sum of part's rows (chunks, C), partial column sums in dtype's summed type (a bias gradient
    summed by the kernel that wrote its gradient, of dtype: bias_gelu_bwd_fwd16's, the flash backward's),
    added in a fixed order by column_sums_add (its build for dtype)."""
    chunks, C = part.shape
    cuda.launch(COLUMN_SUMS_ADD, dtype, (-(-C // 32),), (32, 8), (part, out, np.int32(chunks), np.int32(C)))


def bias_gelu_forward_gpu(x, b, out=None):
    """GELU(x + b) for x (..., C) and b (C,) CuPy arrays, into `out` if given; returns y.

    The caller keeps x (the matmul output without its bias) for the backward: h = x + b is never
    stored."""
    _check_bias_gpu(x, b, out, "bias_gelu_forward_gpu")
    cuda.on_cupy("bias_gelu_forward_gpu", x, "Ops.bias_gelu_forward")
    C = np.int32(x.shape[-1])
    if is_bf16(x):
        y = array_module(x).empty_like(x) if out is None else out
        launch_elementwise16(BIAS_GELU_FWD16, x, (x, b, y, C, np.int32(x.size)))
        return y
    kern = BIAS_GELU_FWD.kernel()
    return kern(x, b, C) if out is None else kern(x, b, C, out)


def bias_gelu_backward_gpu(x, b, dy, db=None, out=None):
    """dL/dh for h = x + b, y = GELU(h), from the forward's x and b and dy = dL/dy; into `out`
    if given (it may be dy). With `db`, also db += the column sums of dh. Returns dh."""
    _check_bias_gpu(x, b, out, "bias_gelu_backward_gpu", dy)
    cuda.on_cupy("bias_gelu_backward_gpu", x, "Ops.bias_gelu_backward")
    C = np.int32(x.shape[-1])
    if is_bf16(x):
        dh = array_module(x).empty_like(x) if out is None else out
        launch_elementwise16(BIAS_GELU_BWD16, x, (x, b, dy, dh, C, np.int32(x.size)))
    else:
        kern = BIAS_GELU_BWD.kernel()
        dh = kern(x, b, C, dy) if out is None else kern(x, b, C, dy, out)
    if db is not None:
        db += dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return dh


def bias_gelu_backward_recompute_gpu(x, b, dy, db=None, add_sums=add_column_sums):
    """(dh, y): bias_gelu_backward_gpu's dh and bias_gelu_forward_gpu's y in one pass, new arrays. db
    (bfloat16 x only: a float32 vector like b): db += dh's column sums, in the same pass (bias_gelu_bwd_fwd16's
    partial sums, then add_sums(part, db, dtype): column_sums_add by default)."""
    fn = "bias_gelu_backward_recompute_gpu"
    _check_bias_gpu(x, b, None, fn, dy)
    cuda.on_cupy(fn, x, "Ops.bias_gelu_backward")
    if not is_bf16(x):
        if db is not None:
            raise ValueError(f"{fn}: db is summed in the pass for bfloat16 x only, got {x.dtype}")
        return BIAS_GELU_BWD_FWD.kernel()(x, b, np.int32(x.shape[-1]), dy)
    if db is not None:
        cuda.vector(fn, "db", db, x, summed=True)
    dh, y = array_module(x).empty_like(x), array_module(x).empty_like(x)
    launch_bwd_fwd16(x, b, dy, dh, y, db, add_sums)
    return dh, y


def launch_bwd_fwd16(x, b, dy, dh, y, db=None, add_sums=add_column_sums):
    """bias_gelu_bwd_fwd16 over x's rows into dh and y, and with db its partial sums added up by add_sums
    (column_sums_add by default) (nothing for an empty x)."""
    C, N = x.shape[-1], x.size // max(1, x.shape[-1])
    if not x.size:
        return
    xp = array_module(x)
    chunks = -(-N // GELU16_CHUNK_ROWS)
    part = xp.empty((chunks, C), np.float32) if db is not None else xp.empty(1, np.float32)
    cuda.launch(BIAS_GELU_BWD_FWD16, x.dtype, (-(-C // GELU16_THREADS), chunks), (GELU16_THREADS,),
                (x, b, dy, dh, y, part, np.int32(C), np.int32(N), np.int32(GELU16_CHUNK_ROWS),
                 np.int32(db is not None)))
    if db is not None:
        add_sums(part, db, x.dtype)


# --- the fused piece bias_gelu: the Ops methods it replaces, the self-check's sample, gpu_check's cases,
# its record ---


def _strided16(*arrays):
    """Whether a bfloat16 operand is strided (the RawKernels take contiguous arrays: Ops' code runs it)."""
    return is_bf16(arrays[0]) and not all(a.flags.c_contiguous for a in arrays)


def _fused_bias_gelu_forward(ops, x, b):
    """Ops.bias_gelu_forward: x is kept as it is, h = x + b never stored."""
    if _strided16(x, b):
        return cuda.FALLBACK
    return bias_gelu_forward_gpu(x, b)


def _fused_bias_gelu_backward(ops, x, b, dy, recompute_output=False, db=None):
    """Ops.bias_gelu_backward: dh, and with recompute_output GELU(x + b) from the same pass, which sums db
    too for bfloat16 x (float32: ops.add_bias_grad after it, as Ops')."""
    if _strided16(x, b, dy):
        return cuda.FALLBACK
    if recompute_output and is_bf16(x):
        return bias_gelu_backward_recompute_gpu(x, b, dy, db, ops.add_partial_sums)
    out = bias_gelu_backward_recompute_gpu(x, b, dy) if recompute_output else bias_gelu_backward_gpu(x, b, dy)
    ops._add_dh_sums(out[0] if recompute_output else out, db)
    return out


def _bias_gelu_sample(ops, rng):
    """GELU(x + b) forward and backward over (150, 70), wide enough to reach the tails; the backward
    also with the output recomputed and the bias gradient summed (as MLP.backward asks)."""
    xp = ops.xp
    x, b, dy = draw(xp, rng, 150, 70, scale=4.0), draw(xp, rng, 70), draw(xp, rng, 150, 70)
    y, db = ops.bias_gelu_forward(x, b), xp.zeros(70, np.float32)
    return (y, ops.bias_gelu_backward(x, b, dy), *ops.bias_gelu_backward(x, b, dy, recompute_output=True, db=db),
            db)


def _bias_gelu_cases(k):
    """The MLP's bias + GELU, forward and backward (the bias gradient summed in), against the Ops."""

    def setup():
        k.reseed()
        a, b = k.rand(k.N, k.F, scale=2.0), k.rand(k.F, scale=0.1)
        return dict(a=a, b=b, h=a + b, dy=k.rand(k.N, k.F), db=k.zeros(k.F), hb=k.xp.empty_like(a))

    def generic_fwd(d):
        k.xp.add(d["a"], d["b"], out=d["hb"])  # the Linear adds its bias into the matmul output
        return (k.ref.gelu_forward(d["hb"]),)

    def generic_bwd(d):
        dh = k.ref.gelu_backward(d["h"], d["dy"])
        d["db"] += dh.sum(axis=0)
        return dh, d["db"]

    return [
        ("bias + gelu fwd", setup, lambda d: (bias_gelu_forward_gpu(d["a"], d["b"]),), generic_fwd, True),
        ("bias + gelu bwd", setup, lambda d: (bias_gelu_backward_gpu(d["a"], d["b"], d["dy"], db=d["db"]),
                                              d["db"]), generic_bwd, True),
    ]


def _bias_gelu_timed(ops, sizes):
    """The MLP's bias + GELU over N rows of F, forward and backward with the output recomputed."""
    xp = ops.xp
    x, b, dy = cuda.normals(xp, sizes.N, sizes.F), cuda.normals(xp, sizes.F), cuda.normals(xp, sizes.N, sizes.F)
    return lambda: (ops.bias_gelu_forward(x, b), ops.bias_gelu_backward(x, b, dy, recompute_output=True))


BIAS_GELU = cuda.fused_piece(
    "bias_gelu",
    replaces={"bias_gelu_forward": _fused_bias_gelu_forward, "bias_gelu_backward": _fused_bias_gelu_backward},
    kernels=(BIAS_GELU_FWD, BIAS_GELU_BWD, BIAS_GELU_BWD_FWD, BIAS_GELU_FWD16, BIAS_GELU_BWD16, BIAS_GELU_BWD_FWD16,
             COLUMN_SUMS_ADD),
    sample=_bias_gelu_sample,
    cases=_bias_gelu_cases,
    timed=_bias_gelu_timed,
)


def _check_bias_gpu(x, b, out, fn, dy=None):
    cuda.check_operands(fn, x, out, dy, bf16=True)
    if x.ndim < 1 or x.size >= 2**31 or (is_bf16(x) and not x.flags.c_contiguous):
        raise ValueError(f"{fn}: x must have 1 to 2**31 - 1 elements and a last axis (contiguous if bfloat16), "
                         f"got shape {x.shape}")
    if b.shape != x.shape[-1:] or b.dtype != x.dtype or not b.flags.c_contiguous:
        raise ValueError(f"{fn}: b must be a contiguous {x.dtype} vector of shape {x.shape[-1:]}, got "
                         f"{b.dtype} {b.shape}")
