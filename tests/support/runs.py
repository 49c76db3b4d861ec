"""A small training run in-process, for the tests of the app and of whole commands: the config of
a one-layer model on the stdlib's json package, `andrea.train`'s command run through andrea's
command shell (its exit status; SystemExit is what the shell ends with), and a finished run of a
2-block model trained a few steps (`tiny_run`: trace, eval and serve read it)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from andrea import train

ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = Path(json.__file__).parent


def small_config(tmp, data_dir, **train_overrides):
    cfg = {
        "model": {"vocab_size": 8449, "context_length": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
        "train": {"batch_size": 4, "max_steps": 8, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "log_interval": 1, "eval_interval": 4, "eval_batches": 2, "checkpoint_interval": 4,
                  "sample_tokens": 0, "device": "cpu", **train_overrides},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(data_dir), "allow_smaller_vocab": True},
    }
    path = Path(tmp) / "small.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_main(argv):
    with pytest.raises(SystemExit) as exit_info:
        from andrea.cli import run_cli

        run_cli(train.main, argv)
    return exit_info.value.code


def tiny_run(tmp, data_dir, steps=3):
    """A run directory of a 2-block model trained `steps` steps on the data fixture's corpus."""
    path = small_config(tmp, data_dir, max_steps=steps, eval_interval=steps, checkpoint_interval=steps)
    cfg = yaml.safe_load(path.read_text())
    cfg["model"].update(n_layer=2, n_head=2, context_length=32)
    path.write_text(yaml.safe_dump(cfg))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        assert run_main(["--config", str(path), "--out", str(tmp / "run")]) == 0
    (tmp / "train.out").write_text(printed.getvalue())  # what training printed, beside the run
    return tmp / "run"
