"""andrea.run.schedule: the learning-rate schedules a Trainer is handed (cosine, wsd, constant), their
descriptions, the config keys that choose them, and how a resume tells a changed schedule."""

import dataclasses
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from andrea.config import load_config
from andrea.errors import UserError, one_of
from andrea.run.schedule import SCHEDULES, Constant, make_schedule, schedule_changes
from minitensor.optim import cosine_lr

TINY = load_config("tiny")


def train_section(**overrides):
    return load_config("tiny", [f"train.{k}={v}" for k, v in overrides.items()]).train


@pytest.mark.parametrize("config", ["tiny", "small", "120m"])
def test_cosine_is_the_default_and_gives_cosine_lr_exactly(config):
    """Every shipped config keeps its numbers: the default schedule is cosine_lr, bit for bit."""
    t = load_config(config).train
    schedule = make_schedule(t)
    assert t.schedule == "cosine" and schedule.name == "cosine"
    for step in range(t.max_steps + 5):
        assert schedule.lr(step) == cosine_lr(step, t.lr, t.min_lr, t.warmup_steps, t.max_steps)


def test_wsd_warms_up_stays_then_decays_linearly_over_its_fraction():
    """Its 25 decay steps (0-based 75 to 99) each lower the rate, the last one to min_lr (issue 48: the
    decay began at the peak and ended a step short of min_lr, which these assertions pinned)."""
    t = train_section(schedule="wsd", max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, decay_fraction=0.25)
    s = make_schedule(t)
    lrs = [s.lr(step) for step in range(110)]
    assert lrs[:10] == [cosine_lr(k, 1.0, 0.1, 10, 100) for k in range(10)]  # the same warmup as cosine
    assert lrs[9] == 1.0 and set(lrs[10:75]) == {1.0}                       # stable up to step 74 (0-based)
    assert s.decay_start == 75 and s.decay_steps == 25
    decay = lrs[74:100]
    assert decay == pytest.approx([1.0 - 0.9 * k / 25 for k in range(26)], abs=1e-15)
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lrs[99:] == [0.1] * 11  # min_lr at the last step (max_steps - 1) and after


def test_wsd_without_warmup_and_constant():
    s = make_schedule(train_section(schedule="wsd", max_steps=10, warmup_steps=0, lr=2.0, min_lr=0.0))
    assert [s.lr(k) for k in range(11)] == pytest.approx([2.0] * 8 + [1.0, 0.0, 0.0])  # 0.2 x 10 = 2 decay steps
    c = make_schedule(train_section(schedule="constant", max_steps=10, warmup_steps=4, lr=2.0))
    assert [c.lr(k) for k in range(12)] == [0.5, 1.0, 1.5, 2.0] + [2.0] * 8


def test_a_one_step_wsd_decay_decays():
    """5 steps, decay_fraction 0.2: one decay step, the last, at min_lr (issue 48: the peak at every
    step, while --dry-run promised a decay to min_lr)."""
    s = make_schedule(train_section(schedule="wsd", max_steps=5, warmup_steps=0, lr=2.0, min_lr=0.5,
                                    decay_fraction=0.2))
    assert s.decay_steps == 1 and [s.lr(k) for k in range(5)] == [2.0, 2.0, 2.0, 2.0, 0.5]
    assert "a linear decay to 0.5 over the last 1 steps" in s.describe()


def test_the_wsd_decay_length_is_rounded_to_the_nearest_step():
    """0.3 x 9 = 2.7 decay steps: 3 (a floor would give 2; issue 48's surviving mutant)."""
    s = make_schedule(train_section(schedule="wsd", max_steps=9, warmup_steps=0, lr=1.0, min_lr=0.0,
                                    decay_fraction=0.3))
    assert (s.decay_start, s.decay_steps) == (6, 3)
    assert [s.lr(k) for k in range(9)] == pytest.approx([1.0] * 6 + [2 / 3, 1 / 3, 0.0], abs=1e-15)
    assert "stable to step 6, then a linear decay to 0 over the last 3 steps" in s.describe()


@settings(max_examples=300)
@given(max_steps=st.integers(1, 10**6), fraction=st.floats(0, 1, exclude_min=True),
       warmup=st.floats(0, 1), lr=st.floats(1e-6, 10.0), min_share=st.floats(0, 0.999))
def test_every_wsd_run_ends_at_min_lr_after_a_decay_of_its_length(max_steps, fraction, warmup, lr, min_share):
    """For every max_steps and decay_fraction the config accepts, and any warmup that ends within the
    run: the last step (max_steps - 1) is at min_lr, each of the D decay steps is below the one before
    (when min_lr < lr), and nothing after the warmup rises."""
    min_lr, warmup_steps = lr * min_share, int(warmup * max_steps)
    t = dataclasses.replace(TINY.train, schedule="wsd", max_steps=max_steps, warmup_steps=warmup_steps, lr=lr,
                            min_lr=min_lr, decay_fraction=fraction)
    t.validate(TINY.model)  # a section the config accepts
    s = make_schedule(t)
    assert s.lr(max_steps - 1) == min_lr and s.lr(max_steps) == min_lr
    assert s.decay_steps == max(1, round(fraction * max_steps)) and s.decay_start == max_steps - s.decay_steps
    steps = sorted({max(0, s.decay_start - 1), *range(max(0, s.decay_start - 1), max_steps)[:50],
                    *range(max(0, max_steps - 50), max_steps)})
    lrs = [s.lr(k) for k in steps]
    assert all(b <= a for k, a, b in zip(steps, lrs, lrs[1:]) if k >= warmup_steps)
    if min_lr < lr and warmup_steps <= s.decay_start:
        decay = [s.lr(k) for k in range(max(s.decay_start - 1, 0, max_steps - 51), max_steps)]
        assert all(b < a for a, b in zip(decay, decay[1:]))  # every decay step lowers it, the first one too


