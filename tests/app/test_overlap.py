"""The overlapped gradient reduction (andrea.run.overlap) in one process: which collectives it starts,
when, and over what; the equalities across processes are tests/e2e/test_distributed.py's."""

import numpy as np
import pytest

from andrea.config import load_config
from andrea.errors import UserError
from andrea.model.transformer import ANDREA
from andrea.run.overlap import GradientReduction
from andrea.run.reducer import Identity, Pending, Shards


class Recording(Identity):
    """The one-process reducer, recording each collective with a copy of what its range held when it
    was started, and each wait."""

    def __init__(self, grads):
        super().__init__(0, 1)
        self.grads, self.started, self.waited = grads, [], []

    def all_reduce(self, buf, wait=True):
        start = (buf.ctypes.data - self.grads.ctypes.data) // buf.itemsize  # where in the flat buffer
        return self._record("all_reduce", buf, (start, start + buf.size), wait)

    def reduce_scatter(self, buf, shards, wait=True, span=None):
        span = span or (0, buf.size)
        return self._record("reduce_scatter", buf[span[0]:span[1]], span, wait)

    def _record(self, kind, part, span, wait):
        index = len(self.started)
        self.started.append((kind, span, np.array(part), part))
        pending = Pending(lambda: self.waited.append(index), part)
        if wait:
            pending.wait()
            return None
        return pending


def model(n_layer=3, multiple=16):
    cfg = load_config("tiny", [f"model.n_layer={n_layer}"]).model
    return ANDREA(cfg, seed=0, flat_multiple=multiple)


def backward_of(m, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, m.cfg.vocab_size, (2, 2, 16))
    m.zero_grad()
    m.loss(x, y)
    return x, y


@pytest.mark.parametrize("zero", [False, True])
def test_each_bucket_starts_once_its_gradients_are_complete_top_block_first_embeddings_last(zero):
    m = model()
    shards = Shards(m.params.size, 1) if zero else None
    reducer = Recording(m.params.grads)
    reduction = GradientReduction(m, reducer, shards, overlap=True)
    backward_of(m)
    reduction.backward(0.5)
    final = m.params.grads.copy()
    spans = [span for _, span, _, _ in reducer.started]
    assert len(spans) == m.cfg.n_layer + 1
    assert spans[0][1] == m.params.size and spans[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(spans, spans[1:]))  # the whole buffer, from the top down
    top = m.params.offsets[f"transformer.h.{m.cfg.n_layer - 1}.ln_1.weight"]
    assert spans[0][0] == top and spans[-1][1] == m.params.offsets["transformer.h.0.ln_1.weight"]
    for kind, (start, stop), held, view in reducer.started:
        assert kind == ("reduce_scatter" if zero else "all_reduce")
        np.testing.assert_array_equal(held, final[start:stop])  # complete when started: nothing wrote it after
        assert held.any()  # and it held gradients then, not the zeros of before the backward
        if kind == "all_reduce":
            assert np.shares_memory(view, m.params.grads)  # in place, on the flat buffer
    assert reducer.waited == []  # started, none waited on before finish()
    reduction.finish()
    assert reducer.waited == list(range(len(spans)))  # all, in the order they started
    assert reduction.waited_s >= 0


def test_without_overlap_one_collective_runs_after_the_backward():
    for zero in (False, True):
        m = model()
        reducer = Recording(m.params.grads)
        reduction = GradientReduction(m, reducer, Shards(m.params.size, 1) if zero else None, overlap=False)
        backward_of(m)
        reduction.backward(0.5)
        assert reducer.started == []
        reduction.finish()
        assert [(kind, span) for kind, span, _, _ in reducer.started] == [
            ("reduce_scatter" if zero else "all_reduce", (0, m.params.size))]


def test_overlap_leaves_the_gradients_of_one_process_bit_identical():
    grads = []
    for overlap in (False, True):
        m = model()
        reduction = GradientReduction(m, Identity(), None, overlap=overlap)
        backward_of(m, seed=3)
        reduction.backward(1.0)
        reduction.finish()
        grads.append(m.params.grads.copy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_a_bucket_is_cut_between_the_ranks_that_own_its_parts():
    shards = Shards(100, 3)  # ranges of 48: [0, 48), [48, 96), [96, 144)
    assert shards.cut(40, 100) == [(40, 48), (48, 96), (96, 100)]
    assert shards.cut(50, 60) == [(50, 50), (50, 60), (60, 60)]  # empty where a rank owns none of it
    assert sum(b - a for a, b in shards.cut(0, shards.padded)) == shards.padded


def test_a_span_outside_the_buffer_is_refused():
    with pytest.raises(ValueError, match="span"):
        Identity(0, 1).reduce_scatter(np.zeros(32, np.float32), Shards(32, 1), span=(16, 48))


def test_train_overlap_must_be_a_boolean():
    assert load_config("tiny").train.overlap is True
    assert load_config("tiny", ["train.overlap=false"]).train.overlap is False
    with pytest.raises(UserError, match="overlap"):
        load_config("tiny", ["train.overlap=sometimes"])
