"""The one row softmax (minitensor.backends.softmax.exp_rows) against its textbook form on every backend,
and sampling (andrea.sample.sample_next), which draws from it: the same ids as a draw from the
textbook probabilities with the same generator, top-k and nucleus (top-p) cuts included."""

import numpy as np
import pytest
import reference as F

from andrea.sample import nucleus, sample_next
from minitensor.backends.softmax import exp_rows
from minitensor.device import to_numpy


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-6), (np.float64, 1e-13)])
def test_exp_rows_is_the_softmax_before_its_division(xp, dtype, rtol):
    rng = np.random.default_rng(0)
    z = (30 * rng.standard_normal((3, 4, 17))).astype(dtype)
    z[0, 1, 5:] = -np.inf                  # masked entries: the row keeps finite ones
    z[1, 2, 3] = 1000                      # exp(1000) overflows unless the maximum comes off first
    p, lse = F.softmax(z.astype(np.float64))
    zx = xp.asarray(z)
    out = xp.empty_like(zx)
    total, got_lse = exp_rows(zx, out=out)
    np.testing.assert_array_equal(to_numpy(zx), z)                 # out given: z untouched
    assert total.shape == got_lse.shape == (3, 4, 1)
    np.testing.assert_allclose(to_numpy(out / total), p, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(to_numpy(got_lse), lse, rtol=rtol)
    np.testing.assert_allclose(to_numpy(total), to_numpy(out).sum(axis=-1, keepdims=True), rtol=rtol)
    assert np.all(to_numpy(out)[0, 1, 5:] == 0)
    # in place: the same numbers, bit for bit on a GPU too (the same kernels on the same inputs)
    again, again_lse = exp_rows(zx)
    np.testing.assert_array_equal(to_numpy(zx), to_numpy(out))
    np.testing.assert_array_equal(to_numpy(again), to_numpy(total))
    np.testing.assert_array_equal(to_numpy(again_lse), to_numpy(got_lse))


@pytest.mark.parametrize("temperature, top_k", [(0.7, 5), (1.0, None), (1.5, 40), (1.0, 1)])
def test_sampling_draws_from_the_softmax_of_the_top_k(temperature, top_k):
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((6, 40))).astype(np.float32)
    got = sample_next(logits, np.random.default_rng(9), temperature, top_k)
    z = logits.astype(np.float64) / temperature
    if top_k:                              # only the k largest logits of each row stay possible
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
        assert np.all(np.take_along_axis(z, got[:, None], axis=-1) > -np.inf)
    p, _ = F.softmax(z)
    draw = np.random.default_rng(9)
    assert list(got) == [draw.choice(p.shape[-1], p=row) for row in p]
    if top_k == 1:
        assert list(got) == list(logits.argmax(axis=-1))


def test_sampling_at_temperature_zero_is_greedy():
    logits = np.random.default_rng(2).standard_normal((5, 30))
    assert list(sample_next(logits, np.random.default_rng(0), 0.0)) == list(logits.argmax(axis=-1))


def test_nucleus_sampling_keeps_the_fewest_likeliest_ids_that_reach_top_p():
    probs = np.array([[0.05, 0.5, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]])
    # row 0: 0.5 alone falls short of 0.7, 0.5 + 0.3 reaches it; row 1: ties keep their order
    np.testing.assert_allclose(nucleus(probs, 0.7), [[0, 0.5 / 0.8, 0.3 / 0.8, 0], [1 / 3, 1 / 3, 1 / 3, 0]])
    np.testing.assert_allclose(nucleus(probs, 1e-9), [[0, 1, 0, 0], [1, 0, 0, 0]])  # never empty
    logits = np.log(probs)
    got = sample_next(logits, np.random.default_rng(3), 1.0, None, 0.7)
    draw = np.random.default_rng(3)
    assert list(got) == [draw.choice(4, p=row) for row in nucleus(probs, 0.7)]
    assert set(got[:1]) <= {1, 2}
