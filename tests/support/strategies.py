"""Hypothesis strategies shared by the tests: small, odd-sized shapes and seeds."""

from hypothesis import strategies as st

seeds = st.integers(0, 2**31 - 1)
batch = st.integers(1, 3)
time = st.integers(1, 6)          # T = 1 included: a single position
vocab = st.integers(2, 11)
n_head = st.integers(1, 3)
head_size = st.integers(1, 5)     # odd head sizes included
width = st.integers(1, 9)


@st.composite
def attention_dims(draw):
    nh, hs = draw(n_head), draw(head_size)
    return {"B": draw(batch), "T": draw(time), "n_head": nh, "C": nh * hs}
