"""GEMMs and GEMVs through cuBLAS itself (cupy_backends.cuda.libs.cublas), for what CuPy's matmul cannot do.

    gemm(a, b, out, beta)        out = a @ b + beta out     (2-D CuPy arrays, or 3-D: a strided batch;
                                                            beta 0: out is not read)
    colsum(dy, out, beta)        out = sum over rows of dy + beta out
    matmul(a, b, out=None)       a @ b for batches of matrices, transposed operands as they are stored

CuPy 14.2's 2-D matmul computes out = a @ b only (beta 0: an accumulated weight gradient needs a
GEMM into a temporary and an add), and writes an `out` that is not C-contiguous through a
temporary and a copy. cuBLAS's own calls take beta, the operands' transpose flags and leading
dimensions: a gradient is accumulated in the GEMM's output pass, and a transposed view or a slice
of rows with a longer stride is passed as it is stored. cuBLAS is column-major: a row-major
(M, N) array with row stride ld is, to cuBLAS, the (N, M) column-major matrix with leading
dimension ld, its transpose; so out = a @ b is asked as out^T = b^T a^T, with b first.

CuPy's batched matmul also copies every operand that is not C-contiguous (a transposed k, dy, v, q
of the attention core); `sgemmStridedBatched` takes the transpose flag instead.

These go through `cublas.sgemm` / `dgemm`, `sgemmStridedBatched` / `dgemmStridedBatched` and
`sgemv` / `dgemv` (CuPy 14.2's signatures:
cupy_backends/cuda/libs/cublas.pyx), alpha and beta as host pointers (the handle's default pointer
mode, which CuPy's own matmul also relies on), on the current stream (cuBLAS's calls in CuPy set the
handle's stream first). TF32: sgemm follows the handle's math mode, which
minitensor.device.set_tf32 sets (CUBLAS_TF32_TENSOR_OP_MATH), as it does for CuPy's batched matmul;
each GEMM here sets it back first if another call changed it (minitensor.device.math_mode).
cuBLAS's GEMM and GEMV give the same bits on every run on one GPU (no atomics unless
cublasSetAtomicsMode allows them, which nothing here does).

`gemm` and `colsum` return False, computing nothing, where an operand is not laid out so that
cuBLAS can read it in place (no unit stride along either axis); the caller then falls back to
CuPy's own operations.

bfloat16 (the bf16 policy's activations, minitensor.precision): operands of bfloat16 go through
`gemmEx` / `gemmStridedBatchedEx` (CuPy 14.2's signatures, cupy_backends/cuda/libs/cublas.pyx at
v14.2.0, lines 1639 and 1682), A and B CUDA_R_16BF, computed in float32 (CUBLAS_COMPUTE_32F: bf16
tensor cores, float32 sums; alpha and beta float32 on the host), the output either bfloat16 (an
activation: rounded once from float32) or float32 (a weight gradient summed with beta 1 into the
float32 gradient buffer, never rounded to bf16 on the way). Never through CuPy's matmul: its batched
bfloat16 matmul runs CuPy's integer kernel and is wrong (cupy/_core/_routines_linalg.pyx at v14.2.0,
line 992: only 'efdFD' reach cuBLAS, bfloat16's char is 'E'), so for bfloat16 nothing here falls
back: an operand cuBLAS cannot read in place is copied first, and an output it cannot write in place
is refused. colsum over bfloat16 rows is the same GEMM with one column of ones (cuBLAS has no
bfloat16 GEMV).
"""

import numpy as np

from minitensor import precision
from minitensor.device import array_module, math_mode

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1  # cublasOperation_t (cublas_api.h)


