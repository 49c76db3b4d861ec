"""No command loses a file it did not create (issue 20, class 1): train and export claim their --out.

A directory andrea.train or andrea.export writes carries a marker of its kind and is locked while
written (andrea.run.rundir). Checked here: export refuses a user's own config.json, the run it exports
and a file, before reading the checkpoint; train refuses a Hugging Face model directory and a data
directory, with --overwrite too, and deletes only its own files with it; two runs into one --out
cannot both run; a lock left by a killed process locks nothing; a run from before the marker is
refused in one line.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runs import run_main, small_config

from andrea import export
from andrea.cli import run_cli
from andrea.errors import UserError
from andrea.run import rundir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    """A finished two-step run."""
    root = tmp_path_factory.mktemp("run")
    out = root / "run"
    assert run_main(["--config", str(small_config(root, data_dir, max_steps=2)), "--out", str(out)]) == 0
    return out


def snapshot(directory):
    """{relative path: sha256} of every file under `directory`."""
    directory = Path(directory)
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def cli(main, argv, capsys):
    """(exit code, the last line of stderr) of an entry point run as its __main__ does."""
    with pytest.raises(SystemExit) as info:
        run_cli(main, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, (err.strip().splitlines() or [""])[-1]


def never_load(*args, **kwargs):
    raise AssertionError("the checkpoint was read before --out was checked")


# ----------------------------------------------------------------------------------------------- export

def test_export_refuses_a_users_own_files_before_reading_the_checkpoint(run, tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    before = snapshot(mine)
    monkeypatch.setattr(export, "load_model", never_load)
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(mine)], capsys)
    assert code == 2 and last.startswith("error: ") and "config.json" in last and "did not write" in last
    assert snapshot(mine) == before


def test_export_refuses_the_run_it_exports_which_still_resumes(run, data_dir, capsys, monkeypatch):
    before = snapshot(run)
    monkeypatch.setattr(export, "load_model", never_load)
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(run)], capsys)
    assert code == 2 and "training run's directory" in last
    checkpoint = sorted(run.glob("ckpt-*"))[-1]
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(checkpoint)], capsys)
    assert code == 2 and "checkpoint" in last
    assert snapshot(run) == before
    assert run_main(["--out", str(run), "--resume"]) == 0  # finished, and still a run
    assert "already finished" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["file", "under a file"])
def test_export_to_a_file_is_refused_before_reading_the_checkpoint(run, tmp_path, monkeypatch, capsys, kind):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    monkeypatch.setattr(export, "load_model", never_load)
    out = a_file if kind == "file" else a_file / "x"
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)
    assert code == 2 and last.startswith("error: --out") and a_file.read_text() == "mine"


def test_export_replaces_its_own_earlier_export_and_keeps_other_files(run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("a model card")
    assert cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)[0] == 0
    assert rundir.kind_of(out) == "export"
    (out / "model.safetensors").write_bytes(b"stale")
    assert cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)[0] == 0
    assert (out / "model.safetensors").read_bytes() != b"stale" and (out / "README.md").read_text() == "a model card"


def test_export_refuses_to_replace_the_export_of_another_run(run, tmp_path, capsys):
    # issue 30, class 12: the export of one run silently replaced another run's
    import shutil

    other = tmp_path / "other-run"
    shutil.copytree(run, other)  # another run directory (with the same weights: which run it is, is the path)
    out = tmp_path / "hf"
    assert cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)[0] == 0
    before = snapshot(out)
    code, last = cli(export.main, ["--checkpoint", str(other), "--out", str(out)], capsys)
    assert code == 2 and last.startswith(f"error: --out {out} holds the export of another run ({run.resolve()})")
    assert snapshot(out) == before
    newest = sorted(run.glob("ckpt-*"))[-1]  # the same run, named by one of its checkpoints: replaced
    assert cli(export.main, ["--checkpoint", str(newest), "--out", str(out)], capsys)[0] == 0
    marker = json.loads((out / rundir.MARKER).read_text())
    marker.pop("source")  # an export of an andrea that did not name its run
    (out / rundir.MARKER).write_text(json.dumps(marker))
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)
    assert code == 2 and "a run it does not name" in last


def test_a_refused_export_leaves_nothing_behind(run, tmp_path, capsys):
    # issue 30, class 12: a variant's export was refused after --out was made and marked
    import shutil

    variant = tmp_path / "post-norm"
    shutil.copytree(run, variant)
    for meta_path in variant.glob("ckpt-*/meta.json"):  # the same tensors, under a post-norm config
        record = json.loads(meta_path.read_text())
        record["meta"]["config"]["model"]["norm_position"] = "post"
        meta_path.write_text(json.dumps(record))
    out = tmp_path / "hf"
    code, last = cli(export.main, ["--checkpoint", str(variant), "--out", str(out)], capsys)
    assert code == 2 and "is a variant (norm_position=post), not GPT-2" in last
    assert not out.exists()


def test_an_export_that_fails_to_write_leaves_no_half_export(run, tmp_path, monkeypatch, capsys):
    import errno

    from andrea.interop import hf

    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(hf, "atomic_writer", full_disk)
    out = tmp_path / "hf"
    code, last = cli(export.main, ["--checkpoint", str(run), "--out", str(out)], capsys)
    assert code == 1 and "No space left on device" in last
    assert not out.exists()


# ----------------------------------------------------------------------------------------------- train

def hugging_face_directory(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (path / "model.safetensors").write_bytes(b"weights")
    return path


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"], ["--dry-run"], ["--overwrite", "--dry-run"]])
def test_train_never_takes_over_a_hugging_face_or_data_directory(data_dir, tmp_path, capsys, flags):
    hf_dir = hugging_face_directory(tmp_path / "gpt2")
    for other in (hf_dir, data_dir):
        before = snapshot(other)
        cfg = str(small_config(tmp_path, data_dir, max_steps=2))
        assert run_main(["--config", cfg, "--out", str(other), *flags]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: ") and str(other) in last
        assert snapshot(other) == before, other


def test_overwrite_deletes_only_what_train_wrote(data_dir, tmp_path, capsys):
    cfg = str(small_config(tmp_path, data_dir, max_steps=2))
    out = tmp_path / "run"
    assert run_main(["--config", cfg, "--out", str(out)]) == 0
    (out / "notes.txt").write_text("my notes")
    (out / "ckpt-notes").mkdir()
    assert run_main(["--config", cfg, "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and (out / "ckpt-notes").is_dir()


def test_a_run_from_before_the_marker_is_refused_in_one_line(data_dir, tmp_path, capsys):
    from andrea import train

    cfg = str(small_config(tmp_path, data_dir, max_steps=4))
    out = tmp_path / "run"
    assert run_main(["--config", cfg, "--out", str(out), "--stop-at-step", "2"]) == 0
    (out / rundir.MARKER).unlink()
    before = snapshot(out)
    assert rundir.kind_of(out) is None
    code, line = cli(train.main, ["--out", str(out), "--resume"], capsys)
    assert code == 2 and line == (f"error: --out {out} holds a run of an older layout (no .andrea marker): resume "
                                  "it with the andrea version that wrote it, or choose another --out")
    assert snapshot(out) == before


def test_a_second_run_into_a_claimed_out_is_refused(data_dir, tmp_path, capsys):
    cfg = str(small_config(tmp_path, data_dir, max_steps=2))
    out = tmp_path / "run"
    with rundir.claim(out, "run"):  # another andrea.train, mid-run (flock: per open file, so also in-process)
        for flags in ([], ["--overwrite"], ["--dry-run"]):
            assert run_main(["--config", cfg, "--out", str(out), *flags]) == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert "in use by another andrea.train" in last and f"process {os.getpid()}" in last
        assert not (out / "metrics.jsonl").exists()
    assert run_main(["--config", cfg, "--out", str(out)]) == 0  # released


def test_two_trainings_started_together_into_one_out(data_dir, tmp_path):
    """Real processes: the first holds --out for its whole run, the second exits 2 at once."""
    # a run far longer than the test (stopped by SIGINT below), so it is surely still running
    cfg = str(small_config(tmp_path, data_dir, max_steps=10**6, checkpoint_interval=10**6, eval_interval=10**6,
                           log_interval=10**6))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), ANDREA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    argv = [sys.executable, "-m", "andrea.train", "--config", cfg, "--out", str(out)]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:  # running: it has claimed --out
            if line.startswith("step"):
                break
        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "in use by another andrea.train" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130  # stopped by the interrupt, with a checkpoint it can resume from
    assert sorted(out.glob("ckpt-*"))


def test_the_lock_of_a_killed_process_locks_nothing(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from andrea.run import rundir; rundir.claim(sys.argv[1], 'run'); "
                               "print('claimed', flush=True); time.sleep(60)", str(out)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "claimed"
    with pytest.raises(UserError, match="in use by another andrea.train"):
        rundir.claim(out, "run")
    holder.kill()
    holder.wait()
    with rundir.claim(out, "run") as claim:
        assert claim.directory == out


def test_a_file_system_without_locks_is_a_warning_not_a_refusal(tmp_path, monkeypatch, capsys):
    import errno

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    out = tmp_path / "run"
    with rundir.claim(out, "run"):
        assert rundir.kind_of(out) == "run"
    assert "cannot be locked here (No locks available)" in capsys.readouterr().err


def test_another_checks_moment_on_a_new_out_is_not_a_run_in_use(tmp_path):
    """The race the ranks of one run met (1 in ~40 suites, 3 processes): rank 0's preflight makes the new
    --out, locks it for a moment and removes it (andrea.run.paths.check_directory), while rank 2 probes it
    (rundir.check). A lock that is gone a moment later is not a run in use, and neither is a directory gone
    meanwhile; a lock that stays is (the probe tries 3 times, 50 ms apart)."""
    import fcntl
    import threading

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # flock locks an open file: another open in this process conflicts
    fcntl.flock(fd, fcntl.LOCK_EX)
    timer = threading.Timer(0.02, os.close, (fd,))  # the other check's moment: the lock dropped 20 ms on
    timer.start()
    try:
        rundir.check(out, "run")                    # no error: it saw the lock, then a free directory
    finally:
        timer.join()
    gone = tmp_path / "gone"
    rundir._refuse_if_in_use(gone, "run")           # removed between is_dir() and the probe's open: nothing in use
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)                  # held throughout: a claim
    try:
        with pytest.raises(UserError, match="in use by another andrea.train"):
            rundir.check(out, "run")
    finally:
        os.close(fd)
