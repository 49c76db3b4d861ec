"""The checks before any work, the same with and without --dry-run and on every rank (issue 20,
classes 3 and 4): a dry run refuses what the real start refuses, prints the plan of the whole
launch with the device its probe found, and ranks started with different arguments all stop with
one error instead of waiting for each other forever.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from optional import require
from procs import run_in_own_session

from andrea.config import load_config
from andrea.errors import UserError
from andrea.run.launch import build_run_config
from andrea.run.trainer import kernels_line
from andrea.train import parse_args
from minitensor.backends import numba_jit

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def small_config(tmp, **train):
    cfg = {"model": {"vocab_size": 300, "context_length": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
           "train": {"batch_size": 4, "max_steps": 4, "warmup_steps": 1, "sample_tokens": 0, "device": "cpu",
                     **train},
           "data": {"data_dir": str(Path(tmp) / "data")}}
    path = Path(tmp) / "small.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def launch(cmd, timeout=120):
    """Runs a command in its own session; one still running after `timeout` fails the test (killed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")
    done = run_in_own_session(cmd, env, ROOT, timeout)
    return done.returncode, done.stdout, done.stderr


def train(*args, n=1):
    cmd = [sys.executable, "-m", "andrea.train", *args]
    if n > 1:
        require("mpi4py")
        cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py", *cmd[1:]]
    return launch(cmd)


def error_line(err):
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def gpt2_directory(path, weights=None):
    """A GPT-2 directory holding config.json and, optionally, `weights` (file name: bytes)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_positions": 16,
                                                  "n_embd": 16, "n_layer": 1, "n_head": 2}))
    for name, data in (weights or {}).items():
        (path / name).write_bytes(data)
    return path


@pytest.mark.parametrize("dry_run", [True, False])
def test_init_from_without_its_weights_is_refused_before_any_work(tmp_path, dry_run):
    bare = gpt2_directory(tmp_path / "bare")
    index = {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors",
                            "transformer.h.0.ln_1.weight": "model-00002-of-00002.safetensors"}}
    sharded = gpt2_directory(tmp_path / "sharded", {"model.safetensors.index.json": json.dumps(index).encode(),
                                                    "model-00001-of-00002.safetensors": b""})
    flags = ["--dry-run"] if dry_run else []
    for directory, message in ((bare, "has no model.safetensors"),
                               (sharded, "names model-00002-of-00002.safetensors, which is not in")):
        code, out, err = train("--config", small_config(tmp_path), "--init-from", str(directory),
                               "--out", str(tmp_path / "run"), *flags)
        assert code == 2 and message in error_line(err), err
        assert not (tmp_path / "data").exists()  # nothing prepared


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_vocabulary_beyond_uint16_is_refused_before_any_work(tmp_path, dry_run):
    code, out, err = train("--config", small_config(tmp_path), "--set", "model.vocab_size=70000",
                           "--out", str(tmp_path / "run"), *(["--dry-run"] if dry_run else []))
    assert code == 2 and "model.vocab_size 70000 is more than the token files hold" in error_line(err)
    assert not (tmp_path / "data").exists()


def test_the_dry_run_names_the_device_its_probe_found(tmp_path):
    code, out, err = train("--config", small_config(tmp_path), "--out", str(tmp_path / "run"), "--dry-run")
    assert code == 0, err
    device = next(line for line in out.splitlines() if line.startswith("device"))
    assert device.split()[1] == "cpu" and "train.device" not in device  # asked for and got the CPU
    code, out, err = train("--config", small_config(tmp_path, device="auto"), "--out", str(tmp_path / "run"),
                           "--dry-run")
    device = next(line for line in out.splitlines() if line.startswith("device"))
    assert code == 0 and device.split()[1] in ("cpu", "gpu") and "(train.device auto)" in device, out
    assert "Error" not in err  # a CPU machine is no error


@pytest.mark.slow
def test_under_mpiexec_the_dry_run_plans_the_whole_launch_and_refuses_what_it_cannot_share(tmp_path):
    # 192 tokens a step = 3 windows of 4 x 16: one process takes all 3, two processes cannot share them
    cfg = small_config(tmp_path, tokens_per_step=192)
    code, out, err = train("--config", cfg, "--out", str(tmp_path / "run"), "--dry-run")
    assert code == 0 and "192 (batch 4 x 16 tokens x 3 micro-batches)" in out, out + err
    code, out, err = train("--config", cfg, "--out", str(tmp_path / "run"), "--dry-run", n=2)
    assert code == 2 and "must be a multiple of batch_size x seq_len x processes (4 x 16 x 2 = 128)" in err, err
    code, out, err = train("--config", cfg, "--set", "train.tokens_per_step=256", "--out", str(tmp_path / "run"),
                           "--dry-run", n=2)
    assert code == 0, err
    assert "256 (batch 4 x 16 tokens x 2 micro-batches each x 2 processes)" in out, out
    assert out.count("tokens/step") == 1  # rank 0 prints the plan once


@pytest.mark.slow
def test_ranks_started_with_different_arguments_all_stop_with_one_error(tmp_path):
    require("mpi4py")
    cfg = small_config(tmp_path)
    rank = [sys.executable, "-m", "mpi4py", "-m", "andrea.train", "--config", cfg, "--out", str(tmp_path / "run")]
    # an MPMD launch: rank 0 told 2 steps, rank 1 told 3 (each rank would wait in a collective
    # the other never reaches)
    code, out, err = launch([str(MPIEXEC), "-n", "1", *rank, "--max-steps", "2", ":", "-n", "1", *rank,
                             "--max-steps", "3"])
    assert code == 2, err
    line = error_line(err)
    assert "started with other arguments than rank 0: train.max_steps 3 (rank 0: 2)" in line, line
    assert "(rank 1 of 2)" in line and not (tmp_path / "data").exists()


def test_the_start_up_line_names_the_cpu_path_the_steps_run():
    from minitensor.backends import get_ops

    line = kernels_line(get_ops(np, "numba"))  # was "kernels: generic (NumPy)" while numba ran
    if numba_jit.numba is not None:
        assert line.startswith("kernels: numba-compiled CPU kernels") and "the first step compiles them" in line
        # the backend's own line, which andrea.bench prints, names them too (it said "generic (NumPy)")
        assert get_ops(np, "numba").kernels_line.startswith("kernels: numba-compiled CPU kernels")
    else:
        assert line.startswith("kernels: NumPy (pip install")
    assert kernels_line(get_ops(np, "numpy")).startswith("kernels: NumPy")


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_to_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # what a Ctrl-C after the start-up and before the first checkpoint leaves
    (out / "config.json").write_text(json.dumps(load_config(small_config(tmp_path)).to_dict()))
    (out / "metrics.jsonl").write_text("")
    (out / ".andrea").write_text(json.dumps({"kind": "run", "written_by": "andrea.train", "pid": 1}))  # the claim
    code, _, err = train("--out", str(out), "--resume")
    assert code == 2 and "stopped before its first checkpoint; start it afresh with --overwrite" in error_line(err)
    code, _, err = train("--config", small_config(tmp_path), "--out", str(out))
    assert code == 2 and "--overwrite" in error_line(err)


def test_an_init_from_run_is_named_after_its_directory(tmp_path):
    args = parse_args(["--init-from", str(gpt2_directory(tmp_path / "my-gpt2"))])
    cfg, out_dir = build_run_config(args)
    assert cfg.name == "my-gpt2-finetune" and out_dir == Path("out") / "my-gpt2-finetune"  # not out/andrea-tiny


def test_a_cpu_machine_with_cupy_installed_reads_one_calm_line(monkeypatch):
    from andrea.errors import UserError
    from andrea.run import preflight
    from minitensor import device

    driver = ("no CUDA device (CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is "
              "insufficient for CUDA runtime version)")
    monkeypatch.setattr(device, "_probe_gpu", lambda: (False, driver))
    chosen, note = preflight.probe_device("auto")
    assert chosen == "cpu" and "Error" not in note and "insufficient" not in note
    assert note.startswith("no usable GPU (CuPy is installed, but this machine has no CUDA driver or GPU)")
    with pytest.raises(UserError, match="--device gpu: no usable GPU: no CUDA device"):
        preflight.probe_device("gpu")  # asked for: the full reason
    assert preflight.probe_device("cpu") == ("cpu", "")
    monkeypatch.setattr(device, "_probe_gpu", lambda: (True, ""))
    assert preflight.probe_device("auto") == ("gpu", "")


def test_init_from_checks_train_values_against_the_imported_model(tmp_path):
    # the README's fine-tune: seq_len 256, above the tiny config's context (128), within GPT-2's (1024)
    directory = gpt2_directory(tmp_path / "gpt2")
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_positions": 1024,
                                                       "n_embd": 16, "n_layer": 1, "n_head": 2}))
    sets = ["train.seq_len=256", "train.lr=1e-4", "train.min_lr=1e-5"]
    cfg, _ = build_run_config(parse_args(["--init-from", str(directory), *[a for s in sets for a in ("--set", s)]]))
    assert (cfg.model.context_length, cfg.train.seq_len, cfg.train.lr) == (1024, 256, 1e-4)
    with pytest.raises(UserError, match=r"train.seq_len \(2048\) exceeds model.context_length \(1024\)"):
        build_run_config(parse_args(["--init-from", str(directory), "--set", "train.seq_len=2048"]))
