"""AdamW: `Ops.adamw_step` (the paper's update) and the folded form the backends run
(`minitensor.backends.tricks.adamw_update`: the whole buffer at once, a decay mask, grad_scale a 0-d
array on the device) against PyTorch's order of the step (reference.adamw) on every backend, and the
folded form against NumpyOps' chunked path bit for bit. The numba kernel is compared with the Ops
step in test_cpu_kernels.py, the CUDA kernel with the textbook step in test_kernels_fused.py;
test_model.py checks the optimizer on a model."""

import math

import numpy as np
import pytest
import reference as F

from minitensor.backends import get_ops
from minitensor.backends.numpy_ops import NumpyOps
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import adamw_update
from minitensor.device import to_numpy
from minitensor.flat import Params
from minitensor.optim import AdamW, cosine_lr

SHAPES = {"w": (30, 70), "b": (70,), "e": (9, 33)}   # decayed, not decayed, decayed


def masked_steps(xp, params, grads, lr, b1, b2, eps, wd, scales):
    """AdamW over the whole buffer in the folded form, a keep factor per element."""
    p = xp.asarray(params.data.copy())
    m, v = xp.zeros_like(p), xp.zeros_like(p)
    keep = 1.0 - lr * wd * xp.asarray(params.mask(lambda name, shape: len(shape) >= 2))
    for t, (g, scale) in enumerate(zip(grads, scales), start=1):
        c1, c2 = 1.0 - b1**t, 1.0 - b2**t
        adamw_update(xp, p, xp.asarray(g), m, v, xp.empty_like(p), b1, b2, xp.asarray(scale, dtype=p.dtype),
                     lr * math.sqrt(c2) / c1, eps * math.sqrt(c2), keep)
    return p, m, v


def draw(seed, dtype="float64"):
    rng = np.random.default_rng(seed)
    params = Params(SHAPES, dtype=dtype)
    params.data[...] = rng.standard_normal(params.size)  # the padding too: AdamW must leave it alone
    grads = []
    for _ in range(3):
        g = np.zeros(params.size, params.dtype)
        for name, shape in params.shapes.items():
            start = params.offsets[name]
            g[start:start + math.prod(shape)] = rng.standard_normal(math.prod(shape))
        grads.append(g)
    return params, grads


def ops_steps(xp, params, grads, lr, b1, b2, eps, wd, scales):
    """AdamW over the whole buffer with Ops.adamw_step, the textbook."""
    p = xp.asarray(params.data.copy())
    m, v = xp.zeros_like(p), xp.zeros_like(p)
    mask = xp.asarray(params.mask(lambda name, shape: len(shape) >= 2))
    for t, (g, scale) in enumerate(zip(grads, scales), start=1):
        Ops(xp).adamw_step(p, xp.asarray(g), m, v, mask, lr, b1, b2, eps, wd, t, xp.asarray(scale, dtype=p.dtype))
    return p, m, v


@pytest.mark.parametrize("eps", [1e-8, 0.3])  # 0.3, above sqrt(v): where eps stands in the step is seen
@pytest.mark.parametrize("steps", [masked_steps, ops_steps])
def test_masked_update_equals_the_textbook_step(xp, steps, eps):
    params, grads = draw(0)
    scales = (1.0, 0.3, 0.7)
    got = steps(xp, params, grads, 0.01, 0.9, 0.95, eps, 0.1, scales)
    p, m, v = params.data.copy(), np.zeros(params.size), np.zeros(params.size)
    mask = params.mask(lambda name, shape: len(shape) >= 2)
    for t, (g, scale) in enumerate(zip(grads, scales), start=1):
        p, m, v = F.adamw(p, g, m, v, mask, lr=0.01, beta1=0.9, beta2=0.95, eps=eps, weight_decay=0.1, t=t,
                          grad_scale=scale)
    for a, b in zip(got, (p, m, v)):
        np.testing.assert_allclose(to_numpy(a), b, rtol=1e-13, atol=1e-15)


def test_numpy_chunks_equal_the_masked_update_bit_for_bit(monkeypatch):
    monkeypatch.setattr("minitensor.backends.cpu.adamw.CHUNK", 512)   # several chunks per tensor, and a partial one
    params, grads = draw(1)
    params.ops = NumpyOps(numba=False)
    scales = (1.0, 0.3, 0.7)
    want = masked_steps(np, params, grads, 0.01, 0.9, 0.95, 1e-8, 0.1, scales)
    opt = AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g, scale in zip(grads, scales):
        params.grads[...] = g
        opt.step(grad_scale=scale)
    for a, b in zip((params.data, *opt.named_state().values()), want):
        np.testing.assert_array_equal(a, b)


def test_numpys_decay_mask_is_a_byte_per_parameter_and_the_textbooks_is_the_parameters_dtype():
    # the float32 mask was 369 MB at ANDREA-120M: the bench's peak RSS 2.40 GiB against PyTorch's 2.21
    for numba in (False, True):
        params, _ = draw(2, dtype="float32")
        params.ops = NumpyOps(numba=numba)
        decayed = AdamW(params).decayed
        assert decayed.dtype == np.uint8 and decayed.nbytes == params.size
        np.testing.assert_array_equal(decayed, params.mask(lambda name, shape: len(shape) >= 2))
    params.ops = Ops(np)
    assert AdamW(params).decayed.dtype == np.float32


