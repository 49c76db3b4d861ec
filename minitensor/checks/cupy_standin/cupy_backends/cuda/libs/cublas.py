"""cuBLAS (stand-in): the math mode per handle, and the GEMM and GEMV calls computed on NumPy.

setMathMode / getMathMode: what was set reads back. sgemm / dgemm (C = alpha op(A) op(B) + beta C),
their strided batched forms (batchCount such products, matrix i at pointer + i stride elements)
and sgemv / dgemv (y = alpha op(A) x + beta y) take CuPy 14.2's arguments (cupy_backends/cuda/libs/
cublas.pyx): device pointers (a stand-in array's `data.ptr`, the address of its NumPy memory),
alpha and beta as host pointers, matrices column-major with a leading dimension, as cuBLAS reads
them. The memory behind the pointers is read and written in place, so a wrong pointer, dimension
or leading dimension corrupts or faults as on a GPU; the argument checks cuBLAS makes
(CUBLAS_STATUS_INVALID_VALUE) are made here too. With beta 0, C (or y) is not read: NaNs in it do
not reach the result, as in cuBLAS.

gemmEx / gemmStridedBatchedEx take each matrix's CUDA data type (CUDA_R_16BF, CUDA_R_32F, CUDA_R_64F:
cupy.cuda.runtime's constants) and a cublasComputeType_t, with CuPy 14.2's signatures
(cupy_backends/cuda/libs/cublas.pyx at v14.2.0, lines 1639 and 1682):

    gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo)
    gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
                         strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo)

The combinations cuBLAS lists for cublasGemmEx that the engine uses are computed; any other is
CUBLAS_STATUS_NOT_SUPPORTED, as cuBLAS answers it. CUBLAS_COMPUTE_32F (alpha and beta float32 on the
host): the operands widened to float32 exactly, their products summed in float32, alpha and beta
applied in float32, and the result rounded once to C's type (bfloat16 by ml_dtypes, nearest even),
so a bfloat16 output is never summed in bfloat16. cuBLAS's own order of the float32 sums (its
tiles, split-K) is not NumPy's: the float32 rounding differs in the last bits, not the bf16 one
beyond a tie. A product of more than cupy.standin's GEMM_LIMIT multiply-adds (a GEMM peak's 8192^3) is
not computed but counted, its output NaN in every 64 x 64 tile, as cupy.matmul's.
"""

import ctypes

import numpy as np

CUBLAS_DEFAULT_MATH, CUBLAS_TENSOR_OP_MATH, CUBLAS_PEDANTIC_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 1, 2, 3
CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_OP_C = 0, 1, 2
CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE = 0, 1
CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_NOT_SUPPORTED = 7, 15
# cublasComputeType_t and cublasGemmAlgo_t (cupy_backends/cuda/libs/cublas.pxd at v14.2.0, lines 60-83)
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_COMPUTE_64F, CUBLAS_COMPUTE_64F_PEDANTIC = 68, 69, 70, 71
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
_modes = {}


class CUBLASError(RuntimeError):
    def __init__(self, status):
        self.status = status
        super().__init__({CUBLAS_STATUS_INVALID_VALUE: "CUBLAS_STATUS_INVALID_VALUE",
                          CUBLAS_STATUS_NOT_SUPPORTED: "CUBLAS_STATUS_NOT_SUPPORTED"}.get(status, str(status)))


def setMathMode(handle, mode):  # noqa: N802 (cuBLAS's name)
    _modes[handle] = mode


def getMathMode(handle):  # noqa: N802
    return _modes.get(handle, CUBLAS_DEFAULT_MATH)


def getPointerMode(handle):  # noqa: N802
    return CUBLAS_POINTER_MODE_HOST


def matrix(ptr, dtype, rows, cols, ld):
    """The column-major rows x cols matrix at device pointer ptr with leading dimension ld: a NumPy
    view of that memory (writable)."""
    dtype = np.dtype(dtype)
    if rows == 0 or cols == 0:
        return np.empty((rows, cols), dtype)
    span = (cols - 1) * ld + rows
    flat = np.frombuffer((ctypes.c_char * (span * dtype.itemsize)).from_address(ptr), dtype, span)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))


def vector(ptr, dtype, n, inc):
    return matrix(ptr, dtype, 1, n, inc)[0] if n else np.empty(0, dtype)


def host_scalar(ptr, dtype):
    return np.frombuffer((ctypes.c_char * np.dtype(dtype).itemsize).from_address(ptr), dtype, 1)[0]


def gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc):
    """The stored (rows, cols) of A and B, after cuBLAS's argument checks."""
    a = (m, k) if transa == CUBLAS_OP_N else (k, m)
    b = (k, n) if transb == CUBLAS_OP_N else (n, k)
    if (min(m, n, k) < 0 or transa not in (CUBLAS_OP_N, CUBLAS_OP_T) or transb not in (CUBLAS_OP_N, CUBLAS_OP_T)
            or lda < max(1, a[0]) or ldb < max(1, b[0]) or ldc < max(1, m)):
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE)
    return a, b


def _gemm(dtype, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
    a_shape, b_shape = gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc)
    a, b = matrix(A, dtype, *a_shape, lda), matrix(B, dtype, *b_shape, ldb)
    op_a = a if transa == CUBLAS_OP_N else a.T
    op_b = b if transb == CUBLAS_OP_N else b.T
    c = matrix(C, dtype, m, n, ldc)
    alpha, beta = host_scalar(alpha, dtype), host_scalar(beta, dtype)
    product = alpha * (op_a @ op_b)
    c[...] = product if beta == 0 else product + beta * c


