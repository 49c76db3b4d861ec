"""The reducer (andrea.run.reducer): its collectives on 2 and 3 MPI processes against their
definitions, the one-process identity, NCCL's in-place calls on threads with a fake NCCL, and the
collective-order check naming a planted mismatch, in a bare driver and in training."""

import ctypes
import json
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from optional import require
from procs import run_in_own_session
from reducer_driver import SIZE, filled, span

from andrea.run import distributed as dist
from andrea.run import nccl as nccl_transport
from andrea.run.ordercheck import CollectiveOrderError, OrderCheck
from andrea.run.reducer import ALIGN, Identity, Shards

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
DRIVER = ROOT / "tests" / "support" / "reducer_driver.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")


def expected(kind, rank, n, dtype):
    """What rank's buffer holds after `kind` over n ranks (filled: rank r holds r + 1 + i / 8)."""
    shards = Shards(SIZE, n)
    bufs = [filled(r, shards.padded, dtype) for r in range(n)]
    mine = bufs[rank].copy()
    if kind == "all_reduce":
        return sum(bufs)
    if kind == "broadcast":
        return bufs[0]
    if kind == "reduce_scatter_span":  # the rank's part of the span summed; outside the span untouched
        a, b = span(shards)
        lo, hi = shards.cut(a, b)[rank]
        return np.concatenate([mine[:a], mine[b:]]), sum(bufs)[lo:hi], (a, b, lo, hi)
    start, stop = shards.bounds(rank)
    if kind == "reduce_scatter":
        return sum(bufs)[start:stop], (start, stop)  # the rest of the buffer is left undefined
    for r in range(n):
        a, b = shards.bounds(r)
        mine[a:b] = bufs[r][a:b]
    return mine


@pytest.mark.parametrize("n", [2, 3])
def test_each_collective_on_mpi_processes_blocking_and_started(tmp_path, n):
    require("mpi4py")
    r = run_in_own_session([str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py", str(DRIVER), str(tmp_path)],
                           ENV, ROOT, 120)
    assert r.returncode == 0, r.stderr
    shards = Shards(SIZE, n)
    assert shards.length % ALIGN == 0 and shards.owned(n - 1)[1] - shards.owned(n - 1)[0] < shards.length
    for rank in range(n):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got) == 20
        for key, values in got.items():
            kind, dtype, _ = key.split()
            values, want = np.array(values), expected(kind, rank, n, dtype)
            if kind == "reduce_scatter":
                (want, (start, stop)) = want
                values = values[start:stop]
            if kind == "reduce_scatter_span":
                outside, want, (a, b, lo, hi) = want
                np.testing.assert_array_equal(np.concatenate([values[:a], values[b:]]), outside)
                values = values[lo:hi]
            np.testing.assert_array_equal(values, want, err_msg=f"rank {rank}: {key}")


def test_a_planted_mismatch_is_named_by_the_order_check(tmp_path):
    require("mpi4py")
    r = run_in_own_session([str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(DRIVER), str(tmp_path),
                            "--plant"], ENV, ROOT, 60)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: collective 3 differs across ranks: rank 0 all_reduce of 64 float32, rank 1 broadcast "
                      "of 48 float32; every rank must issue the same collectives in the same order (a collective "
                      "under a test of the rank hangs)"], r.stderr
    assert "not reached" not in r.stdout


