"""cuBLAS math mode per handle (stand-in): what setMathMode set, getMathMode reads back."""

CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_PEDANTIC_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 1, 2, 3
_modes = {}


def setMathMode(handle, mode):  # noqa: N802 (cuBLAS's name)
    _modes[handle] = mode


def getMathMode(handle):  # noqa: N802
    return _modes.get(handle, CUBLAS_DEFAULT_MATH)
