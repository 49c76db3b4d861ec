"""The reducer of a CPU run's flat buffers over MPI (andrea.run.reducer's interface): mpi4py's
non-blocking collectives, in place on host (NumPy) buffers.

    reducer = MPIReducer(MPI, comm)        # what MPIWorld.reducer_for(numpy) hands the trainer
    reducer.all_reduce(grads)              # Iallreduce(IN_PLACE), waited on
    pending = reducer.reduce_scatter(grads, shards, wait=False)   # Ireduce_scatter_block, started
    reducer.reduce_scatter(grads, shards, span=(a, b))   # a bucket: Ireduce_scatter of unequal counts

MPI's in-place reduce-scatter leaves the rank's sum at the start of the buffer (of the bucket); the wait
moves it to the rank's own range. A started collective must not be touched before its wait (MPI's rule for
non-blocking calls): the Pending keeps the buffer alive until then.
"""

from __future__ import annotations

from andrea.run.reducer import Pending, Reducer


class MPIReducer(Reducer):
    """Flat host buffers between the ranks of an MPI communicator."""

    name = "MPI"

    def __init__(self, MPI, comm, check=None):  # noqa: N803 (mpi4py's module, by its name)
        super().__init__(comm.Get_rank(), comm.Get_size(), check)
        self.MPI, self.comm = MPI, comm

    def _all_reduce(self, buf, shards):
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return Pending(request.Wait, buf, request.Test)

    def _reduce_scatter(self, buf, shards):
        request = self.comm.Ireduce_scatter_block(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        start, stop = shards.bounds(self.rank)

        def finish():
            request.Wait()
            if start:  # the sum came back in the first range: this rank's is further on (no overlap)
                buf[start:stop] = buf[:shards.length]

        return Pending(finish, buf)

    def _reduce_scatter_span(self, buf, shards, span):
        # a bucket: MPI's reduce-scatter of unequal counts, each rank's part of the bucket its count
        parts, (start, stop) = shards.cut(*span), span
        request = self.comm.Ireduce_scatter(self.MPI.IN_PLACE, buf[start:stop], [b - a for a, b in parts],
                                            op=self.MPI.SUM)
        lo, hi = parts[self.rank]

        def finish():
            request.Wait()
            if lo > start:  # the sum came back at the bucket's start: this rank's part is further on
                buf[lo:hi] = buf[start:start + hi - lo].copy()

        return Pending(finish, buf, request.Test)

    def _all_gather(self, buf, shards):
        return Pending(self.comm.Iallgather(self.MPI.IN_PLACE, buf).Wait, buf)

    def _broadcast(self, buf, shards):
        return Pending(self.comm.Ibcast(buf, root=0).Wait, buf)
