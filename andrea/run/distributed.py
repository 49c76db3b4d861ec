"""The world of a data-parallel run: MPI start-up, scalars, agreement, CPU gradients; GPU gradients through NCCL.

    mpiexec -n 2 python -m mpi4py -m andrea.train --config tiny --out runs/dp2

`init()` picks the world once, at start-up: `Single` (rank 0 of 1, no mpi4py import) unless the
environment shows an MPI launcher (PMI_RANK / PMI_SIZE from MPICH's Hydra, OMPI_COMM_WORLD_SIZE
from Open MPI, PMIX_RANK from PMIx launchers such as srun), else `MPIWorld` over COMM_WORLD.

A world gives rank / size / local_rank / is_main, and every collective training needs, issued by
all ranks in the same order:
- `sum_scalars(values)`: float64 all-reduce of a few numbers (loss, validation sums, stop flag);
- `broadcast_json(obj)`: rank 0's JSON-safe value on every rank (checkpoint metadata, no pickle),
  and on it `require_same(world, values, ...)`: one error for all when a rank's values (its
  arguments, the fingerprints of its tokenizer and data) differ from rank 0's, and `agree(world,
  decide)`: rank 0's decision on every rank (the fused GPU kernels, andrea.run.kernels.agreed_kernels);
- `barrier()`; `together()`: a block every rank runs, which, if it fails on any rank, ends all
  ranks there with the lowest failing rank's message;
- `reducer_for(xp)`: the reducer of the model's flat buffers (andrea.run.reducer: all-reduce,
  reduce-scatter, all-gather, broadcast, each blocking or started and waited on): `Identity` for one
  process, `MPIReducer` for NumPy (andrea.run.mpi), `NcclReducer` for CuPy (andrea.run.nccl);
- `check_collectives()`: from then on, every collective of the world and of its reducers is
  compared across ranks before it is issued (andrea.run.ordercheck, `train.check_collectives`).

The trainer all-reduces the gradient once per step and scales each rank's backward by
1 / (accumulation x N), so the sum is the mean gradient; with two ranks the sum a + b is exactly the
float32 sum one process accumulates over the same two micro-batches.

`guard(world)` around a whole run ends every rank when one fails. The NCCL check and the
all-reduce timing are commands of their own (`python -m andrea.run.allreduce`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

import numpy as np

from andrea.errors import UserError
from andrea.run.mpi import MPIReducer
from andrea.run.nccl import NcclReducer
from andrea.run.ordercheck import FIELDS, CollectiveOrderError, OrderCheck
from andrea.run.reducer import Identity

LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
MPI_HINT = "install the mpi extra: pip install -e '.[mpi]' (mpi4py and an MPICH)"


def launched_by_mpi(environ=None) -> bool:
    """True when an MPI launcher started this process (checked before importing mpi4py)."""
    environ = os.environ if environ is None else environ
    return any(k in environ for k in LAUNCHER_VARIABLES)


def accumulation(tokens_per_step: int, batch_size: int, seq_len: int, world: int) -> int:
    """Micro-batches per rank per optimizer step: tokens_per_step / (B x T x N); 0 means one."""
    micro = batch_size * seq_len * world
    if tokens_per_step == 0:
        return 1
    if tokens_per_step % micro:
        raise UserError(f"train.tokens_per_step ({tokens_per_step}) must be a multiple of batch_size x seq_len x "
                        f"processes ({batch_size} x {seq_len} x {world} = {micro}): change the batch or -n")
    return tokens_per_step // micro


class AgreedError(UserError):
    """A UserError that every rank has agreed to stop on (see `together`)."""


class _World:
    """What `Single` and `MPIWorld` share: the agreement protocol built on `sum_scalars`."""

    rank, size, local_rank = 0, 1, 0
    check = None  # the collective-order check, once check_collectives() turned it on

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """A line of the run's output: rank 0 prints it, the other ranks say nothing."""
        if self.is_main:
            print(msg, flush=True)

    def note(self, msg: str) -> None:
        """A note or warning on stderr, from rank 0 alone."""
        if self.is_main:
            print(msg, file=sys.stderr, flush=True)

    def max_int(self, value: int) -> int:
        """The largest of one non-negative int per rank (a signal number, say), on every rank."""
        flags = np.zeros(64)
        if value:
            flags[min(int(value), 63)] = 1.0
        hit = np.nonzero(self.sum_scalars(flags))[0]
        return int(hit[-1]) if len(hit) else 0

    @contextlib.contextmanager
    def together(self):
        """Run a block on every rank; if it raises on any rank, all ranks stop here.

        The block itself must issue no collective: a rank that failed before it would wait in
        this agreement while the others wait in the block's collective.

        The lowest failing rank re-raises its error (a UserError becomes an AgreedError, naming the
        rank unless all failed); the others exit with code 2 without a message, so a
        mistake every rank makes prints once.
        """
        error = None
        try:
            yield
        except CollectiveOrderError:
            raise  # already agreed, by every rank (and the others have left: no agreement to wait in)
        except Exception as e:  # noqa: BLE001 (re-raised below, on the rank that reports)
            error = e
        if self.size == 1:
            if error is not None:
                raise error
            return
        flags = np.zeros(self.size)
        flags[self.rank] = 1.0 if error is not None else 0.0
        failed = np.nonzero(self.sum_scalars(flags))[0]
        if len(failed) == 0:
            return
        if failed[0] != self.rank:
            raise SystemExit(2)
        if isinstance(error, UserError):
            # name the rank only when it matters: a bad config fails on every rank alike
            where = "" if len(failed) == self.size else f" (rank {self.rank} of {self.size})"
            raise AgreedError(f"{error}{where}") from error
        raise error


