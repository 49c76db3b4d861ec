"""The GPU code paths, run on every change without a GPU: the CuPy stand-in (tests/support/gpu_standin.py).

The stand-in's arrays are NumPy's behind CuPy's wall (no implicit host conversion, no NumPy
operands, every read back to the host counted); ElementwiseKernels run their operation as C++,
RawKernels through minitensor's launch emulation. Through the public entry points:

- the model's forward, backward and AdamW on "gpu" against the CPU's, generic and fused kernels,
  dense and blocked attention, float64 and float32;
- `python -m andrea.train --device gpu` with train.kernels generic and auto, stopped and resumed,
  against the same run on the CPU; sampling on the GPU against the CPU's greedy choice;
- one host read per training step;
- the memory pre-flight of `device: auto` counting the GPU's memory when a GPU works.

scripts/gpu_check.sh --dry-run on the stand-in is in test_gpu_check.py.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from gpu_standin import ROOT, STANDIN, reports, standin_cupy, standin_env

from andrea.config import load_config
from minitensor import device

STDLIB_JSON = Path(json.__file__).parent


def every_piece_fused(text):
    """Whether the log says every fused piece passed its self-check (in any order), none refused."""
    from minitensor.backends import fused_pieces

    line = next((ln for ln in text.splitlines() if ln.startswith("kernels: fused ")), "")
    line = line.split(" (not timed")[0]  # the stand-in's times say nothing of a GPU's: none taken
    return set(line[len("kernels: fused "):].split(", ")) == set(fused_pieces()) and "generic for" not in text


# --- the stand-in itself -----------------------------------------------------------------------


def test_only_the_tests_that_ask_see_the_standin():
    before = device._probe_gpu()
    with standin_cupy() as cupy:
        assert Path(cupy.__file__).is_relative_to(STANDIN)
        assert device._probe_gpu() == (True, "")
        assert device.get_device("gpu").xp is cupy
    assert device._probe_gpu() == before
    assert not getattr(sys.modules.get("cupy"), "STANDIN", False)


def test_the_standin_refuses_what_cupy_refuses_and_counts_host_reads():
    with standin_cupy() as cupy:
        a = cupy.arange(6, dtype=np.float32).reshape(2, 3)
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
            np.asarray(a)
        with pytest.raises(TypeError, match="Unsupported type"):
            a + np.ones(3, np.float32)
        with pytest.raises(TypeError, match="Unsupported type"):
            cupy.matmul(a.T, np.ones((2, 2), np.float32))
        b = np.exp(a) @ a.T  # NumPy's functions on device arrays stay on the device, as with CuPy
        total = b.sum()
        assert type(total) is cupy.ndarray and total.shape == ()
        assert cupy.standin.reads == []
        assert float(total) == pytest.approx(float(np.sum(np.exp(np.arange(6.0)).reshape(2, 3) @
                                                         np.arange(6.0).reshape(2, 3).T)), rel=1e-6)
        host = cupy.asnumpy(a)
        assert [r.what for r in cupy.standin.reads] == ["float", "get"] and host.shape == (2, 3)


def test_an_elementwise_kernel_runs_its_operation_as_cpp_with_outputs_bound_to_inputs():
    with standin_cupy() as cupy:
        kern = cupy.ElementwiseKernel("T x, raw T b, int32 C, T s", "T y, T z",
                                      "const T old = x;\ny = x + b[i % C] * s;\nz = old * 2;", "axpb")
        x = cupy.asarray(np.arange(6, dtype=np.float64).reshape(2, 3))
        b = cupy.asarray(np.array([10.0, 20.0, 30.0]))
        y, z = kern(x, b, np.int32(3), 0.5)
        assert np.array_equal(y.get(), np.arange(6.0).reshape(2, 3) + [5.0, 10.0, 15.0])
        assert np.array_equal(z.get(), 2 * np.arange(6.0).reshape(2, 3))
        kern(x, b, np.int32(3), 1.0, x, z)  # x is also y: one buffer, read before it is written
        assert np.array_equal(x.get(), np.arange(6.0).reshape(2, 3) + [10.0, 20.0, 30.0])
        assert np.array_equal(z.get(), 2 * np.arange(6.0).reshape(2, 3))
        with pytest.raises(TypeError, match="Type is mismatched"):
            kern(x, b, np.int32(3), np.float32(1.0))


# --- the engine: the model's forward, backward and AdamW against the CPU's ------------------------


def small_model_config(**changes):
    base = dict(vocab_size=97, context_length=16, d_model=32, n_layer=2, n_head=2)
    return dataclasses.replace(load_config("tiny").model, **{**base, **changes})


def run_model(device, dtype, kernels, dense, steps=2):
    """Losses, step-0 gradients and the final weights of `steps` AdamW steps of a small ANDREA."""
    from andrea.model.transformer import ANDREA
    from minitensor.backends import fused_pieces
    from minitensor.device import to_numpy
    from minitensor.layers.attention import CausalSelfAttention
    from minitensor.optim import AdamW

    cfg = small_model_config()
    model = ANDREA(cfg, device=device, dtype=dtype, seed=0, kernels=kernels)
    ops = model.ops
    if device == "gpu":  # the kernels asked for are the ones the backend was built with
        assert ops.in_use == (frozenset(fused_pieces()) if kernels == "fused" else frozenset()), ops
    CausalSelfAttention.dense = dense
    # AdamW divides by sqrt(v) + eps: where a gradient is near 0, a rounding difference in it is
    # magnified up to lr / eps times; float32's eps here keeps that within float32's reach
    opt = AdamW(model, lr=1e-2, weight_decay=0.1, eps=1e-8 if dtype == "float64" else 1e-4)
    rng = np.random.default_rng(3)
    losses, grads = [], None
    try:
        for _ in range(steps):
            x = rng.integers(0, cfg.vocab_size, (3, cfg.context_length + 1))
            loss = model.loss(x[:, :-1], x[:, 1:])
            model.zero_grad()
            model.backward()
            losses.append(float(loss))
            if grads is None:
                grads = {name: to_numpy(g).astype(np.float64) for name, g in model.named_grads()}
            scale, finite = ops.clip_scale(ops.global_norm(model.params.grads), 1.0, loss)
            assert bool(finite)
            opt.step(grad_scale=scale)
    finally:
        CausalSelfAttention.dense = None
    weights = {name: to_numpy(w).astype(np.float64) for name, w in model.named_parameters()}
    return np.array(losses), grads, weights


def normwise(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-11), ("float32", 2e-5)])
@pytest.mark.parametrize("kernels, dense", [("generic", True), ("generic", False), ("fused", True)])
def test_the_gpu_path_equals_the_cpu_path_forward_backward_and_adamw(kernels, dense, dtype, tol):
    want = run_model("cpu", dtype, "generic", None)
    with standin_cupy():
        got = run_model("gpu", dtype, kernels, dense)
    assert np.allclose(got[0], want[0], rtol=tol, atol=0), (got[0], want[0])
    for name in want[1]:
        assert normwise(got[1][name], want[1][name]) <= tol, f"gradient of {name}"
        # AdamW magnifies the gradients' rounding differences (run_model), hence 100 tol on the weights
        assert normwise(got[2][name], want[2][name]) <= 100 * tol, f"{name} after AdamW"


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-11), ("float32", 3e-3)])
def test_the_gpu_path_with_the_flash_core_equals_the_cpu_path(dtype, tol):
    """Every fused piece and the attention core as training chooses it (the flash kernels: heads of 16):
    float64 as tight as the other GPU paths, float32 within TF32's reach (its products' operands keep
    11 bits); the float32 weights after AdamW are not compared, its division by sqrt(v) magnifies
    TF32's rounding of near-zero gradients."""
    from minitensor.device import set_tf32

    want = run_model("cpu", dtype, "generic", None)
    with standin_cupy() as cupy:
        set_tf32(cupy, True)  # as train.tf32 does: the flash kernels' float32 products on tensor cores
        try:
            got = run_model("gpu", dtype, "fused", None)
        finally:
            set_tf32(cupy, False)
        assert {"flash_attention_fwd", "flash_attention_bwd_dkv"} <= {name for _, name, _ in cupy.standin.kernels}
    assert np.allclose(got[0], want[0], rtol=tol, atol=0), (got[0], want[0])
    for name in want[1]:
        assert normwise(got[1][name], want[1][name]) <= tol, f"gradient of {name}"
        if dtype == "float64":
            assert normwise(got[2][name], want[2][name]) <= 100 * tol, f"{name} after AdamW"


