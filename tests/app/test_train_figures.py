"""The figures training prints are each computed from their own window (issue 20, class 6).

tokens/s and MFU count the time of training steps only: evaluation and checkpoints stop the clock,
whatever their interval against log_interval. The end-of-run summary gives the last step's training
loss (not the last logged step's) and a rate from the steps after the first (start-up and
compilation left out). Steps here are made slow on purpose (a sleep inside each), so a bound on
the figures holds however loaded the machine is.
"""

import json
import re
import time

from runs import run_main, small_config

from andrea import train

TOKENS_PER_STEP = 4 * 16  # small_config: batch 4 x context 16, one micro-batch


def slow_steps(monkeypatch, seconds, first=None):
    """Every optimizer step takes at least `seconds` (the first at least `first`)."""
    real = train.Trainer.train_step
    calls = {"n": 0}

    def train_step(self, lr):
        calls["n"] += 1
        time.sleep(first if first is not None and calls["n"] == 1 else seconds)
        return real(self, lr)

    monkeypatch.setattr(train.Trainer, "train_step", train_step)


def step_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "tokens_per_s" in r]


def summary_line(printed):
    return next(line for line in printed.splitlines() if line.startswith("done: "))


def test_tokens_per_s_and_mfu_leave_out_evaluation_and_checkpoints(tmp_path, data_dir, monkeypatch):
    # eval and checkpoint every 3 steps, a log line every 4: windows that straddle a slow
    # evaluation; the old loop restarted the window's clock there but kept its step count
    slow_steps(monkeypatch, 0.05)
    real_eval = train.Trainer.evaluate
    monkeypatch.setattr(train.Trainer, "evaluate", lambda self: (time.sleep(0.5), real_eval(self))[1])
    cfg = small_config(tmp_path, data_dir, max_steps=12, log_interval=4, eval_interval=3, checkpoint_interval=3)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out)]) == 0
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 4, 8, 12]
    ceiling = TOKENS_PER_STEP / 0.05  # no step is faster than its sleep
    assert all(r["tokens_per_s"] <= ceiling for r in rows), [r["tokens_per_s"] for r in rows]
    # and the evaluations (0.5 s each) are not in it: four steps in a window with one evaluation
    # would make it at most 4 x 64 / (4 x 0.05 + 0.5) = 366 tokens/s
    assert all(r["tokens_per_s"] > 4 * TOKENS_PER_STEP / 0.7 for r in rows[1:]), [r["tokens_per_s"] for r in rows]
    mfu_per_token = rows[1]["mfu"] / rows[1]["tokens_per_s"]  # MFU is the same window's
    for r in rows:
        assert abs(r["mfu"] / r["tokens_per_s"] - mfu_per_token) <= 1e-9 * mfu_per_token


def test_the_summary_gives_the_last_steps_loss_not_the_last_logged(tmp_path, data_dir, capsys):
    every = tmp_path / "every"
    assert run_main(["--config", str(small_config(tmp_path, data_dir)), "--out", str(every),
                     "--stop-at-step", "3"]) == 0
    capsys.readouterr()
    loss_3 = next(r["loss"] for r in step_rows(every) if r["step"] == 3)
    sparse = tmp_path / "sparse"  # the same run, logging every 2 steps: step 3 is not logged
    assert run_main(["--config", str(small_config(tmp_path, data_dir, log_interval=2)), "--out", str(sparse),
                     "--stop-at-step", "3"]) == 0
    assert 3 not in [r["step"] for r in step_rows(sparse)]
    line = summary_line(capsys.readouterr().out)
    assert f"train loss {loss_3:.4f}" in line, line


def test_the_summary_rate_leaves_out_the_first_step_and_start_up(tmp_path, data_dir, monkeypatch, capsys):
    slow_steps(monkeypatch, 0.02, first=2.0)  # the first step as slow as compiling the numba kernels
    cfg = small_config(tmp_path, data_dir, max_steps=8)
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "run")]) == 0
    line = summary_line(capsys.readouterr().out)
    match = re.search(r"\| ([\d,]+) tokens/s \((\d+) steps after the first step, ([\d.]+) s of training\)", line)
    assert match, line
    rate, steps, seconds = float(match[1].replace(",", "")), int(match[2]), float(match[3])
    assert steps == 7 and 7 * 0.02 <= seconds < 2.0, line
    tokens = steps * TOKENS_PER_STEP  # the rate is of those steps and seconds (printed to 0.1 s)
    assert tokens / (seconds + 0.05) <= rate <= tokens / max(seconds - 0.05, 0.01), line


def test_the_eta_comes_from_the_steps_after_the_first(tmp_path, data_dir, monkeypatch, capsys):
    slow_steps(monkeypatch, 0.02, first=3.0)
    cfg = small_config(tmp_path, data_dir, max_steps=40, log_interval=2, eval_interval=100, checkpoint_interval=100)
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "run")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ") and "tok/s" in line]
    assert "first step: start-up included, not in the ETA" in lines[0]
    eta_at_2 = re.search(r"ETA (\d+)m(\d+)s", lines[1])
    assert eta_at_2, lines[1]
    # 38 steps left at well under a second each, not at the first step's 3 s (which would be ~2 minutes)
    assert int(eta_at_2[1]) * 60 + int(eta_at_2[2]) < 38, lines[1]
