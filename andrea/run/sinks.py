"""The optional sinks of a run's metrics, each an extra that train.log_to turns on (none by default):

    python -m andrea.train --set train.log_to=tensorboard,wandb

Each takes every record andrea.run.metrics.Metrics hands it (on rank 0 alone) and plots its finite
numbers (`scalars`: a record's keys as tags, nested ones joined with "/") at the record's step: the
values metrics.jsonl holds, TensorBoard's as float32.

- **tensorboard** (`pip install -e '.[tensorboard]'`: tensorboardX writes, TensorBoard reads): event
  files in OUT/tensorboard/, for `tensorboard --logdir OUT/tensorboard`. A resume from step S opens a
  new event file that starts with a SessionLog START at step S + 1 (tensorboardX's purge_step), which
  tells TensorBoard to hide the earlier files' events from that step on: the steps the interrupted
  run logged after its checkpoint, which the resumed run logs again (metrics.jsonl drops them too).
- **wandb** (`pip install -e '.[wandb]'`): a W&B run named after OUT, its files in OUT/wandb/; online,
  or with WANDB_MODE=offline on disk alone (`wandb sync OUT/wandb/offline-run-*` uploads it later).
  W&B never rewrites a step it holds, so a resume continues the same W&B run (its id and the last
  step logged to it are kept in OUT/wandb/andrea-run.json) and leaves out the steps up to that one:
  those between the checkpoint and the interruption keep the interrupted run's values (on the CPU,
  the same bits). A branch (--resume-from) into a new --out is a new W&B run. W&B does not capture
  the console (console="off"): the log is andrea's own. WANDB_PROJECT names the project (default andrea).

Every check that can be made before the run writes anything is `check_sinks` (preflight: the names,
the libraries, each sink's folder); a sink that still fails as it opens (W&B not logged in) is opened
before the run directory is written (andrea.run.metrics.open_sinks), and leaves nothing behind.

A new sink: a class here (`name`, `__init__(out_dir, cfg, start_step)`, `log(record)`, `flush()`,
`close()`; `module` and `extra`: what it imports and the pyproject.toml extra that installs it, or
None for a sink that needs no library; `directory`: the folder of the run directory it writes in,
which `train --overwrite` deletes with the rest of the run), its entry in SINKS, and a test that
reads back what it wrote.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
from pathlib import Path

from andrea.errors import UserError, one_of
from andrea.files import atomic_writer


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a record but its step, by tag: nested values joined with "/"
    ({"grad_flow": {"grad_in": [0.1, ...]}} -> "grad_flow/grad_in/0"); flags and text left out."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix] = value

    walk("", {k: v for k, v in record.items() if k != "step"})
    return out


class TensorBoardSink:
    name, module, extra, directory = "tensorboard", "tensorboardX", "tensorboard", "tensorboard"

    def __init__(self, out_dir: Path, cfg, start_step: int):
        from tensorboardX import SummaryWriter

        # a file name of its own: tensorboardX names a file by the second and the host, so two writers
        # opened within one second (a quick resume) would write one file
        self.writer = SummaryWriter(str(out_dir / self.directory), purge_step=start_step + 1 if start_step else None,
                                    filename_suffix=f".{os.getpid()}.{secrets.token_hex(3)}")

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name, module, extra, directory = "wandb", "wandb", "wandb", "wandb"

    def __init__(self, out_dir: Path, cfg, start_step: int):
        import wandb

        self.state_path = out_dir / self.directory / "andrea-run.json"
        state = _read_state(self.state_path) if start_step else {}
        self.run_id = state.get("id") or secrets.token_hex(4)  # W&B's ids: 8 lowercase letters and digits
        self.seen = self.last_step = int(state.get("last_step", 0))  # W&B holds the steps up to this one
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "andrea", name=out_dir.resolve().name,
                              dir=str(out_dir), id=self.run_id, resume="allow", config=cfg.to_dict(),
                              settings=wandb.Settings(console="off"))
        self._save_state()

    def log(self, record: dict) -> None:
        if record["step"] > self.seen:
            self.run.log(scalars(record), step=record["step"])
            self.last_step = max(self.last_step, record["step"])

    def flush(self) -> None:
        self._save_state()

    def close(self) -> None:
        self._save_state()
        self.run.finish()

    def _save_state(self) -> None:
        with atomic_writer(self.state_path) as f:
            f.write(json.dumps({"id": self.run_id, "last_step": self.last_step}).encode())


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


SINKS = {cls.name: cls for cls in (TensorBoardSink, WandbSink)}


def check_sink_names(names) -> None:
    """A UserError unless every name is a sink of SINKS (train.log_to's check, in andrea.config)."""
    if not set(names) <= set(SINKS):
        raise UserError(f"train.log_to may hold {one_of(SINKS)}, got {names}")


def check_sinks(names, out_dir) -> None:
    """Every check of train.log_to's sinks that can be made before anything is written (preflight, on
    --dry-run too): each named once, its library installed, and the folder it writes in (`directory`
    in out_dir) absent or a directory it can write in. A one-line UserError on the first that fails."""
    twice = sorted({name for name in names if list(names).count(name) > 1})
    if twice:
        raise UserError(f"train.log_to names {twice[0]} twice: name each sink once, e.g. "
                        f"--set train.log_to={','.join(dict.fromkeys(names))}")
    check_installed(names)
    for name in names:
        folder = Path(out_dir) / SINKS[name].directory
        if folder.is_symlink() and not folder.exists():
            raise UserError(f"train.log_to has {name}, which writes in {folder}: a link to nothing; remove it, or "
                            f"leave {name} out of train.log_to")
        if folder.exists() and not folder.is_dir():
            raise UserError(f"train.log_to has {name}, which writes in {folder}: that is a file; move it away, or "
                            f"leave {name} out of train.log_to")
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"train.log_to has {name}, which writes in {folder}: it cannot be written (no "
                            f"permission, or a read-only file system); choose another --out, or leave {name} out "
                            "of train.log_to")


def check_installed(names) -> None:
    """A UserError naming the extra to install when a sink of train.log_to cannot import its library."""
    for name in names:
        sink = SINKS[name]
        if sink.module is not None and importlib.util.find_spec(sink.module) is None:
            raise UserError(f"train.log_to has {name}, whose library ({sink.module}) is not installed: "
                            f"pip install -e '.[{sink.extra}]', or leave {name} out of train.log_to")
