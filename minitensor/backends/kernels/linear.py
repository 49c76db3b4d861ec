"""The residual branches' epilogue on the GPU: y += b and y += r in one pass, the ElementwiseKernel of
kernels/linear.cu (always on, when CupyOps.add_epilogue gets both; no record: the same two float adds
in the same order as Ops')."""

from minitensor.backends import cuda
from minitensor.backends.kernels.gelu import column
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
