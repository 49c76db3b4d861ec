"""train.precision=bf16 through the Trainer (on the CuPy stand-in, generic kernels): its checkpoints hold
the float32 master weights and AdamW's float32 state only, so a bf16 run resumes in float32 and back,
bit for bit, and exports to Hugging Face as a float32 run does; on a CPU the setting is refused in one
line before anything is written."""

import json
from pathlib import Path

import numpy as np
import pytest

from andrea import train
from andrea.cli import run_cli
from andrea.data.preparation import prepare
from andrea.interop import hf
from andrea.run import checkpoint as ckpt
from minitensor import precision
from minitensor.device import to_numpy

STDLIB_JSON = Path(json.__file__).parent
BF16 = precision.bfloat16()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prepare([str(STDLIB_JSON)], d, allow_smaller_vocab=True, progress=False)
    return d


def sets(data_dir, *more):
    return ["model.vocab_size=8449", "model.context_length=16", "model.d_model=16", "model.n_layer=1",
            "model.n_head=2", "train.batch_size=2", "train.tokens_per_step=32", f"data.inputs={STDLIB_JSON}",
            f"data.data_dir={data_dir}", "data.allow_smaller_vocab=true", *more]


def make_trainer(data_dir, out, precision_name):
    argv = ["--out", str(out)]
    for s in sets(data_dir, "train.device=gpu", "train.kernels=generic", f"train.precision={precision_name}"):
        argv += ["--set", s]
    cfg, out = train.build_run_config(train.parse_args(argv))
    tokenizer, tokens, val_tokens = train.prepare_data(cfg)
    return train.Trainer(cfg, out, tokens, val_tokens, tokenizer)


def steps(t, n):
    losses = []
    for _ in range(n):
        loss, _, applied = t.train_step(1e-3)
        assert applied
        t.step += 1
        losses.append(float(loss))
    return losses


def restored(data_dir, out, precision_name, path):
    t = make_trainer(data_dir, out, precision_name)
    _, tensors, meta = train.read_checkpoint(t, path)
    t.restore(tensors, meta)
    return t


def masters(t):
    return np.array(to_numpy(t.model.params.data))


def test_a_bf16_checkpoint_resumes_in_float32_and_back(cupy, data_dir, tmp_path):
    run = make_trainer(data_dir, tmp_path / "bf16", "bf16")
    steps(run, 2)
    path = run.save()
    tensors, _ = ckpt.load_checkpoint(path)
    assert all(a.dtype == np.float32 for a in tensors.values())  # masters and AdamW's state: no bfloat16
    np.testing.assert_array_equal(tensors["transformer.wte.weight"], to_numpy(run.model.params["transformer.wte.weight"]))
    then = steps(run, 2)                                  # the run goes on: its steps 3 and 4

    as_f32 = restored(data_dir, tmp_path / "f32", "float32", path)
    assert not as_f32.model.params.mixed
    np.testing.assert_array_equal(masters(as_f32), tensors_flat(tensors, as_f32))
    back = restored(data_dir, tmp_path / "back", "bf16", as_f32.save())  # float32's checkpoint, into bf16
    compute = np.array(to_numpy(back.model.params.compute))
    assert np.array_equal(compute.view(np.uint16), masters(back).astype(BF16).view(np.uint16))
    assert steps(back, 2) == then                         # bit for bit the run that never stopped

    f32_then = steps(as_f32, 2)                           # and float32 goes on from it, near bf16's curve
    assert np.all(np.abs(np.array(f32_then) - then) <= 2.0 ** -8 * np.array(then)), (f32_then, then)


def tensors_flat(tensors, t):
    """A checkpoint's weights laid out in t's flat buffer."""
    flat = np.zeros(t.model.params.size, np.float32)
    for name, shape in t.model.params.shapes.items():
        start = t.model.params.offsets[name]
        flat[start:start + int(np.prod(shape))] = tensors[name].reshape(-1)
    return flat


def test_a_bf16_model_exports_its_float32_masters(cupy, data_dir, tmp_path):
    run = make_trainer(data_dir, tmp_path / "run", "bf16")
    steps(run, 1)
    run.model.save_pretrained(tmp_path / "hf")
    state = hf.read_state(tmp_path / "hf", run.model.params.shapes)
    for name, view in run.model.named_parameters():
        assert state[name].dtype == np.float32
        np.testing.assert_array_equal(state[name], to_numpy(view))


def test_bf16_on_the_cpu_is_refused_in_one_line_before_anything_is_written(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--out", str(out), "--device", "cpu"]
    for s in sets(data_dir, "train.precision=bf16"):
        argv += ["--set", s]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(train.main, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "precision bf16 needs a GPU (CuPy)" in err, err
    assert "train.precision=float32" in err
    assert not out.exists()


def test_the_plan_says_bf16_and_counts_its_memory():
    """--dry-run's memory: float32 masters, gradients, m and v (16 bytes a parameter) plus the bfloat16
    copy (2), and bfloat16 activations: half of float32's (ANDREA-120M keeps no attention probabilities)."""
    from andrea.config import load_config
    from andrea.run.preflight import describe_precision, estimate_memory

    f32, b16 = (load_config("120m", overrides=[f"train.precision={p}"]) for p in ("float32", "bf16"))
    m32, m16 = estimate_memory(f32), estimate_memory(b16)
    assert m16.state_bytes == 18 * m16.parameters and m32.state_bytes == 16 * m32.parameters
    assert 2 * m16.activation_bytes == m32.activation_bytes
    assert describe_precision(f32.train) == "float32"
    assert describe_precision(b16.train).startswith("bf16: float32 master weights")


def test_a_bf16_runs_mfu_is_against_the_bf16_gemm_peak(cupy, data_dir, tmp_path, monkeypatch):
    """Its steps' GEMMs are bf16 ones (twice TF32's rate on a tensor core), so its MFU divides by the bf16
    GEMM peak, measured on bfloat16 products through the GEMM its layers call (cuBLAS gemmEx; the stand-in
    does not compute an 8192^3 one, it counts it), and says so; a float32 run's stays float32's."""
    from andrea.run import perf
    from andrea.run import trainer as trainer_module

    measured = []

    def peak(xp, fresh=False, dtype="float32", **kw):
        measured.append(dtype)
        return perf.matmul_peak_flops(xp, fresh=fresh, dtype=dtype, **kw)

    monkeypatch.setattr(trainer_module, "matmul_peak_flops", peak)
    cupy.standin.reset()
    meter = make_trainer(data_dir, tmp_path / "bf16", "bf16")._throughput_meter()
    assert measured == ["bfloat16"] and meter.peak_name.startswith("GPU bf16 GEMM peak (cuBLAS gemmEx")
    assert cupy.standin.skipped_gemms >= 2  # the warm-up and each timed product: bfloat16, through gemmEx
    meter = make_trainer(data_dir, tmp_path / "f32", "float32")._throughput_meter()
    assert measured[1:] == ["float32"] and meter.peak_name.startswith("GPU float32 GEMM peak")
    with pytest.raises(ValueError, match="needs a GPU"):
        perf.matmul_peak_flops(np, n=8, dtype="bfloat16")
