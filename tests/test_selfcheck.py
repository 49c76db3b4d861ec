"""The start-up self-check of the fused kernels (minitensor/selfcheck.py) and the kernels switch.

Without a GPU, the real checks of the pieces built from RawKernels only (LayerNorm, the causal
softmax of the dense attention core) run their layer's fused path through the host emulation of
the kernels (kernelcheck.emulate_launch, NumPy arrays standing in for CuPy ones); a kernel made
to disagree (a sign flipped in its CUDA code) is refused, reported, and the generic code takes
its place. The choice and the line are also checked with stand-in checks.
"""

import dataclasses

import numpy as np
import pytest
from markers import needs_cxx

from minitensor import attention, cuda, kernelcheck, layernorm, selfcheck
from minitensor.layernorm import LayerNorm


class NumPyStandingInForCuPy:
    """An array module that is not numpy itself (so the self-check runs) but makes NumPy arrays."""

    def __getattr__(self, name):
        return getattr(np, name)


FAKE_GPU = NumPyStandingInForCuPy()


@pytest.fixture
def emulated(monkeypatch):
    """The layers' fused paths on NumPy arrays: `uses` ignores the backend, RawKernels are emulated."""
    monkeypatch.setattr(cuda, "uses", lambda name, x: name in cuda.in_use)
    monkeypatch.setattr(cuda, "launch", kernelcheck.emulate_launch)
    monkeypatch.setattr(cuda, "in_use", set())


def stand_in_check(error):
    """A check whose 'fused' run is off by `error` relative to its generic run."""
    def check(xp, rng):
        y = rng.standard_normal(50).astype(np.float32)
        return (y * (1 + error) if cuda.in_use else y,)
    return check


def test_select_keeps_what_agrees_and_reports_what_does_not(monkeypatch):
    monkeypatch.setattr(cuda, "in_use", set())
    checks = {"layernorm": stand_in_check(1e-7), "adamw": stand_in_check(1e-2), "bias_gelu": stand_in_check(0.0)}
    line = selfcheck.select_kernels("auto", FAKE_GPU, checks)
    assert cuda.in_use == {"layernorm", "bias_gelu"}
    assert line.startswith("kernels: fused layernorm, bias_gelu; generic for adamw (failed its self-check: max error")


def test_a_check_that_raises_is_refused(monkeypatch):
    monkeypatch.setattr(cuda, "in_use", set())

    def broken(xp, rng):
        if cuda.in_use:
            raise RuntimeError("NVRTC said no\nmore")
        return (np.zeros(3),)

    line = selfcheck.select_kernels("auto", FAKE_GPU, {"adamw": broken})
    assert cuda.in_use == set()
    assert line == "kernels: fused none; generic for adamw (failed its self-check: RuntimeError: NVRTC said no)"


def test_modes_and_numpy(monkeypatch):
    monkeypatch.setattr(cuda, "in_use", set())
    assert selfcheck.select_kernels("fused", FAKE_GPU).startswith("kernels: fused layernorm, bias_gelu")
    assert cuda.in_use == set(cuda.FUSED)
    assert selfcheck.select_kernels("generic", FAKE_GPU) == "kernels: generic (train.kernels=generic)"
    assert cuda.in_use == set()
    cuda.in_use = {"adamw"}
    assert selfcheck.select_kernels("auto", np) == "kernels: generic (NumPy)"
    assert cuda.in_use == set()
    with pytest.raises(ValueError, match="kernels must be one of"):
        selfcheck.select_kernels("fast", np)


def test_every_piece_has_a_check_that_runs():
    checks = cuda.all_kernels() and cuda.CHECKS
    assert set(checks) == set(cuda.FUSED)
    # on NumPy both runs take the generic code: each check runs and agrees with itself
    assert selfcheck.choose(checks, np) == (list(checks), {})


@needs_cxx
@pytest.mark.parametrize("piece", ["layernorm", "causal_softmax"])
def test_the_real_check_passes_the_emulated_kernels(emulated, piece):
    cuda.all_kernels()
    assert selfcheck.select_kernels("auto", FAKE_GPU, {piece: cuda.CHECKS[piece]}) == f"kernels: fused {piece}"


@needs_cxx
@pytest.mark.parametrize("module, spec, wrong", [
    (layernorm, "LAYERNORM_FWD", ("* w[j] + b[j]", "* w[j] - b[j]")),
    (layernorm, "LAYERNORM_BWD", ("- mg -", "+ mg -")),
    (attention, "CAUSAL_SOFTMAX_BWD", ("(dpr[j] - dot)", "(dpr[j] + dot)")),
])
def test_a_kernel_made_to_disagree_is_replaced_by_the_generic_path(emulated, monkeypatch, module, spec, wrong):
    good = getattr(module, spec)
    assert wrong[0] in good.code
    monkeypatch.setattr(module, spec, dataclasses.replace(good, code=good.code.replace(*wrong)))
    piece = "layernorm" if module is layernorm else "causal_softmax"
    cuda.all_kernels()
    line = selfcheck.select_kernels("auto", FAKE_GPU, {piece: cuda.CHECKS[piece]})
    assert line.startswith(f"kernels: fused none; generic for {piece} (failed its self-check: max error")
    assert piece not in cuda.in_use
    if piece == "layernorm":  # and the layer now runs the generic code, which is right
        rng = np.random.default_rng(0)
        x, w, b = rng.standard_normal((5, 16)), rng.standard_normal(16), rng.standard_normal(16)
        y = LayerNorm(w, np.zeros(16), b, np.zeros(16)).forward(x)
        want, _, _ = layernorm.layernorm_forward_reference(x, w, b)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
