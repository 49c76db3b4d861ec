"""The optimizer's state between the Trainer, checkpoints and the start-up broadcast: everything goes
through AdamW's own names (`named_state`, `STATE`), so a checkpoint written before the state was
named still restores bit for bit, and a state tensor added to the optimizer is saved, checked,
restored and broadcast without another edit (issue 46)."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea import train
from andrea.data.preparation import prepare
from andrea.run import checkpoint as ckpt
from andrea.run import trainer as trainer_module
from minitensor.optim import AdamW

STDLIB_JSON = Path(json.__file__).parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prepare([str(STDLIB_JSON)], d, allow_smaller_vocab=True, progress=False)
    return d


def make_trainer(data_dir, out, *more):
    sets = ["model.vocab_size=8449", "model.context_length=16", "model.d_model=16", "model.n_layer=1",
            "model.n_head=2", "train.batch_size=2", "train.tokens_per_step=32", "train.device=cpu",
            f"data.inputs={STDLIB_JSON}", f"data.data_dir={data_dir}", "data.allow_smaller_vocab=true", *more]
    cfg, out = train.build_run_config(train.parse_args(["--out", str(out), *[a for s in sets for a in ("--set", s)]]))
    tokenizer, tokens, val_tokens = train.prepare_data(cfg)
    return train.Trainer(cfg, out, tokens, val_tokens, tokenizer)


def trained(data_dir, out, steps=2):
    t = make_trainer(data_dir, out)
    for _ in range(steps):
        t.train_step(1e-3)
        t.step += 1
    return t


def test_a_checkpoint_in_the_format_written_before_the_state_was_named_restores_bit_for_bit(data_dir, tmp_path):
    t = trained(data_dir, tmp_path / "a")
    m, v = (np.array(s) for s in t.opt.named_state().values())
    # what Trainer.state() wrote before issue 46, spelled out: the weights, optimizer.m, optimizer.v over
    # the whole flat buffer, and the step count as meta["optimizer_t"]
    tensors = {name: np.array(view) for name, view in t.model.named_parameters()}
    tensors.update({"optimizer.m": m, "optimizer.v": v})
    meta = {**t.state()[1], "optimizer_t": 2}
    path = ckpt.save_checkpoint(tmp_path / "old", 2, tensors, meta)
    assert set(t.state()[0]) == set(tensors)  # the format written today is the same
    fresh = make_trainer(data_dir, tmp_path / "b")
    _, loaded, loaded_meta = train.read_checkpoint(fresh, path)
    fresh.restore(loaded, loaded_meta)
    assert fresh.opt.t == 2 and fresh.step == 2
    np.testing.assert_array_equal(fresh.model.params.data, t.model.params.data)
    np.testing.assert_array_equal(fresh.opt.named_state()["m"], m)
    np.testing.assert_array_equal(fresh.opt.named_state()["v"], v)
    # and the next step of each is the same step
    assert float(fresh.train_step(1e-3)[0]) == float(t.train_step(1e-3)[0])
    np.testing.assert_array_equal(fresh.model.params.data, t.model.params.data)


class WithPeak(AdamW):
    """AdamW with one more state tensor: the one line a new state tensor takes."""

    STATE = (*AdamW.STATE, "peak")


def test_a_state_tensor_added_to_the_optimizer_is_saved_checked_restored_and_broadcast(data_dir, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(trainer_module, "AdamW", WithPeak)
    t = trained(data_dir, tmp_path / "a", steps=1)
    peak = t.opt.named_state()["peak"]
    peak[...] = np.random.default_rng(0).standard_normal(peak.shape)
    tensors, meta = t.state()
    assert {k for k in tensors if k.startswith("optimizer.")} == {"optimizer.m", "optimizer.v", "optimizer.peak"}
    path = ckpt.save_checkpoint(tmp_path / "run", 1, tensors, meta)

    fresh = make_trainer(data_dir, tmp_path / "b")
    _, loaded, loaded_meta = train.read_checkpoint(fresh, path)
    fresh.restore(loaded, loaded_meta)
    np.testing.assert_array_equal(fresh.opt.named_state()["peak"], peak)

    without = {k: v for k, v in loaded.items() if k != "optimizer.peak"}  # a checkpoint from before the tensor
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer state \(optimizer.peak\) does not fit"):
        fresh.validate_checkpoint(without, loaded_meta)

    sent = []
    fresh.world = type("TwoRanks", (), {"size": 2})()
    fresh.reducer = type("Recorder", (), {"broadcast": lambda self, buf: sent.append(buf)})()
    train.share_state(fresh)
    assert [id(b) for b in sent] == [id(fresh.model.params.data), *map(id, fresh.opt.named_state().values())]
    assert len(sent) == 4


RSS_CODE = """
import sys
import numpy as np
from andrea.run.reducer import Shards
from minitensor.flat import Params
from minitensor.optim import AdamW

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

