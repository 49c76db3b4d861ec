"""Failures of the outside world and late surprises (issue 14): each found by trying, each checked here.

The pre-flight pass (--dry-run, short splits, empty prompts, memory, warmup, devices), a full disk
(a real tmpfs when the machine lets root mount one, and a simulated one), wrong paths, one story
per run directory (resume, fresh runs into an occupied --out, conflicting --config, finished runs,
stale temporaries) and what a user sees (summary, micro-batch progress, preparation lines, YAML
line numbers, the header, messages in the keys a user can type).
"""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from runs import STDLIB_JSON, run_main, small_config

from andrea import bench, sample, train
from andrea import params as params_cli
from andrea import prepare as prepare_cli
from andrea.cli import run_cli
from andrea.config import load_config
from andrea.data.manifest import split_counts
from andrea.run import checkpoint as ckpt
from andrea.run import metrics as run_metrics
from andrea.run import preflight, runlog

ROOT = Path(__file__).resolve().parents[2]


def cli(main, argv):
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv)
    return info.value.code


def one_line_error(err):
    lines = err.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("error: ") and "Traceback" not in err, err
    return lines[-1]


def steps(out):
    return [r["step"] for r in run_metrics.read_records(Path(out) / "metrics.jsonl") if "step" in r]


# ----------------------------------------------------------------------------------------------- pre-flight

def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    assert run_main(["--config", str(small_config(tmp_path, data_dir)), "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    for word in ("parameters", "memory", "tokens/step", "train tokens", "1 block,", str(out)):
        assert word in printed, printed
    assert not out.exists()


def test_a_short_validation_split_is_refused_before_the_first_step(tmp_path, data_dir, capsys):
    n_val = split_counts(data_dir)[1]
    out = tmp_path / "run"
    cfg = small_config(tmp_path, data_dir, eval_interval=4)
    code = run_main(["--config", str(cfg), "--out", str(out), "--set", f"model.context_length={n_val}"])
    assert code == 2
    msg = one_line_error(capsys.readouterr().err)
    assert "validation split" in msg and f"--set train.seq_len={n_val - 1}" in msg
    assert not (out / "metrics.jsonl").exists()  # no step was trained and lost


def test_an_empty_sample_prompt_is_refused_before_training(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    cfg = small_config(tmp_path, data_dir, sample_tokens=5)
    assert run_main(["--config", str(cfg), "--out", str(out), "--set", "train.sample_prompt="]) == 2
    assert "train.sample_prompt is empty" in one_line_error(capsys.readouterr().err)
    assert not (out / "metrics.jsonl").exists()


def test_a_model_that_cannot_fit_is_refused_from_its_shapes(tmp_path, data_dir, capsys):
    cfg = small_config(tmp_path, data_dir)
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "r"), "--set", "model.n_layer=1e9"]) == 2
    msg = one_line_error(capsys.readouterr().err)
    assert "needs" in msg and "available" in msg and "train.batch_size" in msg


def test_memory_close_to_the_limit_warns(monkeypatch):
    cfg = load_config("tiny")
    est = preflight.estimate_memory(cfg)
    warnings = []
    monkeypatch.setattr(preflight, "available_memory", lambda device: (int(est.total / 0.9), "test"))
    preflight.check_memory(est, "cpu", warn=warnings.append)
    assert len(warnings) == 1 and "90%" in warnings[0]
    monkeypatch.setattr(preflight, "available_memory", lambda device: (est.total * 10, "test"))
    preflight.check_memory(est, "cpu", warn=warnings.append)
    assert len(warnings) == 1


def test_auto_device_checks_the_memory_of_the_device_it_will_run_on(monkeypatch):
    """device auto on a GPU machine is checked against the GPU's free memory, not the host's."""
    from minitensor import device

    for usable, want in ((True, "gpu"), (False, "cpu")):
        monkeypatch.setattr(device, "gpu_available", lambda usable=usable: usable)
        assert preflight.memory_device("auto") == want
    assert preflight.memory_device("gpu") == "gpu" and preflight.memory_device("cpu") == "cpu"


