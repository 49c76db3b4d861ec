"""A bias gradient's last reduction left to the LayerNorm backward after it (ops.deferred_bias_sums): the flash
backward's and the bf16 GELU backward's partial column sums (c_attn's and c_fc's bias gradients) added up by
the second launch of the norm's backward (layernorm_bwd_params' extra blocks) instead of a column_sums_add
launch each, within a pre-norm block's backward. On the CuPy stand-in: the same bits as the launch it saves,
what no pass took added at the scope's end, a planted drop refused."""

import dataclasses

import numpy as np
import pytest

from andrea import ANDREA, ModelConfig
from minitensor import precision
from minitensor.backends import cuda
from minitensor.backends.cupy_ops import CupyOps
from minitensor.backends.kernels import gelu, layernorm
from minitensor.backends.ops import Ops
from minitensor.checks.gradcheck import check_gradients
from minitensor.device import to_numpy

BF16 = precision.bfloat16()


@pytest.fixture
def launches(monkeypatch):
    """The names of the RawKernels launched, in order."""
    names = []
    launch = cuda.launch
    monkeypatch.setattr(cuda, "launch", lambda spec, *a: (names.append(spec.name), launch(spec, *a))[1])
    return names


@pytest.mark.parametrize("name", ["float32", "bf16"])
def test_a_blocks_bias_sums_are_added_up_by_its_norms_backward(cupy, monkeypatch, launches, name):
    """ANDREA (2 blocks, every fused piece) forward and backward, as is and with the sums added at once (Ops'
    deferred_bias_sums, which leaves nothing): every gradient the same bits, and no column_sums_add launched
    where each block's sums were left to its norms (bf16: c_attn's and c_fc's, two a block; float32: c_attn's,
    whose GELU bias gradient is cuBLAS's GEMV)."""
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, n_layer=2, n_head=2)
    x = np.random.default_rng(2).integers(0, 50, (2, 17))
    grads, counted = [], []
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(CupyOps, "deferred_bias_sums", Ops.deferred_bias_sums)
        m = ANDREA(cfg, device="gpu", kernels="fused", precision=name, seed=0)
        m.zero_grad()
        launches.clear()
        m.loss(x[:, :-1], x[:, 1:])
        m.backward()
        grads.append(to_numpy(m.params.grads).copy())
        counted.append(launches.count("column_sums_add"))
    assert counted == [0, cfg.n_layer * (2 if name == "bf16" else 1)]
    assert np.array_equal(grads[0].view(np.uint32), grads[1].view(np.uint32))



def test_the_gradients_through_the_flash_bias_sums_match_finite_differences(cupy, launches):
    """float64 ANDREA (heads of 16, which the flash kernels take; 5 positions: a partial tile) on every fused
    piece: c_attn's bias gradient from the flash backward's column sums, added up by ln_1's backward, and
    every other gradient, against central differences along 6 random directions, within 1e-6."""
    cfg = ModelConfig(vocab_size=13, context_length=8, d_model=32, n_layer=1, n_head=2)
    m = ANDREA(cfg, device="gpu", kernels="fused", dtype="float64", seed=1)
    rng = np.random.default_rng(1)
    for _, view in m.named_parameters():  # off the symmetric init, so that every path matters
        view += cupy.asarray(rng.normal(0, 0.3, view.shape))
    idx, targets = rng.integers(0, 13, (2, 5)), rng.integers(0, 13, (2, 5))
    pairs = {n: (m.params[n], m.params.grad(n)) for n in m.params.names()}

    def backward(dloss):
        m.backward(dloss)
        return {}

    m.loss(idx, targets)
    launches.clear()
    report = check_gradients(lambda: m.loss(idx, targets), backward, {}, pairs, 1.0, directions=6)
    assert {"flash_attention_bwd_dkv", "layernorm_bwd_params"} <= set(launches) and "column_sums_add" not in launches
    assert report.max_rel_error <= 1e-6, report
    assert len(report.checked) == len(m.params.names())