def _gemm_strided_batched(dtype, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta,
                          C, ldc, strideC, batch):
    if batch < 0:
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE)
    item = np.dtype(dtype).itemsize
    for i in range(batch):
        _gemm(dtype, handle, transa, transb, m, n, k, alpha, A + i * strideA * item, lda, B + i * strideB * item, ldb,
              beta, C + i * strideC * item, ldc)


def sgemmStridedBatched(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta,  # noqa: N802
                        C, ldc, strideC, batchCount):  # noqa: N803
    _gemm_strided_batched(np.float32, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta,
                          C, ldc, strideC, batchCount)


def dgemmStridedBatched(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta,  # noqa: N802
                        C, ldc, strideC, batchCount):  # noqa: N803
    _gemm_strided_batched(np.float64, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta,
                          C, ldc, strideC, batchCount)


def gemv_shapes(trans, m, n, lda, incx, incy):
    """(length of x, length of y), after cuBLAS's argument checks."""
    if min(m, n) < 0 or trans not in (CUBLAS_OP_N, CUBLAS_OP_T) or lda < max(1, m) or incx == 0 or incy == 0:
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE)
    if incx < 0 or incy < 0:
        raise NotImplementedError("the stand-in's gemv: negative increments")
    return (n, m) if trans == CUBLAS_OP_N else (m, n)


def _gemv(dtype, handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy):
    nx, ny = gemv_shapes(trans, m, n, lda, incx, incy)
    a = matrix(A, dtype, m, n, lda)
    xv, yv = vector(x, dtype, nx, incx), vector(y, dtype, ny, incy)
    alpha, beta = host_scalar(alpha, dtype), host_scalar(beta, dtype)
    product = alpha * ((a if trans == CUBLAS_OP_N else a.T) @ xv)
    yv[...] = product if beta == 0 else product + beta * yv


def sgemm(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
    _gemm(np.float32, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)


def dgemm(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
    _gemm(np.float64, handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)


def sgemv(handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy):
    _gemv(np.float32, handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy)


def dgemv(handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy):
    _gemv(np.float64, handle, trans, m, n, alpha, A, lda, x, incx, beta, y, incy)


def _ex_dtypes(Atype, Btype, Ctype, computeType):  # noqa: N803 (cuBLAS's names)
    """(operand dtype, output dtype, compute dtype) of a gemmEx type combination the engine uses, from
    cuBLAS's table for cublasGemmEx; any other: CUBLAS_STATUS_NOT_SUPPORTED."""
    from cupy.cuda import runtime

    from minitensor import precision

    bf16 = runtime.CUDA_R_16BF
    combos = {(bf16, bf16, CUBLAS_COMPUTE_32F): (precision.BF16, precision.BF16, "float32"),
              (bf16, runtime.CUDA_R_32F, CUBLAS_COMPUTE_32F): (precision.BF16, "float32", "float32"),
              (runtime.CUDA_R_32F, runtime.CUDA_R_32F, CUBLAS_COMPUTE_32F): ("float32", "float32", "float32"),
              (runtime.CUDA_R_64F, runtime.CUDA_R_64F, CUBLAS_COMPUTE_64F): ("float64", "float64", "float64")}
    found = combos.get((Atype, Ctype, computeType)) if Atype == Btype else None
    if found is None:
        raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED)
    return tuple(precision.dtype_of(name) for name in found)


def _gemm_ex(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, dtypes):
    operand, output, compute = dtypes
    a_shape, b_shape = gemm_shapes(transa, transb, m, n, k, lda, ldb, ldc)
    a = matrix(A, operand, *a_shape, lda).astype(compute)  # a bfloat16 widens to float32 exactly
    b = matrix(B, operand, *b_shape, ldb).astype(compute)
    op_a = a if transa == CUBLAS_OP_N else a.T
    op_b = b if transb == CUBLAS_OP_N else b.T
    c = matrix(C, output, m, n, ldc)
    from cupy import standin  # (at the call: cupy imports this module)

    if int(m) * int(n) * int(k) > standin.GEMM_LIMIT:  # not computed, as cupy.matmul past the limit
        standin.skipped_into(c)
        return
    alpha, beta = host_scalar(alpha, compute), host_scalar(beta, compute)
    product = alpha * (op_a @ op_b)
    c[...] = (product if beta == 0 else product + beta * c.astype(compute)).astype(output)  # rounded once


def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,  # noqa: N802
           computeType, algo):  # noqa: N803
    _gemm_ex(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc,
             _ex_dtypes(Atype, Btype, Ctype, computeType))


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,  # noqa: N802
                         strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):  # noqa: N803
    dtypes = _ex_dtypes(Atype, Btype, Ctype, computeType)
    if batchCount < 0:
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE)
    item_in, item_out = dtypes[0].itemsize, dtypes[1].itemsize
    for i in range(batchCount):
        _gemm_ex(handle, transa, transb, m, n, k, alpha, A + i * strideA * item_in, lda, B + i * strideB * item_in,
                 ldb, beta, C + i * strideC * item_out, ldc, dtypes)
