"""The CPU backend (minitensor.backends.numpy_ops and its pieces, minitensor/backends/cpu/) against Ops.

test_layers.py runs every gradient check and the float32-vs-float64 comparison on the default
backend (.ci/run runs it with ANDREA_CPU_KERNELS=numba and =numpy); here each NumpyOps, with the
numba kernels and without, meets the Ops reference directly: the same layer case agrees to
float64 rounding in float64 and to float32 rounding in float32. The vectorised float32 exp stays
within 2 ulp, and the kernels' results do not depend on the thread count.
"""

import numpy as np
import pytest
from layer_cases import CASES
from optional import require

from minitensor import parallel
from minitensor.backends import get_ops, numba_jit
from minitensor.backends.cpu import adamw as cpu_adamw
from minitensor.backends.cpu import attention as cpu_attention
from minitensor.backends.cpu import gelu as cpu_gelu
from minitensor.backends.cpu import layernorm as cpu_layernorm
from minitensor.backends.numpy_ops import NumpyOps
from minitensor.backends.ops import Ops
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.layers.layernorm import LayerNorm
from minitensor.optim import AdamW

require("numba")

DIMS = {"B": 2, "T": 7, "C": 8, "n_head": 2, "n_in": 5, "n_out": 6, "V": 11}
LAYERS = ["linear", "gelu", "bias+gelu", "mlp", "mlp+residual", "layernorm", "layernorm+residual", "attention",
          "attention-blocks", "attention-recompute", "attention-dense", "embedding", "head", "loss"]
BACKENDS = {"numba": lambda: NumpyOps(numba=True), "numpy": lambda: NumpyOps(numba=False)}


def run_case(name, dtype, ops, seed=3):
    case = CASES[name](np, dtype, seed, {**DIMS, "ops": ops})
    y = case.forward()
    rng = np.random.default_rng(seed + 1)
    dy = 1.5 if case.out_shape == () else rng.standard_normal(case.out_shape).astype(dtype)
    grads = case.backward(dy)
    return [to_numpy(y)] + [to_numpy(g) for g in grads.values()] + [case.params.grads.copy()]


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_cpu_backend_matches_the_ops_reference(backend, name, dtype, rtol):
    fast = run_case(name, dtype, BACKENDS[backend]())
    ref = run_case(name, dtype, Ops(np))
    assert len(fast) == len(ref)
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
    calls = []
    rows = []
    monkeypatch.setattr(cpu_attention, "attention_forward_cpu", lambda *a: calls.append(a))
    real = cpu_attention.block_softmax_backward_cpu
    monkeypatch.setattr(cpu_attention, "block_softmax_backward_cpu", lambda *a: (rows.append(a[0].shape), real(*a)))
    monkeypatch.setattr(numba_jit, "blas_in_kernels", lambda: False)
    fast = run_case(name, dtype, NumpyOps(numba=True))
    ref = run_case(name, dtype, Ops(np))
    assert not calls and rows
    for a, b in zip(fast, ref):
        scale = max(float(np.abs(b).max(initial=0.0)), 1.0)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