def _on_two_threads(calls):
    """Each of two ranks (threads) runs OrderCheck.before over its calls, sharing records through an
    all-gather on a barrier; returns what each raised (None where all its calls passed)."""
    slots, barrier, raised = [None, None], threading.Barrier(2), [None, None]

    def exchange_as(rank):
        def exchange(record):
            slots[rank] = record
            barrier.wait()
            every = np.stack(slots)
            barrier.wait()
            return every
        return exchange

    def rank_main(rank):
        check = OrderCheck(rank, 2, exchange_as(rank))
        try:
            for call in calls[rank]:
                check.before(*call)
        except BaseException as e:  # noqa: BLE001 (compared by the test)
            raised[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return raised


def test_the_order_check_names_the_first_call_that_differs_and_stops_every_rank():
    same = [("sum_scalars", 3, np.float64), ("all_reduce", 10, np.float32)]
    assert _on_two_threads([same, same]) == [None, None]
    raised = _on_two_threads([[*same, ("all_reduce", 10, np.float32)], [*same, ("all_gather", 12, np.float64)]])
    assert isinstance(raised[0], CollectiveOrderError) and isinstance(raised[1], SystemExit)
    assert str(raised[0]).startswith("collective 3 differs across ranks: rank 0 all_reduce of 10 float32, rank 1 "
                                     "all_gather of 12 float64;")


def test_the_running_hash_tells_the_same_call_after_another_history():
    """A rank whose check was turned on at another point (its calls before differ) is told apart from a
    mismatched call: the hash of every call so far is in the record."""
    first = []
    OrderCheck(0, 2, lambda record: first.append(record) or np.stack([record, record])).before("barrier", 0, None)
    other = first[0].copy()
    other[4] ^= 1  # rank 1's record of the same call, after another history
    check = OrderCheck(0, 2, lambda record: np.stack([record, other]))
    with pytest.raises(CollectiveOrderError, match=r"^collective 1 differs across ranks: the same barrier of 0 none "
                                                   r"on every rank, after other collectives before it \(the running "
                                                   r"hashes differ\);"):
        check.before("barrier", 0, None)


def test_one_process_reducer_is_the_identity_and_checks_its_arguments():
    reducer, shards = Identity(), Shards(50, 1)
    assert (shards.length, shards.padded, shards.bounds(0), shards.owned(0)) == (64, 64, (0, 64), (0, 50))
    buf = np.arange(64, dtype=np.float32)
    for call in (lambda w: reducer.all_reduce(buf, wait=w), lambda w: reducer.broadcast(buf, wait=w),
                 lambda w: reducer.reduce_scatter(buf, shards, wait=w), lambda w: reducer.all_gather(buf, shards, w)):
        assert call(True) is None
        pending = call(False)
        pending.wait()
        assert pending.done
    np.testing.assert_array_equal(buf, np.arange(64))
    with pytest.raises(ValueError, match=r"needs Shards of 1 ranges over a buffer of padded size"):
        reducer.reduce_scatter(buf[:50], shards)
    with pytest.raises(ValueError, match="needs a contiguous buffer"):
        reducer.all_reduce(buf[::2])
    assert Shards(100, 3).owned(2) == (96, 100) and Shards(10, 3).owned(2) == (10, 10)  # unequal, and empty


# ----------------------------------------------------------------------------- NCCL, faked on threads


class _ThreadWorld:
    """Rank `rank` of `size` threads: broadcast_json through a shared slot, as MPI would."""

    check = None

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared = rank, size, shared
        self.is_main = rank == 0

    def broadcast_json(self, obj):
        if self.is_main:
            self.shared["bcast"] = json.dumps(obj)
        self.shared["barrier"].wait()
        value = json.loads(self.shared["bcast"])
        self.shared["barrier"].wait()
        return value


class _DeviceArray:
    """A NumPy array dressed as a CuPy one: .data.ptr, .size, .itemsize, .dtype, .flags."""

    def __init__(self, a):
        self.a = a
        self.data = SimpleNamespace(ptr=a.ctypes.data)
        self.size, self.itemsize, self.dtype, self.flags = a.size, a.itemsize, a.dtype, a.flags


class _Events:
    """CuPy's streams and events as the reducer uses them, recording the order of what happens."""

    def __init__(self):
        self.log = []
        events = self

        class Event:
            def __init__(self, disable_timing=False):
                self.recorded = None

            def record(self, stream):
                self.recorded = stream.ptr
                events.log.append(("record", stream.ptr))

        class Stream:
            def __init__(self, non_blocking=False, ptr=None):
                self.ptr = ptr if ptr is not None else 7

            def wait_event(self, event):
                assert event.recorded is not None, "waits on an event never recorded"
                events.log.append(("wait", self.ptr, event.recorded))

        current = Stream(ptr=0)
        self.cupy = SimpleNamespace(cuda=SimpleNamespace(Stream=Stream, Event=Event,
                                                         get_current_stream=lambda: current))


class _FakeNccl:
    """NCCL's calls as CuPy exposes them, over host memory behind the pointers, across threads."""

    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM = 7, 8, 0

    def __init__(self, size):
        self.ids, self.calls = [], []
        self.barrier = threading.Barrier(size)
        self.views = {}
        fake = self

        def view(ptr, count):
            return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (count,))

        def together(rank, mine, combine):
            """Every rank's array in, combine(list) -> this rank's result out, in step."""
            fake.views[rank] = mine.copy()
            fake.barrier.wait()
            out = combine([fake.views[r] for r in sorted(fake.views)])
            fake.barrier.wait()
            return out

        class NcclCommunicator:
            def __init__(self, n, uid, rank):
                fake.ids.append((rank, uid))
                self.n, self.rank = n, rank

            def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802 (CuPy's name)
                assert send == recv and op == fake.NCCL_SUM and dtype == fake.NCCL_FLOAT32 and stream == 7
                fake.calls.append((self.rank, "allReduce", count))
                view(recv, count)[:] = together(self.rank, view(send, count), sum)

            def reduceScatter(self, send, recv, count, dtype, op, stream):  # noqa: N802
                assert recv == send + self.rank * count * 4 and stream == 7  # NCCL's in-place form
                fake.calls.append((self.rank, "reduceScatter", count))
                total = together(self.rank, view(send, count * self.n), sum)
                view(recv, count)[:] = total[self.rank * count:(self.rank + 1) * count]

            def allGather(self, send, recv, count, dtype, stream):  # noqa: N802
                assert send == recv + self.rank * count * 4 and stream == 7
                fake.calls.append((self.rank, "allGather", count))
                view(recv, count * self.n)[:] = np.concatenate(together(self.rank, view(send, count),
                                                                        lambda parts: parts))

            def reduce(self, send, recv, count, dtype, op, root, stream):
                assert send == recv and op == fake.NCCL_SUM and stream == 7 and fake.grouped[self.rank]
                fake.calls.append((self.rank, "reduce", count, root))
                total = together(self.rank, view(send, count), sum)
                if self.rank == root:  # NCCL writes the root's buffer alone
                    view(recv, count)[:] = total

            def bcast(self, buf, count, dtype, root, stream):
                assert root == 0 and stream == 7
                fake.calls.append((self.rank, "bcast", count))
                view(buf, count)[:] = together(self.rank, view(buf, count), lambda parts: parts[0])

        self.NcclCommunicator = NcclCommunicator
        self.grouped = {}  # rank -> inside ncclGroupStart / End (a thread is a rank)

    def groupStart(self):  # noqa: N802 (CuPy's name)
        self.grouped[self._rank()] = True

    def groupEnd(self):  # noqa: N802
        self.grouped[self._rank()] = False

    @staticmethod
    def _rank():
        return int(threading.current_thread().name.rsplit("-", 1)[-1])

    def get_unique_id(self):
        return bytes(np.random.default_rng(1).integers(0, 256, 128, dtype=np.uint8))


def test_nccl_reducer_runs_each_collective_in_place_on_its_stream_after_the_current_one():
    size, nccl = 2, _FakeNccl(2)
    shared = {"barrier": threading.Barrier(size)}
    shards = Shards(20, size)  # 2 ranges of 16: the second holds 4 elements of data and the padding
    results, errors, logs = {}, [], {}

    def rank_main(rank):
        try:
            events = _Events()
            reducer = nccl_transport.NcclReducer(_ThreadWorld(rank, size, shared), nccl, events.cupy)
            for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
                buf = filled(rank, shards.padded, np.float32)
                args = (shards,) if kind in ("reduce_scatter", "all_gather") else ()
                getattr(reducer, kind)(_DeviceArray(buf), *args, wait=False).wait()
                results[rank, kind] = buf
            logs[rank] = events.log
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)
            shared["barrier"].abort()
            nccl.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert len({uid for _, uid in nccl.ids}) == 1 and sorted(r for r, _ in nccl.ids) == [0, 1]
    assert sorted(c for c in nccl.calls if c[0] == 1) == [(1, "allGather", 16), (1, "allReduce", 32),
                                                          (1, "bcast", 32), (1, "reduceScatter", 16)]
    bufs = [filled(r, shards.padded, np.float32) for r in range(size)]
    for rank in range(size):
        np.testing.assert_array_equal(results[rank, "all_reduce"], bufs[0] + bufs[1])
        np.testing.assert_array_equal(results[rank, "broadcast"], bufs[0])
        np.testing.assert_array_equal(results[rank, "all_gather"], np.concatenate([bufs[0][:16], bufs[1][16:]]))
        start, stop = shards.bounds(rank)
        np.testing.assert_array_equal(results[rank, "reduce_scatter"][start:stop], (bufs[0] + bufs[1])[start:stop])
        # per collective: recorded on the current stream (0), waited on by the NCCL stream (7), then recorded
        # there and waited on by the current stream: the order the device runs them in
        assert logs[rank] == [("record", 0), ("wait", 7, 0), ("record", 7), ("wait", 0, 7)] * 4