def agree(world, decide):
    """decide() run on rank 0 alone, its JSON-safe result on every rank (the others wait in the
    broadcast): one decision for the whole run where each rank deciding alone could differ (the fused
    GPU kernels, timed). If decide raises, every rank stops with its error (`together`). A
    collective: every rank calls it, at the same place, outside any `together` block."""
    value = None
    with world.together():
        if world.is_main:
            value = decide()
    return world.broadcast_json(value)


def require_same(world, mine: dict, what: str, advice: str) -> None:
    """Every rank's `mine` ({name: JSON-safe value}) against rank 0's; if any rank's differs, all stop
    with one error, "<what>: <the first differing names, this rank's value and rank 0's>; <advice>".
    Ranks that differ would issue different collectives (and wait for each other forever), or train
    one model on different data without a word. A collective: every rank calls it, at the same place."""
    if world.size == 1:
        return
    mine = json.loads(json.dumps(mine))  # as the broadcast gives rank 0's: lists, not tuples
    main_rank = world.broadcast_json(mine)
    with world.together():
        differ = [k for k in mine if mine[k] != main_rank.get(k)]
        if differ:
            shown = ", ".join(f"{k} {mine[k]!r} (rank 0: {main_rank.get(k)!r})" for k in differ[:3])
            raise UserError(f"{what}: {shown}; {advice}")


class Single(_World):
    """One process: every collective is the identity."""

    name = "single process"

    def sum_scalars(self, values):
        return np.array(values, dtype=np.float64)

    def broadcast_json(self, obj):
        return obj

    def barrier(self):
        pass

    def reducer_for(self, xp):
        return Identity()

    def check_collectives(self):
        pass  # one rank cannot disagree with itself

    def abort(self, code):
        raise SystemExit(code)


class MPIWorld(_World):
    """COMM_WORLD through mpi4py: scalars, JSON and host (NumPy) buffers."""

    name = "MPI"

    def __init__(self, MPI, comm=None):
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        # the rank among the processes sharing this node's memory picks this rank's GPU
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = node.Get_rank()
        node.Free()

    def sum_scalars(self, values):
        buf = np.array(values, dtype=np.float64)
        if self.check is not None:
            self.check.before("sum_scalars", buf.size, buf.dtype)
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def broadcast_json(self, obj):
        # a length then UTF-8 bytes, not comm.bcast, which would pickle; the check sees the length's
        # broadcast alone (only rank 0 knows the size of what it sends)
        if self.check is not None:
            self.check.before("broadcast_json", 1, np.int64)
        data = json.dumps(obj).encode() if self.is_main else b""
        n = np.array([len(data)], dtype=np.int64)
        self.comm.Bcast(n, root=0)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.is_main else np.empty(int(n[0]), dtype=np.uint8)
        self.comm.Bcast(buf, root=0)
        return json.loads(buf.tobytes().decode())

    def barrier(self):
        if self.check is not None:
            self.check.before("barrier", 0, None)
        self.comm.Barrier()

    def reducer_for(self, xp):
        """The reducer of the model's flat buffers: MPI's on host buffers, NCCL's on GPUs (its set-up a
        collective: the unique id goes out over MPI)."""
        if xp is np:
            return MPIReducer(self.MPI, self.comm, self.check)
        return NcclReducer(self)

    def check_collectives(self):
        """Every collective from here on is compared across ranks first (andrea.run.ordercheck): the
        world's, and those of the reducers made after it (a reducer takes the world's check when made).
        Every rank must turn it on at the same point (it is the config's, which all ranks share)."""
        def exchange(record):
            every = np.empty((self.size, FIELDS), dtype=np.int64)
            self.comm.Allgather(record, every)
            return every

        self.check = OrderCheck(self.rank, self.size, exchange)

    def abort(self, code):
        sys.stdout.flush()
        sys.stderr.flush()
        # MPI_Abort makes the launcher kill every process, and output still on its way through the
        # launcher's pipes can be lost with them (seen with MPICH's Hydra): give it a moment
        time.sleep(0.5)
        self.comm.Abort(code)


def init():
    """The world this process belongs to: Single, or MPIWorld when an MPI launcher started it."""
    if not launched_by_mpi():
        return Single()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise UserError(f"started by an MPI launcher but mpi4py cannot be imported ({e}): {MPI_HINT}") from e
    return MPIWorld(MPI)


def use_local_gpu(world) -> None:
    """Make GPU (local_rank mod GPUs on this node) current, before anything touches a GPU."""
    if world.size == 1:
        return
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 (no CuPy or no driver: the backend's probe says why)
        return
    if count:
        cupy.cuda.Device(world.local_rank % count).use()



@contextlib.contextmanager
def guard(world):
    """Around a whole run: an error that escapes on one rank is printed with the rank and ends all.

    Agreed stops (`together`, SystemExit) pass through, so every rank exits the normal way.
    Single processes are untouched: run_cli reports their errors as always.
    """
    if world.size == 1:
        yield
        return
    try:
        yield
    except (SystemExit, AgreedError, CollectiveOrderError):
        raise
    except BaseException as e:  # noqa: BLE001 (one rank failing must not leave the others waiting)
        who = f"rank {world.rank} of {world.size}"
        if isinstance(e, UserError):
            print(f"error ({who}): {e}", file=sys.stderr, flush=True)
            code = 2
        elif isinstance(e, KeyboardInterrupt):
            print(f"interrupted ({who})", file=sys.stderr, flush=True)
            code = 130
        else:
            print(f"error ({who}): {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc()
            code = 1
        world.abort(code)
