"""bfloat16 GEMMs through cuBLAS (minitensor.backends.cublas: gemmEx / gemmStridedBatchedEx in float32),
and the CuPy stand-in holding bfloat16 arrays as CuPy 14.2 does.

Each product is checked against the float64 product of the same bfloat16 operands, elementwise, at
a bound derived from the arithmetic: the float32 sums of K products of exactly representable terms
err by at most gamma = (K + 2) u32 times S = sum_k |a_ik b_kj| (+ |beta c_ij|), u32 = 2^-24 (the +2:
alpha's and beta's multiplications and the final add); a bfloat16 output is then rounded once, by
at most u16 = 2^-8 of the value rounded. So

    float32 out:   |got - exact| <= gamma S
    bfloat16 out:  |got - exact| <= u16 |exact| + (1 + u16) gamma S

A bfloat16 output that were rounded twice (summed in bfloat16) would miss the second bound by far
once K is a few dozen. The tests that take the `cupy` fixture run on the real CuPy and cuBLAS on a
GPU, on the stand-in elsewhere; the others are about the stand-in itself.
"""

import importlib.metadata
import inspect
import re

import numpy as np
import pytest
from gpu_standin import standin_cupy

from minitensor import precision
from minitensor.backends import cublas as mcublas

BF16 = precision.bfloat16()
U16, U32 = 2.0 ** -8, 2.0 ** -24


def bound(a, b, beta, c, out_dtype):
    """The elementwise error bound of out = a @ b + beta c (the module's docstring), float64 operands."""
    K = a.shape[-1]
    S = np.abs(a) @ np.abs(b) + (abs(beta) * np.abs(c) if beta else 0.0)
    exact = a @ b + (beta * c if beta else 0.0)
    gamma = (K + 2) * U32
    if out_dtype == np.float32:
        return exact, gamma * S
    return exact, U16 * np.abs(exact) + (1 + U16) * gamma * S


def check(got, exact, allowed):
    """got within the bound everywhere; returns the worst error as a share of its bound."""
    err = np.abs(got.astype(np.float64) - exact)
    assert np.all(err <= allowed), f"worst {float(np.max(err / allowed)):.3f} x the bound"
    return float(np.max(err / allowed))