def test_nccl_unique_id_survives_the_trip_in_both_cupy_forms():
    raw = bytes(range(128))
    assert nccl_transport.unpack_unique_id(nccl_transport.pack_unique_id(raw)) == raw
    signed = tuple(np.arange(-64, 64, dtype=np.int8).tolist())
    assert nccl_transport.unpack_unique_id(nccl_transport.pack_unique_id(signed)) == signed


def test_the_single_world_hands_out_the_identity():
    world = dist.Single()
    world.check_collectives()
    assert isinstance(world.reducer_for(np), Identity) and world.check is None


def test_nccl_reduce_scatters_a_bucket_as_one_grouped_reduce_to_each_rank_that_owns_part_of_it():
    size, nccl = 2, _FakeNccl(2)
    shared = {"barrier": threading.Barrier(size)}
    shards = Shards(40, size)  # 2 ranges of 32
    span = (16, 48)  # the last half of rank 0's range, the first half of rank 1's
    results, errors = {}, []

    def rank_main(rank):
        try:
            events = _Events()
            reducer = nccl_transport.NcclReducer(_ThreadWorld(rank, size, shared), nccl, events.cupy)
            buf = filled(rank, shards.padded, np.float32)
            reducer.reduce_scatter(_DeviceArray(buf), shards, wait=False, span=span).wait()
            results[rank] = buf
            assert events.log == [("record", 0), ("wait", 7, 0), ("record", 7), ("wait", 0, 7)]
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)
            shared["barrier"].abort()
            nccl.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    # every rank: one reduce per owner of part of the bucket, of that part's length, in one group
    assert sorted(c for c in nccl.calls if c[0] == 1) == [(1, "reduce", 16, 0), (1, "reduce", 16, 1)]
    assert nccl.grouped == {0: False, 1: False}
    bufs = [filled(r, shards.padded, np.float32) for r in range(size)]
    for rank in range(size):
        lo, hi = shards.cut(*span)[rank]
        np.testing.assert_array_equal(results[rank][lo:hi], (bufs[0] + bufs[1])[lo:hi])
        outside = np.r_[0:span[0], span[1]:shards.padded]
        np.testing.assert_array_equal(results[rank][outside], bufs[rank][outside])
