"""GPU gradients between ranks through NCCL (cupy.cuda.nccl): the transport a CuPy run's world hands
the trainer (andrea.run.distributed.MPIWorld.reducer_for).

    reducer = NcclReducer(world)     # every rank, its GPU already current (distributed.use_local_gpu)
    reducer.sum_(grads)              # in-place sum over ranks of a flat (P,) buffer, on the current stream
    reducer.broadcast_(params)       # rank 0's buffer on every rank

Rank 0 makes NCCL's unique id and the world's MPI broadcasts it (`pack_unique_id`: 129 bytes, no
pickle). CuPy loads libnccl from the nvidia-nccl-cu12 / -cu13 wheels; `load_nccl` says what to
install when it cannot.
"""

from __future__ import annotations

import numpy as np

from andrea.errors import UserError


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


class NcclReducer:
    """Flat-buffer sum and broadcast between GPUs through cupy.cuda.nccl, on the current stream.

    Rank 0 makes the unique id, MPI broadcasts it, and every rank joins with its GPU already
    current (`use_local_gpu`). `nccl` can be given (a fake in the CPU tests).
    """

    name = "NCCL"

    def __init__(self, world, nccl=None, cupy=None):
        if nccl is None:
            nccl, cupy = load_nccl()
        self.world, self.nccl, self.cupy = world, nccl, cupy
        uid = pack_unique_id(nccl.get_unique_id()) if world.is_main else np.zeros(129, dtype=np.uint8)
        world.broadcast_(uid)
        self.comm = nccl.NcclCommunicator(world.size, unpack_unique_id(uid), world.rank)

    def _call(self, buf):
        if buf.dtype == np.float32:
            dtype = self.nccl.NCCL_FLOAT32
        elif buf.dtype == np.float64:
            dtype = self.nccl.NCCL_FLOAT64
        else:
            raise TypeError(f"NCCL reducer: unsupported dtype {buf.dtype}")
        if not buf.flags.c_contiguous:
            raise ValueError("NCCL reducer needs a contiguous buffer")
        return buf.data.ptr, buf.size, dtype, self.cupy.cuda.get_current_stream().ptr

    def sum_(self, buf):
        ptr, n, dtype, stream = self._call(buf)
        self.comm.allReduce(ptr, ptr, n, dtype, self.nccl.NCCL_SUM, stream)

    def broadcast_(self, buf):
        ptr, n, dtype, stream = self._call(buf)
        self.comm.bcast(ptr, n, dtype, 0, stream)


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