def test_the_fused_kernels_pass_their_start_up_self_check_on_the_standin():
    from minitensor.backends import fused_pieces
    from minitensor.backends.selection import select_kernels

    with standin_cupy() as cupy:
        fused, line = select_kernels("auto", cupy)
    assert every_piece_fused(line), line
    assert sorted(fused) == sorted(fused_pieces())


@pytest.mark.parametrize("broken, reason", [("sum", "CuPy cannot compile or run a kernel; is NVRTC installed?"),
                                            ("matmul", "CuPy cannot run a matmul; is cuBLAS installed?")])
def test_the_gpu_probe_says_what_is_missing(monkeypatch, broken, reason):
    """CuPy imports without NVRTC or cuBLAS; the probe's tiny kernel and matmul find out which."""
    with standin_cupy() as cupy:
        def fails(*args, **kwargs):
            raise RuntimeError(f"{broken} failed")

        monkeypatch.setattr(cupy.ndarray, "sum" if broken == "sum" else "__matmul__", fails, raising=False)
        ok, why = device._probe_gpu()
        with pytest.raises(device.GPUUnavailable, match="no usable GPU"):
            device.get_device("gpu")
    assert not ok and why.startswith(reason) and f"RuntimeError: {broken} failed" in why


def test_the_nccl_allreduce_benchmark_runs_at_one_rank(capsys):
    from andrea.run import allreduce
    with standin_cupy():
        assert allreduce.main(["--bench", "4096", "--gpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["transport"] == "NCCL" and result["processes"] == 1 and result["bytes"] == 4 * 4096


def test_the_nccl_self_test_runs_each_collective_at_one_rank(capsys):
    from andrea.run import allreduce
    with standin_cupy():
        assert allreduce.main(["--nccl-self-test"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("NCCL self-test: ok (version 22707, 1 rank, 4 MiB all-reduce, broadcast, reduce-scatter "
                          "(whole and of a bucket) and all-gather on the NCCL stream)"), out


def test_tf32_is_set_through_cupys_gemm_compute_type_and_cublas_math_mode():
    from minitensor.device import set_tf32

    with standin_cupy() as cupy:
        on, off = set_tf32(cupy, True), set_tf32(cupy, False)
    assert on.startswith("tf32: on (2-D GEMMs: compute type COMPUTE_TYPE_TF32; batched GEMMs: cuBLAS math mode 3")
    assert off.startswith("tf32: off (2-D GEMMs: compute type COMPUTE_TYPE_DEFAULT; batched GEMMs: cuBLAS math mode 0")


# --- the memory pre-flight ---------------------------------------------------------------------


def test_the_memory_preflight_of_device_auto_counts_the_gpu_memory_when_a_gpu_works(tmp_path):
    from andrea.errors import UserError
    from andrea.run import preflight

    cfg = load_config("tiny", overrides=["train.device=auto"])
    with standin_cupy() as cupy:
        plan = preflight.check(cfg, tmp_path / "out")
        assert plan.memory_verdict.endswith("(free GPU memory)"), plan.memory_verdict
        cupy.standin.free_bytes = 1 << 20
        with pytest.raises(UserError, match=r"only 1\.0 MiB is available \(free GPU memory\)"):
            preflight.check(cfg, tmp_path / "out")
    cpu = preflight.check(load_config("tiny", overrides=["train.device=cpu"]), tmp_path / "out")
    assert "GPU" not in cpu.memory_verdict


# --- the command line: train, stop, resume and sample on the GPU, against the CPU ----------------


def run_config(tmp, data_dir, **train):
    cfg = {
        "model": {"vocab_size": 8449, "context_length": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
        "train": {"batch_size": 4, "max_steps": 6, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "log_interval": 1, "eval_interval": 3, "eval_batches": 2, "checkpoint_interval": 3,
                  "sample_tokens": 0, **train},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(data_dir), "allow_smaller_vocab": True},
    }
    path = Path(tmp) / f"run-{abs(hash(json.dumps(train, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def command(module, *args, report_dir=None):
    run = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=standin_env(report_dir),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def metrics(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "step" in r and "loss" in r}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, data_dir):
    tmp = tmp_path_factory.mktemp("cpu")
    command("andrea.train", "--config", run_config(tmp, data_dir), "--out", tmp / "run", "--device", "cpu")
    return tmp / "run"


@pytest.mark.parametrize("kernels", ["generic", "auto"])
def test_train_on_the_gpu_stops_resumes_and_matches_the_cpu_run(tmp_path, data_dir, cpu_run, kernels):
    cfg = run_config(tmp_path, data_dir, kernels=kernels)
    out = tmp_path / "run"
    first = command("andrea.train", "--config", cfg, "--out", out, "--device", "gpu", "--stop-at-step", 3)
    assert "stopped at step 3" in first
    if kernels == "auto":
        assert every_piece_fused(first), first
    else:
        assert "kernels: generic (train.kernels=generic)" in first
    assert "tf32: off" in first and "GPU float32 GEMM peak" in first
    second = command("andrea.train", "--out", out, "--resume", "--device", "gpu")
    assert "resumed from" in second and "step      6/6" in second
    gpu, cpu = metrics(out), metrics(cpu_run)
    assert sorted(gpu) == sorted(cpu) == [1, 2, 3, 4, 5, 6]
    for step in cpu:  # float32 on both: the summation orders differ, the formulas must not
        assert gpu[step]["loss"] == pytest.approx(cpu[step]["loss"], rel=1e-4), step
        if "val_loss" in cpu[step]:
            assert gpu[step]["val_loss"] == pytest.approx(cpu[step]["val_loss"], rel=1e-4), step

    prompt = ("--prompt", "def ", "--max-new-tokens", 12, "--top-k", 1, "--checkpoint", out)
    on_gpu = command("andrea.sample", *prompt, "--device", "gpu")
    on_cpu = command("andrea.sample", *prompt, "--device", "cpu")
    assert on_gpu.splitlines()[-1] == on_cpu.splitlines()[-1] and "def " in on_gpu


def test_a_training_step_reads_from_the_gpu_once(tmp_path, data_dir):
    """Two runs that differ only in their number of steps: the extra steps' reads, one each (the
    finite check that decides whether the update applies; the loss is read only to log)."""
    cfg = run_config(tmp_path, data_dir, log_interval=100, eval_interval=100, checkpoint_interval=100)
    counted = {}
    for steps in (2, 5):
        report = tmp_path / f"reads-{steps}"
        command("andrea.train", "--config", cfg, "--out", tmp_path / f"run-{steps}", "--device", "gpu",
                "--max-steps", steps, report_dir=report)
        counted[steps] = [read for r in reports(report) for read in r["reads"]]
    extra = len(counted[5]) - len(counted[2])
    sites = sorted({read[2][-1] for read in counted[5]})
    assert extra == 3, f"{extra} reads in 3 steps; reads at {sites}"


# --- cuBLAS's own GEMM and GEMV calls (minitensor.backends.cublas) -----------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_the_standin_cublas_gemm_is_numpys_matmul_column_major(ta, tb, beta, dtype):
    """The stand-in's sgemm/dgemm read the column-major matrices behind the pointers as cuBLAS does:
    C = op(A) op(B) + beta C for every transpose pair, with leading dimensions longer than the rows
    (C's padding left as it was), and with beta 0 C's old values (NaN here) not read; and
    minitensor.backends.cublas.gemm, which asks cuBLAS for out = a @ b as out^T = b^T a^T, gives
    NumPy's a @ b + beta out for a, b as transposed views and out a slice of longer rows."""
    from minitensor.backends import cublas as mcublas

    rng = np.random.default_rng(3)
    m, n, k, pad = 5, 3, 4, 2
    a_st = rng.standard_normal((k, m + pad) if ta else (m, k + pad)).astype(dtype)  # row-major storage
    b_st = rng.standard_normal((n, k + pad) if tb else (k, n + pad)).astype(dtype)
    a = a_st[:, :m].T if ta else a_st[:, :k]                                       # (m, k) views
    b = b_st[:, :k].T if tb else b_st[:, :n]                                       # (k, n)
    c0 = rng.standard_normal((m, n + pad)).astype(dtype)
    if beta == 0:
        c0[:, :n] = np.nan
    want = c0.copy()
    want[:, :n] = a @ b + (beta * c0[:, :n] if beta else 0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    with standin_cupy() as cupy:
        from cupy_backends.cuda.libs import cublas

        # the stand-in itself, column-major: C^T (n, m), ld n + pad = op(B)^T op(A)^T with B's and A's
        # row-major storage read as their column-major transposes
        A, B, C = (cupy.asarray(v) for v in (a_st, b_st, c0))
        one, coef = np.array(1, dtype), np.array(beta, dtype)
        fn = cublas.sgemm if dtype == np.float32 else cublas.dgemm
        fn(1, cublas.CUBLAS_OP_T if tb else cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T if ta else cublas.CUBLAS_OP_N,
           n, m, k, one.ctypes.data, B.data.ptr, b_st.shape[1], A.data.ptr, a_st.shape[1], coef.ctypes.data,
           C.data.ptr, c0.shape[1])
        np.testing.assert_allclose(C.get(), want, rtol=tol, atol=tol)
        with pytest.raises(cublas.CUBLASError, match="INVALID_VALUE"):  # ldc shorter than C^T's rows
            fn(1, 0, 0, n, m, k, one.ctypes.data, B.data.ptr, n, A.data.ptr, k, coef.ctypes.data, C.data.ptr, n - 1)
        # through minitensor's wrapper, on views
        A, B, C = (cupy.asarray(v) for v in (a_st, b_st, c0))
        av = A[:, :m].T if ta else A[:, :k]
        bv = B[:, :k].T if tb else B[:, :n]
        assert mcublas.gemm(av, bv, C[:, :n], beta)
        np.testing.assert_allclose(C.get(), want, rtol=tol, atol=tol)
        # what cuBLAS cannot take in place is left to the caller: an out laid out column by column,
        # an operand with no unit stride
        assert not mcublas.gemm(av, bv, cupy.asarray(np.zeros((n, m), dtype)).T, beta)
        assert not mcublas.gemm(cupy.asarray(np.zeros((m, 2 * k), dtype))[:, ::2], bv, C[:, :n], beta)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_the_standin_strided_batched_gemm_is_numpys_batched_matmul(ta, tb, beta, dtype):
    """minitensor.backends.cublas.gemm on (batch, M, K) @ (batch, K, N): one sgemmStridedBatched /
    dgemmStridedBatched with each operand transposed as stored (the attention core's k^T, v^T, dy^T,
    q^T), against NumPy's batched matmul, out with beta 0 (NaNs not read) and 1; out's matrices
    overlapping, or an operand with no single batch stride, are left to the caller."""
    from minitensor.backends import cublas as mcublas

    rng = np.random.default_rng(5)
    nb, m, n, k = 3, 4, 5, 6
    a_st = rng.standard_normal((nb, k, m) if ta else (nb, m, k)).astype(dtype)
    b_st = rng.standard_normal((nb, n, k) if tb else (nb, k, n)).astype(dtype)
    a, b = (a_st.transpose(0, 2, 1) if ta else a_st), (b_st.transpose(0, 2, 1) if tb else b_st)
    c0 = rng.standard_normal((nb, m, n)).astype(dtype)
    if beta == 0:
        c0[...] = np.nan
    want = a @ b + (beta * c0 if beta else 0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    with standin_cupy() as cupy:
        A, B, C = (cupy.asarray(v) for v in (a_st, b_st, c0))
        av, bv = (A.transpose(0, 2, 1) if ta else A), (B.transpose(0, 2, 1) if tb else B)
        assert mcublas.gemm(av, bv, C, beta)
        np.testing.assert_allclose(C.get(), want, rtol=tol, atol=tol)
        assert not mcublas.gemm(av, bv, cupy.broadcast_to(cupy.zeros((m, n), dtype), (nb, m, n)), beta)  # one out
        spaced = rng.standard_normal((nb, 2, m, k)).astype(dtype)  # matrices 2 m k apart: taken as they are
        assert mcublas.gemm(cupy.asarray(spaced)[:, 0], bv, C, 0.0)
        np.testing.assert_allclose(C.get(), spaced[:, 0] @ b, rtol=tol, atol=tol)
        assert not mcublas.gemm(av, bv, cupy.asarray(np.zeros((m, nb, n), dtype)).transpose(1, 0, 2)[:, :, ::-1],
                                beta)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_standin_cublas_gemv_and_colsum_are_numpys(beta, dtype):
    """colsum(dy, out, ones, beta) = dy.sum(0) + beta out through the stand-in's sgemv/dgemv, dy a
    slice of longer rows and out a strided view; the stand-in's gemv with OP_T against NumPy too."""
    from minitensor.backends import cublas as mcublas

    rng = np.random.default_rng(4)
    R, C = 6, 5
    dy_st = rng.standard_normal((R, C + 3)).astype(dtype)
    out0 = rng.standard_normal(2 * C).astype(dtype)
    if beta == 0:
        out0[::2] = np.nan
    want = out0.copy()
    want[::2] = dy_st[:, :C].sum(axis=0) + (beta * out0[::2] if beta else 0)
    x = rng.standard_normal(C).astype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    with standin_cupy() as cupy:
        from cupy_backends.cuda.libs import cublas

        dy, out = cupy.asarray(dy_st), cupy.asarray(out0)
        assert mcublas.colsum(dy[:, :C], out[::2], cupy.asarray(np.ones(R + 2, dtype)), beta)
        np.testing.assert_allclose(out.get(), want, rtol=tol, atol=tol)
        # OP_T: y (R,) = A^T x for A the column-major (C, R) matrix behind dy's storage, i.e. dy[:, :C] x
        y, xd = cupy.asarray(np.zeros(R, dtype)), cupy.asarray(x)
        one, zero = np.array(1, dtype), np.array(0, dtype)
        (cublas.sgemv if dtype == np.float32 else cublas.dgemv)(
            1, cublas.CUBLAS_OP_T, C, R, one.ctypes.data, dy.data.ptr, C + 3, xd.data.ptr, 1, zero.ctypes.data,
            y.data.ptr, 1)
        np.testing.assert_allclose(y.get(), dy_st[:, :C] @ x, rtol=tol, atol=tol)


def test_the_recording_counts_cublas_calls_from_their_arguments():
    """While recording, sgemm/dgemm are one GEMM launch each of 2 m n k FLOPs, A and B read, C written
    (and read with beta 1), "(unaligned)" by a leading dimension not a multiple of 16 bytes; sgemv a
    GEMM launch of 2 m n FLOPs; nothing is computed (the memory is never written)."""
    from minitensor.backends import cublas as mcublas

    with standin_cupy() as cupy:
        from cupy import _record

        a, b = cupy.empty((8, 12), np.float32), cupy.empty((12, 16), np.float32)
        out, odd = cupy.empty((8, 16), np.float32), cupy.empty((8, 17), np.float32)
        ones = cupy.empty(8, np.float32)
        with _record.recording() as rec:
            assert mcublas.gemm(a, b, out, 0.0) and mcublas.gemm(a, b, out, 1.0)
            assert mcublas.gemm(a, b[:, :16], odd[:, :16], 0.0)
            assert mcublas.colsum(out, out[0], ones, 1.0)
            assert mcublas.gemm(a.reshape(2, 4, 12), b.reshape(2, 12, 8), out.reshape(2, 4, 16)[:, :, :8])
    ops = [(op.kind, op.name, op.flops, op.read, op.written) for op in rec.ops]
    ab, c = 4 * (8 * 12 + 12 * 16), 4 * 8 * 16
    assert ops == [("gemm", "cublas sgemm", 2 * 8 * 16 * 12, ab, c),
                   ("gemm", "cublas sgemm", 2 * 8 * 16 * 12, ab + c, c),
                   ("gemm", "cublas sgemm (unaligned)", 2 * 8 * 16 * 12, ab, c),
                   ("gemm", "cublas sgemv", 2 * 16 * 8, 4 * (8 * 16 + 8) + 4 * 16, 4 * 16),
                   ("gemm", "cublas sgemmStridedBatched", 2 * 2 * 4 * 8 * 12, 4 * 2 * (4 * 12 + 12 * 8), 4 * 2 * 4 * 8)]
