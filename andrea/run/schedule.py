"""The learning-rate schedule a run is handed: the rate of each optimizer step, and its own plan line.

    schedule = make_schedule(cfg.train)   # train.schedule: cosine (the default), wsd or constant
    schedule.lr(step)                     # step counts from 0: the rate of the update that makes it step + 1
    schedule.describe()                   # what --dry-run and the resume line print

Each one rises linearly over train.warmup_steps, from train.lr / warmup_steps to train.lr (none when
warmup_steps is 0), and then:

- **cosine**: half a cosine from train.lr down to train.min_lr at train.max_steps (GPT-2's, as in
  nanoGPT: minitensor.optim.cosine_lr, which this calls).
- **wsd**, warmup-stable-decay: train.lr until the last train.decay_fraction of the steps, then a
  straight line down to train.min_lr at train.max_steps: a decay of D steps (decay_fraction x
  max_steps, rounded to the nearest step, at least 1) lowers the rate at each of them, the last step
  of the run (step max_steps - 1, counted from 0) being at min_lr. A warmup that runs into the decay
  takes the lower of the two rates at each step (so a warmup that ends within the run still ends it
  at min_lr). From MiniCPM (Hu et al. 2024, "MiniCPM:
  Unveiling the Potential of Small Language Models with Scalable Training Strategies",
  arXiv:2404.06395, section 4); Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond
  Fixed Training Durations", arXiv:2405.18392) found a linear cooldown over about the last 20% of the
  steps (the default fraction here) matching cosine. The stable phase does not depend on where the
  run ends, so a decay can branch from any stable checkpoint: docs/training.md, "Schedules".
- **constant**: train.lr to the end.

A new schedule is a class here (`lr`, `describe`, `settings`: the train keys it reads) and one entry
in SCHEDULES, which train.schedule's check (check_schedule) reads.
"""

from __future__ import annotations

from andrea.errors import check_key
from minitensor.optim import cosine_lr


class Schedule:
    """Linear warmup, then `after_warmup(step)`. `settings`: the train.* keys whose change changes
    the curve (a resume compares them), train.max_steps aside (the run's length, see the resume)."""

    name = ""
    settings: tuple[str, ...] = ("schedule", "lr", "warmup_steps")

    def __init__(self, train):
        self.peak, self.min_lr = train.lr, train.min_lr
        self.warmup_steps, self.max_steps = train.warmup_steps, train.max_steps

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        return self.after_warmup(step)

    def after_warmup(self, step: int) -> float:
        raise NotImplementedError

    def warmup_words(self) -> str:
        if not self.warmup_steps:
            return f"lr {self.peak:g} from the first step"
        return f"warmup over {self.warmup_steps:,} steps to lr {self.peak:g}"

    def describe(self) -> str:
        raise NotImplementedError


class Cosine(Schedule):
    name = "cosine"
    settings = (*Schedule.settings, "min_lr")

    def lr(self, step: int) -> float:
        return cosine_lr(step, self.peak, self.min_lr, self.warmup_steps, self.max_steps)

    def describe(self) -> str:
        return (f"cosine: {self.max_steps:,} steps, {self.warmup_words()}, then a cosine decay to "
                f"{self.min_lr:g} at step {self.max_steps:,}")


class WarmupStableDecay(Schedule):
    name = "wsd"
    settings = (*Schedule.settings, "min_lr", "decay_fraction")

    def __init__(self, train):
        super().__init__(train)
        self.decay_fraction = train.decay_fraction
        self.decay_steps = max(1, round(train.decay_fraction * train.max_steps))
        self.decay_start = train.max_steps - self.decay_steps  # the first step of the decay (0-based)

    def lr(self, step: int) -> float:
        # a warmup longer than the stable phase meets the decay: the lower rate, so that the run still ends at min_lr
        return min(super().lr(step), self.after_warmup(step))

    def after_warmup(self, step: int) -> float:
        if step < self.decay_start:
            return self.peak
        # step decay_start is the decay's first of decay_steps updates, step max_steps - 1 its last, at min_lr
        progress = min(1.0, (step + 1 - self.decay_start) / self.decay_steps)
        return self.min_lr + (self.peak - self.min_lr) * (1.0 - progress)  # min_lr exactly at the end

    def describe(self) -> str:
        return (f"wsd: {self.max_steps:,} steps, {self.warmup_words()}, stable to step {self.decay_start:,}, "
                f"then a linear decay to {self.min_lr:g} over the last {self.decay_steps:,} steps "
                f"(train.decay_fraction {self.decay_fraction:g})"
                + ("; the warmup runs into the decay: each step takes the lower of the two rates"
                   if self.warmup_steps > self.decay_start else ""))


class Constant(Schedule):
    name = "constant"

    def after_warmup(self, step: int) -> float:
        return self.peak

    def describe(self) -> str:
        return f"constant: {self.max_steps:,} steps, {self.warmup_words()}, then constant"


SCHEDULES = {cls.name: cls for cls in (Cosine, WarmupStableDecay, Constant)}


def check_schedule(name: str) -> None:
    """A UserError unless name is a schedule of SCHEDULES (train.schedule's check, in andrea.config)."""
    check_key(SCHEDULES, name, "train.schedule")


def make_schedule(train) -> Schedule:
    """The schedule train.schedule names, over train's settings (a TrainConfig, already validated)."""
    return SCHEDULES[train.schedule](train)


def schedule_changes(saved: dict, now: dict) -> list[str]:
    """["train.lr 0.003 -> 0.001", ...]: the settings in which two train sections (as
    Config.to_dict() writes them: every key present) differ, among those either schedule reads."""
    keys = dict.fromkeys(SCHEDULES[saved["schedule"]].settings + SCHEDULES[now["schedule"]].settings)
    return [f"train.{k} {saved.get(k)} -> {now[k]}" for k in keys if saved.get(k) != now[k]]
