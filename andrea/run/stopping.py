"""When a run stops before max_steps: too many non-finite steps in a row, or a signal on any rank.

`NonFiniteGuard`: a step whose loss or gradient norm is not finite applies no update (the Trainer
skips it); the guard counts them and ends the run (EXIT_NONFINITE) after max_bad_steps in a row.
`StopVote`: Ctrl-C or SIGTERM on any rank stops every rank after the same step, which is saved
(EXIT_INTERRUPTED).
"""

import math
import signal

from andrea.run import checkpoint as ckpt

EXIT_INTERRUPTED = 130
EXIT_NONFINITE = 3


class NonFiniteGuard:
    """Steps whose loss or gradient norm is not finite apply no update (train_step skips it); this
    counts them, logs each, and says when max_bad_steps in a row should end the run."""

    def __init__(self, max_in_a_row, world, total=0):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, total
        self.world = world  # rank 0 alone says each skipped step

    def record(self, applied, step, loss, norm, metrics):
        """False when the run must stop (max_in_a_row skipped steps in a row)."""
        if applied:
            self.in_a_row = 0
            return True
        loss, norm = float(loss), float(norm)
        self.in_a_row += 1
        self.total += 1
        metrics.log({"step": step, "loss": _num(loss), "grad_norm": _num(norm), "skipped": True})
        self.world.note(f"warning: step {step}: non-finite loss {loss} or gradient norm {norm}; update skipped "
                        f"({self.in_a_row} in a row, {self.total} in total)")
        return self.in_a_row < self.max_in_a_row

    def stop_message(self, step, last_checkpoint, out_dir):
        good = last_checkpoint or (ckpt.list_checkpoints(out_dir) or [None])[0]
        return (f"error: training stopped at step {step} after {self.in_a_row} non-finite steps in a row; last "
                f"good checkpoint: {good or 'none'}. Lower train.lr or check the data, then resume with --resume")


class StopVote:
    """Ctrl-C or SIGTERM on any rank stops every rank after the same step, which is then saved.

    A context manager: its signal handlers hold for the run and the previous ones come back after.
    `agreed()` is the vote, a collective every rank calls once per step. A second Ctrl-C stops at
    once (checkpoints are atomic, so that loses nothing saved)."""

    def __init__(self, world, trainer):
        self.world, self.trainer = world, trainer
        self.signal = None  # the signal that stops this run, this rank's or another's
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        self.world.note(f"\n{signal.Signals(signum).name} received: finishing step {self.trainer.step + 1}, then "
                        "saving a checkpoint (press Ctrl-C again to stop at once)")

    def agreed(self):
        """True when a signal reached any rank. The agreed value goes into a local first: assigning
        it to self.signal would erase a signal whose handler ran while max_int was under way (it is
        picked up after the next step instead)."""
        signalled = self.world.max_int(self.signal or 0)
        if signalled and self.signal is None:
            self.signal = signalled  # another rank's
        return bool(signalled)


def _num(x):
    return x if math.isfinite(x) else str(x)