def test_memory_estimate_matches_the_measured_120m_figures():
    est = preflight.estimate_memory(load_config("120m", ["train.batch_size=1"]))
    assert abs(est.state_bytes / 2**30 - 1.38) < 0.01  # BENCHMARKS.md: four buffers of 92.3M floats
    # 471.8 MiB of activations measured (12 C per layer and token, the logits and head inputs)
    assert 465 < est.activation_bytes / 2**20 < 485


def test_warmup_longer_than_the_run_is_said_with_the_peak_it_reaches(tmp_path, data_dir, capsys):
    cfg = small_config(tmp_path, data_dir)
    assert run_main(["--config", str(cfg), "--dry-run", "--set", "train.warmup_steps=16"]) == 0
    err = capsys.readouterr().err
    assert "warning: train.warmup_steps (16) exceeds train.max_steps (8)" in err and "rises to 1.50e-03" in err


# ----------------------------------------------------------------------------------------------- ANDREA_DEVICE

def test_andrea_device_is_honoured_when_no_device_is_given(tmp_path, data_dir, monkeypatch, capsys):
    from minitensor.device import gpu_available

    cfg = small_config(tmp_path, data_dir, device="auto")
    monkeypatch.setenv("ANDREA_DEVICE", "tpu")
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "a")]) == 2
    assert "ANDREA_DEVICE='tpu' is not a device" in one_line_error(capsys.readouterr().err)
    monkeypatch.setenv("ANDREA_DEVICE", "gpu")
    if not gpu_available():  # gpu asked through the environment: not a silent CPU run
        assert run_main(["--config", str(cfg), "--out", str(tmp_path / "b")]) == 2
        assert "no usable GPU" in one_line_error(capsys.readouterr().err)
    monkeypatch.setenv("ANDREA_DEVICE", "cpu")
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "c"), "--max-steps", "1"]) == 0
    assert "parameters on cpu" in capsys.readouterr().out
    monkeypatch.setenv("ANDREA_DEVICE", "tpu")  # an explicit device wins over the environment
    assert run_main(["--config", str(cfg), "--out", str(tmp_path / "d"), "--max-steps", "1", "--device", "cpu"]) == 0


