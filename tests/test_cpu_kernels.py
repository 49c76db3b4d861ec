"""The numba fast path (minitensor.cpu) against the NumPy code it replaces.

test_layers.py runs every gradient check and the float32-vs-float64 comparison on whichever path
is active (.ci/run runs it on both); here the two paths meet directly: the same layer case run
with ANDREA_CPU_KERNELS=numba and =numpy agrees to float64 rounding in float64 and to float32
rounding in float32, the vectorised float32 exp stays within 2 ulp, and the kernels' results do
not depend on the thread count.
"""

import numpy as np
import pytest
from layer_cases import CASES
from optional import require

from minitensor import cpu, parallel
from minitensor.backend import to_numpy
from minitensor.embedding import scatter_add_rows
from minitensor.layernorm import LayerNorm
from minitensor.optim import AdamW
from minitensor.params import Params

require("numba")

DIMS = {"B": 2, "T": 7, "C": 8, "n_head": 2, "n_in": 5, "n_out": 6, "V": 11}
LAYERS = ["gelu", "linear+gelu", "mlp", "layernorm", "layernorm+residual", "attention", "attention-blocks",
          "attention-recompute", "embedding", "loss"]


def run_case(name, dtype, seed=3):
    case = CASES[name](np, dtype, seed, DIMS)
    y = case.forward()
    rng = np.random.default_rng(seed + 1)
    dy = 1.5 if case.out_shape == () else rng.standard_normal(case.out_shape).astype(dtype)
    grads = case.backward(dy)
    return [to_numpy(y)] + [to_numpy(g) for g in grads.values()] + [case.params.grads.copy()]


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", LAYERS)
def test_fast_path_matches_numpy_path(monkeypatch, name, dtype, rtol):
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")
    fast = run_case(name, dtype)
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numpy")
    ref = run_case(name, dtype)
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype
        scale = max(float(np.abs(b).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", ["attention", "attention-blocks", "attention-recompute"])
def test_attention_row_kernels_without_blas_in_kernels(monkeypatch, name, dtype, rtol):
    """Without SciPy the fused attention kernels cannot reach BLAS: the Python block loop with the
    numba row kernels runs instead, and it too agrees with the NumPy path."""
    require("scipy")  # with it, the case above runs the fused kernels; this one must not
    import minitensor.attention as attention

    calls = []
    monkeypatch.setattr(attention, "attention_forward_cpu", lambda *a: calls.append(a))
    monkeypatch.setattr(cpu, "blas_in_kernels", lambda: False)
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")
    fast = run_case(name, dtype)
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numpy")
    ref = run_case(name, dtype)
    assert not calls
    for a, b in zip(fast, ref):
        scale = max(float(np.abs(b).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def test_attention_runs_the_fused_kernels_with_scipy(monkeypatch):
    require("scipy")
    import minitensor.attention as attention

    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")
    seen = []
    real = attention.attention_backward_cpu
    monkeypatch.setattr(attention, "attention_backward_cpu", lambda *a: (seen.append(a[0].shape), real(*a)))
    run_case("attention-blocks", np.float32)
    assert seen and all(shape == (DIMS["T"], DIMS["C"] // DIMS["n_head"]) for shape in seen)


def test_exp_float32_within_two_ulp():
    x = np.linspace(-87.3, 88.3, 1_000_001, dtype=np.float32)
    got = _exp_all(x)
    exact = np.exp(x.astype(np.float64))
    assert got.dtype == np.float32
    assert np.max(np.abs(got - exact) / exact) < 2 * 2.0**-24
    edge = _exp_all(np.array([-np.inf, -1000, -88, 0, 89, 1000, np.inf], np.float32))
    assert list(edge) == [0, 0, 0, 1, np.inf, np.inf, np.inf]


@cpu.kernel()
def _exp_kernel(x, y):
    for i in range(x.size):
        y[i] = cpu.exp(x[i])


def _exp_all(x):
    y = np.empty_like(x)
    _exp_kernel(x, y)
    return y


@pytest.fixture
def threads(monkeypatch):
    """Sets minitensor's thread count for the rest of a test."""
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")

    def set_threads(n):
        monkeypatch.setattr(parallel, "_threads", n)
        monkeypatch.setattr(parallel, "_pool", None)
    return set_threads


def test_reductions_do_not_depend_on_the_thread_count(threads):
    rng = np.random.default_rng(0)
    N, C, V = 300, 64, 50
    x, dy = rng.standard_normal((N, C), dtype=np.float32), rng.standard_normal((N, C), dtype=np.float32)
    ids, rows = rng.integers(0, V, N), rng.standard_normal((N, C), dtype=np.float32)
    out = {}
    for n in (1, 2, 3):
        threads(n)
        ln = LayerNorm(np.ones(C, np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32),
                       np.zeros(C, np.float32))
        ln.forward(x)
        dx = ln.backward(dy)
        dW = np.zeros((V, C), np.float32)
        scatter_add_rows(dW, ids, rows)
        out[n] = [dx, ln.dw, ln.db, dW]
    for n in (2, 3):
        for a, b in zip(out[1], out[n]):
            assert np.array_equal(a, b)


def test_adamw_fast_path_matches_numpy_path(monkeypatch):
    shapes = {"w": (70, 30), "b": (30,)}
    result = {}
    for mode in ("numba", "numpy"):
        monkeypatch.setenv("ANDREA_CPU_KERNELS", mode)
        p = Params(shapes, dtype="float32")
        rng = np.random.default_rng(0)
        p.data[:] = rng.standard_normal(p.size, dtype=np.float32)
        opt = AdamW(p, lr=1e-2)
        for _ in range(3):
            p.grads[:] = rng.standard_normal(p.size, dtype=np.float32)
            opt.step(grad_scale=0.5)
        result[mode] = (p.data.copy(), opt.m.copy(), opt.v.copy())
    for a, b in zip(result["numba"], result["numpy"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mode_follows_the_environment(monkeypatch):
    x = np.ones(3, np.float32)
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numpy")
    assert not cpu.enabled(x)
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")
    assert cpu.enabled(x) and not cpu.enabled(x.astype(np.float16)) and not cpu.enabled([1.0])
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "fortran")
    with pytest.raises(ValueError, match="ANDREA_CPU_KERNELS"):
        cpu.mode()
