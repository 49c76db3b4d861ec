"""The run's meter: tokens/s, MFU and the ETA, from the time of training steps alone."""

import time

from andrea.run.perf import synchronize


class Throughput:
    """Tokens/s, MFU and the ETA, from the time of training steps alone.

    The clock runs while steps run and stops (once the device has finished its queued work) for
    everything else: the log line, evaluation, checkpoints. Two tallies read it: the window since
    the last log line (the figures logged) and this run's steps after its first (the ETA and the
    end-of-run rate): a process's first step also compiles kernels and warms caches, far longer with
    a cold numba cache than the steps after it (BENCHMARKS.md, "The CPU kernels").

    MFU is against `peak`, the matmul peak measured at start. A window whose steps ran faster than
    it shows that measurement was low (a machine busy with other work at that moment):
    `measure_again(achieved, peak)` then measures it afresh, and the peak becomes the highest of
    every measurement and every rate achieved (the device did run that fast), so MFU stays a share
    of what this device demonstrably does, at most 100%."""

    def __init__(self, xp, tokens_per_step, flops_per_step, peak, peak_name, measure_again=None):
        self.xp, self.tokens_per_step, self.flops_per_step = xp, tokens_per_step, flops_per_step
        self.peak, self.peak_name, self.measure_again = peak, peak_name, measure_again
        self.first_step_s = None                  # this run's first step, start-up included
        self.run_steps, self.run_s = 0, 0.0       # the steps after it
        self.window_steps, self.window_s = 0, 0.0
        self._steps, self._since = 0, None        # since the clock last started

    def start(self):
        if self._since is None:
            self._since = time.perf_counter()

    def step_done(self):
        self._steps += 1
        if self.first_step_s is None:
            self.stop()  # the first step is timed alone

    def stop(self):
        if self._since is None:
            return
        synchronize(self.xp)
        seconds = time.perf_counter() - self._since
        if self.first_step_s is None:
            self.first_step_s = seconds
        else:
            self.run_steps, self.run_s = self.run_steps + self._steps, self.run_s + seconds
        self.window_steps, self.window_s = self.window_steps + self._steps, self.window_s + seconds
        self._steps, self._since = 0, None

    def window(self):
        """(tokens/s, MFU) of the steps since the last call (the clock is stopped first)."""
        self.stop()
        seconds = max(self.window_s, 1e-9)
        tps = self.window_steps * self.tokens_per_step / seconds
        achieved = self.window_steps * self.flops_per_step / seconds
        if self.measure_again is not None and achieved > self.peak:  # the clock is stopped meanwhile
            self.peak = max(self.peak, self.measure_again(achieved, self.peak), achieved)
        self.window_steps, self.window_s = 0, 0.0
        return tps, achieved / self.peak

    def eta(self, steps_left):
        """Seconds for `steps_left` more steps at this run's pace after its first step; None before
        a later step has been timed."""
        return self.run_s / self.run_steps * steps_left if self.run_steps else None

    def run_rate(self):
        """(tokens/s, seconds, steps) of this run's training steps after the first (the first alone
        when it is the only one)."""
        if self.run_steps:
            return self.run_steps * self.tokens_per_step / self.run_s, self.run_s, self.run_steps
        if self.first_step_s:
            return self.tokens_per_step / self.first_step_s, self.first_step_s, 1
        return 0.0, 0.0, 0