def test_attention_runs_the_fused_kernels_with_scipy(monkeypatch):
    require("scipy")
    seen = []
    real = cpu_attention.attention_backward_cpu
    monkeypatch.setattr(cpu_attention, "attention_backward_cpu", lambda *a: (seen.append(a[0].shape), real(*a)))
    run_case("attention-blocks", np.float32, NumpyOps(numba=True))
    assert seen and all(shape == (DIMS["T"], DIMS["C"] // DIMS["n_head"]) for shape in seen)


def test_exp_float32_within_two_ulp():
    x = np.linspace(-87.3, 88.3, 1_000_001, dtype=np.float32)
    got = _exp_all(x)
    exact = np.exp(x.astype(np.float64))
    assert got.dtype == np.float32
    assert np.max(np.abs(got - exact) / exact) < 2 * 2.0**-24
    edge = _exp_all(np.array([-np.inf, -1000, -88, 0, 89, 1000, np.inf], np.float32))
    assert list(edge) == [0, 0, 0, 1, np.inf, np.inf, np.inf]


@numba_jit.kernel()
def _exp_kernel(x, y):
    for i in range(x.size):
        y[i] = numba_jit.exp(x[i])


def _exp_all(x):
    y = np.empty_like(x)
    _exp_kernel(x, y)
    return y


@pytest.fixture
def threads(monkeypatch):
    """Sets minitensor's thread count for the rest of a test."""
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
    ops = NumpyOps(numba=True)
    for n in (1, 2, 3):
        threads(n)
        ln = LayerNorm(np.ones(C, np.float32), np.zeros(C, np.float32), np.zeros(C, np.float32),
                       np.zeros(C, np.float32), ops=ops)
        ln.forward(x)
        dx = ln.backward(dy)
        dW = np.zeros((V, C), np.float32)
        ops.scatter_add_rows(dW, ids, rows)
        out[n] = [dx, ln.dw, ln.db, dW]
    for n in (2, 3):
        for a, b in zip(out[1], out[n]):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_layernorm_parameter_gradients_add_every_row_block(backend, threads):
    """dw and db sum over all N rows, which the backends take in parts: the numba kernel one part
    per LN_ROW_BLOCK rows, the NumPy path one per thread. 300 rows of 128 (9 blocks of 32 and a
    partial one; 3 threads' parts) against the Ops reference, onto gradients already holding
    something: a part left out, or written over, is a wrong gradient."""
    threads(3)
    rng = np.random.default_rng(5)
    N, C = 300, 128
    assert N > 9 * cpu_layernorm.LN_ROW_BLOCK and N * C >= cpu_layernorm.LN_MIN_WORK // 2  # both split, as intended
    x, dy, w, b = rng.standard_normal((N, C)), rng.standard_normal((N, C)), rng.standard_normal(C), np.zeros(C)
    out = []
    for ops in (BACKENDS[backend](), Ops(np)):
        _, mean, rstd = ops.layernorm_forward(x, w, b, 1e-5)
        dw, db = np.full(C, 0.5), np.full(C, -0.5)
        dx = ops.layernorm_backward(dy, x, mean, rstd, w, dw, db)
        out.append((dx, dw, db))
    for got, want in zip(*out):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * float(np.abs(want).max()))


def test_gelu_pieces_cover_every_element_across_chunk_edges(monkeypatch, threads):
    """The NumPy path runs GELU over CHUNK-element pieces of the flat arrays, spread over the threads:
    with CHUNK at 512, 2,100 elements are four whole pieces and a partial one, and every element
    still equals the Ops reference (forward, backward, and backward recomputing the output)."""
    monkeypatch.setattr(cpu_gelu, "CHUNK", 512)
    threads(3)
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((7, 300)) * 3, rng.standard_normal((7, 300))
    fast, ref = NumpyOps(numba=False), Ops(np)
    np.testing.assert_allclose(fast.gelu_forward(x), ref.gelu_forward(x), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fast.gelu_backward(x, dy), ref.gelu_backward(x, dy), rtol=1e-10, atol=1e-12)
    dx, y = fast.gelu_backward(x.copy(), dy, recompute_output=True)
    np.testing.assert_allclose(dx, ref.gelu_backward(x, dy), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(y, ref.gelu_forward(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("eps", [1e-8, 0.3])
def test_adamw_cpu_backends_match_the_ops_reference(monkeypatch, eps):
    """With CHUNK at 64 each tensor is many pieces and a partial one (the decay flag changes at a
    piece's edge); with eps 0.3, far above sqrt(v), its place in the denominator is what is checked
    (its folded form eps sqrt(1 - b2^t) against the textbook's eps after the bias correction)."""
    monkeypatch.setattr(cpu_adamw, "CHUNK", 64)
    shapes = {"w": (70, 30), "b": (30,)}
    result = {}
    for mode, ops in (("numba", NumpyOps(numba=True)), ("numpy", NumpyOps(numba=False)), ("ops", Ops(np))):
        p = Params(shapes, dtype="float32", ops=ops)
        rng = np.random.default_rng(0)
        p.data[:] = rng.standard_normal(p.size, dtype=np.float32)
        opt = AdamW(p, lr=1e-2, eps=eps)
        for _ in range(3):
            p.grads[:] = rng.standard_normal(p.size, dtype=np.float32)
            opt.step(grad_scale=0.5)
        # the tensors only: the Ops step runs over the whole buffer, padding included (never read)
        inside = p.mask(lambda name, shape: True).astype(bool)
        result[mode] = (p.data[inside], *(state[inside] for state in opt.named_state().values()))
    for mode in ("numba", "numpy"):
        for a, b in zip(result[mode], result["ops"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_backend_is_chosen_once_from_the_setting_or_the_environment(monkeypatch):
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numpy")
    assert get_ops().name == "numpy" and get_ops(kernels="numba").name == "numba"
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numba")
    ops = get_ops()
    assert ops.name == "numba" and get_ops() is ops       # one instance per choice
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numpy")
    ln = LayerNorm(np.ones(3), np.zeros(3), np.zeros(3), np.zeros(3), ops=ops)
    assert ln.ops is ops                                   # a built layer keeps its backend
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "fortran")
    with pytest.raises(ValueError, match="ANDREA_CPU_KERNELS"):
        get_ops()
