"""c_attn's bias gradient summed by the flash backward's kernels as they write dq, dk, dv (attention.cu,
colsums.cuh): each block's column sums of its 64 rows as stored, one row of partial sums per sequence and
tile, then column_sums_add. Run on the CPU through the emulation (minitensor/checks/emulation.py), in
float64, float32 on TF32 and bfloat16, against the float64 column sums of the gradients the same launch
wrote; planted bugs refused.

The bound. The kernels add the very values they store, so the only error is the summation's own: at most
(the adds on a value's path) x the unit roundoff of the summed type x the sum of the absolute values, a path
of 1 + 3 (the shuffle tree over a warp's 8 row pairs) + 4 (the warps) + 8 + the chunks / 8 (column_sums_add)
adds. 64 adds x the unit roundoff is a bound above all of these at the shapes below.
"""

import dataclasses

import numpy as np
import pytest
from markers import needs_cxx

from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.kernels import attention
from minitensor.checks import emulation

BF16 = precision.bfloat16()
UNIT = {np.dtype(np.float64): 2.0 ** -53, np.dtype(np.float32): 2.0 ** -24}
SHAPES = [(1, 1, 1, 16), (2, 100, 2, 16), (1, 150, 1, 32), (2, 64, 3, 32)]  # (B, T, n_head, hs)


@pytest.fixture
def emulated(monkeypatch):
    if emulation.shutil.which("g++") is None:
        pytest.skip("no g++ for the emulation")
    monkeypatch.setattr(cuda, "launch", emulation.emulate_launch)


def attention_inputs(B, T, n_head, hs, dtype, seed=0):
    """qkv (B, T, 3, n_head, hs), b (3C,), dy (B, T, n_head, hs) of dtype, and y, lse from flash_forward."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, 3, n_head, hs)).astype(dtype)
    b = rng.standard_normal(3 * n_head * hs).astype(dtype)
    dy = rng.standard_normal((B, T, n_head, hs)).astype(dtype)
    y = np.empty((B, T, n_head, hs), dtype)
    lse = attention.flash_forward(qkv, b, hs ** -0.5, y, tf32=True)
    return qkv, b, y, dy, lse


def backward(inputs, db=None):
    qkv, b, y, dy, lse = inputs
    return attention.flash_backward(qkv, b, y, dy, lse, qkv.shape[-1] ** -0.5, tf32=True, db=db)


@needs_cxx
@pytest.mark.parametrize("dtype", [np.float64, np.float32, BF16], ids=["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_the_backward_sums_the_bias_gradient_of_the_gradients_it_writes(emulated, dtype, shape):
    """db += the column sums of dq, dk, dv as stored: T = 1, T not a multiple of the 64-row tiles (100, 150:
    the last tile partial, its rows past T adding nothing), several sequences, heads and tiles; the gradients
    the same bits as without db; the sums within the summation's bound of float64's, accumulated onto what
    db held, and the same bits on a second run (no atomics)."""
    B, T, n_head, hs = shape
    if np.dtype(dtype) == np.float64 and hs > 32:
        pytest.skip("float64 heads up to 32")
    inputs = attention_inputs(*shape, dtype, seed=T)
    plain = backward(inputs)
    acc = precision.accumulate_of(np.dtype(dtype))
    start = np.full(3 * n_head * hs, 0.5, acc)
    db = start.copy()
    dqkv = backward(inputs, db)
    assert np.array_equal(dqkv.view(np.uint8), plain.view(np.uint8))
    rows = dqkv.reshape(B * T, -1).astype(np.float64)
    want, size = 0.5 + rows.sum(axis=0), 0.5 + np.abs(rows).sum(axis=0)
    assert db.dtype == acc and np.all(np.abs(db - want) <= 64 * UNIT[acc] * size), np.max(np.abs(db - want) / size)
    again = start.copy()
    backward(inputs, again)
    assert np.array_equal(again.view(np.uint8), db.view(np.uint8))


def planted(monkeypatch, spec, old, new):
    """`spec` (a registered flash kernel) with `old` replaced by `new` in its source, put in its place."""
    name = {s.name: n for n, s in vars(attention).items() if isinstance(s, cuda.RawSpec)}[spec.name]
    assert spec.code.count(old) >= 1, old
    monkeypatch.setattr(attention, name, dataclasses.replace(spec, inline=spec.code.replace(old, new)))


PLANTS = {
    # the warps' sums added but the last one's (its 16 rows of every tile lost)
    "a warp dropped": (attention.FLASH_BWD_DQ, "for (int w = 0; w < WARPS; ++w)", "for (int w = 0; w < WARPS - 1; ++w)"),
    # dv's warp sums written over dk's: both of dkv's parts wrong
    "v over k": (attention.FLASH_BWD_DKV, "sums + (DKV_THREADS / 32 + warp) * HS, acc_v", "sums + warp * HS, acc_v"),
    # the shuffle tree one step short: the rows g = 4..7 of every pair never added
    "a short tree": (attention.FLASH16_BWD_DKV, "for (int o = 4; o < 32; o <<= 1)", "for (int o = 4; o < 16; o <<= 1)"),
    # the float32 values summed instead of the bfloat16 ones stored (the gradient c_attn's backward reads)
    "not as stored": (attention.FLASH16_BWD_DQ, "return widen(narrow_bf16(a * scale));", "return a * scale;"),
}


@needs_cxx
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_bug_in_the_bias_sums_is_refused(emulated, monkeypatch, plant):
    spec, old, new = PLANTS[plant]
    planted(monkeypatch, spec, old, new)
    dtype = BF16 if spec.bf16 else np.float32
    inputs = attention_inputs(2, 100, 2, 16, dtype, seed=1)
    acc = precision.accumulate_of(np.dtype(dtype))
    db = np.zeros(3 * 2 * 16, acc)
    rows = backward(inputs, db).reshape(200, -1).astype(np.float64)
    ratio = np.max(np.abs(db - rows.sum(axis=0)) / (64 * UNIT[acc] * np.abs(rows).sum(axis=0)))
    assert ratio > 1.0, ratio


def test_db_must_be_a_vector_of_the_summed_type():
    qkv = np.zeros((1, 8, 3, 2, 16), BF16)
    y, dy, lse = np.zeros((1, 8, 2, 16), BF16), np.zeros((1, 8, 2, 16), BF16), np.zeros((2, 8), np.float32)
    for bad in (np.zeros(96, BF16), np.zeros(32, np.float32)):
        with pytest.raises(ValueError, match=r"db must be a contiguous float32 vector of shape \(96,\)"):
            attention.flash_backward(qkv, None, y, dy, lse, 0.25, db=bad)
