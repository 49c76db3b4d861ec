"""The residual branches' epilogue on the GPU: y += b and y += r in one pass, the ElementwiseKernel of
kernels/linear.cu (always on, when CupyOps.add_epilogue gets both; no record: the same two float adds
in the same order as Ops').

On bfloat16 y (train.precision=bf16) CupyOps.add_epilogue runs bias_residual_add16 instead (a RawKernel
of kernels/linear.cu: the adds in float32, the sum rounded once, as Ops adds bfloat16), also with a bias
alone; CuPy's ElementwiseKernel takes no bfloat16."""

import numpy as np

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.kernels.gelu import column, launch_elementwise16
from minitensor.device import array_module

BIAS_RESIDUAL_ADD = cuda.register(cuda.ElementwiseSpec(
    "bias_residual_add", "T y_in, raw T b, int32 C, T r", "T y", "linear.cu",
    reference=lambda y_in, b, C, r: (y_in + b[column(y_in.size, C)]) + r,
    scalars=(("C", 7),),
))


def epilogue_fits(y, b, r):
    """Whether bias_residual_add applies: y (N, C) float and contiguous, b (C,) and r (N, C) alike."""
    return (y.dtype.name in BIAS_RESIDUAL_ADD.dtypes and y.ndim == 2 and y.flags.c_contiguous and y.size < 2**31
            and b.dtype == y.dtype and b.shape == y.shape[-1:] and b.flags.c_contiguous
            and r.dtype == y.dtype and r.shape == y.shape and not array_module(y).may_share_memory(y, r))


def _bias_residual_add16_traffic(b, r, y, with_residual, **_):
    """y read and written in place, b read, r read only with the residual."""
    return y.nbytes + b.nbytes + (r.nbytes if with_residual else 0), y.nbytes


def _bias_residual_add16_model(m):
    """A bf16 step's epilogues at the model's sizes: a residual branch's last product (N, C) with its residual,
    the attention's qkv (N, 3C) with its bias alone (minitensor.checks.counts; bfloat16 alone: float32 runs
    the ElementwiseKernel)."""
    bf16 = precision.bfloat16()
    for width, with_residual in ((m.C, 1), (3 * m.C, 0)):
        y, r, b = np.zeros((m.N, width), bf16), np.zeros((m.N, width), bf16), np.zeros(width, bf16)
        launch_elementwise16(BIAS_RESIDUAL_ADD16, y, (b, r, y, np.int32(width), np.int32(y.size), np.int32(with_residual)))


BIAS_RESIDUAL_ADD16 = cuda.register(cuda.RawSpec("bias_residual_add16", "linear.cu", traffic=_bias_residual_add16_traffic,
                                                 model=_bias_residual_add16_model, bf16=True))


def epilogue16_fits(y, b, r=None):
    """Whether bias_residual_add16 applies: y (N, C) bfloat16 and contiguous, b (C,) and r (None, or (N, C)
    apart from y) alike."""
    return (y.dtype.name == precision.BF16 and y.ndim == 2 and y.flags.c_contiguous and y.size < 2**31
            and b.dtype == y.dtype and b.shape == y.shape[-1:] and b.flags.c_contiguous
            and (r is None or (r.dtype == y.dtype and r.shape == y.shape and r.flags.c_contiguous
                               and not array_module(y).may_share_memory(y, r))))


def bias_residual_add16_gpu(y, b, r=None):
    """y += b (+ r) in place for bfloat16 CuPy arrays that epilogue16_fits: the sum in float32, rounded once."""
    if not epilogue16_fits(y, b, r):
        raise ValueError(f"bias_residual_add16_gpu: y must be a contiguous (N, C) bfloat16 array, b its (C,) bias and "
                         f"r None or an array like y apart from it; got y {y.dtype} {y.shape}, b {b.dtype} {b.shape}"
                         + ("" if r is None else f", r {r.dtype} {r.shape}"))
    launch_elementwise16(BIAS_RESIDUAL_ADD16, y, (b, y if r is None else r, y, np.int32(y.shape[-1]),
                                                  np.int32(y.size), np.int32(r is not None)))
