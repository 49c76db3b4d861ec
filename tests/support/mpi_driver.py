"""`python -m andrea.train` under mpiexec with one injected fault, for tests/e2e/test_distributed.py.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_driver.py [FAULT ...] -- TRAIN ARGS

Faults (each names the rank and the optimizer step it hits):
  --hashes DIR           every rank writes DIR/rank<r>.json: sha256 of its weights after each step
  --nan RANK STEP        that rank's gradient gets a NaN before the reduction of that step
  --raise RANK STEP      that rank raises RuntimeError("injected failure") in that step
  --signal RANK STEP     that rank sends itself SIGTERM during that step
  --state FILE           before its first step, the run's state (weights, the optimizer's state gathered
                         as a checkpoint holds it) as sha256 per tensor in FILE, written by rank 0
  --extra-collective RANK STEP
                         that rank broadcasts 16 floats of its own before that step (a collective under
                         a test of the rank: it hangs, unless train.check_collectives names it)
"""

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from andrea import train
from andrea.cli import run_cli


def digests(tensors):
    return {name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for name, a in tensors.items()}


def install(opts):
    original = train.Trainer.train_step
    hashes, started = [], []

    def train_step(self, lr):
        step, rank = self.step + 1, self.world.rank
        if opts.state and not started:
            started.append(step)
            optimizer = self.optimizer_state()  # every rank: sharded, the gather is a collective
            if rank == 0:
                Path(opts.state).write_text(json.dumps(digests(self.state(optimizer)[0])))
        if opts.raise_ and opts.raise_ == [rank, step]:
            raise RuntimeError("injected failure")
        if opts.signal and opts.signal == [rank, step]:
            os.kill(os.getpid(), signal.SIGTERM)
        if opts.extra_collective and opts.extra_collective == [rank, step]:
            self.reducer.broadcast(np.zeros(16, np.float32))
        if opts.nan and opts.nan == [rank, step]:
            backward = self.model.backward

            def poisoned(*a, **k):  # the NaN enters after each backward, before the embeddings' gradient reduces
                backward(*a, **k)
                self.model.params.grads[0] = float("nan")

            self.model.backward = poisoned
            try:
                result = original(self, lr)
            finally:
                del self.model.backward
        else:
            result = original(self, lr)
        if opts.hashes:
            hashes.append(hashlib.sha256(self.model.params.data.tobytes()).hexdigest())
            Path(opts.hashes, f"rank{rank}.json").write_text(json.dumps(hashes))
        return result

    train.Trainer.train_step = train_step


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--hashes")
    ap.add_argument("--nan", nargs=2, type=int)
    ap.add_argument("--raise", dest="raise_", nargs=2, type=int)
    ap.add_argument("--signal", nargs=2, type=int)
    ap.add_argument("--extra-collective", nargs=2, type=int)
    ap.add_argument("--state")
    install(ap.parse_args(argv[:split]))
    run_cli(train.main, argv[split + 1:])


if __name__ == "__main__":
    main()
