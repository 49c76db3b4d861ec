"""The collectives of a data-parallel run over flat buffers, one interface for every transport.

    reducer.all_reduce(grads)              # in place: the sum over ranks, on every rank
    reducer.reduce_scatter(grads, shards)  # rank r's range of grads holds the sum of every rank's range r
    reducer.all_gather(params, shards)     # every rank's range r is rank r's
    reducer.broadcast(params)              # rank 0's buffer on every rank
    pending = reducer.all_reduce(grads, wait=False)   # started; ... other work ...; pending.wait()
    reducer.reduce_scatter(grads, shards, wait=False, span=(a, b))   # one bucket of the buffer alone

Each collective is blocking (`wait=True`, the default) or started and waited on (`wait=False` returns
a `Pending`; `wait()` makes what comes after it see the result: on a CPU it waits, on a GPU it
orders the current stream after the collective). `Shards` cuts a buffer into one equal range per rank,
each a multiple of ALIGN elements, so the buffer is `shards.padded` long: NCCL's reduce-scatter and
all-gather take equal counts, and the padding keeps every range aligned.

The implementations: `Identity` here (one process: every collective leaves the buffer as it is),
`MPIReducer` (andrea.run.mpi: mpi4py's non-blocking collectives on host buffers) and `NcclReducer`
(andrea.run.nccl: NCCL on a stream of its own, ordered by events). Every collective goes through
`Reducer._issue`, where the collective-order check (andrea.run.ordercheck, `train.check_collectives`)
sees it before it is issued.

Every rank must issue the same collectives in the same order, or they wait for each other forever:
the training step issues them in code every rank runs alike, never under a test of the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 16  # elements: 64 bytes in float32, as minitensor.flat aligns its tensors
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Shards:
    """A flat buffer of `size` elements cut into `n` ranges of `length` (a multiple of ALIGN), the
    last ones holding the padding: range r is [r length, (r + 1) length) of a buffer `padded` long."""

    size: int
    n: int

    @property
    def length(self) -> int:
        per_rank = -(-self.size // self.n)
        return -(-per_rank // ALIGN) * ALIGN

    @property
    def padded(self) -> int:
        return self.length * self.n

    def bounds(self, rank: int) -> tuple[int, int]:
        """(start, stop) of rank's range of the padded buffer."""
        return rank * self.length, (rank + 1) * self.length

    def cut(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[(start, stop)] of each rank's range within [start, stop) of the padded buffer (empty ranges
        (a, a) where a rank's range lies outside it): how a bucket of the buffer is reduce-scattered."""
        return [(min(max(a, start), stop), max(min(b, stop), start)) for a, b in map(self.bounds, range(self.n))]

    def owned(self, rank: int) -> tuple[int, int]:
        """(start, stop) of rank's range within the `size` elements that hold data (empty past them)."""
        start, stop = self.bounds(rank)
        return min(start, self.size), min(stop, self.size)


class Pending:
    """A started collective: `wait()` once before reading or writing its buffer (a second wait is free);
    `progress()` lets the transport move it on without waiting (MPI: a Test), where it has a way to."""

    def __init__(self, finish=None, buf=None, test=None):
        self._finish, self._buf = finish, buf  # the buffer stays referenced, so alive, until the wait
        self._test = test

    def progress(self) -> None:
        if self._finish is not None and self._test is not None:
            self._test()

    def wait(self) -> None:
        if self._finish is not None:
            self._finish()
        self._finish = self._buf = self._test = None

    @property
    def done(self) -> bool:
        return self._finish is None


class Reducer:
    """The interface: the four collectives, each `wait=True` (blocking) or `wait=False` (a Pending).

    A transport implements `_all_reduce`, `_reduce_scatter`, `_all_gather` and `_broadcast`, each
    (buf, shards) -> Pending, and `_reduce_scatter_span` (buf, shards, (start, stop)) -> Pending; `check` is the collective-order check of the world, or None."""

    name = "?"

    def __init__(self, rank: int = 0, size: int = 1, check=None):
        self.rank, self.size, self.check = rank, size, check

    def all_reduce(self, buf, wait=True):
        return self._issue("all_reduce", buf, None, wait)

    def reduce_scatter(self, buf, shards, wait=True, span=None):
        """span=(start, stop): only that range of buf (a bucket), each rank getting the sum of its part of
        it (Shards.cut); the rest of buf untouched."""
        return self._issue("reduce_scatter", buf, shards, wait, span)

    def all_gather(self, buf, shards, wait=True):
        return self._issue("all_gather", buf, shards, wait)

    def broadcast(self, buf, wait=True):
        return self._issue("broadcast", buf, None, wait)

    def _issue(self, kind, buf, shards, wait, span=None):
        if shards is not None and (buf.size != shards.padded or shards.n != self.size):
            raise ValueError(f"{self.name} {kind}: a buffer of {buf.size} in {self.size} ranges needs Shards of "
                             f"{self.size} ranges over a buffer of padded size, got {shards}")
        if not buf.flags.c_contiguous:
            raise ValueError(f"{self.name} {kind} needs a contiguous buffer")
        if span is not None and not 0 <= span[0] <= span[1] <= buf.size:
            raise ValueError(f"{self.name} {kind}: span {span} is not a range of a buffer of {buf.size}")
        if self.check is not None:
            self.check.before(kind, buf.size if span is None else span[1] - span[0], buf.dtype)
        if span is not None and tuple(span) != (0, buf.size):
            pending = self._reduce_scatter_span(buf, shards, tuple(span))
        else:
            pending = getattr(self, "_" + kind)(buf, shards)
        if not wait:
            return pending
        pending.wait()
        return None


class Identity(Reducer):
    """One process: every collective is the identity (the sum of one rank is its own buffer)."""

    name = "single process"

    def _all_reduce(self, buf, shards):
        return Pending()

    _reduce_scatter = _all_gather = _broadcast = _all_reduce

    def _reduce_scatter_span(self, buf, shards, span):
        return Pending()
