"""cupy.cuda.nccl (stand-in): NCCL's API at one rank, the only size a single process can join.

allReduce, reduceScatter, reduce, allGather and bcast take device pointers, as NCCL does: at one rank a
sum or a gather is a copy from the send buffer to the receive buffer (nothing when they are one), and a
broadcast changes nothing; groupStart and groupEnd, which group calls into one launch, do nothing.
"""

import ctypes
import os

available = True
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
NCCL_INT32, NCCL_INT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 2, 4, 6, 7, 8
_SIZES = {NCCL_INT32: 4, NCCL_INT64: 8, NCCL_FLOAT16: 2, NCCL_FLOAT32: 4, NCCL_FLOAT64: 8}


class NcclError(RuntimeError):
    pass


def get_version():
    return 22707


def get_unique_id():
    return os.urandom(128)


def groupStart():  # noqa: N802 (NCCL's names)
    pass


def groupEnd():  # noqa: N802
    pass


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):  # noqa: N803 (NCCL's names)
        if ndev != 1 or rank != 0:
            raise NcclError(f"the CuPy stand-in runs NCCL at one rank, not rank {rank} of {ndev}")
        if len(bytes(commId)) != 128:
            raise NcclError("a unique id is 128 bytes")

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        if sendbuf != recvbuf:
            ctypes.memmove(recvbuf, sendbuf, count * _SIZES[datatype])

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self.allReduce(sendbuf, recvbuf, recvcount, datatype, op, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        if sendbuf != recvbuf:
            ctypes.memmove(recvbuf, sendbuf, count * _SIZES[datatype])

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        if root != 0:
            raise NcclError(f"root {root} at one rank")
        self.allReduce(sendbuf, recvbuf, count, datatype, op, stream)

    def bcast(self, buff, count, datatype, root, stream):
        if root != 0:
            raise NcclError(f"root {root} at one rank")

    def destroy(self):
        pass

    def size(self):
        return 1

    def rank_id(self):
        return 0
