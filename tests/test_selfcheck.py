"""The start-up self-check of the fused kernels (minitensor/selfcheck.py) and the kernels switch.

Without a GPU, the real checks of the pieces built from RawKernels only (LayerNorm, the causal
softmax of the dense attention core) run CupyOps' fused path through the host emulation of the
kernels (kernelcheck.emulate_launch, NumPy arrays standing in for CuPy ones); a kernel made to
disagree (a sign flipped in its CUDA code) is refused, reported, and the Ops code takes its
place. With the ElementwiseKernels replaced by their references (spec.reference) too, every
fused piece (all five) runs and agrees with the Ops code it replaces. The choice and the line are
also checked with stand-in checks.
"""

import dataclasses

import formulas as F
import numpy as np
import pytest
from markers import needs_cxx

from minitensor import cuda, cupy_ops, kernelcheck, selfcheck
from minitensor.cupy_ops import CupyOps
from minitensor.layernorm import LayerNorm


class NumPyStandingInForCuPy:
    """An array module that is not numpy itself (so the self-check runs) but makes NumPy arrays."""

    def __getattr__(self, name):
        return getattr(np, name)


FAKE_GPU = NumPyStandingInForCuPy()


def elementwise_on_the_host(spec):
    """A stand-in for spec's CuPy ElementwiseKernel on NumPy arrays: its reference (the NumPy code), which
    the host check compares with the kernel's own operation compiled as C++ (kernelcheck)."""
    names = [p.split()[-1] for p in spec.in_params.split(",")]

    def call(*args):
        ins, outs = args[:len(names)], args[len(names):]
        first = ins[0]
        flat = {n: (a.reshape(-1) if isinstance(a, np.ndarray) and a.size == first.size else a)
                for n, a in zip(names, ins)}
        got = spec.reference(**flat)
        got = [np.asarray(g).reshape(first.shape) for g in (got if isinstance(got, tuple) else (got,))]
        if not outs:
            return got[0] if len(got) == 1 else tuple(got)
        for o, g in zip(outs, got):
            o[...] = g
        return outs[0] if len(outs) == 1 else outs

    return call


@pytest.fixture
def emulated(monkeypatch):
    """CupyOps' fused paths on NumPy arrays (FAKE_GPU's): RawKernels are emulated."""
    monkeypatch.setattr(cuda, "launch", kernelcheck.emulate_launch)
    monkeypatch.setattr(cuda, "in_use", set())


@pytest.fixture
def host_gpu(emulated, monkeypatch):
    """Every fused piece runnable on NumPy: RawKernels emulated, ElementwiseKernels by formula."""
    monkeypatch.setattr(cuda, "on_cupy", lambda fn, x, alternative: None)
    monkeypatch.setattr(cuda.ElementwiseSpec, "kernel", lambda spec, dtype=None: elementwise_on_the_host(spec))


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
@pytest.mark.parametrize("piece, spec, wrong", [
    ("layernorm", "LAYERNORM_FWD", ("* w[j] + b[j]", "* w[j] - b[j]")),
    ("layernorm", "LAYERNORM_BWD", ("- mg -", "+ mg -")),
    ("causal_softmax", "CAUSAL_SOFTMAX_BWD", ("(dpr[j] - dot)", "(dpr[j] + dot)")),
])
def test_a_kernel_made_to_disagree_is_replaced_by_the_generic_path(emulated, monkeypatch, piece, spec, wrong):
    good = getattr(cupy_ops, spec)
    assert wrong[0] in good.code
    monkeypatch.setattr(cupy_ops, spec, dataclasses.replace(good, code=good.code.replace(*wrong)))
    cuda.all_kernels()
    line = selfcheck.select_kernels("auto", FAKE_GPU, {piece: cuda.CHECKS[piece]})
    assert line.startswith(f"kernels: fused none; generic for {piece} (failed its self-check: max error")
    assert piece not in cuda.in_use
    if piece == "layernorm":  # and the layer now runs the generic code, which is right
        rng = np.random.default_rng(0)
        x, w, b = rng.standard_normal((5, 16)), rng.standard_normal(16), rng.standard_normal(16)
        y = LayerNorm(w, np.zeros(16), b, np.zeros(16), ops=CupyOps(FAKE_GPU)).forward(x)
        want, _, _ = F.layernorm_forward(x, w, b)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


@needs_cxx
def test_every_layer_takes_its_fused_path_and_agrees_with_the_generic_one(host_gpu):
    """CupyOps' wiring of all five pieces (what it keeps, passes and returns on the fused path)."""
    checks = cuda.all_kernels() and cuda.CHECKS
    line = selfcheck.select_kernels("auto", FAKE_GPU, checks)
    assert line == f"kernels: fused {', '.join(checks)}"
    assert cuda.in_use == set(cuda.FUSED)


@needs_cxx
def test_a_whole_model_step_with_every_fused_piece_equals_the_generic_one(host_gpu, monkeypatch):
    """ANDREA (2 blocks) forward, backward and an AdamW step, with every fused piece and the dense
    attention core, against the generic code, in float64: the model's use of the fused paths."""
    from andrea import ANDREA, AdamW, ModelConfig
    from minitensor.attention import CausalSelfAttention

    monkeypatch.setattr(CausalSelfAttention, "dense", True)
    launched = []
    monkeypatch.setattr(cuda, "launch", lambda spec, *args: (launched.append(spec.name),
                                                             kernelcheck.emulate_launch(spec, *args)))
    built = []
    monkeypatch.setattr(cuda.ElementwiseSpec, "kernel",
                        lambda spec, dtype=None: (built.append(spec.name), elementwise_on_the_host(spec))[1])
    rng = np.random.default_rng(3)
    x = rng.integers(0, 13, (2, 9))
    results = []
    for names in ((), cuda.FUSED):
        m = ANDREA(ModelConfig(vocab_size=13, context_length=8, d_model=8, n_layer=2, n_head=2), dtype="float64",
                   seed=4, ops=CupyOps(FAKE_GPU))
        with cuda.using(names):
            loss = float(m.loss(x[:, :-1], x[:, 1:]))
            m.zero_grad()
            m.backward(0.5)
            grads = m.params.grads.copy()
            opt = AdamW(m, lr=1e-2)
            opt.step(grad_scale=np.asarray(0.7))
        results.append((loss, grads, m.params.data.copy()))
    (loss_g, grads_g, p_g), (loss_f, grads_f, p_f) = results
    assert set(launched) == {"layernorm_fwd", "layernorm_bwd", "layernorm_bwd_params", "causal_softmax_fwd",
                             "causal_softmax_bwd", "softmax_xent_fwd"}
    assert {"bias_gelu_fwd", "bias_gelu_bwd", "softmax_xent_bwd", "adamw_step"} <= set(built)
    assert loss_f == pytest.approx(loss_g, rel=1e-12)
    np.testing.assert_allclose(grads_f, grads_g, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(p_f, p_g, rtol=1e-12, atol=1e-14)