def bf16_normals(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(BF16)


# --- CuPy 14.2's constants and signatures ---------------------------------------------------------


def test_the_cuda_constants_are_cupy_14_2s(cupy):
    """CUDA_R_16BF = 14, CUDA_R_32F = 0 (cupy_backends/cuda/api/_runtime_enum.pxd), CUBLAS_COMPUTE_32F =
    68 and CUBLAS_GEMM_DEFAULT = -1 (cupy_backends/cuda/libs/cublas.pxd), as CuPy exports them: the
    real ones on a GPU, the stand-in's elsewhere."""
    from cupy_backends.cuda.libs import cublas

    assert (cupy.cuda.runtime.CUDA_R_16BF, cupy.cuda.runtime.CUDA_R_32F, cupy.cuda.runtime.CUDA_R_64F) == (14, 0, 1)
    assert (cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_COMPUTE_64F, cublas.CUBLAS_GEMM_DEFAULT) == (68, 70, -1)


def _compiled_signatures():
    """{name: [parameter names]} of gemmEx and gemmStridedBatchedEx as the installed CuPy wheel's
    compiled cublas module records them (Cython keeps each cpdef's signature as text)."""
    try:
        dist = next(d for d in importlib.metadata.distributions() if d.metadata["Name"].startswith("cupy-cuda"))
    except StopIteration:
        pytest.skip("no CuPy wheel installed to read cuBLAS's signatures from")
    libs = [f for f in dist.files if re.fullmatch(r"cupy_backends/cuda/libs/cublas\..*\.so", str(f))]
    if not libs:
        pytest.skip("the CuPy wheel has no compiled cublas module")
    text = dist.locate_file(libs[0]).read_bytes().decode("latin-1")
    found = {}
    for name in ("gemmEx", "gemmStridedBatchedEx"):
        params = re.search(rf"\b{name}\(([^()]*)\)", text).group(1)
        found[name] = [p.split()[-1] for p in params.split(",")]
    return found


def test_the_standins_gemm_ex_signatures_are_the_installed_cupys():
    """The stand-in's gemmEx / gemmStridedBatchedEx take the parameters, in order, of CuPy's own (read
    from the installed wheel: gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb,
    beta, C, Ctype, ldc, computeType, algo), the batched one with strideA/B/C and batchCount)."""
    compiled = _compiled_signatures()
    with standin_cupy():
        from cupy_backends.cuda.libs import cublas

        for name, params in compiled.items():
            assert list(inspect.signature(getattr(cublas, name)).parameters) == params


# --- the GEMMs, against float64 -------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [BF16, np.float32], ids=["bf16-out", "f32-out"])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_a_bf16_gemm_is_the_float64_product_within_its_bound(cupy, ta, tb, beta, out_dtype):
    """gemm(a, b, out, beta) on bfloat16 a and b (transposed views, rows longer than the matrix), out a
    slice of longer rows of bfloat16 or float32, beta 0 (out's NaNs not read) and 1 (accumulated),
    K = 96: within the bound of the module's docstring; out's padding untouched."""
    rng = np.random.default_rng(7)
    m, n, k, pad = 24, 40, 96, 8
    a_st = bf16_normals(rng, (k, m + pad) if ta else (m, k + pad))
    b_st = bf16_normals(rng, (n, k + pad) if tb else (k, n + pad))
    c0 = rng.standard_normal((m, n + pad)).astype(out_dtype)
    if beta == 0:
        c0[:, :n] = np.nan
    a64 = (a_st[:, :m].T if ta else a_st[:, :k]).astype(np.float64)
    b64 = (b_st[:, :k].T if tb else b_st[:, :n]).astype(np.float64)
    exact, allowed = bound(a64, b64, beta, c0[:, :n].astype(np.float64), out_dtype)
    A, B, C = (cupy.asarray(v) for v in (a_st, b_st, c0))
    av = A[:, :m].T if ta else A[:, :k]
    bv = B[:, :k].T if tb else B[:, :n]
    assert mcublas.gemm(av, bv, C[:, :n], beta)
    got = C.get()
    check(got[:, :n], exact, allowed)
    assert got.dtype == out_dtype and np.array_equal(got[:, n:].view(np.uint8), c0[:, n:].view(np.uint8))


@pytest.mark.parametrize("out_dtype", [BF16, np.float32], ids=["bf16-out", "f32-out"])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_a_bf16_strided_batched_gemm_is_the_float64_product_within_its_bound(cupy, ta, tb, beta, out_dtype):
    """The batched form (the attention core's q k^T, p v, and their transposed gradients) through
    gemmStridedBatchedEx, each operand transposed as stored: within the same bound, matrix by matrix."""
    rng = np.random.default_rng(8)
    nb, m, n, k = 3, 16, 24, 64
    a_st = bf16_normals(rng, (nb, k, m) if ta else (nb, m, k))
    b_st = bf16_normals(rng, (nb, n, k) if tb else (nb, k, n))
    c0 = rng.standard_normal((nb, m, n)).astype(out_dtype)
    if beta == 0:
        c0[...] = np.nan
    a64 = (a_st.transpose(0, 2, 1) if ta else a_st).astype(np.float64)
    b64 = (b_st.transpose(0, 2, 1) if tb else b_st).astype(np.float64)
    exact, allowed = bound(a64, b64, beta, c0.astype(np.float64), out_dtype)
    A, B, C = (cupy.asarray(v) for v in (a_st, b_st, c0))
    assert mcublas.gemm(A.transpose(0, 2, 1) if ta else A, B.transpose(0, 2, 1) if tb else B, C, beta)
    check(C.get(), exact, allowed)


def test_matmul_takes_bf16_batches_through_cublas_never_cupys_matmul(cupy):
    """cublas.matmul on bfloat16 (the attention core's products: k transposed as stored, an operand with
    no unit stride copied first) gives a bfloat16 result within the bound; CuPy 14.2's own batched
    bfloat16 matmul is wrong (its integer kernel), and the stand-in refuses it."""
    rng = np.random.default_rng(9)
    q, k = bf16_normals(rng, (4, 32, 16)), bf16_normals(rng, (4, 32, 16))
    exact, allowed = bound(q.astype(np.float64), k.astype(np.float64).transpose(0, 2, 1), 0.0, None, BF16)
    Q, Kd = cupy.asarray(q), cupy.asarray(k)
    s = mcublas.matmul(Q, Kd.transpose(0, 2, 1))
    assert s.dtype == BF16 and s.shape == (4, 32, 32)
    check(s.get(), exact, allowed)
    wide = cupy.asarray(bf16_normals(rng, (4, 16, 64)))  # every other column: no unit stride, copied
    exact, allowed = bound(q.astype(np.float64), wide.get()[:, :, ::2].astype(np.float64), 0.0, None, BF16)
    check(mcublas.matmul(Q, wide[:, :, ::2]).get(), exact, allowed)
    if getattr(cupy, "STANDIN", False):
        with pytest.raises(TypeError, match="batched bfloat16 matmul .* integer kernel"):
            cupy.matmul(Q, Kd.transpose(0, 2, 1))


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_a_bf16_colsum_sums_into_float32(cupy, beta):
    """colsum(dy, db, ones, beta), dy bfloat16 rows (a slice of longer ones), db float32: the GEMM of one
    column of bfloat16 ones, within the float32 bound; a bfloat16 GEMV does not exist in cuBLAS."""
    rng = np.random.default_rng(10)
    R, C = 300, 40
    dy_st = bf16_normals(rng, (R, C + 8))
    db0 = rng.standard_normal(C).astype(np.float32)
    if beta == 0:
        db0[...] = np.nan
    dy64 = dy_st[:, :C].astype(np.float64)
    exact, allowed = bound(dy64.T, np.ones((R, 1)), beta, db0.astype(np.float64)[:, None], np.float32)
    dy, db = cupy.asarray(dy_st), cupy.asarray(db0)
    assert mcublas.colsum(dy[:, :C], db, cupy.asarray(np.ones(R + 3, BF16)), beta)
    check(db.get()[:, None], exact, allowed)


def test_cupyops_sums_bf16_weight_gradients_in_float32(cupy):
    """CupyOps.linear_weight_grads on bfloat16 x and dy into float32 dW and db views: the first micro-batch
    writes (beta 0), the second adds (beta 1) in the GEMM's pass; the sum of both within the float32 bound
    of K = 2N products, nowhere rounded to bfloat16 (that would miss the bound by ~2^16)."""
    from minitensor.backends.cupy_ops import CupyOps

    rng = np.random.default_rng(11)
    N, n_in, n_out = 64, 48, 32
    xs, dys = [bf16_normals(rng, (N, n_in)) for _ in range(2)], [bf16_normals(rng, (N, n_out)) for _ in range(2)]
    ops = CupyOps(cupy)
    grads = cupy.asarray(np.full(n_in * n_out + n_out, np.nan, np.float32))
    ops.fill_zero(grads)
    dW, db = grads[:n_in * n_out].reshape(n_in, n_out), grads[n_in * n_out:]
    for x, dy in zip(xs, dys):
        ops.linear_weight_grads(cupy.asarray(x), cupy.asarray(dy), dW, db)
    x64 = np.concatenate(xs).astype(np.float64)
    dy64 = np.concatenate(dys).astype(np.float64)
    check(dW.get(), *bound(x64.T, dy64, 0.0, None, np.float32))
    check(db.get()[:, None], *bound(dy64.T, np.ones((2 * N, 1)), 0.0, None, np.float32))
    out = cupy.asarray(np.zeros((N, n_out), BF16))  # Ops.gemm's contract, bfloat16 output
    ops.gemm(cupy.asarray(xs[0]), cupy.asarray(bf16_normals(rng, (n_in, n_out))), out)
    assert out.dtype == BF16


def test_cupyops_matmul_takes_bf16_products_through_cublas(cupy):
    """CupyOps.matmul, the layers' products (Ops.matmul: float32 sums rounded once), on bfloat16: 2-D and
    batched with a transposed operand, each within the bfloat16 bound, through cuBLAS's gemmEx (the
    stand-in counts the calls; CuPy's own batched bfloat16 matmul would be wrong)."""
    from minitensor.backends.cupy_ops import CupyOps

    rng = np.random.default_rng(12)
    ops = CupyOps(cupy)
    a, b = bf16_normals(rng, (40, 24)), bf16_normals(rng, (24, 56))
    got = ops.matmul(cupy.asarray(a), cupy.asarray(b))
    assert got.dtype == BF16
    check(got.get(), *bound(a.astype(np.float64), b.astype(np.float64), 0.0, None, BF16))
    q, k = bf16_normals(rng, (3, 20, 16)), bf16_normals(rng, (3, 20, 16))
    got = ops.matmul(cupy.asarray(q), cupy.asarray(k).transpose(0, 2, 1))
    assert got.dtype == BF16 and got.shape == (3, 20, 20)
    check(got.get(), *bound(q.astype(np.float64), k.astype(np.float64).transpose(0, 2, 1), 0.0, None, BF16))


def test_bf16_operands_refuse_other_dtypes_in_one_line(cupy):
    a = cupy.asarray(np.ones((4, 8), BF16))
    with pytest.raises(TypeError, match=r"gemm: bfloat16 operands take a bfloat16 partner .* float32 @ bfloat16"):
        mcublas.gemm(cupy.asarray(np.ones((4, 4), np.float32)), a, cupy.asarray(np.ones((4, 8), np.float32)))
    with pytest.raises(TypeError, match=r"bfloat16 or float32 output, got bfloat16 @ bfloat16 -> float64"):
        mcublas.gemm(a.T, a, cupy.asarray(np.ones((8, 8), np.float64)))
    with pytest.raises(ValueError, match="a bfloat16 product needs an out of rows with a unit stride"):
        mcublas.gemm(a.T, a, cupy.asarray(np.ones((8, 8), np.float32)).T)


# --- what the stand-in records and holds ------------------------------------------------------------


def test_the_recording_counts_gemm_ex_at_each_operands_size():
    """While recording, gemmEx is one GEMM launch: A and B read at 2 bytes an element, a float32 C written
    at 4 (and read with beta 1), "(unaligned)" by a leading dimension not a multiple of 16 bytes."""
    with standin_cupy() as cupy:
        from cupy import _record

        a, b = cupy.empty((8, 16), BF16), cupy.empty((16, 24), BF16)
        out, out16 = cupy.empty((8, 24), np.float32), cupy.empty((8, 24), BF16)
        with _record.recording() as rec:
            assert mcublas.gemm(a, b, out, 1.0) and mcublas.gemm(a, b, out16, 0.0)
            assert mcublas.gemm(a, b[:, :20], out[:, :20], 0.0)
            assert mcublas.gemm(a.reshape(2, 4, 16), b.reshape(2, 16, 12), out16.reshape(2, 4, 24)[:, :, :12])
    ops = [(op.kind, op.name, op.flops, op.read, op.written) for op in rec.ops]
    ab = 2 * (8 * 16 + 16 * 24)
    assert ops == [("gemm", "cublas gemmEx", 2 * 8 * 24 * 16, ab + 4 * 8 * 24, 4 * 8 * 24),
                   ("gemm", "cublas gemmEx", 2 * 8 * 24 * 16, ab, 2 * 8 * 24),
                   ("gemm", "cublas gemmEx", 2 * 8 * 20 * 16, 2 * (8 * 16 + 16 * 20), 4 * 8 * 20),
                   ("gemm", "cublas gemmStridedBatchedEx (unaligned)", 2 * 2 * 4 * 12 * 16,  # B's rows: 24 bytes
                    2 * 2 * (4 * 16 + 16 * 12), 2 * 2 * 4 * 12)]


def test_the_standin_holds_bf16_arrays_as_cupy_does():
    """cupy.asarray of a bfloat16 NumPy array, astype, copy and get keep the bits; elementwise arithmetic
    is ml_dtypes' (float32 arithmetic rounded to bfloat16, as CuPy's bfloat16 class computes); a 2-D
    matmul gives a bfloat16 result of float32 sums rounded once (CuPy's gemmEx path), not NumPy's float32."""
    rng = np.random.default_rng(12)
    x, y = bf16_normals(rng, (16, 64)), bf16_normals(rng, (64, 8))
    with standin_cupy() as cupy:
        X, Y = cupy.asarray(x), cupy.asarray(y)
        assert X.dtype == BF16 and np.array_equal(X.copy().get().view(np.uint16), x.view(np.uint16))
        assert np.array_equal(X.astype(np.float32).get(), x.astype(np.float32))
        assert np.array_equal((X * X + X).get().view(np.uint16), (x * x + x).view(np.uint16))
        Z = X @ Y
        assert Z.dtype == BF16
        check(Z.get(), *bound(x.astype(np.float64), y.astype(np.float64), 0.0, None, BF16))


def test_the_standins_kernels_type_bf16_as_cupy_does():
    """An ElementwiseKernel types a bfloat16 array as CuPy 14.2 does, its own class `bfloat16`: made from
    a float by rounding to nearest even, read as a float, so `y = x * 2.0f` is exact and an assignment of
    16 bits stores their number (the trap a kernel avoids by writing a uint16 view, as adamw_step_copy
    does); a RawKernel built with `typedef unsigned short T;` (RawSpec.source's for bfloat16) takes
    bfloat16 arrays and bf16.cuh's widen / narrow_bf16."""
    from minitensor.backends import cuda

    header = cuda._header("bf16.cuh")
    x = np.array([1.0, -3.5, 0.1, 1e-39, 3e37], np.float32).astype(BF16)
    with standin_cupy() as cupy:
        X = cupy.asarray(x)
        twice = cupy.ElementwiseKernel("T x", "T y", "y = x * 2.0f", "twice_bf16")(X)
        assert twice.dtype == BF16 and np.array_equal(twice.get(), (x.astype(np.float32) * 2).astype(BF16))
        bits = cupy.ElementwiseKernel("T x", "T y", "y = narrow_bf16(widen(x))", "bits_bf16", preamble=header)(X)
        assert np.array_equal(bits.get(), x.view(np.uint16).astype(BF16))  # the number of the bits
        code = ("typedef unsigned short T;\n" + header
                + '\nextern "C" __global__ void halve(const T *x, T *y, int n) {\n'
                "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                "  if (i < n) y[i] = narrow_bf16(widen(x[i]) * 0.5f);\n}\n")
        Y = cupy.empty_like(X)
        cupy.RawKernel(code, "halve")((1,), (32,), (X, Y, np.int32(x.size)))
        assert Y.dtype == BF16 and np.array_equal(Y.get(), (x.astype(np.float32) * 0.5).astype(BF16))
