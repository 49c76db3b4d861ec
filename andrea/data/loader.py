"""Batches for training and validation, drawn from a split's `TokenShards`.

`BatchLoader` draws (B, T) windows at random offsets from a seeded PCG64, splits each optimizer
step's windows across data-parallel ranks in a fixed order, and can be resumed exactly on any
number of processes; `iter_eval_batches` gives fixed windows for a comparable validation loss
(every world-th batch to each rank).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from andrea.data.manifest import TokenShards
from andrea.errors import UserError


def _check_window(n_tokens: int, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise UserError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    if n_tokens < seq_len + 1:
        raise UserError(
            f"the data holds {n_tokens} tokens, too few for the context length {seq_len} "
            f"(a window needs {seq_len + 1}): use a larger corpus or a shorter context_length"
        )


def _windows(tokens: TokenShards, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    chunk = tokens.windows(starts, seq_len + 1)  # (B, T+1)
    return np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])


class BatchLoader:
    """Random (B, T) training windows: x = tokens[o:o+T], y = tokens[o+1:o+T+1] per row.

    Offsets come from `np.random.Generator(PCG64(seed))`, so a seed fixes the whole stream.
    Data-parallel runs (`world` processes, `accum` micro-batches each) draw all B x accum x world
    windows of an optimizer step in one call, and rank r takes the r-th contiguous share, cut
    into its micro-batches in order. The windows of each step are therefore the same set for any
    world size that divides the step, and the generator's state between steps does not depend
    on it (PCG64's bounded integers come out the same whether drawn in one call or several, so
    one process draws exactly what it drew before this split existed).

    `state_dict()` / `load_state_dict()` (between optimizer steps) let a resumed run, on any
    number of processes, draw exactly the batches it would have.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 accum: int = 1, rank: int = 0, world: int = 1):
        _check_window(len(tokens), batch_size, seq_len)
        if not (accum >= 1 and world >= 1 and 0 <= rank < world):
            raise ValueError(f"bad data-parallel split: accum {accum}, rank {rank}, world {world}")
        self.tokens = TokenShards.of(tokens)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.accum, self.rank, self.world = accum, rank, world
        self.windows = 0  # drawn by all ranks together: the same count on any world size
        self._queue: list[np.ndarray] = []  # this rank's micro-batches of the current step
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Return (x, y), both int64 of shape (B, T)."""
        if not self._queue:
            self._queue = self._draw_step()
        return _windows(self.tokens, self._queue.pop(0), self.seq_len)

    def _draw_step(self) -> list[np.ndarray]:
        share = self.batch_size * self.accum
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len, size=share * self.world)
        self.windows += len(starts)
        mine = starts[self.rank * share : (self.rank + 1) * share]
        return [mine[i : i + self.batch_size] for i in range(0, share, self.batch_size)]

    def state_dict(self) -> dict:
        """JSON-safe state: PCG64's 128-bit integers are kept as decimal strings."""
        if self._queue:
            raise RuntimeError("the data-loader state is only defined between optimizer steps")
        s = self._rng.bit_generator.state
        return {
            "bit_generator": s["bit_generator"],
            "state": str(s["state"]["state"]),
            "inc": str(s["state"]["inc"]),
            "has_uint32": int(s["has_uint32"]),
            "uinteger": int(s["uinteger"]),
            "windows": self.windows,
        }

    def load_state_dict(self, d: dict) -> None:
        try:
            state = {
                "bit_generator": d["bit_generator"],
                "state": {"state": int(d["state"]), "inc": int(d["inc"])},
                "has_uint32": int(d["has_uint32"]),
                "uinteger": int(d["uinteger"]),
            }
            windows = int(d["windows"])
            self._rng.bit_generator.state = state
            self.windows, self._queue = windows, []
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"the saved data-loader state is not one this version can resume from ({e}): resume "
                            "the run with the andrea version that wrote it") from e


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int, rank: int = 0, world: int = 1
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield up to `max_batches` fixed (x, y) int64 batches of shape (B, T) for validation.

    Windows start at evenly spaced offsets from the first token to the last full window, so they
    sample the whole file and never overlap; every batch is full unless the file holds fewer than
    B windows, in which case there is one smaller batch. With `world` > 1, rank r gets batches
    r, r + world, ... of that same list.
    """
    _check_window(len(tokens), batch_size, seq_len)
    tokens = TokenShards.of(tokens)
    n_windows = min(max_batches * batch_size, (len(tokens) - 1) // seq_len)
    if n_windows >= batch_size:
        n_windows -= n_windows % batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_windows).round().astype(np.int64)
    for i in range(rank * batch_size, n_windows, world * batch_size):
        yield _windows(tokens, starts[i : i + batch_size], seq_len)