n = int(sys.argv[1])
SHAPES = {"w": (2048, 2048), "b": (2048,)}
warm = Params(SHAPES)  # the step's code (numba's kernel) and its threads started first, then freed
AdamW(warm).step()
del warm
params = Params(SHAPES, multiple=16 * n)
params.grads[...] = 1.0
before = resident()
opt = AdamW(params, shard=Shards(params.size, n).bounds(0) if n > 1 else None)
opt.step()
print(resident() - before)
"""


def test_the_optimizers_memory_on_a_rank_of_two_is_half_the_replicated_runs():
    """RSS: what AdamW adds to a process (its state and decay mask, once a step has written them; the
    step's code and threads started before, on a buffer then freed) over
    rank 0's range at N=2, against the whole buffer (4.2M parameters: 34 MB of m and v)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    added = {n: int(subprocess.run([sys.executable, "-c", RSS_CODE, str(n)], capture_output=True, text=True,
                                   check=True, cwd=root, env={"PYTHONPATH": str(root)}).stdout) for n in (1, 2)}
    print(f"AdamW's RSS: replicated {added[1] / 2**20:.1f} MiB, ZeRO-1 rank 0 of 2 {added[2] / 2**20:.1f} MiB")
    assert added[1] > 2 * 4 * 2048 * 2048 * 0.95  # the replicated state is resident at all
    assert added[2] <= 0.6 * added[1]


def test_preflight_counts_a_ranks_share_of_the_moments_under_zero1():
    from andrea.config import load_config
    from andrea.run import preflight

    replicated = preflight.estimate_memory(load_config("tiny"), processes=2)
    cfg = load_config("tiny", ["train.zero_stage=1"])
    n, size = replicated.parameters, 4
    assert replicated.state_bytes == 4 * n * size
    assert preflight.estimate_memory(cfg, processes=2).state_bytes == 3 * n * size   # 2 N + 2 N / 2
    assert preflight.estimate_memory(cfg, processes=4).state_bytes == 2 * n * size + n * size // 2
    assert preflight.estimate_memory(cfg).state_bytes == 4 * n * size  # one process: nothing to share


ONE_RANK_CODE = """
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests/app")
from test_optimizer_state import make_trainer
from minitensor.device import to_numpy

data_dir, out, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = [make_trainer(data_dir, out, f"train.device={device}", f"train.zero_stage={z}") for z in (0, 1)]
for _ in range(3):
    steps = [t.train_step(1e-3) for t in runs]
    assert [float(s[1]) for s in steps[:1]] == [float(s[1]) for s in steps[1:]]
tensors = [t.state()[0] for t in runs]
assert sorted(tensors[0]) == sorted(tensors[1])
assert all(np.array_equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
assert np.array_equal(to_numpy(runs[0].model.params.data), to_numpy(runs[1].model.params.data))
print("equal", runs[1].shards, runs[1].model.xp.__name__)
"""


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_zero1_at_one_process_is_the_replicated_run_bit_for_bit(data_dir, tmp_path, device):
    """Its reduce-scatter, all-reduce of the squared norm and all-gather are the identity at N=1, and the
    norm from its square (in the norm's own dtype) is the norm: on NumPy and, through the CuPy stand-in,
    on the GPU's code paths."""
    import subprocess
    import sys

    from minitensor.checks.standin import standin_env

    root = Path(__file__).resolve().parents[2]
    env = standin_env() if device == "gpu" else None
    r = subprocess.run([sys.executable, "-c", ONE_RANK_CODE, str(data_dir), str(tmp_path / "o"), device],
                       capture_output=True, text=True, cwd=root, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("equal Shards(size=")
    assert r.stdout.split()[-1] == ("numpy" if device == "cpu" else "cupy")