def layout(a):
    """(transposed, ld) for a 2-D array a laid out for cuBLAS: a = M (transposed False) or M^T
    (True) for a row-major M whose row stride is ld elements; None where neither holds. For a 3-D
    array (a batch of matrices), that of each matrix, and (transposed, ld, batch stride) where the
    matrices lie a fixed number of elements apart (None where not)."""
    if a.ndim not in (2, 3) or not precision.is_float(a.dtype, bf16=True):
        return None
    found = _layout(a.itemsize, a.shape[-2:], a.strides[-2:])
    if a.ndim == 2 or found is None:
        return found
    step = a.strides[0]
    if a.shape[0] > 1 and (step <= 0 or step % a.itemsize):
        return None
    return (*found, step // a.itemsize if a.shape[0] > 1 else 0)


def _layout(item, shape, strides):
    (r, c), (s0, s1) = shape, strides
    if (c <= 1 or s1 == item) and (r <= 1 or (s0 > 0 and s0 % item == 0 and s0 // item >= c)):
        return False, max(1, c if r <= 1 else s0 // item)  # row-major (r, c), rows ld apart
    if (r <= 1 or s0 == item) and (c <= 1 or (s1 > 0 and s1 % item == 0 and s1 // item >= r)):
        return True, max(1, r if c <= 1 else s1 // item)   # the transpose of a row-major (c, r)
    return None


def _scalar(value, dtype):
    """A host copy of value for cuBLAS's alpha or beta (kept alive by the caller until the call returns)."""
    return np.array(value, dtype=dtype)


def gemm(a, b, out, beta=0.0):
    """out = a @ b + beta out for CuPy arrays a (M, K), b (K, N), out (M, N) of one float dtype (or a
    and b bfloat16, out bfloat16 or float32: gemmEx, below),
    out row-major (a unit column stride, any row stride); beta 0: out's old values are not read.
    With a batch axis first on all three (the same count, each array's matrices a fixed stride
    apart, out's apart by at least one matrix), one strided batched GEMM. Returns False, computing
    nothing, where cuBLAS cannot take them as they are laid out."""
    if not a.ndim == b.ndim == out.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[:-2] != out.shape[:-2]:
        raise ValueError(f"gemm: shapes {a.shape} @ {b.shape} -> {out.shape}: expected one batch shape")
    M, K = a.shape[-2:]
    N = b.shape[-1]
    if b.shape[-2] != K or out.shape[-2:] != (M, N):
        raise ValueError(f"gemm: shapes {a.shape} @ {b.shape} -> {out.shape}: expected (M, K) @ (K, N) -> (M, N)")
    if _bf16(a, b, out, "gemm"):
        return _gemm_bf16(a, b, out, beta)
    la, lb, lc = layout(a), layout(b), layout(out)
    if (la is None or lb is None or lc is None or lc[0] or min(M, N, K) == 0
            or not a.dtype == b.dtype == out.dtype):
        return False
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    math_mode(handle)  # TF32 as set_tf32 chose it, whatever ran through the handle since
    one, coef = _scalar(1.0, a.dtype), _scalar(beta, a.dtype)
    # out^T (N, M) = b^T a^T: b's row-major storage is b^T to cuBLAS (no transpose), a transposed
    # view is stored as its row-major transpose (cuBLAS transposes it back)
    ops = (CUBLAS_OP_T if lb[0] else CUBLAS_OP_N, CUBLAS_OP_T if la[0] else CUBLAS_OP_N, N, M, K, one.ctypes.data)
    if a.ndim == 2:
        fn = cublas.sgemm if a.dtype == np.float32 else cublas.dgemm
        fn(handle, *ops, b.data.ptr, lb[1], a.data.ptr, la[1], coef.ctypes.data, out.data.ptr, lc[1])
        return True
    if out.shape[0] > 1 and lc[2] < (M - 1) * lc[1] + N:  # out's matrices would overlap
        return False
    fn = cublas.sgemmStridedBatched if a.dtype == np.float32 else cublas.dgemmStridedBatched
    fn(handle, *ops, b.data.ptr, lb[1], lb[2], a.data.ptr, la[1], la[2], coef.ctypes.data, out.data.ptr, lc[1],
       lc[2], a.shape[0])
    return True


def colsum(dy, out, ones, beta=0.0):
    """out = the sum over the rows of dy (R, C) + beta out, out (C,), as the GEMV dy^T ones; ones:
    a contiguous device vector of at least R ones of dy's dtype. Returns False, computing nothing,
    where cuBLAS cannot read dy or out in place."""
    R, C = dy.shape
    ld = layout(dy)
    if out.shape != (C,) or ones.shape[0] < R:
        raise ValueError(f"colsum: dy {dy.shape}, out {out.shape}, ones {ones.shape}: expected (R, C), (C,) "
                         f"and at least R ones")
    if _bf16(dy, ones, out, "colsum"):
        # out (C, 1) = dy^T (C, R) ones (R, 1): a GEMM of one column, out a contiguous vector
        if out.strides[0] != out.itemsize:
            raise ValueError(f"colsum: a bfloat16 sum needs a contiguous out, got strides {out.strides}")
        return _gemm_bf16(dy.T, ones[:R].reshape(R, 1), out.reshape(C, 1), beta)
    if (ld is None or ld[0] or out.strides[0] <= 0 or out.strides[0] % out.itemsize or R == 0 or C == 0
            or not dy.dtype == out.dtype == ones.dtype):
        return False
    import cupy
    from cupy_backends.cuda.libs import cublas

    fn = cublas.sgemv if dy.dtype == np.float32 else cublas.dgemv
    one, coef = _scalar(1.0, dy.dtype), _scalar(beta, dy.dtype)
    # dy's storage is the column-major (C, R) matrix dy^T: out = dy^T ones, no transpose
    fn(cupy.cuda.device.get_cublas_handle(), CUBLAS_OP_N, C, R, one.ctypes.data, dy.data.ptr, ld[1],
       ones.data.ptr, 1, coef.ctypes.data, out.data.ptr, out.strides[0] // out.itemsize)
    return True


def _bf16(a, b, out, fn):
    """True where the operands a and b are bfloat16 (then out must be bfloat16 or float32, the policy's
    accumulate type); a bfloat16 operand beside one of another dtype is refused."""
    names = {x.dtype.name for x in (a, b)}
    if precision.BF16 not in names:
        return False
    allowed = (precision.BF16, precision.accumulate_of(precision.bfloat16()).name)
    if names != {precision.BF16} or out.dtype.name not in allowed:
        raise TypeError(f"{fn}: bfloat16 operands take a bfloat16 partner and a {' or '.join(allowed)} output, got "
                        f"{a.dtype} @ {b.dtype} -> {out.dtype}")
    return True


def _cuda_type(dtype):
    """cudaDataType_t of a dtype (CUDA_R_16BF = 14, CUDA_R_32F = 0: cupy.cuda.runtime's, from
    cupy_backends/cuda/api/_runtime_enum.pxd at v14.2.0)."""
    import cupy

    return {precision.BF16: cupy.cuda.runtime.CUDA_R_16BF, "float32": cupy.cuda.runtime.CUDA_R_32F}[dtype.name]


def _gemm_bf16(a, b, out, beta):
    """out = a @ b + beta out for bfloat16 a and b, out bfloat16 or float32: gemmEx (a strided batch:
    gemmStridedBatchedEx) in float32 (the module's docstring). An operand cuBLAS cannot read in place is
    copied; an out it cannot write in place is refused. Returns True."""
    M, K = a.shape[-2:]
    N = b.shape[-1]
    lc = layout(out)
    if lc is None or lc[0] or (out.ndim == 3 and out.shape[0] > 1 and lc[2] < (M - 1) * lc[1] + N):
        raise ValueError(f"gemm: a bfloat16 product needs an out of rows with a unit stride, its matrices apart, got "
                         f"shape {out.shape}, strides {out.strides}")
    if min(M, N, K) == 0:
        out[...] = 0 if beta == 0 else out * beta
        return True
    xp = array_module(a)
    if layout(a) is None:
        a = xp.ascontiguousarray(a)
    if layout(b) is None:
        b = xp.ascontiguousarray(b)
    la, lb = layout(a), layout(b)
    import cupy
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    one, coef = _scalar(1.0, np.float32), _scalar(beta, np.float32)  # CUBLAS_COMPUTE_32F: float32 scalars
    t_in, t_out = _cuda_type(a.dtype), _cuda_type(out.dtype)
    # out^T = b^T a^T, as in gemm
    ops = (CUBLAS_OP_T if lb[0] else CUBLAS_OP_N, CUBLAS_OP_T if la[0] else CUBLAS_OP_N, N, M, K, one.ctypes.data)
    if a.ndim == 2:
        cublas.gemmEx(handle, *ops, b.data.ptr, t_in, lb[1], a.data.ptr, t_in, la[1], coef.ctypes.data,
                      out.data.ptr, t_out, lc[1], cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
        return True
    cublas.gemmStridedBatchedEx(handle, *ops, b.data.ptr, t_in, lb[1], lb[2], a.data.ptr, t_in, la[1], la[2],
                                coef.ctypes.data, out.data.ptr, t_out, lc[1], lc[2], a.shape[0],
                                cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return True


def matmul(a, b, out=None):
    """a @ b for CuPy arrays (batch, M, K) @ (batch, K, N), into out or a new C-contiguous array: one
    strided batched GEMM, transposed operands taken as they are stored, where cuBLAS can take them;
    else CuPy's matmul (which copies an operand that is not C-contiguous). bfloat16: always cuBLAS's
    (gemmStridedBatchedEx, a bfloat16 result), never CuPy's matmul."""
    xp = array_module(a)
    if out is None:
        out = xp.empty((*a.shape[:-1], b.shape[-1]), dtype=np.result_type(a.dtype, b.dtype))
    if not gemm(a, b, out):
        xp.matmul(a, b, out=out)
    return out
