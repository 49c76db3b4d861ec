"""The cross-entropy's backward in bfloat16 (kernels/softmax_xent.cu softmax_xent_bwd16): a RawKernel over
T = bfloat16 stored and ACC = float32 summed, run through softmax_xent_backward_gpu on the `cupy` fixture (a
GPU where there is one, else the stand-in's launch emulation of the same code), against

- the generic Ops on the same bfloat16 probabilities (Ops.summed / Ops.stored), bit for bit: both compute
  (p - onehot) in float32, multiply by the float32 scale dloss / N and round once to nearest even, all exact
  IEEE operations in the same order;
- float64's (p - onehot) dloss / N of the same probabilities, at bfloat16's bound: one rounding of a value
  that float32 computed within two of its own roundings, so within U = 2^-8 relatively plus 2^-22.

Before this kernel a bf16 step sent the backward to Ops' code (seven launches over the (N, V) logits where
one does, 5.3 ms of an H200 step by the step model); two planted kernels that round in bfloat16 before
the scale are refused.
"""

import numpy as np
import pytest

from minitensor import precision
from minitensor.backends import cuda, cupy_ops
from minitensor.backends.kernels import softmax_xent
from minitensor.backends.ops import Ops

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (the bf16 extra)")

BF16 = np.dtype(ml_dtypes.bfloat16)
U = 2.0 ** -8
REF = Ops(np)


def probabilities(seed, *shape, pad=0):
    """Softmax rows of random logits, as bfloat16 (the bf16 forward stores them so), with `pad` columns of
    exact zeros after them (the tied head's padding); and targets among the real columns."""
    rng = np.random.default_rng(seed)
    z = 3.0 * rng.standard_normal(shape)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    p = np.concatenate([e / e.sum(axis=-1, keepdims=True), np.zeros((*shape[:-1], pad))], axis=-1)
    return p.astype(BF16), rng.integers(0, shape[-1], shape[:-1])


def exact(p, t, dloss):
    """(p - onehot(t)) dloss / N in float64, N the rows."""
    p64 = p.astype(np.float64).reshape(-1, p.shape[-1])
    p64[np.arange(p64.shape[0]), t.reshape(-1)] -= 1.0
    return (p64 * (dloss / p64.shape[0])).reshape(p.shape)


@pytest.mark.parametrize("shape, pad, dloss", [((37, 130), 0, 0.5), ((2, 9, 100), 28, 1.0), ((1, 1), 0, 3.0)])
def test_the_bf16_backward_is_the_ops_bit_for_bit(cupy, shape, pad, dloss):
    p, t = probabilities(0, *shape, pad=pad)
    want = REF.softmax_xent_backward(p.reshape(-1, p.shape[-1]).copy(), t.reshape(-1), dloss).reshape(p.shape)
    P = cupy.asarray(p)
    got = softmax_xent.softmax_xent_backward_gpu(P, cupy.asarray(t), dloss)
    assert got is P and got.dtype == BF16  # in place, as the float32 kernel
    assert np.array_equal(got.get().view(np.uint16), want.view(np.uint16))
    err = np.abs(got.get().astype(np.float64) - exact(p, t, dloss))
    assert np.all(err <= U * np.abs(exact(p, t, dloss)) + 2.0 ** -22 * dloss / t.size), err.max()
    if pad:  # the padding's probabilities are 0 and never a target: no gradient
        assert not np.any(got.get()[..., -pad:].astype(np.float32))


def planted(expression):
    """softmax_xent_bwd16 with its one line replaced by `expression`."""
    code = softmax_xent.SOFTMAX_XENT_BWD16.code
    line = "p[i] = to_stored<T>((widen(p[i]) - (col == targets[row] ? (ACC)1 : (ACC)0)) * scale);"
    assert line in code
    return cuda.RawSpec("softmax_xent_bwd16", bf16=True, inline=code.replace(line, expression))


@pytest.mark.parametrize("expression", [
    # the difference rounded to bfloat16 before the scale: two roundings
    "p[i] = to_stored<T>(widen(to_stored<T>(widen(p[i]) - (col == targets[row] ? (ACC)1 : (ACC)0))) * scale);",
    # the scale rounded to bfloat16 (1/N is not a bfloat16)
    "p[i] = to_stored<T>((widen(p[i]) - (col == targets[row] ? (ACC)1 : (ACC)0)) * widen(to_stored<T>(scale)));",
])
def test_a_backward_rounded_twice_is_refused(cupy, monkeypatch, expression):
    p, t = probabilities(1, 37, 130)
    want = REF.softmax_xent_backward(p.copy(), t, 0.5)
    monkeypatch.setattr(softmax_xent, "SOFTMAX_XENT_BWD16", planted(expression))
    got = softmax_xent.softmax_xent_backward_gpu(cupy.asarray(p), cupy.asarray(t), 0.5).get()
    assert not np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_cupy_ops_runs_the_bf16_backward_on_bfloat16_probabilities(cupy, monkeypatch):
    """The fused piece softmax_xent takes the bf16 kernel on bfloat16 probabilities (not Ops' code); float32
    keeps the ElementwiseKernel (no RawKernel launched)."""
    assert cuda.KERNELS["softmax_xent_bwd16"] is softmax_xent.SOFTMAX_XENT_BWD16  # --check compiles it
    assert precision.BF16 in softmax_xent.SOFTMAX_XENT_BWD16.dtypes
    assert softmax_xent.SOFTMAX_XENT_BWD16 in cuda.PIECES["softmax_xent"].kernels
    launched = []
    launch = cuda.launch
    monkeypatch.setattr(cuda, "launch", lambda spec, *a: (launched.append(spec.name), launch(spec, *a))[1])
    ops = cupy_ops.CupyOps(cupy, fused=("softmax_xent",))
    p, t = probabilities(2, 24, 100)
    got = ops.softmax_xent_backward(cupy.asarray(p), cupy.asarray(t), 0.25).get()
    assert launched == ["softmax_xent_bwd16"]
    assert np.array_equal(got.view(np.uint16), REF.softmax_xent_backward(p.copy(), t, 0.25).view(np.uint16))
    launched.clear()
    ops.softmax_xent_backward(cupy.asarray(p.astype(np.float32)), cupy.asarray(t), 0.25)
    assert launched == []
