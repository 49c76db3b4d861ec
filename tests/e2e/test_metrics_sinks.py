"""The metrics sinks end to end: a run with train.log_to=tensorboard,wandb (W&B offline), cut after
step 6 with its last checkpoint at step 4 and resumed, leaves TensorBoard event files (read with
TensorBoard's own reader) and an offline W&B run (its run files read back) holding each step once,
with the values metrics.jsonl holds; and the Metrics object's rules: rank 0 alone writes, a sink
that fails is left out, a sink whose library is missing is named before any work."""

import os
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
from optional import require
from runs import run_main, small_config

from andrea.config import load_config
from andrea.errors import UserError, one_of
from andrea.run import sinks
from andrea.run.metrics import JsonlSink, Metrics, open_metrics, read_records
from andrea.run.sinks import scalars


def logged(out):
    """{step: its record} of metrics.jsonl, each step once (as a resume leaves it)."""
    rows = [r for r in read_records(out / "metrics.jsonl") if "step" in r]
    assert len({r["step"] for r in rows}) == len(rows)
    return {r["step"]: r for r in rows}


def tensorboard_scalars(logdir):
    """{tag: [(step, value), ...]} as TensorBoard shows them."""
    require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_and_wandb_hold_what_metrics_jsonl_holds_across_a_resume(tmp_path, data_dir, monkeypatch):
    require("tensorboardX")
    require("wandb")
    import wandb_offline

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = small_config(tmp_path, data_dir, log_to=["tensorboard", "wandb"], log_grad_flow=True)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out), "--stop-at-step", "6"]) == 0
    before = logged(out)  # steps 1 to 6 of the first run
    shutil.rmtree(out / "ckpt-00000006")  # as if killed after step 6: steps 5 and 6 are trained again
    assert run_main(["--out", str(out), "--resume"]) == 0
    rows = logged(out)
    assert sorted(rows) == list(range(1, 9)) and "grad_flow" in rows[1] and "val_loss" in rows[8]
    expected = {}  # {tag: [(step, value)]} of metrics.jsonl
    for step, row in sorted(rows.items()):
        for tag, value in scalars(row).items():
            expected.setdefault(tag, []).append((step, value))
    assert {"loss", "lr", "grad_norm", "val_loss", "val_bpb", "grad_flow/grad_in/0"} <= set(expected)
    # TensorBoard: every step once (the resumed file's first event hides steps 5 and 6 of the first
    # file), each value metrics.jsonl's as float32
    board = tensorboard_scalars(out / "tensorboard")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert set(board) == set(expected)
    for tag, points in expected.items():
        assert board[tag] == [(step, float(np.float32(value))) for step, value in points], tag
    # W&B: one run continued (the same id in both offline runs); it keeps steps 5 and 6 of the first
    # and takes 7 and 8 from the resumed one, every value exactly the one metrics.jsonl had for it
    # (the losses of 5 and 6 are the same bits in both; their tokens/s are not)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1
    first, resumed = (wandb_offline.history(r) for r in runs)
    assert [h["_step"] for h in first] == [1, 2, 3, 4, 5, 6] and [h["_step"] for h in resumed] == [7, 8]
    for h, source in [(h, before) for h in first] + [(h, rows) for h in resumed]:
        assert {k: v for k, v in h.items() if not k.startswith("_")} == scalars(source[h["_step"]])
    assert [before[k]["loss"] for k in (5, 6)] == [rows[k]["loss"] for k in (5, 6)]
    # --overwrite deletes what the sinks wrote with the rest of the run
    assert run_main(["--config", str(small_config(tmp_path, data_dir, max_steps=1)), "--out", str(out),
                     "--overwrite"]) == 0
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


def test_only_rank_0_writes_and_a_failing_sink_is_left_out(tmp_path, capsys):
    cfg = load_config("tiny")
    other = open_metrics(tmp_path, cfg, SimpleNamespace(is_main=False), 0)
    assert other.sinks == []
    other.log({"step": 1, "loss": 1.0})
    other.close()
    assert list(tmp_path.iterdir()) == []  # no metrics.jsonl, no /dev/null stand-in

    class Broken:
        name = "broken"

        def log(self, record):
            raise OSError("no space left")

    jsonl = JsonlSink(tmp_path / "metrics.jsonl")
    with Metrics([Broken(), jsonl]) as metrics:
        for step in (1, 2):
            metrics.log({"step": step, "loss": 1.0})
            metrics.flush()
    assert capsys.readouterr().err.count("the broken metrics sink failed (OSError: no space left); training goes "
                                         "on without it") == 1
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]


def test_scalars_are_the_finite_numbers_of_a_record():
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "skipped": True, "grad_norm": "nan",
              "grad_flow": {"grad_in": [0.5, None, float("inf")], "grad_top": 1}}
    assert scalars(record) == {"loss": 2.5, "lr": 1e-3, "grad_flow/grad_in/0": 0.5, "grad_flow/grad_top": 1}


def test_log_to_is_checked_before_any_work(monkeypatch):
    with pytest.raises(UserError, match=rf"^{re.escape(f'train.log_to may hold {one_of(sinks.SINKS)}')}, "
                                        r"got \['tensorbord'\]$"):
        load_config("tiny", ["train.log_to=tensorbord"])
    monkeypatch.setitem(sinks.SINKS, "csv", sinks.TensorBoardSink)  # a member is its registry's entry alone
    assert load_config("tiny", ["train.log_to=csv"]).train.log_to == ["csv"]
    with pytest.raises(UserError, match=r"^train.log_to may hold .* or csv, got \['tensorbord'\]$"):
        load_config("tiny", ["train.log_to=tensorbord"])
    assert load_config("tiny").train.log_to == []  # off by default
    monkeypatch.setattr(sinks.WandbSink, "module", "andrea_no_such_module")
    with pytest.raises(UserError, match=r"^train.log_to has wandb, whose library \(andrea_no_such_module\) is not "
                                        r"installed: pip install -e '.\[wandb\]', or leave wandb out of train.log_to$"):
        sinks.check_installed(["wandb"])  # alone: tensorboard's library may be missing too (the test extra alone)


