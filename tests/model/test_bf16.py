"""ANDREA under precision bf16 (float32 master weights, bfloat16 weights and activations for the layers,
every sum in float32) on the CuPy stand-in, through the generic Ops code (kernels "generic": the fused
bf16 kernels are checked on their own), against float32 and float64.

u = 2^-8 is bfloat16's unit roundoff (8 significant bits); the tolerances below are derived from it.
"""

import numpy as np
import pytest

from andrea import ANDREA, AdamW, ModelConfig
from andrea.errors import UserError
from minitensor import precision
from minitensor.checks.gradcheck import check_gradients
from minitensor.device import to_numpy

U = 2.0 ** -8
BF16 = precision.bfloat16()


def test_bf16_is_refused_on_the_cpu_in_one_line():
    with pytest.raises(UserError, match=r"precision bf16 needs a GPU \(CuPy\)") as e:
        ANDREA(ModelConfig(vocab_size=13, context_length=8, d_model=8, n_layer=1, n_head=2), device="cpu",
               precision="bf16")
    assert "\n" not in str(e.value)


def learnable_batches(steps, B=4, T=16, V=50, seed=0):
    """Sequences that count up by one (mod V) with 10% of the tokens random: a curve that goes down."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        x = (rng.integers(0, V, (B, 1)) + np.arange(T + 1)) % V
        noise = rng.random(x.shape) < 0.1
        x[noise] = rng.integers(0, V, int(noise.sum()))
        batches.append(x)
    return batches


def test_bf16_training_follows_the_float32_curve(cupy):
    """20 AdamW steps of the same model from the same weights on the same batches, in float32 and bf16.

    Tolerance: at every step |loss_bf16 - loss_float32| <= u loss_float32, the loss's own bf16 resolution
    (0.015 at 3.9). Both runs start from the same masters; bf16 perturbs each stored activation and
    gradient by at most u relatively, and the float32 masters keep the updates from rounding away, so
    the curves may drift apart by no more than one bfloat16 step of the loss. Measured on the stand-in
    (tiny model, lr 3e-3): at most 1.4e-3 (4.3e-4 relative), while the loss falls by 0.78; a run whose
    bfloat16 weights were not refreshed by the update stays at its first loss and fails from step 2 on."""
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layer=2, n_head=2)
    curves = {}
    for name in ("float32", "bf16"):
        m = ANDREA(cfg, device="gpu", kernels="generic", precision=name, seed=0)
        opt = AdamW(m, lr=3e-3, weight_decay=0.0)
        losses = []
        for x in learnable_batches(20):
            m.zero_grad()
            loss = m.loss(x[:, :-1], x[:, 1:])
            m.backward()
            opt.step()
            losses.append(float(loss))
        curves[name] = np.array(losses)
        if name == "bf16":  # what bf16 keeps in which dtype
            assert np.dtype(loss.dtype) == np.float32
            assert np.dtype(m.params.data.dtype) == np.float32 and np.dtype(m.params.grads.dtype) == np.float32
            assert np.dtype(m.wte.W.dtype) == BF16 and np.dtype(m.wte.forward(m._ids(x[:, :-1], "x")).dtype) == BF16
            assert all(np.dtype(s.dtype) == np.float32 for s in opt.named_state().values())
    f32, b16 = curves["float32"], curves["bf16"]
    assert f32[0] - f32[-1] > 0.5, f32                    # the curve goes somewhere
    assert np.all(np.abs(b16 - f32) <= U * f32), np.abs(b16 - f32).max()


def test_bf16_gradients_follow_float64_finite_differences(cupy):
    """The bf16 backward's gradients (float32, from bfloat16 activations) against float64 central
    differences of the same model at the weights the bf16 forward reads (its bfloat16 copy, exact in
    float64), every entry of every parameter.

    Bound: R u relative to the largest gradient, R the bfloat16 roundings on a gradient's longest path:
    forward 1 (the embeddings' sum) + 10 per block (ln_1, qkv, the core, c_proj's product and epilogue;
    ln_2, c_fc, GELU, c_proj's product and epilogue) + 3 (ln_f, the logits, the saved probabilities),
    backward 3 (dlogits, the head's dx, ln_f) + 8 per block: R = 18 L + 7 = 43 for L = 2, R u = 0.168.
    Each rounding moves what it rounds by at most u relatively, and to first order the errors add.
    Measured on the stand-in: 1.0e-2 (2.6 u), against 1e-12 for float64 itself
    (tests/model/test_model.py); a wrong backward is off by the gradient's own order."""
    cfg = ModelConfig(vocab_size=13, context_length=8, d_model=8, n_layer=2, n_head=2)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 13, (2, 8)), rng.integers(0, 13, (2, 8))
    m16 = ANDREA(cfg, device="gpu", kernels="generic", precision="bf16", seed=1)
    for _, view in m16.named_parameters():  # off the symmetric init, so every path matters
        view += cupy.asarray(rng.normal(0, 0.3, view.shape).astype(np.float32))
    m16.params.refresh_compute()
    m16.zero_grad()
    m16.loss(idx, targets)
    m16.backward()
    g16 = {n: np.asarray(to_numpy(m16.params.grad(n))) for n in m16.params.names()}
    assert all(g.dtype == np.float32 for g in g16.values())

    m64 = ANDREA(cfg, device="cpu", dtype="float64")
    m64.load_state_dict({n: np.asarray(to_numpy(m16.params.compute_view(n))).astype(np.float64)
                         for n in m16.params.names()})
    pairs = {n: (m64.params[n], m64.params.grad(n)) for n in m64.params.names()}

    def bf16_backward(dloss):  # the analytic gradients compared: the bf16 model's
        for n, (_, g) in pairs.items():
            g[...] = g16[n]
        return {}

    R = 18 * cfg.n_layer + 7
    report = check_gradients(lambda: m64.loss(idx, targets), bf16_backward, {}, pairs, 1.0, floor=1.0)
    assert len(report.checked) == len(pairs)
    assert report.max_rel_error <= R * U, report


def test_bf16_runs_with_every_fused_piece_in_use(cupy):
    """kernels "fused": a piece whose kernels are not built for bfloat16 hands bfloat16 arguments to the
    method it replaces (minitensor.backends.cupy_ops._with_piece), down to the Ops code; the padded
    head's logits go to Ops' cross-entropy, which masks the padding. AdamW's piece writes the bfloat16
    copy of the weights itself (adamw_step_copy): its bfloat16 argument must not send the whole update to
    the generic code, as it did (five passes over the buffers where one does). Three steps within u of
    the generic run's losses (the same code where no piece takes bfloat16; bfloat16 kernels round like it)."""
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layer=1, n_head=2)
    curves = {}
    for kernels in ("generic", "fused"):
        cupy.standin.reset()
        m = ANDREA(cfg, device="gpu", kernels=kernels, precision="bf16", seed=0)
        opt = AdamW(m, lr=3e-3)
        curves[kernels] = []
        for x in learnable_batches(3, B=2):
            m.zero_grad()
            curves[kernels].append(float(m.loss(x[:, :-1], x[:, 1:])))
            m.backward()
            opt.step()
        launched = {name for _, name, _ in cupy.standin.kernels}
        assert ("adamw_step_copy" in launched) == (kernels == "fused"), (kernels, sorted(launched))
    generic = np.array(curves["generic"])
    assert np.all(np.abs(np.array(curves["fused"]) - generic) <= U * generic), curves
