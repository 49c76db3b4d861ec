"""Data-parallel training: 2 MPI processes train the model 1 process does, resume exactly, fail together.

The runs launch `mpiexec -n 2` (the one beside this Python, from the mpi extra) with one BLAS and
one minitensor thread per rank; tests/support/mpi_driver.py injects the faults. The reducers'
collectives themselves (MPI's, NCCL's with a fake NCCL on threads) are checked in test_reducer.py; the
real NCCL runs in scripts/gpu_check.sh at one rank.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from optional import require
from procs import run_in_own_session

from andrea.data.loader import BatchLoader, iter_eval_batches
from andrea.data.preparation import prepare
from andrea.errors import UserError
from andrea.run import checkpoint as ckpt
from andrea.run import distributed as dist
from minitensor import device

ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = Path(json.__file__).parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# the measured 1-vs-2-process differences are float32 summation order: ~1e-7 on losses and ~1e-6
# on weights after 6 steps here; these bounds leave room without hiding a wrong batch split
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


def config(tmp, data_dir, n_layer=1, **train):
    vocab = json.loads((Path(data_dir) / "meta.json").read_text())["vocab_size"]
    cfg = {
        "model": {"vocab_size": vocab, "context_length": 16, "d_model": 16, "n_layer": n_layer, "n_head": 2},
        "train": {"batch_size": 4, "tokens_per_step": 128, "max_steps": 6, "lr": 3e-3, "min_lr": 3e-4,
                  "warmup_steps": 2, "log_interval": 1, "eval_interval": 3, "eval_batches": 3,
                  "checkpoint_interval": 3, "sample_tokens": 0, "device": "cpu", **train},
        "data": {"inputs": [str(STDLIB_JSON)], "data_dir": str(data_dir), "allow_smaller_vocab": True},
    }
    path = Path(tmp) / "dp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(args, n=2, faults=(), timeout=180, env=None):
    """`python -m andrea.train ARGS` on n ranks (n=1: no mpiexec); returns the CompletedProcess.

    A run past `timeout` is killed with its whole process group (mpiexec's ranks too, which would
    otherwise hold the pipes open) and fails the test with what it printed.
    """
    environ = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1",
                   **(env or {}))
    if n == 1 and not faults:
        cmd = [sys.executable, "-m", "andrea.train", *args]
    else:
        cmd = [str(MPIEXEC), "-n", str(n), sys.executable, "-m", "mpi4py",
               str(ROOT / "tests" / "support" / "mpi_driver.py"), *faults, "--", *args]
    return run_in_own_session(cmd, environ, ROOT, timeout)


def metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "step" in row]  # step rows, not the resume events


def weights(path):
    tensors, _ = ckpt.load_checkpoint(path)
    return tensors


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    stats = prepare([str(STDLIB_JSON)], d, allow_smaller_vocab=True, progress=False)
    # once more at the size the corpus gave, which the runs then ask for (a resumed run asks for the
    # saved config's size, and another requested size would make rank 0 encode the corpus again)
    prepare([str(STDLIB_JSON)], d, vocab_size=stats["vocab_size"], progress=False)
    return d


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data_dir):
    """The straight 2-process run, with each rank's weight hashes after every step, logging to
    TensorBoard too (which rank 0 alone writes)."""
    require("mpi4py")
    require("tensorboardX")
    tmp = tmp_path_factory.mktemp("dp2")
    out, hashes = tmp / "run", tmp / "hashes"
    hashes.mkdir()
    r = run(["--config", str(config(tmp, data_dir, log_to=["tensorboard"])), "--out", str(out)],
            faults=["--hashes", str(hashes)])
    assert r.returncode == 0, r.stderr
    return SimpleNamespace(out=out, hashes=hashes, stdout=r.stdout, stderr=r.stderr)


def test_two_processes_train_the_model_one_process_trains(tmp_path, data_dir, two_ranks):
    one = tmp_path / "one"
    r = run(["--config", str(config(tmp_path, data_dir)), "--out", str(one)], n=1)
    assert r.returncode == 0, r.stderr
    assert "x 2 micro-batches = 128 tokens/step" in r.stdout
    assert "x 1 micro-batch x 2 processes (MPI) = 128 tokens/step" in two_ranks.stdout
    a, b = metrics(one), metrics(two_ranks.out)
    assert [row["step"] for row in a] == [row["step"] for row in b] == list(range(1, 7))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    val = [(x["val_loss"], y["val_loss"]) for x, y in zip(a, b) if "val_loss" in x]
    assert len(val) == 2 and all("val_loss" in y for y in b if y["step"] in (3, 6))
    val_diff = max(abs(x - y) for x, y in val)
    # bits per byte: each rank's targets and bytes summed with its losses, so the pair matches too
    bpb_diff = max(abs(x["val_bpb"] - y["val_bpb"]) for x, y in zip(a, b) if "val_loss" in x)
    wa, wb = weights(one / "ckpt-00000006"), weights(two_ranks.out / "ckpt-00000006")
    weight_diff = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)
    print(f"1 vs 2 processes: max |loss diff| {loss_diff:.3g}, |val diff| {val_diff:.3g}, "
          f"|weight diff| {weight_diff:.3g}")
    assert loss_diff < LOSS_TOL and val_diff < LOSS_TOL and bpb_diff < LOSS_TOL and weight_diff < WEIGHT_TOL
    assert a[-1]["loss"] < a[0]["loss"]  # it learns, so equal losses are not two dead runs
    # only rank 0 wrote: one checkpoint per interval (the format does not depend on N), one
    # metrics.jsonl row per step, one TensorBoard event file
    assert [p.name for p in ckpt.list_checkpoints(two_ranks.out)] == ["ckpt-00000006", "ckpt-00000003"]
    assert len(list((two_ranks.out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert set(wa) == set(wb)


def test_both_ranks_hold_identical_weights_after_every_step(two_ranks):
    h0, h1 = (json.loads((two_ranks.hashes / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(h0) == 6 and h0 == h1
    assert len(set(h0)) == 6  # every step changed the weights


def test_stop_and_resume_on_two_processes_is_bit_identical(tmp_path, data_dir, two_ranks):
    cfg = str(config(tmp_path, data_dir))
    out = tmp_path / "run"
    first = run(["--config", cfg, "--out", str(out), "--stop-at-step", "4"])
    assert first.returncode == 0, first.stderr
    assert "mpiexec -n 2 python -m mpi4py -m andrea.train" in first.stdout
    second = run(["--config", cfg, "--out", str(out), "--resume"])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "written by" not in second.stdout
    straight = {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss")) for r in metrics(two_ranks.out)}
    resumed = {r["step"]: (r["loss"], r["grad_norm"], r.get("val_loss")) for r in metrics(out)}
    assert resumed == straight
    a, b = weights(out / "ckpt-00000006"), weights(two_ranks.out / "ckpt-00000006")
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_on_another_process_count_keeps_the_data_order(tmp_path, data_dir, two_ranks):
    out = tmp_path / "run"
    cfg = str(config(tmp_path, data_dir))
    assert run(["--config", cfg, "--out", str(out), "--stop-at-step", "3"]).returncode == 0
    r = run(["--config", cfg, "--out", str(out), "--resume"], n=1)
    assert r.returncode == 0, r.stderr
    assert "written by 2 process(es), this run has 1: same batches in the same order" in r.stdout
    straight = {row["step"]: row["loss"] for row in metrics(two_ranks.out)}
    for row in metrics(out):
        assert abs(row["loss"] - straight[row["step"]]) < LOSS_TOL


def test_an_exception_on_one_rank_ends_all_ranks_with_its_message(tmp_path, data_dir):
    require("mpi4py")
    start = time.perf_counter()
    r = run(["--config", str(config(tmp_path, data_dir, max_steps=200)), "--out", str(tmp_path / "run")],
            faults=["--raise", "1", "2"], timeout=120)
    elapsed = time.perf_counter() - start
    assert r.returncode != 0
    assert "error (rank 1 of 2): RuntimeError: injected failure" in r.stderr
    assert "step      3/" not in r.stdout  # rank 0 did not train on alone
    assert elapsed < 60  # ~5 s on an idle machine, start-up included; rank 0 alone would wait forever


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path, data_dir):
    require("mpi4py")
    hashes = tmp_path / "hashes"
    hashes.mkdir()
    r = run(["--config", str(config(tmp_path, data_dir, max_steps=4, eval_interval=10)), "--out", str(tmp_path / "o")],
            faults=["--nan", "1", "2", "--hashes", str(hashes)])
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("warning: step 2: non-finite") == 1  # said once, by rank 0
    rows = metrics(tmp_path / "o")
    assert [row["step"] for row in rows if row.get("skipped")] == [2]
    h0, h1 = (json.loads((hashes / f"rank{k}.json").read_text()) for k in (0, 1))
    assert h0 == h1 and len(h0) == 4
    assert h0[1] == h0[0] and h0[2] != h0[1]  # step 2 left the weights alone on both ranks


def test_a_signal_on_one_rank_stops_all_after_the_same_step(tmp_path, data_dir):
    require("mpi4py")
    out = tmp_path / "o"
    r = run(["--config", str(config(tmp_path, data_dir)), "--out", str(out)], faults=["--signal", "1", "2"])
    assert r.returncode == 130, r.stderr
    assert "interrupted at step 2" in r.stderr
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["ckpt-00000002"]


def test_the_collective_order_check_names_a_collective_one_rank_adds_in_training(tmp_path, data_dir):
    require("mpi4py")
    r = run(["--config", str(config(tmp_path, data_dir, max_steps=4, check_collectives=True)), "--out",
             str(tmp_path / "o")], faults=["--extra-collective", "1", "2"], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "step      1/" in r.stdout  # the checked collectives of step 1 agreed
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, r.stderr
    assert re.fullmatch(r"error: collective \d+ differs across ranks: rank 0 all_reduce of [\d,]+ float32, rank 1 "
                        r"broadcast of 16 float32; every rank must issue the same collectives in the same order "
                        r"\(a collective under a test of the rank hangs\)", errors[0]), errors[0]


def test_data_is_prepared_once_by_rank_0(tmp_path, data_dir):
    require("mpi4py")
    fresh = tmp_path / "fresh"
    cfg = yaml.safe_load(config(tmp_path, data_dir, max_steps=1).read_text())
    cfg["data"]["data_dir"] = str(fresh)
    cfg["model"]["vocab_size"] = 8449
    path = tmp_path / "fresh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # with device auto and no usable GPU, the fallback note is said once too (by rank 0)
    gpu = device._probe_gpu()[0]
    r = run(["--config", str(path), "--out", str(tmp_path / "o"), "--device", "cpu" if gpu else "auto"])
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("-id BPE tokenizer on") == 1 and (fresh / "train-00000.bin").exists()
    assert r.stderr.count("note: no usable GPU") == (0 if gpu else 1), r.stderr


def test_gpu_under_mpi_without_a_gpu_is_one_line_error(tmp_path, data_dir):
    require("mpi4py")
    r = run(["--config", str(config(tmp_path, data_dir)), "--out", str(tmp_path / "o"), "--device", "gpu"],
            env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: --device gpu: no usable GPU"), r.stderr
    assert "Traceback" not in r.stderr


def test_ranks_whose_data_directories_hold_other_data_are_refused_at_start(tmp_path):
    # issue 30, class 13: two ranks whose data.data_dir held different corpora and tokenizers of the
    # same size trained together and exited 0
    require("mpi4py")
    import http

    cwd = {rank: tmp_path / f"node{rank}" for rank in (0, 1)}
    for rank, corpus in ((0, STDLIB_JSON), (1, Path(http.__file__).parent)):
        cwd[rank].mkdir()
        prepare([str(corpus)], cwd[rank] / "data", vocab_size=300, progress=False)
    cfg = yaml.safe_load(config(tmp_path, cwd[0] / "data").read_text())
    cfg["data"]["data_dir"] = "data"  # the same setting on both ranks, another directory for each
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rank = [sys.executable, "-m", "mpi4py", "-m", "andrea.train", "--config", str(path), "--out", str(tmp_path / "o")]
    environ = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", ANDREA_NUM_THREADS="1")
    r = run_in_own_session([str(MPIEXEC), "-n", "1", "-wdir", str(cwd[0]), *rank, ":",
                            "-n", "1", "-wdir", str(cwd[1]), *rank], environ, ROOT, 120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0].startswith("error: this process's data differs from rank 0's: tokenizer fingerprint ")
    assert "data fingerprint" in errors[0] and "(rank 1 of 2)" in errors[0]
    assert not list((tmp_path / "o").glob("ckpt-*"))


def test_the_data_fingerprint_tells_other_data_under_the_same_tokenizer(tmp_path, data_dir):
    import http
    import shutil

    from andrea.data.manifest import open_split
    from andrea.data.tokenizer import load_tokenizer
    from andrea.run.rundata import data_fingerprint

    def fingerprint(d):
        fp, vocab = load_tokenizer(d / "tokenizer.json").fingerprint(), json.loads((d / "meta.json").read_text())
        splits = [open_split(d, s, vocab["vocab_size"], fp) for s in ("train", "val")]
        return data_fingerprint(d, *splits)

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    other = tmp_path / "other"  # another corpus, encoded with the same tokenizer
    prepare([str(Path(http.__file__).parent)], other, tokenizer=data_dir / "tokenizer.json", progress=False)
    assert fingerprint(copy) == fingerprint(data_dir) != fingerprint(other)


# ----------------------------------------------------------------------------- no MPI needed


def test_a_plain_run_does_not_import_mpi4py():
    env = {k: v for k, v in os.environ.items() if k not in dist.LAUNCHER_VARIABLES}
    code = ("import sys; from andrea import train; from andrea.run import distributed as d; w = d.init(); "
            "print(w.size, 'mpi4py' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(env, PYTHONPATH=str(ROOT)))
    assert r.stdout.split() == ["1", "False"], r.stderr
    assert dist.launched_by_mpi({"PMI_RANK": "0"}) and dist.launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert not dist.launched_by_mpi({})


def test_accumulation_divides_the_step_by_processes():
    assert dist.accumulation(1024, 4, 16, 2) == 8
    assert dist.accumulation(0, 4, 16, 3) == 1
    with pytest.raises(UserError, match=r"multiple of batch_size x seq_len x processes \(4 x 16 x 3 = 192\)"):
        dist.accumulation(1024, 4, 16, 3)


def test_the_windows_of_a_step_are_the_same_for_any_process_count():
    tokens = np.arange(5000, dtype=np.uint16)
    B, T, windows_per_step = 2, 8, 8
    for world in (1, 2, 4):
        accum = windows_per_step // (B * world)
        loaders = [BatchLoader(tokens, B, T, seed=7, accum=accum, rank=r, world=world) for r in range(world)]
        steps = []
        for _ in range(3):
            rows = [x[:, 0] for ld in loaders for x, _ in (ld.next_batch() for _ in range(accum))]
            steps.append(np.concatenate(rows))
        states = {json.dumps(ld.state_dict()) for ld in loaders}
        assert len(states) == 1  # every rank, and (below) every world size, holds the same state
        if world == 1:
            reference, reference_state = steps, states
        assert all(np.array_equal(a, b) for a, b in zip(steps, reference)) and states == reference_state


def test_validation_batches_split_across_ranks_cover_the_single_process_list():
    tokens = np.arange(3000, dtype=np.uint16)
    single = [x for x, _ in iter_eval_batches(tokens, 4, 16, 5)]
    split = [[x for x, _ in iter_eval_batches(tokens, 4, 16, 5, rank=r, world=2)] for r in (0, 1)]
    assert len(split[0]) == 3 and len(split[1]) == 2
    assert all(np.array_equal(a, b) for a, b in zip(single, [split[i % 2][i // 2] for i in range(5)]))


def test_single_world_agrees_on_errors_as_one_process_did():
    w = dist.Single()
    assert w.max_int(15) == 15 and w.max_int(0) == 0
    with pytest.raises(UserError, match="^bad$"), w.together():
        raise UserError("bad")


def test_bench_times_the_gradient_allreduce_between_two_processes():
    require("mpi4py")
    from andrea.bench import bench_allreduce

    r = bench_allreduce(100_000, "cpu")
    assert r["transport"] == "MPI" and r["processes"] == 2 and r["bytes"] == 400_000, r
    assert 0 < r["seconds"] < 5


def test_bench_times_the_steps_wait_on_the_reduction_with_overlap_off_and_on(capsys):
    require("mpi4py")
    from andrea.bench import _print_notes, bench_reduce_wait

    r = bench_reduce_wait("tiny", 2, 16)
    assert r["processes"] == 2 and r["transport"] == "MPI", r
    for mode in ("after", "overlap"):
        assert 0 <= r[mode]["waited_s"] < 5 and 0 < r[mode]["backward_s"] < 30, r
    _print_notes({"config": "tiny", "reduce_wait": r})
    line = capsys.readouterr().out
    assert "ms after the backward" in line and "ms overlapped with it" in line


# ----------------------------------------------------------------------------- ZeRO-1 (train.zero_stage 1)

ZERO_STEP = 384  # tokens: 6 micro-batches of 4 x 16 at N=1, 3 per rank at N=2, 2 at N=3


class Runs:
    """Runs of the ZeRO_STEP config (3 blocks: 4 buckets with overlap, which 3 ranks' ranges cut across) made
    on first use and kept for the module: (n, zero_stage, overlap) -> its output, weight hashes per step,
    config and stdout."""

    def __init__(self, tmp, data_dir):
        self.tmp, self.data_dir, self.made = tmp, data_dir, {}

    def __getitem__(self, key):
        if key not in self.made:
            n, zero, overlap = key
            name = f"n{n}-zero{zero}-overlap{int(overlap)}"
            out, hashes = self.tmp / name, self.tmp / f"hashes-{name}"
            hashes.mkdir()
            cfg = config(self.tmp, self.data_dir, n_layer=3, tokens_per_step=ZERO_STEP, zero_stage=zero,
                         overlap=overlap).rename(self.tmp / f"{name}.yaml")
            r = run(["--config", str(cfg), "--out", str(out)], n=n, faults=["--hashes", str(hashes)])
            assert r.returncode == 0, r.stderr
            self.made[key] = SimpleNamespace(out=out, hashes=hashes, config=cfg, stdout=r.stdout)
        return self.made[key]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, data_dir):
    """One process replicated, and runs on 2 and 3 processes, replicated or ZeRO-1, overlap on or off, each
    with its weight hashes per step; zero_runs[n]: ZeRO-1 on n processes, overlap on (the default)."""
    require("mpi4py")
    runs = Runs(tmp_path_factory.mktemp("zero"), data_dir)

    class ByN(dict):
        def __missing__(self, n):
            return runs[(1, 0, True)] if n == 1 else runs[(n, 1, True)]

    by_n = ByN()
    by_n.runs = runs
    return by_n


# (n, zero_stage, overlap): every combination on 2 and 3 processes (3: shards of unequal size)
EQUAL_TO_ONE = [(n, zero, overlap) for n in (2, 3) for zero in (0, 1) for overlap in (True, False)]


@pytest.mark.parametrize("n,zero,overlap", EQUAL_TO_ONE,
                         ids=[f"n{n}-{'zero1' if z else 'replicated'}-overlap-{'on' if o else 'off'}"
                              for n, z, o in EQUAL_TO_ONE])
def test_n_processes_train_the_model_one_process_trains(zero_runs, n, zero, overlap):
    """Replicated (one all-reduce) or ZeRO-1 (gradients reduce-scattered, the norm from the ranges' squares,
    AdamW on each rank's range, the weights all-gathered), the reduction overlapped with the backward
    bucket by bucket or after it: the losses and weights of one process, to float32 summation order, on
    every rank alike (3 ranks: the last range holds less of the model than the others, the rest padding)."""
    one, many = zero_runs[1], zero_runs.runs[(n, zero, overlap)]
    a, b = metrics(one.out), metrics(many.out)
    assert [row["step"] for row in b] == list(range(1, 7))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    wa, wb = weights(one.out / "ckpt-00000006"), weights(many.out / "ckpt-00000006")
    assert set(wa) == set(wb) and wa["optimizer.m"].shape == wb["optimizer.m"].shape  # the same checkpoint
    weight_diff = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa if not k.startswith("optimizer."))
    print(f"1 process vs {n} (zero_stage {zero}, overlap {overlap}): max |loss diff| {loss_diff:.3g}, "
          f"|weight diff| {weight_diff:.3g}")
    assert loss_diff < 1e-6 and weight_diff < WEIGHT_TOL and a[-1]["loss"] < a[0]["loss"]
    every = [json.loads((many.hashes / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(h == every[0] for h in every) and len(set(every[0])) == 6
    # each logged step says how long it waited on the reduction; one process logs none
    assert all(row["reduce_wait_s"] >= 0 for row in b) and "reduce wait" in many.stdout
    assert all("reduce_wait_s" not in row for row in a)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_collective_order_check_passes_with_overlap_on(tmp_path, zero_runs, zero):
    """Each rank starts the same buckets in the same order (the backward's): the check compares every one
    of them across ranks and finds them alike, on 3 processes, replicated and ZeRO-1."""
    cfg = zero_runs.runs[(3, zero, True)].config
    r = run(["--config", str(cfg), "--out", str(tmp_path / "o"), "--max-steps", "2", "--set",
             "train.check_collectives=true", "--set", "train.eval_batches=1"], n=3)
    assert r.returncode == 0, r.stderr
    assert "differs across ranks" not in r.stderr and "reduce wait" in r.stdout


def digest_of(path):
    tensors, _ = ckpt.load_checkpoint(path)
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in tensors.items()}


def test_a_zero1_checkpoint_resumes_at_any_n_and_as_replicated_exactly_as_saved(tmp_path, zero_runs):
    """A ZeRO-1 run at N=2 stopped at step 3 resumes at N=2, 3 and 1 and as a replicated run at N=2, each
    holding (weights and optimizer state gathered) bit for bit what the checkpoint holds; at N=2 it goes
    on bit-identically to the run that did not stop, elsewhere to float32 summation order."""
    cfg = str(zero_runs[2].config)
    stopped = tmp_path / "stopped"
    r = run(["--config", cfg, "--out", str(stopped), "--stop-at-step", "3"])
    assert r.returncode == 0, r.stderr
    saved = digest_of(stopped / "ckpt-00000003")
    straight = {row["step"]: row["loss"] for row in metrics(zero_runs[2].out)}
    for n, zero in ((2, 1), (3, 1), (1, 1), (2, 0)):
        out = tmp_path / f"n{n}-zero{zero}"
        shutil.copytree(stopped, out)
        state = tmp_path / f"state-{n}-{zero}.json"
        r = run(["--config", cfg, "--out", str(out), "--resume", "--set", f"train.zero_stage={zero}"], n=n,
                faults=["--state", str(state)])
        assert r.returncode == 0, r.stderr
        assert json.loads(state.read_text()) == saved, (n, zero)
        resumed = {row["step"]: row["loss"] for row in metrics(out)}
        assert sorted(resumed) == list(range(1, 7))
        if (n, zero) == (2, 1):
            assert resumed == straight
        assert max(abs(resumed[s] - straight[s]) for s in resumed) < LOSS_TOL