# ----------------------------------------------------------------------------------------------- issue 48, class 4

def sink_run(tmp_path, data_dir, out, *more):
    cfg = small_config(tmp_path, data_dir, log_to=["tensorboard"], max_steps=4, eval_interval=4,
                       checkpoint_interval=2)
    return run_main(["--config", str(cfg), "--out", str(out), *more])


def one_error_line(capsys):
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_sink_named_twice_is_refused_in_one_line_before_any_work(tmp_path, data_dir, capsys):
    with pytest.raises(UserError, match=r"^train.log_to names tensorboard twice: name each sink once, e.g. --set "
                                        r"train.log_to=tensorboard,wandb$"):
        sinks.check_sinks(["tensorboard", "wandb", "tensorboard"], tmp_path)
    out = tmp_path / "run"
    cfg = small_config(tmp_path, data_dir, max_steps=2)
    assert run_main(["--config", str(cfg), "--out", str(out), "--set", "train.log_to=tensorboard,tensorboard"]) == 2
    assert "train.log_to names tensorboard twice" in one_error_line(capsys) and not out.exists()


def test_a_sink_folder_that_is_a_file_is_refused_before_anything_is_written(tmp_path, data_dir, capsys):
    """A new run and a resume alike: nothing written (no config.json, metrics.jsonl, tokenizer, sink
    folder, marker, nor a resume record), and the same command runs once the file is moved away."""
    require("tensorboardX")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a user's notes\n")
    assert sink_run(tmp_path, data_dir, out) == 2
    assert one_error_line(capsys) == (f"error: train.log_to has tensorboard, which writes in {out / 'tensorboard'}: "
                                      "that is a file; move it away, or leave tensorboard out of train.log_to")
    assert os.listdir(out) == ["tensorboard"]
    (out / "tensorboard").unlink()
    assert sink_run(tmp_path, data_dir, out, "--stop-at-step", "2") == 0
    capsys.readouterr()
    # a resume refused for the same reason leaves metrics.jsonl as it was: no resume record
    shutil.rmtree(out / "tensorboard")
    (out / "tensorboard").write_text("a user's notes\n")
    before = (out / "metrics.jsonl").read_bytes()
    assert run_main(["--out", str(out), "--resume"]) == 2
    assert "that is a file; move it away" in one_error_line(capsys)
    assert (out / "metrics.jsonl").read_bytes() == before
    (out / "tensorboard").unlink()
    assert run_main(["--out", str(out), "--resume"]) == 0
    events = [r for r in read_records(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert len(events) == 1 and events[0]["at_step"] == 2
    assert sorted(logged(out)) == [1, 2, 3, 4]


def test_a_sink_folder_that_cannot_be_written_is_refused_before_anything_is_written(tmp_path, data_dir, capsys):
    """A resume whose sink folder is on a read-only file system: refused with metrics.jsonl as it was,
    and resumed once the folder can be written again."""
    require("tensorboardX")
    out = tmp_path / "run"
    folder = out / "tensorboard"
    assert sink_run(tmp_path, data_dir, out, "--stop-at-step", "2") == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_bytes()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        assert run_main(["--out", str(out), "--resume"]) == 2
        assert one_error_line(capsys) == (
            f"error: train.log_to has tensorboard, which writes in {folder}: it cannot be written (no permission, "
            "or a read-only file system); choose another --out, or leave tensorboard out of train.log_to")
        assert (out / "metrics.jsonl").read_bytes() == before
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert run_main(["--out", str(out), "--resume"]) == 0
    assert sorted(logged(out)) == [1, 2, 3, 4]


def test_a_sink_that_fails_as_it_opens_leaves_no_half_made_run(tmp_path, data_dir, monkeypatch, capsys):
    """A failure no check can foresee (W&B not logged in), at a start and at a resume: the run directory
    is left as it was, and the same command, once the sink works, runs."""
    require("tensorboardX")
    real = sinks.TensorBoardSink.__init__

    def fails(self, out_dir, cfg, start_step):
        (out_dir / self.directory).mkdir(exist_ok=True)  # as a library would, before it fails
        raise RuntimeError("not logged in")

    out = tmp_path / "run"
    monkeypatch.setattr(sinks.TensorBoardSink, "__init__", fails)
    assert sink_run(tmp_path, data_dir, out) == 2
    assert one_error_line(capsys) == ("error: the tensorboard metrics sink (train.log_to) could not start: "
                                      "RuntimeError: not logged in")
    assert [p.name for p in out.iterdir() if p.name != ".andrea"] == []  # the marker alone: no run in it
    monkeypatch.setattr(sinks.TensorBoardSink, "__init__", real)
    assert sink_run(tmp_path, data_dir, out, "--stop-at-step", "2") == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(sinks.TensorBoardSink, "__init__", fails)
    assert run_main(["--out", str(out), "--resume"]) == 2
    assert "could not start: RuntimeError: not logged in" in one_error_line(capsys)
    assert (out / "metrics.jsonl").read_bytes() == before and (out / "tensorboard").is_dir()  # the run's own
    monkeypatch.setattr(sinks.TensorBoardSink, "__init__", real)
    assert run_main(["--out", str(out), "--resume"]) == 0
    assert sorted(logged(out)) == [1, 2, 3, 4]
