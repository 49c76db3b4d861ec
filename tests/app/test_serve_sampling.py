"""The sampling a served completion and andrea.sample share, at its edges: any positive temperature
down to the smallest double draws without NaN (greedy but for exact ties); nucleus sampling's cut
when the running total meets top_p exactly and when it falls among tied ids; an over-long prompt
keeps its last context-length tokens, the ones the generation continues; and the stop-string check
(andrea.serve.engine.StopText) gives what the plain search of every prefix gave, at a cost that does
not grow with the stop strings' length.
"""

import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea import ANDREA, ModelConfig
from andrea.sample import Decoder, generate, nucleus, sample_next
from andrea.serve.engine import StopText
from minitensor.device import to_numpy

TINY = dict(vocab_size=13, context_length=8, d_model=6, n_layer=2, n_head=2)
TINIEST = [1e-30, 1e-300, 2.2250738585072014e-308, 5e-324]  # the last: the smallest positive double


@pytest.mark.parametrize("temperature", TINIEST)
def test_a_tiny_temperature_samples_greedily_without_overflow(temperature):
    logits = 30 * np.random.default_rng(0).standard_normal((6, 50))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # no overflow, no NaN on the way
        for top_k, top_p in [(None, 1.0), (5, 1.0), (None, 0.3), (3, 0.5)]:
            got = sample_next(logits, np.random.default_rng(1), temperature, top_k, top_p)
            assert list(got) == list(logits.argmax(axis=-1)), (top_k, top_p)
        # ids tied for the largest logit are drawn among, the others never
        tied = np.array([[1.0, 3.0, -2.0, 3.0, 3.0 - 1e-12]])
        drawn = {int(sample_next(tied, np.random.default_rng(s), temperature)[0]) for s in range(40)}
        assert drawn == {1, 3}


def test_a_temperature_scales_the_logits_as_the_softmax_says():
    # (logits - max) / T gives softmax(logits / T): the same draws as the textbook probabilities
    logits = 4 * np.random.default_rng(2).standard_normal((5, 30))
    for temperature in (0.05, 0.8, 2.0):
        z = logits / temperature
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        draw = np.random.default_rng(4)
        want = [draw.choice(30, p=row) for row in p]
        assert list(sample_next(logits, np.random.default_rng(4), temperature)) == want


def test_top_p_stops_at_the_id_whose_running_total_reaches_it_exactly():
    # 0.5 + 0.25 is exactly 0.75: the total is reached with the second id, so the third is not kept
    probs = np.array([[0.125, 0.5, 0.125, 0.25]])
    np.testing.assert_array_equal(nucleus(probs, 0.75), [[0, 0.5 / 0.75, 0, 0.25 / 0.75]])
    np.testing.assert_array_equal(nucleus(probs, 0.5), [[0, 1, 0, 0]])
    np.testing.assert_array_equal(nucleus(probs, 0.5 + 2 ** -40), [[0, 0.5 / 0.75, 0, 0.25 / 0.75]])


def test_top_p_among_tied_ids_keeps_the_lower_ones():
    # 1024 ids of equal probability (2^-10 each, every running total exact): top_p 0.25 keeps the
    # first 256 by id, as a stable ranking does; shuffled ties of another row keep their lowest ids
    V = 1024
    probs = np.full((2, V), 1 / V)
    order = np.random.default_rng(5).permutation(V)
    probs[1] = 0.0
    probs[1, order[:512]] = 1 / 512
    kept = nucleus(probs, 0.25) > 0
    assert np.flatnonzero(kept[0]).tolist() == list(range(256))
    assert np.flatnonzero(kept[1]).tolist() == sorted(order[:512])[:128]


@pytest.fixture(scope="module")
def model():
    return ANDREA(ModelConfig(**TINY), dtype="float64", seed=3)


def last_logits(model, ids):
    return to_numpy(model.forward_kv(np.array([ids]), model.new_kv_cache(1), 0))


def test_an_over_long_prompt_keeps_its_last_tokens(model):
    ctx = model.cfg.context_length
    ids = np.random.default_rng(6).integers(0, TINY["vocab_size"], ctx + 5).tolist()
    sequence = Decoder(model, ids)
    np.testing.assert_allclose(to_numpy(sequence.logits), last_logits(model, ids[-ctx:]), rtol=1e-12, atol=1e-12)
    assert not np.allclose(to_numpy(sequence.logits), last_logits(model, ids[:ctx]))
    assert sequence.ids == ids and sequence.pos == ctx
    # full: the next token rebuilds the cache from the last half of the context
    sequence.push(4)
    np.testing.assert_allclose(to_numpy(sequence.logits), last_logits(model, (ids + [4])[-(ctx // 2):]),
                               rtol=1e-12, atol=1e-12)
    # generation continues the prompt's end: its greedy tokens are those of the last ctx tokens alone
    assert list(generate(model, ids, 6, temperature=0)) == list(generate(model, ids[-ctx:], 6, temperature=0))


def plain_stop_text(stops, pieces):
    """StopText's answers by the search it replaced: every prefix of every stop string tested at each piece."""
    text, sent, out = "", 0, []
    for piece in pieces:
        text += piece
        found = [i for i in (text.find(s, sent) for s in stops) if i >= 0]
        if found:
            text = text[:min(found)]
            out.append((text[sent:], True))
            return out, text
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        upto = max(sent, len(text) - held)
        out.append((text[sent:upto], False))
        sent = upto
    return out, text


@settings(max_examples=400)
@given(stops=st.lists(st.text("aab", min_size=1, max_size=7), max_size=4),
       pieces=st.lists(st.text("abc", max_size=5), min_size=1, max_size=12))
def test_stop_text_answers_as_the_plain_search_does(stops, pieces):
    text, got = StopText(tuple(stops)), []
    for piece in pieces:
        got.append(text.add(piece))
        if got[-1][1]:
            break
    want, whole = plain_stop_text(stops, pieces)
    assert got == want and text.text == whole


def test_stop_strings_of_250_kb_cost_what_the_text_matches_of_them():
    # four stop strings of 250 kB, and 3,000 pieces that keep beginning each and failing: the plain
    # search took minutes a piece; here the whole completion takes well under a second
    stops = tuple("a" * 249_999 + end for end in "bcde")
    text = StopText(stops)
    start = time.perf_counter()
    for i in range(3000):
        out, stopped = text.add("a" * 7 if i % 50 else "x")
        assert not stopped
    took = time.perf_counter() - start
    assert text.sent == len(text.text) - 7 * 49  # all but the run of a's since the last x is sent
    assert took < 5, f"3,000 pieces took {took:.1f} s"