def test_clip_scale_brings_the_norm_to_clip(xp):
    """Ops.global_norm and Ops.clip_scale (docs/derivations.md, "AdamW with gradient clipping") on every
    backend: the scale clip / (norm + 1e-6) above clip, 1 at or below it and with clip 0, and the guard
    false for a non-finite loss or norm."""
    g = np.random.default_rng(2).standard_normal(1000)
    want = float(np.sqrt(g @ g))
    for ops in {Ops(xp), get_ops(xp)}:
        norm = ops.global_norm(xp.asarray(g))
        assert float(norm) == pytest.approx(want, rel=1e-13)
        scale, finite = ops.clip_scale(norm, 1.0, 2.5)
        assert float(scale) == pytest.approx(1.0 / (want + 1e-6), rel=1e-13) and bool(finite)
        assert float(to_numpy(scale) * want) == pytest.approx(1.0, rel=1e-6)  # the clipped norm is clip
        for clip in (want, 2 * want, 0.0):                                    # not above clip, or no clipping
            scale, finite = ops.clip_scale(norm, clip, 2.5)
            assert float(scale) == 1.0 and bool(finite)
        for loss, n in ((float("nan"), norm), (2.5, xp.asarray(float("inf")))):
            assert not bool(ops.clip_scale(n, 1.0, loss)[1])


def test_the_global_norm_adds_every_chunk_of_a_long_buffer(xp):
    """A model's gradient buffer is millions of floats, which NumpyOps sums a million (1 << 20) at a
    time: 2.5M floats (two whole chunks and a partial one) against the float64 norm, on every backend."""
    g = np.random.default_rng(4).standard_normal(5 * (1 << 19) + 17).astype(np.float32)
    want = math.sqrt(float(np.dot(g.astype(np.float64), g.astype(np.float64))))
    for ops in {Ops(xp), get_ops(xp)}:
        assert float(ops.global_norm(xp.asarray(g))) == pytest.approx(want, rel=1e-5), ops


def test_the_learning_rate_schedule_warms_up_then_follows_the_cosine():
    """cosine_lr (1.0 -> 0.1, 10 warmup steps of 100): a linear rise to the peak over the warmup,
    the peak at its end, the cosine's symmetry about its middle (lr(10 + k) + lr(100 - k) = max + min),
    the mean of max and min half way, min_lr at the end and past it."""
    lrs = [cosine_lr(s, 1.0, 0.1, 10, 100) for s in range(120)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)], rel=1e-15)
    assert lrs[10] == 1.0 and lrs[55] == pytest.approx(0.55, rel=1e-15)
    for k in range(0, 91):
        assert lrs[10 + k] + lrs[100 - k] == pytest.approx(1.1, rel=1e-14)
    assert all(a > b for a, b in zip(lrs[10:100], lrs[11:101]))
    assert lrs[100:] == [0.1] * 20
    assert cosine_lr(0, 1.0, 0.1, 0, 100) == 1.0  # no warmup: the peak at once


def test_optimizers_over_the_shards_of_a_buffer_update_it_as_one_over_the_whole(xp):
    """AdamW over a range of the flat buffer (a rank's shard, as ZeRO-1 splits it): the shards' updates,
    put together, equal one optimizer's over the whole buffer bit for bit, on every backend; each keeps
    its state over its range only, and a checkpoint's whole-buffer state loads into each shard's range."""
    params, grads = draw(3, dtype="float32")
    params.ops = get_ops(xp)
    whole, parts = Params(SHAPES, xp=xp, dtype="float32", ops=params.ops), []
    whole.data[...] = xp.asarray(params.data)
    P = whole.size
    bounds = [(0, 0), (0, 1000), (1000, 2100), (2100, P)]  # an empty shard, a cut inside a tensor
    for lo, hi in bounds:
        part = Params(SHAPES, xp=xp, dtype="float32", ops=params.ops)
        part.data[...] = xp.asarray(params.data)
        parts.append((part, AdamW(part, lr=0.01, shard=(lo, hi))))
    opt = AdamW(whole, lr=0.01)
    assert opt.shard == (0, P) and all(s.size == P for s in opt.named_state().values())
    for g, scale in zip(grads, (1.0, 0.3, 0.7)):
        for p, o in [(whole, opt), *parts]:
            p.grads[...] = xp.asarray(g)
            o.step(grad_scale=scale)
    for (lo, hi), (part, o) in zip(bounds, parts):
        np.testing.assert_array_equal(to_numpy(part.data[lo:hi]), to_numpy(whole.data[lo:hi]))
        np.testing.assert_array_equal(to_numpy(part.data[hi:]), params.data[hi:])  # outside: untouched
        for name, state in o.named_state().items():
            assert state.shape == (hi - lo,)
            np.testing.assert_array_equal(to_numpy(state), to_numpy(opt.named_state()[name][lo:hi]))
        fresh = AdamW(part, shard=(lo, hi))
        fresh.load_state_dict(opt.state_dict())
        assert fresh.t == 3 and all(np.array_equal(to_numpy(a), to_numpy(b)) for a, b in
                                    zip(fresh.named_state().values(), o.named_state().values()))


def test_optimizer_state_that_does_not_fit_is_refused_by_name():
    params, _ = draw(4)
    opt = AdamW(params)
    state = opt.state_dict()
    with pytest.raises(ValueError, match=r"optimizer state 'v' of size \(5,\) does not fit the flat buffer of"):
        opt.load_state_dict({**state, "v": np.zeros(5)})
    with pytest.raises(ValueError, match="optimizer state has no 'm'"):
        opt.load_state_dict({"v": state["v"], "t": 1})
    with pytest.raises(ValueError, match=r"AdamW shard \[10, 5\) is not a range of the flat buffer"):
        AdamW(params, shard=(10, 5))
    with pytest.raises(ValueError, match="is not a range"):
        AdamW(params, shard=(0, params.size + 1))