def test_the_scope_adds_what_no_pass_took_and_outside_it_nothing_waits(cupy):
    ops = CupyOps(cupy)
    part = cupy.asarray(np.random.default_rng(0).standard_normal((11, 70)).astype(np.float32))
    want = 1.0 + to_numpy(part).astype(np.float64).sum(axis=0)
    size = 1.0 + np.abs(to_numpy(part)).astype(np.float64).sum(axis=0)
    now = cupy.ones(70, np.float32)
    ops.add_partial_sums(part, now, np.float32)  # outside a scope: added at once
    assert np.all(np.abs(to_numpy(now) - want) <= 16 * 2.0 ** -24 * size)
    later, bf16_kept = cupy.ones(70, np.float32), cupy.ones(70, np.float32)
    with ops.deferred_bias_sums():
        with ops.deferred_bias_sums():  # nested: the outer scope's
            ops.add_partial_sums(part, later, np.float32)
            ops.add_partial_sums(part, bf16_kept, BF16)
        assert np.all(to_numpy(later) == 1.0)  # left for a later pass
        taken = ops.take_partial_sums(np.float32)  # the first of the summed type float32 (bf16's is too)
        assert taken[1] is later and ops.take_partial_sums(np.float64) is None
        gelu.add_column_sums(*taken, np.float32)  # the pass that took it adds it
    assert np.array_equal(to_numpy(later), to_numpy(now)) and np.array_equal(to_numpy(bf16_kept), to_numpy(now))
    assert ops.take_partial_sums(np.float32) is None  # nothing waits outside a scope


def ln_inputs(cupy, N, C, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, dy = (cupy.asarray(rng.standard_normal((N, C)).astype(dtype)) for _ in range(2))
    w = cupy.asarray((1 + 0.1 * rng.standard_normal(C)).astype(dtype))
    y, mean, rstd = layernorm.layernorm_forward_gpu(x, w, cupy.zeros(C, dtype))
    return dy, x, w, mean, rstd


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_layernorm_backward_adds_up_another_set_in_its_second_launch(cupy, launches, dtype):
    """layernorm_backward_gpu(more=(part, out)): dx, dw, db the same bits as without; out += part's column
    sums the same bits as column_sums_add's (the same adds in the same order), for 70 columns (not a
    multiple of the 32 a block takes) over 13 chunks (more than the 8 adders); two launches, and with no
    rows column_sums_add alone."""
    acc = precision.accumulate_of(np.dtype(dtype))
    args = ln_inputs(cupy, 40, 100, dtype)
    part = cupy.asarray(np.random.default_rng(1).standard_normal((13, 70)).astype(acc))
    outs = []
    for more in (False, True):
        dw, db, out = cupy.zeros(100, acc), cupy.zeros(100, acc), cupy.full(70, 0.5, acc)
        launches.clear()
        dx = layernorm.layernorm_backward_gpu(*args, dw, db, more=(part, out) if more else None)
        outs.append([to_numpy(a) for a in (dx, dw, db, out)])
        assert launches == ["layernorm_bwd", "layernorm_bwd_params"]
    want = cupy.full(70, 0.5, acc)
    gelu.add_column_sums(part, want, dtype)
    for a, b in zip(outs[0][:3], outs[1][:3]):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert np.array_equal(outs[1][3], to_numpy(want)) and not np.array_equal(outs[0][3], outs[1][3])
    empty, out = ln_inputs(cupy, 0, 100, dtype), cupy.full(70, 0.5, acc)
    launches.clear()
    layernorm.layernorm_backward_gpu(*empty, cupy.zeros(100, acc), cupy.zeros(100, acc), more=(part, out))
    assert launches == ["column_sums_add"] and np.array_equal(to_numpy(out), to_numpy(want))
    with pytest.raises(ValueError, match="more's partial sums must be a contiguous float32 array"):
        layernorm.layernorm_backward_gpu(*args, cupy.zeros(100, acc), cupy.zeros(100, acc),
                                         more=(part.astype(np.float64), cupy.zeros(70, np.float64)))


def test_a_params_launch_that_drops_the_other_set_is_refused(cupy, monkeypatch):
    """Planted: layernorm_bwd_params' extra blocks return without adding (the grid still holds them)."""
    spec = layernorm.LAYERNORM_BWD_PARAMS
    old = "    add_column_partials(more, more_out, more_chunks, more_C, acc_w, blockIdx.x - blocks);\n"
    assert old in spec.code
    monkeypatch.setattr(layernorm, "LAYERNORM_BWD_PARAMS", dataclasses.replace(spec, inline=spec.code.replace(old, "")))
    args = ln_inputs(cupy, 40, 100, np.float32)
    part, out = cupy.ones((13, 70), np.float32), cupy.zeros(70, np.float32)
    layernorm.layernorm_backward_gpu(*args, cupy.zeros(100, np.float32), cupy.zeros(100, np.float32),
                                     more=(part, out))
    assert not np.all(to_numpy(out) == 13.0)