def test_a_warmup_that_runs_into_the_decay_takes_the_lower_rate():
    s = make_schedule(train_section(schedule="wsd", max_steps=10, warmup_steps=10, lr=1.0, min_lr=0.0,
                                    decay_fraction=0.5))
    assert [s.lr(k) for k in range(10)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.4, 0.2, 0.0])
    assert s.describe().endswith("; the warmup runs into the decay: each step takes the lower of the two rates")


def test_describe_says_each_schedule_in_its_own_words():
    t = load_config("tiny").train
    assert make_schedule(t).describe() == ("cosine: 500 steps, warmup over 50 steps to lr 0.003, then a cosine "
                                           "decay to 0.0003 at step 500")
    assert make_schedule(train_section(schedule="wsd")).describe() == (
        "wsd: 500 steps, warmup over 50 steps to lr 0.003, stable to step 400, then a linear decay to 0.0003 over "
        "the last 100 steps (train.decay_fraction 0.2)")
    assert make_schedule(train_section(schedule="constant", warmup_steps=0)).describe() == (
        "constant: 500 steps, lr 0.003 from the first step, then constant")


def test_the_plan_prints_the_schedules_own_description(tmp_path):
    from andrea.run import preflight

    cfg = load_config("tiny", ["train.schedule=wsd", "train.device=cpu"])
    plan = preflight.Plan(cfg, tmp_path, "cpu", "cpu", preflight.estimate_memory(cfg), "fits", "data: -")
    row = next(line for line in plan.describe().splitlines() if line.startswith("schedule"))
    assert row == f"{'schedule':<12}{make_schedule(cfg.train).describe()}"


def test_bad_schedule_settings_are_one_line_errors():
    with pytest.raises(UserError, match=rf"^{re.escape(f'train.schedule must be {one_of(SCHEDULES)}')}, got 'wds'$"):
        train_section(schedule="wds")
    with pytest.raises(UserError, match=r"^train.decay_fraction must be in \(0, 1\], got 0.0$"):
        train_section(decay_fraction=0)
    with pytest.raises(UserError, match=r"^train.decay_fraction must be in \(0, 1\], got 1.5$"):
        train_section(decay_fraction=1.5)


def test_schedule_changes_names_what_the_schedules_read():
    def d(**kw):
        return load_config("tiny", [f"train.{k}={v}" for k, v in kw.items()]).to_dict()["train"]

    assert schedule_changes(d(), d()) == []
    assert schedule_changes(d(), d(max_steps=900, batch_size=2)) == []  # the run's length, not its schedule
    assert schedule_changes(d(), d(decay_fraction=0.5)) == []            # cosine does not read it
    assert schedule_changes(d(), d(lr=1e-3, min_lr=1e-4)) == ["train.lr 0.003 -> 0.001",
                                                              "train.min_lr 0.0003 -> 0.0001"]
    assert schedule_changes(d(), d(schedule="wsd")) == ["train.schedule cosine -> wsd"]
    assert schedule_changes(d(schedule="wsd"), d(schedule="wsd", decay_fraction=0.5)) == \
        ["train.decay_fraction 0.2 -> 0.5"]
    # the keys of both schedules: those the new one reads and the saved one did not are named too
    # (issue 48: reading the saved schedule's keys alone survived every test)
    assert schedule_changes(d(schedule="constant"), d(schedule="wsd", min_lr=1e-4, decay_fraction=0.5)) == [
        "train.schedule constant -> wsd", "train.min_lr 0.0003 -> 0.0001", "train.decay_fraction 0.2 -> 0.5"]
    assert schedule_changes(d(schedule="wsd", min_lr=1e-4, decay_fraction=0.5), d(schedule="constant")) == [
        "train.schedule wsd -> constant", "train.min_lr 0.0001 -> 0.0003", "train.decay_fraction 0.5 -> 0.2"]
    # the same for every two schedules of SCHEDULES: each key either reads, and no other, is named
    base = d()
    for saved, now in itertools.permutations(SCHEDULES, 2):
        read = dict.fromkeys(SCHEDULES[saved].settings + SCHEDULES[now].settings)
        changed = {k: (base[k] + 1 if isinstance(base[k], int) else base[k] / 2) for k in read if k != "schedule"}
        other = "eval_interval"  # read by no schedule
        assert other not in read
        assert schedule_changes({**base, "schedule": saved}, {**base, **changed, "schedule": now, other: 7}) == [
            f"train.{k} {({**base, 'schedule': saved})[k]} -> {({**changed, 'schedule': now})[k]}" for k in read]


def test_train_schedule_takes_what_SCHEDULES_holds(monkeypatch):
    """The config lists no schedule: it asks the registry (check_schedule), so a class in SCHEDULES is
    a value train.schedule takes and its error message names, with nothing else edited."""
    class Linear(Constant):
        name = "linear"

    monkeypatch.setitem(SCHEDULES, "linear", Linear)
    assert train_section(schedule="linear").schedule == "linear"
    with pytest.raises(UserError, match=r"^train.schedule must be .*, constant or linear, got 'wds'$"):
        train_section(schedule="wds")
