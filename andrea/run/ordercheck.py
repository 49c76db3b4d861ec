"""The collective-order check (`--set train.check_collectives=true`): every rank must issue the same
collectives in the same order, and this names the first one that differs instead of hanging.

Each rank keeps a running hash (sha256) of every collective it issues: its kind, its element count
and its dtype, the world's own (sum_scalars, broadcast_json, barrier) and the reducer's
(all_reduce, reduce_scatter, all_gather, broadcast) alike. Before a collective is issued, every rank
shares a record of it (the call's number, kind, count, dtype and the hash so far) with all others
through an MPI all-gather of a few integers, a collective of the same kind and size on every rank,
so it cannot itself mismatch. Where any rank's record differs, every rank stops there, before the
collective that would have hung or mixed unrelated buffers, and rank 0 says:

    collective 17 differs across ranks: rank 0 all_reduce of 1,312 float32, rank 1 broadcast of 48 float32

The cost is one small all-gather per collective: a debugging setting, off by default.
"""

from __future__ import annotations

import hashlib

import numpy as np

from andrea.errors import UserError

KINDS = ("sum_scalars", "broadcast_json", "barrier", "all_reduce", "reduce_scatter", "all_gather", "broadcast")
DTYPES = ("float32", "float64", "uint8", "int64", "none")
FIELDS = 5  # call number, kind, count, dtype, the first 7 bytes of the hash so far


class CollectiveOrderError(UserError):
    """Ranks issued different collectives: raised on rank 0, which every rank agreed to stop with (the
    others exit quietly, as after `together`; andrea.run.distributed.guard lets it through)."""


class OrderCheck:
    """The check of one rank. exchange(record) -> every rank's record, (size, FIELDS) int64: an all-gather."""

    def __init__(self, rank: int, size: int, exchange):
        self.rank, self.size, self.exchange = rank, size, exchange
        self.calls = 0
        self.digest = hashlib.sha256()

    def before(self, kind: str, count: int, dtype) -> None:
        """Compares this collective with every rank's, before it is issued; raises where any differs."""
        dtype = np.dtype(dtype).name if dtype is not None else "none"
        self.calls += 1
        self.digest.update(f"{kind} {count} {dtype};".encode())
        mine = np.array([self.calls, KINDS.index(kind), count, DTYPES.index(dtype),
                         int.from_bytes(self.digest.digest()[:7], "little")], dtype=np.int64)
        every = np.asarray(self.exchange(mine)).reshape(self.size, FIELDS)
        if (every == mine).all():
            return
        if self.rank != 0:
            raise SystemExit(2)
        if (every[:, :4] == mine[:4]).all():  # this call agrees: what came before it did not
            calls = (f"the same {describe(mine)} on every rank, after other collectives before it (the running "
                     "hashes differ)")
        else:
            calls = ", ".join(f"rank {r} {describe(row)}" for r, row in enumerate(every))
        raise CollectiveOrderError(f"collective {self.calls} differs across ranks: {calls}; every rank must issue "
                                   "the same collectives in the same order (a collective under a test of the rank "
                                   "hangs)")


def describe(row) -> str:
    """'all_reduce of 1,312 float32' from a record."""
    _, kind, count, dtype, _ = (int(v) for v in row)
    return f"{KINDS[kind]} of {count:,} {DTYPES[dtype]}"
