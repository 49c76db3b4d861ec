"""GELU on every backend against its textbook formula (Ops, minitensor/backends/ops.py), and the kernels and
kernelcheck modules and finite differences, the NVRTC compile check (and that it can fail), the host C++
check of each elementwise operation, and, on a GPU, the CuPy kernels against NumPy."""

import dataclasses
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import reference as F
import strategies as S
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from markers import needs_cxx, needs_nvrtc

from minitensor.backends import all_kernels, cuda, cupy_ops
from minitensor.backends.cpu import gelu as cpu_gelu
from minitensor.backends.kernels import gelu
from minitensor.backends.numpy_ops import NumpyOps
from minitensor.backends.ops import Ops
from minitensor.checks import kernelcheck
from minitensor.checks.__main__ import main as kernels_main

DTYPES = [np.float32, np.float64]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9)
chunks = st.sampled_from([1, 7, 64, cpu_gelu.CHUNK])  # small chunks exercise the chunk edges


def assert_close(got, want, *inputs):
    """The host check's rule: |got - want| <= rtol (1 + |want|) prod(1 + |input|)."""
    rtol = 1e-12 if got.dtype == np.float64 else 16 * np.finfo(np.float32).eps
    scale = np.prod([1.0 + np.abs(np.asarray(a, np.float64)) for a in inputs], axis=0)
    err = np.abs(got.astype(np.float64) - want) / (rtol * (1.0 + np.abs(want)) * scale)
    assert got.shape == np.shape(want)
    assert err.size == 0 or err.max() <= 1.0, f"worst error {err.max():.3g} x tolerance"


def sample(seed, shape, dtype, scale=3.0):
    return np.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)  # 0-d stays an array




# --- GELU on every CPU backend ------------------------------------------------------------------

CPU_OPS = {"ops": Ops(np), "numpy": NumpyOps(numba=False), "numba": NumpyOps(numba=True)}
backends = st.sampled_from(sorted(CPU_OPS))


@given(shape=shapes, seed=S.seeds, dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.1, 1.0, 4.0]),
       backend=backends, chunk=chunks)
def test_gelu_forward_matches_formula(shape, seed, dtype, scale, backend, chunk):
    x = sample(seed, shape, dtype, scale)
    with mock.patch.object(cpu_gelu, "CHUNK", chunk):
        y = CPU_OPS[backend].gelu_forward(x)
    assert y.dtype == dtype
    assert_close(y, F.gelu(x.astype(np.float64)), x)


@given(shape=shapes, seed=S.seeds, dtype=st.sampled_from(DTYPES), scale=st.sampled_from([0.1, 1.0, 4.0]),
       backend=backends, chunk=chunks, recompute=st.booleans())
def test_gelu_backward_matches_formula(shape, seed, dtype, scale, backend, chunk, recompute):
    x, dy = sample(seed, shape, dtype, scale), sample(seed + 1, shape, dtype, 1.0)
    x64 = x.astype(np.float64)
    with mock.patch.object(cpu_gelu, "CHUNK", chunk):
        got = CPU_OPS[backend].gelu_backward(x, dy, recompute_output=recompute)
    dx, y = got if recompute else (got, None)
    assert dx.dtype == dtype
    assert_close(dx, F.gelu_backward(x64, dy.astype(np.float64)), x, dy)
    if recompute:  # GELU(x) again, possibly written over x
        assert_close(y, F.gelu(x64), x64)


@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9), seed=S.seeds,
       dtype=st.sampled_from(DTYPES), backend=backends, chunk=chunks)
def test_bias_gelu_forward_and_backward(shape, seed, dtype, backend, chunk):
    """GELU(x + b): the x handed back to the backward is whatever the forward left in it."""
    x, b, dy = sample(seed, shape, dtype), sample(seed + 1, shape[-1:], dtype), sample(seed + 2, shape, dtype)
    h = x.astype(np.float64) + b
    ops = CPU_OPS[backend]
    with mock.patch.object(cpu_gelu, "CHUNK", chunk):
        y = ops.bias_gelu_forward(x, b)
        dh = ops.bias_gelu_backward(x, b, dy)
    bb = np.broadcast_to(b, shape)
    assert_close(y, F.gelu(h), h)
    assert_close(dh, F.gelu_backward(h, dy.astype(np.float64)), h, dy, bb)


