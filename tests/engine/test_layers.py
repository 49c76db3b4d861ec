"""Every layer: forward against a slow reference, gradients against finite differences in float64,
accumulation, the dropped cache, and float32 against float64. Shapes and seeds come from hypothesis.
"""

import numpy as np
import pytest
import strategies as S
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_cases import CASES

from minitensor.checks.gradcheck import check_gradients
from minitensor.device import to_numpy


@st.composite
def dims(draw):
    d = draw(S.attention_dims())
    d.update(n_in=draw(S.width), n_out=draw(S.width), V=draw(S.vocab))
    return d


def upstream(case, xp, dtype, seed):
    rng = np.random.default_rng(seed + 1)
    if case.out_shape == ():
        return float(rng.uniform(0.5, 2.0))
    return xp.asarray(rng.standard_normal(case.out_shape), dtype=dtype)


names = pytest.mark.parametrize("name", sorted(CASES))
examples = settings(max_examples=12)


@names
@examples
@given(seed=S.seeds, d=dims())
def test_forward_matches_reference(xp, name, seed, d):
    case = CASES[name](xp, np.float64, seed, d)
    y = to_numpy(case.forward())
    np.testing.assert_allclose(y, case.reference(), rtol=1e-10, atol=1e-12)


@names
@examples
@given(seed=S.seeds, d=dims())
def test_gradients_match_finite_differences(xp, name, seed, d):
    case = CASES[name](xp, np.float64, seed, d)
    dy = upstream(case, xp, np.float64, seed)
    case.forward()
    # on CuPy every perturbed entry would cost a host read: random directions there instead
    report = check_gradients(case.forward, case.backward, case.inputs, case.param_pairs(), dy,
                             directions=None if xp is np else 6)
    assert report.max_rel_error <= 1e-6, report
    assert set(report.checked) == set(case.inputs) | set(case.params.names())


@names
@examples
@given(seed=S.seeds, d=dims())
def test_backward_accumulates_and_drops_cache(xp, name, seed, d):
    case = CASES[name](xp, np.float64, seed, d)
    dy = upstream(case, xp, np.float64, seed)
    case.forward()
    once_inputs = {k: to_numpy(v).copy() for k, v in case.backward(dy).items()}
    once = to_numpy(case.params.grads).copy()
    with pytest.raises(RuntimeError, match="without a forward"):
        case.backward(dy)
    case.forward()
    twice_inputs = case.backward(dy)
    np.testing.assert_allclose(to_numpy(case.params.grads), 2 * once, rtol=1e-12, atol=1e-14)
    for k, v in twice_inputs.items():  # input gradients are returned, not accumulated
        np.testing.assert_allclose(to_numpy(v), once_inputs[k], rtol=1e-12, atol=1e-14)


@names
@examples
@given(seed=S.seeds, d=dims())
def test_float32_agrees_with_float64(xp, name, seed, d):
    results = {}
    for dtype in (np.float32, np.float64):
        case = CASES[name](xp, dtype, seed, d)
        y = case.forward()
        assert y.dtype == dtype
        grads = case.backward(upstream(case, xp, dtype, seed))
        results[dtype] = [to_numpy(y)] + [to_numpy(g) for g in grads.values()] + [to_numpy(case.params.grads)]
    for a32, a64 in zip(results[np.float32], results[np.float64]):
        # float32 keeps ~7 digits of the O(1) inputs; a result that cancels to near 0 keeps that
        # absolute error, so the tolerance is absolute at the scale of max(result, 1)
        scale = max(float(np.abs(a64).max(initial=0.0)), 1.0)
        if name.startswith("layernorm") and d["C"] == 1:
            # a one-wide row has zero variance whatever the data, so rstd = 1 / sqrt(eps) ~ 316
            # multiplies every float32 rounding (dx is 0 in exact arithmetic, ~1e-14 in float64,
            # ~1e-5 in float32 with FMA contraction): compare at that condition number
            scale /= np.sqrt(1e-5)
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["linear", "head"])
def test_a_fresh_gradient_is_written_then_accumulated(xp, name):
    """After Params.zero_grad, a Linear's or TiedHead's next weight gradient is written by the GEMM
    (the backend's GradWrites, told by its fill_zero): it overwrites the gradient views whatever they
    hold, and the one after adds to them. The layer itself only ever asks for `dW += x^T dy`."""
    d = {"B": 2, "T": 3, "n_in": 5, "n_out": 4, "C": 6, "V": 7}
    case = CASES[name](xp, np.float64, 0, d)
    dy = upstream(case, xp, np.float64, 0)

    def grads():
        return [to_numpy(case.params.grad(n)).copy() for n in case.params.names()]

    case.forward()
    case.backward(dy)
    once = grads()
    assert all(float(abs(g).max()) > 0 for g in once)
    case.params.zero_grad()
    for n in case.params.names():
        case.params.grad(n)[...] = 7.0                       # stale values the written gradient must not keep
    case.forward()
    case.backward(dy)
    for got, want in zip(grads(), once):
        # within float64 rounding, not bit for bit: written straight into the gradient view (out=),
        # cuBLAS may pick another kernel than for a fresh array (another alignment), so another
        # summation order; the stale 7.0 would show at any tolerance
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    assert case.layer.ops is case.params.ops and not case.params.ops.grad_writes.first(case.layer.dW)
    case.forward()
    case.backward(dy)
    for got, want in zip(grads(), once):
        np.testing.assert_allclose(got, 2 * want, rtol=1e-12)
