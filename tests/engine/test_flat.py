"""The flat buffers: views share memory with them, zeroing is one fill, layout is aligned."""

import numpy as np
import pytest

from minitensor.flat import ALIGN, Params


def test_views_alias_the_flat_buffers(xp):
    p = Params({"a.weight": (3, 5), "a.bias": (5,), "b": (7,)}, xp=xp, dtype="float64")
    p["a.weight"][...] = 2.0
    p.grad("b")[...] = 3.0
    data, grads = np.asarray(p.data.get() if xp is not np else p.data), None
    grads = p.grads.get() if xp is not np else p.grads
    assert data[p.offsets["a.weight"]:p.offsets["a.weight"] + 15].tolist() == [2.0] * 15
    assert grads[p.offsets["b"]:p.offsets["b"] + 7].tolist() == [3.0] * 7
    assert all(off % ALIGN == 0 for off in p.offsets.values())
    assert p.num_elements() == 15 + 5 + 7
    p.zero_grad()
    assert float(abs(p.grads).max()) == 0.0


def test_mask_marks_only_selected_tensors():
    p = Params({"w": (2, 3), "b": (3,)}, dtype="float32")
    m = p.mask(lambda name, shape: len(shape) >= 2)
    assert m.sum() == 6 and m[p.offsets["b"]:].sum() == 0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dtype(dtype):
    p = Params({"w": (2,)}, dtype=dtype)
    assert p["w"].dtype == np.dtype(dtype) and p.grad("w").dtype == np.dtype(dtype)


def test_a_sharded_run_pads_the_buffers_to_a_multiple_past_the_span():
    """ZeRO-1 over N ranks asks for a size that is a multiple of 16 N: the tensors keep their offsets, the
    padding goes at the end (outside every view and mask), and `span` says where the tensors end."""
    shapes = {"w": (3, 5), "b": (5,)}  # 16 + 16 elements of span
    plain, sharded = Params(shapes), Params(shapes, multiple=3 * ALIGN)
    assert plain.size == plain.span == sharded.span == 32 and sharded.size == 48
    assert plain.offsets == sharded.offsets and sharded.data.shape == sharded.grads.shape == (48,)
    assert sharded.mask(lambda name, shape: True)[32:].sum() == 0
    with pytest.raises(ValueError, match="must round to a multiple of 16, got 24"):
        Params(shapes, multiple=24)