@pytest.mark.parametrize("backend", sorted(CPU_OPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_large_odd_size_in_chunks(backend, dtype):
    n = 2 * cpu_gelu.CHUNK + 13
    x, dy = sample(0, n, dtype), sample(1, n, dtype)
    ops = CPU_OPS[backend]
    assert_close(ops.gelu_forward(x), F.gelu(x.astype(np.float64)), x)
    assert_close(ops.gelu_backward(x, dy), F.gelu_backward(x.astype(np.float64), dy.astype(np.float64)), x, dy)


@pytest.mark.parametrize("backend", sorted(CPU_OPS))
def test_gelu_strided_operands(backend):
    base = sample(2, (6, 10), np.float64)
    x, dy = base[:, ::2], sample(3, (6, 5), np.float64)  # non-contiguous
    ops = CPU_OPS[backend]
    assert_close(ops.gelu_forward(x), F.gelu(x), x)
    assert_close(ops.gelu_backward(x, dy), F.gelu_backward(x, dy), x, dy)


@pytest.mark.parametrize("backend", sorted(CPU_OPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_keeps_extremes_finite(backend, dtype):
    ops = CPU_OPS[backend]
    x = np.array([0.0, -0.0, 1e-30, -1e-30, 30.0, -30.0, 1e4, -1e4], dtype)
    y, dx = ops.gelu_forward(x), ops.gelu_backward(x, np.ones_like(x))
    np.testing.assert_allclose(y, [0, 0, 5e-31, -5e-31, 30, 0, 1e4, 0], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(dx, [0.5, 0.5, 0.5, 0.5, 1, 0, 1, 0], rtol=1e-6)


def test_gelu_derivative_matches_central_differences():
    ops = Ops(np)
    x = np.concatenate([np.linspace(-6, 6, 241), sample(5, 200, np.float64)])
    h = 1e-5
    numeric = (ops.gelu_forward(x + h) - ops.gelu_forward(x - h)) / (2 * h)
    np.testing.assert_allclose(ops.gelu_backward(x, np.ones_like(x)), numeric, rtol=1e-8, atol=1e-9)
    dy = sample(6, x.shape, np.float64)
    np.testing.assert_allclose(ops.gelu_backward(x, dy), dy * numeric, rtol=1e-8, atol=1e-8)


def test_gelu_is_the_tanh_form_not_erf():
    x = np.array([-3.0, -1.0, 0.5, 2.0])
    from math import erf

    exact = np.array([0.5 * v * (1 + erf(v / np.sqrt(2))) for v in x])
    assert 1e-5 < np.max(np.abs(Ops(np).gelu_forward(x) - exact)) < 5e-4


def test_import_needs_no_cupy():
    code = ("import sys, minitensor.checks, minitensor.backends.cupy_ops, andrea.model.transformer; "
            "minitensor.backends.all_kernels(); "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_importing_the_gpu_backend_reads_no_cuda_source():
    """The .cu files are read at a kernel's first use (its code, its build), not at import."""
    code = ("from minitensor.backends import cuda, cupy_ops; from minitensor.backends.kernels import layernorm; "
            "assert cuda._cu_file.cache_info().currsize == 0 and cuda._header.cache_info().currsize == 0; "
            "assert 'block_sum' in layernorm.LAYERNORM_FWD.code; "
            "assert cuda._cu_file.cache_info().currsize == 1 and cuda._header.cache_info().currsize == 2")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_every_section_of_the_kernel_files_is_a_registered_kernel():
    """A kernel is found by its name: `// @kernel NAME` in one .cu file under kernels/, and each
    such section is a registered kernel (none left behind, none read from two files)."""
    sections = {}
    for path in sorted(cuda.KERNEL_DIR.glob("*.cu")):
        for line in path.read_text().splitlines():
            if line.startswith(cuda.MARK):
                name = line[len(cuda.MARK):].split()[0]
                assert name not in sections, (name, path.name, sections.get(name))
                sections[name] = path.name
    kernels = all_kernels()
    assert set(sections) == set(kernels)
    assert all(spec.file == sections[name] for name, spec in kernels.items())
    with pytest.raises(KeyError, match=r"layernorm.cu has no section '// @kernel layernorm_fwdx' \(it has: "):
        cuda.cu_code("layernorm.cu", "layernorm_fwdx")


def test_the_kernels_folder_is_loaded_whole_in_the_order_of_its_names():
    """kernels.load imports every module of the folder (each beside its .cu) in the order of their
    names, and every kernel is registered by the module of its .cu; the fused pieces come in the order
    of their names (the kernels line's), whichever module a process imported first."""
    from minitensor.backends import fused_pieces, kernels

    modules = sorted(p.stem for p in cuda.KERNEL_DIR.glob("*.py") if p.stem != "__init__")
    assert kernels.load() == tuple(modules) and all((cuda.KERNEL_DIR / f"{m}.cu").exists() for m in modules)
    assert all(f"minitensor.backends.kernels.{m}" in sys.modules for m in modules)
    assert sorted({spec.file[:-3] for spec in all_kernels().values()}) == modules
    for spec in all_kernels().values():  # declared beside its source: kernels/NAME.py for NAME.cu
        module = sys.modules[f"minitensor.backends.kernels.{spec.file[:-3]}"]
        assert any(value is spec for value in vars(module).values()), spec.name
    assert list(fused_pieces()) == sorted(fused_pieces())


def test_the_wheel_packs_every_kernel_file():
    """pyproject.toml's package data for minitensor.backends covers every CUDA file under kernels/, and
    its package list the kernels' Python modules (kernels/ is a package) and the CPU's pieces (cpu/)."""
    import ast
    import fnmatch
    import re

    from setuptools import find_packages

    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()  # tomllib: Python 3.11 on
    globs = ast.literal_eval(re.search(r'^"minitensor\.backends" = (\[.*?\])', text, re.M).group(1))
    files = [p.name for p in cuda.KERNEL_DIR.iterdir() if p.is_file()]
    assert {"layernorm.cu", "rows.cuh", "layernorm.py"} <= set(files)
    data = [f for f in files if not f.endswith(".py")]
    assert [f for f in data if not any(fnmatch.fnmatch(f"kernels/{f}", g) for g in globs)] == []
    include = ast.literal_eval(re.search(r'^include = (\[.*?\])', text, re.M).group(1))
    assert {"minitensor.backends.kernels", "minitensor.backends.cpu"} <= set(find_packages(str(root), include=include))


def test_the_gelu_kernels_constants_are_the_ops_constants():
    """kernels/gelu.cu writes GELU's folded constants as literals: they are the Ops code's, to the digit."""
    from minitensor.backends.ops import GELU_C
    from minitensor.backends.tricks import GELU_AC, GELU_AC3

    m2ac, m2c, ac3, c2 = (repr(v) for v in (-2.0 * GELU_AC, -2.0 * GELU_C, 2.0 * GELU_AC3, 2.0 * GELU_C))
    assert gelu.GELU_FWD.operation == f"y = x / ((T)1 + exp(x * (x * x * (T){m2ac} + (T){m2c})));"
    den = f"exp(h * (h2 * (T){m2ac} + (T){m2c}))"
    assert f"const T den = (T)1 + {den};" in gelu.BIAS_GELU_BWD_FWD.operation
    for spec in (gelu.GELU_BWD, gelu.BIAS_GELU_BWD, gelu.BIAS_GELU_BWD_FWD):
        assert f"(T){ac3} + (T){c2})) + (T)1) * sig * dy;" in spec.operation, spec.name
    text = (cuda.KERNEL_DIR / "gelu.cu").read_text()
    assert text.count("(T)") and all(c in text for c in (m2ac, m2c, ac3, c2))


# --- The NVRTC compile check ---------------------------------------------------------------------


@needs_nvrtc
def test_every_kernel_compiles_with_nvrtc():
    """Every kernel in every dtype the precision policy builds it for: bfloat16 too for the row kernels."""
    results = list(kernelcheck.check_kernels())
    assert len(results) == sum(len(s.dtypes) for s in all_kernels().values()) * len(cuda.ARCHS)
    bf16 = {r.name for r in results if r.dtype == "bfloat16"}
    assert {"layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "softmax_xent_fwd", "causal_softmax_fwd",
            "scatter_add_rows"} <= bf16
    # the bf16 flash kernels in bfloat16 alone (their only instances)
    assert {(r.name, r.dtype) for r in results} >= {("flash_attention_fwd_bf16", "bfloat16"),
                                                     ("flash_attention_fwd", "float32")}
    assert not {r.name for r in results if r.dtype != "bfloat16" and r.name.endswith("_bf16")}
    assert [r.line() for r in results if not r.ok] == []


@needs_nvrtc
def test_check_fails_on_what_nvrtc_rejects(monkeypatch, capsys):
    # nvcc accepts INFINITY; NVRTC, which CuPy uses, does not (seen with CuPy 14.2): the check
    # must compile with NVRTC itself.
    broken = cuda.ElementwiseSpec("broken", "T x", "T y", inline="y = x < 0 ? -INFINITY : x",
                                     reference=lambda x: x)
    monkeypatch.setattr(cuda, "KERNELS", {"broken": broken})
    assert kernels_main(["--check", "--arch", "sm_90"]) == 1
    out = capsys.readouterr().out
    assert "FAIL broken float32 sm_90" in out and "INFINITY" in out
    syntax = cuda.RawSpec("syntax", inline='extern "C" __global__ void syntax(T *y) { y[0] = ; }')
    [result] = kernelcheck.check_kernels([syntax], dtypes=["float64"], archs=["sm_80"])
    assert not result.ok and "error" in result.error


@needs_nvrtc
def test_raw_kernels_register_with_their_source():
    raw = cuda.RawSpec("scale", inline='extern "C" __global__ void scale(T *y, T a, int n) {\n'
                                   "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                   "  if (i < n) y[i] *= a;\n}\n")
    assert raw.source("float32").startswith("typedef float T;")
    assert all(r.ok for r in kernelcheck.check_kernels([raw], archs=["sm_90"]))


@needs_nvrtc
def test_elementwise_source_is_what_cupy_generates():
    src = gelu.GELU_FWD.source("float32")
    assert src.startswith("#include <cupy/complex.cuh>")
    assert 'extern "C" __global__ void gelu_fwd(const CArray<float, 1, 1, 1> _raw_x, ' in src
    assert "typedef double T;" in gelu.GELU_FWD.source("float64")


def test_check_without_cupy_says_how_to_install(monkeypatch, capsys):
    cuda.toolchain.cache_clear()
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    try:
        assert kernels_main(["--check"]) == 2
    finally:
        cuda.toolchain.cache_clear()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install -e '.[kernel-check]'" in err


# --- The host C++ check --------------------------------------------------------------------------


@needs_cxx
@pytest.mark.parametrize("name", sorted(n for n, s in all_kernels().items()
                                        if isinstance(s, cuda.ElementwiseSpec)))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elementwise_operation_equals_its_formula_as_cpp(name, dtype):
    result = kernelcheck.host_check(all_kernels()[name], dtype)
    assert result.ok, result.line()


@needs_cxx
def test_host_check_catches_a_wrong_formula():
    right = cuda.ElementwiseSpec("scale", "T x, T a", "T y", inline="y = a * x", reference=lambda x, a: a * x,
                                    scalars=(("a", 0.5),))
    assert kernelcheck.host_check(right, "float32").ok
    slip = dataclasses.replace(right, inline="y = a * x * ((T)1 + (T)1e-9 * x)")
    assert not kernelcheck.host_check(slip, "float64").ok


# --- On a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_gelu_equals_numpy(cupy, dtype):
    ops = cupy_ops.CupyOps(cupy)
    x, dy = sample(7, (37, 129), dtype), sample(8, (37, 129), dtype)
    x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
    assert_close(cupy.asnumpy(ops.gelu_forward(x_gpu)), F.gelu(x.astype(np.float64)), x)
    dx = ops.gelu_backward(x_gpu, dy_gpu)
    assert_close(cupy.asnumpy(dx), F.gelu_backward(x.astype(np.float64), dy.astype(np.float64)),
                 x, dy)
    y = cupy.asnumpy(ops.gelu_forward(x_gpu[:, ::2]))  # strided input: another generated kernel
    assert_close(y, F.gelu(x[:, ::2].astype(np.float64)), x[:, ::2])


@pytest.mark.gpu
@pytest.mark.real_gpu("compares with the code the real CuPy generates at a launch (its cached_codes)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_source_is_the_source_cupy_compiled(cupy, dtype):
    for spec in (gelu.GELU_FWD, gelu.GELU_BWD):
        fresh = cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation, spec.name)
        n_in = len(spec.in_params.split(","))
        fresh(*[cupy.ones((10, 100), dtype)] * n_in)  # contiguous: reduced to 1-D, 32-bit indexing
        [compiled] = fresh.cached_codes.values()
        assert spec.source(dtype).endswith(compiled)
