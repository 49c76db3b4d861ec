"""andrea.run.schedule: the learning-rate schedules a Trainer is handed (cosine, wsd, constant), their
descriptions, the config keys that choose them, and how a resume tells a changed schedule."""

import pytest

from andrea.config import load_config
from andrea.errors import UserError
from andrea.run.schedule import SCHEDULES, make_schedule, schedule_changes
from minitensor.optim import cosine_lr


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
    t = train_section(schedule="wsd", max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, decay_fraction=0.25)
    s = make_schedule(t)
    lrs = [s.lr(step) for step in range(110)]
    assert lrs[:10] == [cosine_lr(k, 1.0, 0.1, 10, 100) for k in range(10)]  # the same warmup as cosine
    assert lrs[9] == 1.0 and set(lrs[10:76]) == {1.0}                       # stable up to step 75 (0-based)
    assert s.decay_start == 75 and s.decay_steps == 25
    decay = lrs[75:101]
    assert decay == pytest.approx([1.0 - 0.9 * k / 25 for k in range(26)], abs=1e-15)
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lrs[100:] == [pytest.approx(0.1)] * 10  # min_lr from max_steps on


def test_wsd_without_warmup_and_constant():
    s = make_schedule(train_section(schedule="wsd", max_steps=10, warmup_steps=0, lr=2.0, min_lr=0.0))
    assert [s.lr(k) for k in range(11)] == pytest.approx([2.0] * 9 + [1.0, 0.0])  # 0.2 x 10 = 2 decay steps
    c = make_schedule(train_section(schedule="constant", max_steps=10, warmup_steps=4, lr=2.0))
    assert [c.lr(k) for k in range(12)] == [0.5, 1.0, 1.5, 2.0] + [2.0] * 8


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
    with pytest.raises(UserError, match=r"^train.schedule must be cosine, wsd or constant, got 'wds'$"):
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
    assert set(SCHEDULES) == {"cosine", "wsd", "constant"}
