"""The reducer of a GPU run's flat buffers through NCCL (cupy.cuda.nccl), andrea.run.reducer's
interface: what a CuPy run's world hands the trainer (andrea.run.distributed.MPIWorld.reducer_for).

    reducer = NcclReducer(world)     # every rank, its GPU already current (distributed.use_local_gpu)
    reducer.all_reduce(grads)        # in-place sum over ranks of a flat (P,) buffer, ordered on the streams
    reducer.broadcast(params)        # rank 0's buffer on every rank
    reducer.reduce_scatter(grads, shards, wait=False).wait()   # started on the NCCL stream, then waited on
    reducer.reduce_scatter(grads, shards, wait=False, span=(a, b))   # a bucket: a grouped reduce to each rank

Rank 0 makes NCCL's unique id and the world's MPI broadcasts it (`pack_unique_id`: 129 bytes, no
pickle). CuPy loads libnccl from the nvidia-nccl-cu12 / -cu13 wheels; `load_nccl` says what to
install when it cannot.
"""

from __future__ import annotations

import numpy as np

from andrea.errors import UserError
from andrea.run.reducer import Pending, Reducer


def pack_unique_id(uid) -> np.ndarray:
    """NCCL's 128-byte unique id as (129,) uint8 for MPI: a type byte, then the id.

    CuPy 14 gives bytes; older CuPy gave a tuple of signed chars. The type byte lets the
    receiving ranks hand NcclCommunicator the same type rank 0 got.
    """
    if isinstance(uid, bytes | bytearray):
        body, kind = np.frombuffer(bytes(uid), dtype=np.uint8), 0
    else:
        body, kind = np.array(uid, dtype=np.int8).view(np.uint8), 1
    return np.concatenate([np.array([kind], dtype=np.uint8), body])


def unpack_unique_id(buf: np.ndarray):
    body = np.asarray(buf[1:], dtype=np.uint8)
    return body.tobytes() if buf[0] == 0 else tuple(int(v) for v in body.view(np.int8))


class NcclReducer(Reducer):
    """Flat device buffers between GPUs through cupy.cuda.nccl, on a stream of the reducer's own.

    Rank 0 makes the unique id, MPI broadcasts it, and every rank joins with its GPU already
    current (`use_local_gpu`). A collective waits on an event recorded on the current stream (the
    work that wrote its buffer), runs on the NCCL stream, and records an event there; its wait makes
    the current stream wait on that event, so the host never blocks and the next kernel that reads
    the buffer runs after the collective. The collectives work in place on the caller's buffers (the
    flat parameters and gradients, which live as long as the model) and allocate nothing, so no
    buffer the memory pool frees can still be in flight; a started one keeps its buffer referenced
    until its wait. `nccl` and `cupy` can be given (fakes in the CPU tests).
    """

    name = "NCCL"

    def __init__(self, world, nccl=None, cupy=None):
        if nccl is None:
            nccl, cupy = load_nccl()
        super().__init__(world.rank, world.size, getattr(world, "check", None))
        self.nccl, self.cupy = nccl, cupy
        uid = pack_unique_id(nccl.get_unique_id()).tolist() if world.is_main else None
        uid = np.array(world.broadcast_json(uid), dtype=np.uint8)
        self.comm = nccl.NcclCommunicator(world.size, unpack_unique_id(uid), world.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _dtype(self, buf):
        if buf.dtype == np.float32:
            return self.nccl.NCCL_FLOAT32
        if buf.dtype == np.float64:
            return self.nccl.NCCL_FLOAT64
        raise TypeError(f"NCCL reducer: unsupported dtype {buf.dtype}")

    def _on_stream(self, buf, call):
        """call(ptr, dtype, stream ptr) on the NCCL stream after the current stream's work so far."""
        dtype, current = self._dtype(buf), self.cupy.cuda.get_current_stream()
        ready, done = self.cupy.cuda.Event(disable_timing=True), self.cupy.cuda.Event(disable_timing=True)
        ready.record(current)
        self.stream.wait_event(ready)
        call(buf.data.ptr, dtype, self.stream.ptr)
        done.record(self.stream)
        return Pending(lambda: self.cupy.cuda.get_current_stream().wait_event(done), buf)

    def _all_reduce(self, buf, shards):
        return self._on_stream(buf, lambda ptr, dtype, s: self.comm.allReduce(ptr, ptr, buf.size, dtype,
                                                                             self.nccl.NCCL_SUM, s))

    def _reduce_scatter(self, buf, shards):
        # in place as NCCL defines it: the receive buffer is the rank's range of the send buffer
        offset = shards.bounds(self.rank)[0] * buf.itemsize
        return self._on_stream(buf, lambda ptr, dtype, s: self.comm.reduceScatter(
            ptr, ptr + offset, shards.length, dtype, self.nccl.NCCL_SUM, s))

    def _reduce_scatter_span(self, buf, shards, span):
        # a bucket: NCCL's reduce-scatter takes equal counts, so one in-place reduce to each rank of its part
        # of the bucket, grouped into one launch (ncclGroupStart / End)
        parts = [(root, a, b) for root, (a, b) in enumerate(shards.cut(*span)) if b > a]

        def call(ptr, dtype, s):
            self.nccl.groupStart()
            try:
                for root, a, b in parts:
                    at = ptr + a * buf.itemsize
                    self.comm.reduce(at, at, b - a, dtype, self.nccl.NCCL_SUM, root, s)
            finally:
                self.nccl.groupEnd()

        return self._on_stream(buf, call)

    def _all_gather(self, buf, shards):
        offset = shards.bounds(self.rank)[0] * buf.itemsize
        return self._on_stream(buf, lambda ptr, dtype, s: self.comm.allGather(ptr + offset, ptr, shards.length,
                                                                             dtype, s))

    def _broadcast(self, buf, shards):
        return self._on_stream(buf, lambda ptr, dtype, s: self.comm.bcast(ptr, buf.size, dtype, 0, s))


def require_nccl() -> None:
    """Raise the UserError load_nccl would, without any collective (see NcclReducer)."""
    load_nccl()


def load_nccl():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise UserError(f"GPU data parallelism needs CuPy with NCCL ({e})") from e
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise UserError("CuPy cannot load NCCL: install nvidia-nccl-cu12 or nvidia-nccl-cu13 "
                        "(pip install -e '.[cuda13]' brings it)")
    return nccl, cupy
