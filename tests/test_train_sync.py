"""Host synchronisations of a training step, counted: the loss, gradient norm, clipping scale and
finiteness stay device values, and the host reads one scalar per optimizer step (and one per
evaluation), however many micro-batches there are.

On a GPU a host read of a device value (float(), bool(), .item(), ...) waits for all queued work.
Here the model runs on NumPy, and the values a GPU would hold (each micro-batch's loss and the
gradient norm) are handed out as `Device` arrays that count every read of them and of every
value computed from them.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea import train
from andrea.data.preparation import prepare
from andrea.model.transformer import ANDREA

STDLIB_JSON = Path(json.__file__).parent


class Device(np.ndarray):
    reads = 0

    def _read(self):
        Device.reads += 1
        return self.view(np.ndarray)

    def __float__(self):
        return float(self._read())

    def __bool__(self):
        return bool(self._read())

    def __int__(self):
        return int(self._read())

    def __index__(self):
        return int(self._read())

    def item(self, *args):
        return self._read().item(*args)

    def tolist(self):
        return self._read().tolist()


def on_device(x):
    return np.asarray(x).view(Device)


@pytest.fixture
def trainer(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    prepare([str(STDLIB_JSON)], data_dir, allow_smaller_vocab=True, progress=False)
    sets = ["model.vocab_size=8449", "model.context_length=16", "model.d_model=16", "model.n_layer=1",
            "model.n_head=2", "train.batch_size=2", "train.tokens_per_step=96", "train.eval_batches=3",
            "train.device=cpu", f"data.inputs={STDLIB_JSON}", f"data.data_dir={data_dir}",
            "data.allow_smaller_vocab=true"]
    cfg, out = train.build_run_config(train.parse_args(["--out", str(tmp_path / "run"),
                                                         *[a for s in sets for a in ("--set", s)]]))
    tokenizer, tokens, val_tokens = train.prepare_data(cfg)
    t = train.Trainer(cfg, out, tokens, val_tokens, tokenizer)
    assert t.accum == 3  # three micro-batches per optimizer step
    real_loss, real_norm = ANDREA.loss, t.model.ops.global_norm
    monkeypatch.setattr(ANDREA, "loss", lambda self, x, y: on_device(real_loss(self, x, y)))
    monkeypatch.setattr(t.model.ops, "global_norm", lambda grads: on_device(real_norm(grads)))
    return t


def test_a_step_reads_the_host_once_and_clips_with_a_device_scale(trainer, monkeypatch):
    scales = []
    real_step = trainer.opt.step

    def step(lr=None, grad_scale=1.0):
        scales.append(grad_scale)
        real_step(lr=lr, grad_scale=np.asarray(grad_scale).view(np.ndarray))  # a read here is the optimizer's

    monkeypatch.setattr(trainer.opt, "step", step)
    monkeypatch.setattr(Device, "reads", 0)
    before = trainer.model.params.data.copy()
    loss, norm, applied = trainer.train_step(1e-3)
    assert Device.reads == 1
    assert applied and not np.array_equal(before, trainer.model.params.data)
    assert len(scales) == 1 and isinstance(scales[0], np.ndarray)  # an array, never a Python number
    assert isinstance(loss, Device) and isinstance(norm, Device)   # still unread: the log reads them
    assert np.isfinite(float(loss)) and float(norm) > 0


def test_a_non_finite_step_is_still_one_read_and_no_update(trainer, monkeypatch):
    real_loss = ANDREA.loss
    monkeypatch.setattr(ANDREA, "loss", lambda self, x, y: real_loss(self, x, y) * np.float32("nan"))
    monkeypatch.setattr(Device, "reads", 0)
    before = trainer.model.params.data.copy()
    _, _, applied = trainer.train_step(1e-3)
    assert Device.reads == 1 and not applied
    np.testing.assert_array_equal(before, trainer.model.params.data)


def test_evaluation_reads_once(trainer, monkeypatch):
    monkeypatch.setattr(Device, "reads", 0)
    val, bpb = trainer.evaluate()
    assert Device.reads == 1 and isinstance(val, float) and np.isfinite(val) and np.isfinite(bpb)