def test_andrea_device_for_sample_and_bench(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ANDREA_DEVICE", "tpu")
    assert cli(sample.main, ["--checkpoint", str(tmp_path)]) == 2
    assert "ANDREA_DEVICE='tpu'" in one_line_error(capsys.readouterr().err)
    assert cli(bench.main, ["--configs", "tiny"]) == 2
    assert "ANDREA_DEVICE='tpu'" in one_line_error(capsys.readouterr().err)
    assert cli(sample.main, ["--checkpoint", str(tmp_path), "--device", "tpu"]) == 2
    assert "--device 'tpu' is not a device" in capsys.readouterr().err
    monkeypatch.setenv("ANDREA_DEVICE", "gpu")
    assert preflight.choose_device(None, "cpu") == "gpu" and preflight.choose_device("cpu") == "cpu"
    monkeypatch.delenv("ANDREA_DEVICE")
    assert preflight.choose_device(None, "cpu") == "cpu"


# ----------------------------------------------------------------------------------------------- full disk

def test_metrics_writes_on_a_full_disk_warn_and_training_goes_on(tmp_path, data_dir, monkeypatch, capsys):
    real = run_metrics._write
    state = {"n": 0}

    def full_after_three(fd, data):
        state["n"] += 1
        if 3 < state["n"] < 7:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(run_metrics, "_write", full_after_three)
    out = tmp_path / "run"
    assert run_main(["--config", str(small_config(tmp_path, data_dir)), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("metrics.jsonl failed (No space left on device); training goes on") == 1
    assert steps(out) == [1, 2, 3, 7, 8] and "done: step 8" in captured.out


def test_a_failed_final_save_exits_4_naming_the_newest_checkpoint(tmp_path, data_dir, monkeypatch, capsys):
    real_save = ckpt.save_checkpoint

    def full_disk_at_step_8(out_dir, step, *args, **kwargs):
        if step == 8:
            raise ckpt.CheckpointError("saving checkpoint failed: No space left on device")
        return real_save(out_dir, step, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk_at_step_8)
    out = tmp_path / "run"
    assert run_main(["--config", str(small_config(tmp_path, data_dir)), "--out", str(out)]) == runlog.EXIT_SAVE_FAILED
    err = capsys.readouterr().err
    assert f"the newest on disk is {out / 'ckpt-00000004'} (step 4)" in err and "--resume" in err


def _mount_tmpfs(path, size):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def test_a_real_full_disk_keeps_training_and_exits_4(tmp_path, data_dir):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated full disk tests above still run")
    try:
        out = disk / "run"
        out.mkdir()
        # leave room for config.json, tokenizer.json and one page of metrics, none for a checkpoint
        need = 4096 * (3 + (data_dir / "tokenizer.json").stat().st_size // 4096)
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(bytes(free - need))
        cfg = small_config(tmp_path, data_dir, max_steps=60, eval_interval=30, checkpoint_interval=20)
        proc = subprocess.run([sys.executable, "-m", "andrea.train", "--config", str(cfg), "--out", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == runlog.EXIT_SAVE_FAILED, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "metrics.jsonl failed" in proc.stderr and "training goes on" in proc.stderr
        assert "step     60/60" in proc.stdout  # it trained to the end
        assert "checkpoint of step 60 could not be saved; there is no checkpoint on disk" in proc.stderr
        assert not list(out.glob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ----------------------------------------------------------------------------------------------- wrong paths

def test_wrong_paths_are_refused_before_any_work(tmp_path, data_dir, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cfg = str(small_config(tmp_path, data_dir))
    cases = [
        (train.main, ["--config", cfg, "--out", str(a_file)], "is a file, not a directory"),
        (train.main, ["--config", cfg, "--out", str(a_file / "sub")], f"{a_file} is a file"),
        (train.main, ["--config", cfg, "--out", str(a_file), "--resume"], "is a file, not a directory"),
        (train.main, ["--config", cfg, "--set", f"data.data_dir={a_file}"], "data.data_dir"),
        (train.main, ["--config", str(tmp_path)], "unknown config"),
        (prepare_cli.main, ["--data-dir", str(a_file), "--input", str(a_file)], "--data-dir"),
        (sample.main, ["--checkpoint", str(a_file)], "is a file"),
        (bench.main, ["--configs", "tiny", "--json", str(tmp_path / "no" / "b.json")], "does not exist"),
        (params_cli.main, [str(tmp_path / "dir.yaml")], "does not exist"),
    ]
    (tmp_path / "conf.yaml").mkdir()
    cases.append((params_cli.main, [str(tmp_path / "conf.yaml")], "is a directory"))
    for main, argv, message in cases:
        assert cli(main, argv) == 2, argv
        assert message in one_line_error(capsys.readouterr().err), argv


def test_a_directory_that_cannot_be_made_is_refused_before_any_work(tmp_path, data_dir, capsys):
    """Permission bits pass a path below a link to nowhere, and for root one in /proc: the dry run,
    the run and prepare try making it (and remove what they made), so each refuses it in one line,
    rc 2, before printing or writing anything."""
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    cfg = str(small_config(tmp_path, data_dir))
    places = [tmp_path / "gone" / "run"] + ([Path("/proc/andrea-test/run")] if Path("/proc/self").is_dir() else [])
    for place in places:
        cases = [
            (train.main, ["--config", cfg, "--out", str(place), "--dry-run"], f"--out {place} cannot be created"),
            (train.main, ["--config", cfg, "--out", str(place)], f"--out {place} cannot be created"),
            (train.main, ["--config", cfg, "--out", str(tmp_path / "run"), "--set", f"data.data_dir={place}"],
             f"data.data_dir {place} cannot be created"),
            (prepare_cli.main, ["--data-dir", str(place), "--input", cfg], f"--data-dir {place} cannot be created"),
        ]
        for main, argv, message in cases:
            assert cli(main, argv) == 2, argv
            out, err = capsys.readouterr()
            assert out == "" and message in one_line_error(err), argv
    assert not (tmp_path / "run").exists() and not (tmp_path / "nowhere").exists()
    new = tmp_path / "new" / "a" / "run"  # a path that can be made is accepted, and left as it was
    assert cli(train.main, ["--config", cfg, "--out", str(new), "--dry-run"]) == 0
    assert not (tmp_path / "new").exists()


def test_files_that_are_not_what_they_claim(tmp_path, data_dir, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  d_model: 64\n   n_layer: 2\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"model:\n  d_model: 64 # caf\xe9\n")
    assert cli(params_cli.main, [str(bad_yaml)]) == 2
    assert "is not valid YAML: line 3, column 11" in one_line_error(capsys.readouterr().err)
    assert cli(params_cli.main, [str(latin)]) == 2
    assert "is not UTF-8" in one_line_error(capsys.readouterr().err)
    for text in ("", "# only a comment\n"):  # not "every default" (a 124M model): a wrong path, a cut write
        (tmp_path / "empty.yaml").write_text(text)
        assert cli(train.main, ["--config", str(tmp_path / "empty.yaml"), "--dry-run"]) == 2
        assert f"config {tmp_path / 'empty.yaml'} is empty" in one_line_error(capsys.readouterr().err)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{not json")
    assert run_main(["--out", str(out), "--resume"]) == 2
    assert "is not readable JSON" in one_line_error(capsys.readouterr().err)
    (out / "config.json").write_text("[1, 2]")
    assert run_main(["--out", str(out), "--resume"]) == 2
    assert "does not hold a config" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("main, argv, message", [
    (train.main, ["--seed", "-1", "--dry-run"], "train.seed must be in [0, 2^63)"),
    (train.main, ["--max-steps", "nan"], "--max-steps: invalid int value"),
    (train.main, ["--device", "tpu"], "argument --device: invalid choice"),
    (sample.main, ["--checkpoint", ".", "--temperature", "nan"], "--temperature must be a finite number"),
    (sample.main, ["--checkpoint", ".", "--temperature", "inf"], "--temperature must be a finite number"),
    (sample.main, ["--checkpoint", ".", "--top-k", "-3"], "--top-k must be >= 0"),
    (sample.main, ["--checkpoint", ".", "--seed", "-1"], "--seed must be in"),
    (sample.main, ["--checkpoint", ".", "--prompt", ""], "--prompt is empty"),
    (prepare_cli.main, ["--val-fraction", "nan", "--data-dir", "/tmp/x"], "--val-fraction must be between"),
])
def test_numbers_out_of_their_domain_are_one_line_errors(main, argv, message, capsys):
    assert cli(main, argv) == 2
    assert message in one_line_error(capsys.readouterr().err)


# ----------------------------------------------------------------------------------------------- one story per run

def test_after_a_resume_each_step_is_in_the_metrics_once(tmp_path, data_dir, capsys):
    cfg = small_config(tmp_path, data_dir)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out), "--stop-at-step", "6"]) == 0
    shutil.rmtree(out / "ckpt-00000006")  # as if killed before step 6's save: steps 5-6 are redone
    assert run_main(["--out", str(out), "--resume"]) == 0
    assert "dropped 2 metrics rows" in capsys.readouterr().out
    rows = run_metrics.read_records(out / "metrics.jsonl")
    assert steps(out) == list(range(1, 9))
    events = [r for r in rows if r.get("event") == "resume"]
    assert len(events) == 1 and events[0]["at_step"] == 4 and events[0]["dropped_rows"] == 2


def test_a_fresh_run_into_another_runs_directory_is_refused(tmp_path, data_dir, capsys):
    cfg = str(small_config(tmp_path, data_dir, max_steps=4))
    out = tmp_path / "run"
    assert run_main(["--config", cfg, "--out", str(out), "--set", "train.checkpoint_interval=100",
                     "--stop-at-step", "2"]) == 0
    shutil.rmtree(out / "ckpt-00000002")  # no checkpoint left, but metrics and config.json of a run
    assert run_main(["--config", cfg, "--out", str(out)]) == 2
    msg = one_line_error(capsys.readouterr().err)
    assert "--resume" in msg and "another --out" in msg and "--overwrite" in msg
    assert run_main(["--config", cfg, "--out", str(out), "--overwrite"]) == 0
    assert steps(out) == [1, 2, 3, 4]


def test_resume_with_another_config_is_an_error(tmp_path, data_dir, capsys):
    cfg = small_config(tmp_path, data_dir)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out), "--stop-at-step", "4"]) == 0
    assert run_main(["--config", "tiny", "--out", str(out), "--resume"]) == 2
    msg = one_line_error(capsys.readouterr().err)
    assert "--config tiny differs from the config of the run" in msg and "model.context_length" in msg
    assert run_main(["--config", str(cfg), "--out", str(out), "--resume"]) == 0  # its own config: fine


def test_resuming_a_finished_run_says_so(tmp_path, data_dir, capsys):
    cfg = small_config(tmp_path, data_dir, max_steps=4)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out)]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert run_main(["--out", str(out), "--resume"]) == 0
    assert "has already finished" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == before


def test_stale_temporaries_of_killed_saves_and_preparations_are_removed(tmp_path, data_dir):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    out = tmp_path / "run"
    out.mkdir()
    dead = 2**22 + 12345  # above Linux's pid_max: no such process
    stale = [data / f".train.bin.{dead}.tmp", out / f".config.json.{dead}.tmp"]
    for p in stale:
        p.write_bytes(b"partial")
    (out / ".tmp-ckpt-00000004-0bad").mkdir()
    live = data / f".val.bin.{os.getppid()}.tmp"  # a live writer's file stays
    live.write_bytes(b"x")
    cfg = small_config(tmp_path, data, max_steps=1)
    assert run_main(["--config", str(cfg), "--out", str(out)]) == 0
    assert not any(p.exists() for p in stale) and not (out / ".tmp-ckpt-00000004-0bad").exists()
    assert live.exists()


# ----------------------------------------------------------------------------------------------- what a user sees

def test_summary_header_and_micro_batch_progress(tmp_path, data_dir, monkeypatch, capsys):
    monkeypatch.setattr(runlog, "PROGRESS_AFTER_S", 0.0)
    cfg = small_config(tmp_path, data_dir, max_steps=2, tokens_per_step=4 * 16 * 3)
    out = tmp_path / "run"
    assert run_main(["--config", str(cfg), "--out", str(out), "--set", "model.n_layer=1"]) == 0
    printed = capsys.readouterr().out
    assert "with model.n_layer=1 (1 block, d_model 16" in printed and "  1 block (" in printed
    assert "1 blocks" not in printed
    assert "micro-batch 2/3 done" in printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("done: step 2 (2 this run)") and "val loss" in last and "ckpt-00000002" in last


def test_preparation_inside_train_and_tokenizer_progress_are_announced(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(STDLIB_JSON, corpus, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = {"model": {"context_length": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
           "train": {"batch_size": 2, "max_steps": 1, "sample_tokens": 0, "device": "cpu"},
           "data": {"inputs": [str(corpus)], "data_dir": str(tmp_path / "data")}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_main(["--config", str(path), "--out", str(tmp_path / "run")]) == 2  # 8449 ids: corpus too small
    err = capsys.readouterr().err
    assert "first run on this corpus: preparing" in err and "tokenizer: reading" in err
    msg = one_line_error(err)
    assert "--set data.allow_smaller_vocab=true" in msg and "--allow-smaller-vocab" not in msg


def test_an_unhandled_file_system_failure_is_one_line_exit_1(tmp_path, capsys):
    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    assert cli(main, []) == 1
    assert one_line_error(capsys.readouterr().err) == (f"error: {tmp_path / 'x'}: No space left on device "
                                                      "(add --debug for the traceback)")
    with pytest.raises(OSError):
        run_cli(main, ["--debug"])


def test_bench_refuses_its_mistakes_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_components", lambda repeats: pytest.fail("measured before checking"))
    for argv, message in ((["--components", "--torch", "--configs", "huge"], "unknown config 'huge'"),
                          (["--components", "--repeats", "0"], "--repeats must be at least 1"),
                          (["--components", "--json", str(tmp_path / "no" / "b.json")], "does not exist")):
        assert cli(bench.main, argv) == 2
        assert message in one_line_error(capsys.readouterr().err)


def test_a_mistyped_cpu_kernels_setting_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ANDREA_CPU_KERNELS", "numbaa")
    assert cli(sample.main, ["--checkpoint", str(tmp_path)]) == 2
    assert "ANDREA_CPU_KERNELS='numbaa'" in one_line_error(capsys.readouterr().err)
