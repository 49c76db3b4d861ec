"""scripts/gpu_check.sh --dry-run: the whole one-shot GPU check runs end to end at toy sizes (on NumPy,
and on the CuPy stand-in as its GPU: the GPU-marked tests collected and a few run, the Python phases,
training with --stop-at-step, --resume and sampling, the sanitizer's step, the benchmark beside
PyTorch's), so a change that breaks a phase fails here, on any machine, not first on a lent GPU; each
phase's verdict, time and figures are in $OUT as it ends, within its limit; a phase that runs past
its limit is stopped with SIGINT, so pytest's summary and the test it was in survive; the tests phase
stops starting tests at its budget and says "partial"; the budget in the script's header is the one it
runs with, 7 minutes of limits at three times their estimates; without a GPU the real check stops after
the device phase. With or without numba (the `fast` extra): without it the CPU dry run trains on NumPy
alone, and the test checks that it says so."""

import importlib.util
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from gpu_standin import reports, standin_cupy, standin_env

from minitensor import device

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MAX_LIMITS = 420  # s: 7 minutes, so that a rerun fits the same 15-minute lease
PHASES = [["0", "device"], ["1", "preflight"], ["2", "tests"], ["3", "kernels"], ["4", "gradients"], ["5", "train"],
          ["6", "nccl"], ["7", "sanitize"], ["8", "bench"], ["9", "bf16"]]
VERDICT = re.compile(r"^(ok  |FAIL) phase (\d+) (\w+) (\d+) s of (\d+) s")
HAS_TORCH = importlib.util.find_spec("torch") is not None
try:  # the `fast` extra: CI installs it, and the dry run on the CPU then trains with numba's kernels
    import numba  # noqa: F401

    CPU_KERNELS = "kernels: numba-compiled CPU kernels"
except ImportError:  # without it the same run trains on NumPy alone, and says so
    CPU_KERNELS = "kernels: NumPy (pip install"


def _summary(tmp_path):
    """(verdict lines, figure lines) of summary.txt; each verdict line is within its limit."""
    lines = (tmp_path / "gpu_check" / "summary.txt").read_text().splitlines()
    verdicts = [line for line in lines if VERDICT.match(line)]
    for line in verdicts:
        seconds, limit = map(int, VERDICT.match(line).groups()[3:])
        assert seconds <= limit, line
    return verdicts, [line.strip() for line in lines if line not in verdicts]


def _dry_run(tmp_path, env, timeout):
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    # verdicts open their line; the sampled text, from a model trained on andrea/'s source, may hold "FAIL"
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert not failed and "SOME PHASES FAILED" not in out, failed or out[-4000:]
    verdicts, figures = _summary(tmp_path)
    assert [line.split()[2:4] for line in verdicts] == PHASES, verdicts
    assert all(line.startswith("ok") for line in verdicts), verdicts
    phases = _phases(tmp_path / "gpu_check" / "phases.log")
    assert list(phases) == [name for _, name in PHASES]
    assert (tmp_path / "gpu_check_results.txt").read_text().count("== phase") == len(PHASES)
    assert _left(tmp_path) == ["gpu_check/phases.log", "gpu_check/summary.txt", "gpu_check_results.txt"]
    return out, figures, phases


def _left(out):
    """The files the check left in $OUT: a lent machine returns at most 8, and the check leaves 3."""
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*")
                  if p.is_file() and p.relative_to(out).parts[0] != "reads")  # the stand-in's, not the check's
    assert len(left) <= 8, left
    return left


def _phases(log):
    """{phase name: its output} from phases.log, in the order the phases ran."""
    phases, name = {}, None
    for line in log.read_text().splitlines():
        found = re.match(r"^== phase \d+ (\w+)$", line)
        if found:
            name = found[1]
            phases[name] = ""
        elif name is not None:
            phases[name] += line + "\n"
    return phases


def _bench_figures(figures, phases):
    assert any(f.startswith("andrea ") and "tokens/s" in f for f in figures), figures
    if HAS_TORCH:  # PyTorch's GPT-2 of the same shape beside it, with SDPA: the ratio
        assert any("sdpa on cpu" in f and "andrea / PyTorch" in f for f in figures), figures
    else:
        assert "skip PyTorch side by side" in phases["bench"]


def test_gpu_check_dry_run_passes_and_reports_each_phase(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    _, figures, phases = _dry_run(tmp_path, env, timeout=600)
    assert "ok   cross-entropy fwd" in phases["kernels"]
    assert "ok   NumPy float32, blocked core" in phases["gradients"]
    assert any(f.startswith("one tiny training step at 2 x 32") for f in figures), figures
    train = phases["train"]
    assert "stopped at step 3" in train and "resumed from" in train and "step      6/6" in train
    assert CPU_KERNELS in train and "tf32: not applicable" in train
    assert any(f.startswith("done: step 3 (3 this run)") for f in figures), figures
    assert any(f.startswith("done: step 6 (3 this run)") for f in figures), figures
    assert any("compute-sanitizer skipped (dry run" in f for f in figures), figures
    assert any(f.startswith("NumPy 1-layer step x 2") for f in figures), figures
    assert any(re.match(r"\d+ of \d+ fused kernels within tolerance", f) for f in figures), figures
    # the flash kernels' TF32 path at head size 64 against float64, in the launch emulation here
    assert any(re.match(r"ok flash TF32 hs 64 vs float64: max error [0-9.e-]+ \(tolerance 0.005\)", f)
               for f in figures), figures
    assert "no project kernel launched" in phases["bench"]
    _bench_figures(figures, phases)
    # the flash kernels' bf16 instances against float64 in the launch emulation (the kernels phase); bf16
    # training needs a GPU
    assert any(re.match(BF16_FLASH, f) for f in figures), figures
    assert any(f.startswith("bf16 training not run (dry run on the CPU") for f in figures), figures


def test_gpu_check_dry_run_on_the_cupy_standin_runs_the_gpu_code_of_every_phase(tmp_path):
    """The same dry run with the CuPy stand-in (tests/support/gpu_standin.py) as its GPU: every phase takes
    its CuPy branch at toy sizes. Phase 1 compiles every kernel and warms CuPy's before the GPU tests
    (all collected, a few run as the real check runs them all); the bench's training step reads from
    the device once, as training's does."""
    env = {**standin_env(tmp_path / "reads"), "OUT": str(tmp_path), "PYTHON": sys.executable}
    out, figures, phases = _dry_run(tmp_path, env, timeout=900)
    assert "(dry run at toy sizes, device gpu)" in out and "CuPy stand-in" in out

    from minitensor.backends import all_kernels, fused_pieces

    preflight = phases["preflight"]
    builds = sum(len(spec.dtypes) for spec in all_kernels().values())  # bfloat16 too for the bf16 RawKernels
    assert builds > 2 * len(all_kernels())
    assert f"compiled {builds + 1} kernels (every kernel x each dtype it is built for, bfloat16 too where " \
           "ml_dtypes is here, and the bench's mma.sync probe)" in preflight
    assert "kernels: fused " in preflight and "not timed: the CuPy stand-in" in preflight
    # every compile in the preflight, CuPy's own kernels warmed there for the tests
    assert preflight.index("CuPy's own kernels warmed") < preflight.index("model built and its kernels chosen")
    assert "FAIL warm-up" not in preflight and any("CuPy's own kernels warmed by 8 tiny training steps" in f
                                                   for f in figures), figures
    tests = phases["tests"]
    assert "tests/model/test_model.py::" in tests and "warm" not in tests
    assert "tests/engine/test_softmax.py::test_exp_rows_is_the_softmax_before_its_division[cupy-float32" in tests
    assert "slowest durations" in tests and any(re.match(r"\d+ passed, \d+ deselected in", f) for f in figures)
    assert any(f.startswith("kernel cache: ") for f in figures), figures
    assert "self-check in" in phases["kernels"] and "skip" not in phases["kernels"]
    # the self-check's line, then one per comparison: every case of every piece's record (one at least
    # each), cuBLAS's 4 calls
    compared = re.search(r"(\d+) of (\d+) fused kernels within tolerance", "\n".join(figures))
    assert compared and compared[1] == compared[2] and int(compared[2]) >= 4 + len(fused_pieces())
    assert phases["kernels"].count("ok   ") == 1 + int(compared[2])
    assert "ok   CuPy float32, dense core, kernels auto (kernels: fused " in phases["gradients"]
    assert any(f.startswith("mma.sync m16n8k8 TF32:") and "dry run" in f for f in figures), figures
    assert any(f.startswith("ok flash TF32 hs 64 vs float64") for f in figures), figures
    # each project kernel's time in one step, the priced column's hook beside it
    assert re.search(r"^kernel flash_attention_fwd +1 launches +[0-9.]+ ms measured", phases["bench"], re.M)
    assert any(re.match(r"\d+ project kernels timed launch by launch in one step", f) for f in figures), figures
    train = phases["train"]
    assert "on gpu (float32)" in train and "kernels: fused " in train and "generic for" not in train
    assert "stopped at step 3" in train and "resumed from" in train and "step      6/6" in train
    assert "NCCL self-test: ok" in phases["nccl"] and any(f.startswith("NCCL self-test: ok") for f in figures)
    assert any(f.startswith("CuPy 1-layer step x 2, dense and blocked core (kernels: fused") for f in figures)
    _bench_figures(figures, phases)
    # the bf16 kernels against float64 (the kernels phase), then the bf16 phase on the stand-in: 20 steps of
    # each precision through python -m andrea.train, bf16's curve within tolerance of float32's, tokens/s of each
    assert any(re.match(BF16_FLASH, f) for f in figures), figures
    assert any(re.match(r"ok bf16 curve: 4 steps within [0-9.]+% of float32's", f) for f in figures), figures
    assert any(re.match(r"bf16 [0-9,]+ tokens/s, float32 \(TF32\) [0-9,]+ tokens/s measured", f) for f in figures)
    assert "train.precision=bf16: 4 steps" in phases["bf16"] and "kernels: fused " in phases["bf16"]

    bench = [r for r in reports(tmp_path / "reads")
             if any(f.endswith(":part_bench") for read in r["reads"] for f in read[2])]
    assert len(bench) == 1
    in_step = [read for read in bench[0]["reads"]
               if any(f.split(":")[0].endswith("steps.py") and f.endswith(":step") for f in read[2])]
    # 5 steps: 1 warm-up, 2 timed, 1 split, 1 with each kernel timed
    assert len(in_step) == 5, [read[2][-1] for read in in_step]


BF16_FLASH = r"ok flash bf16 hs 64 vs float64: max error [0-9.e-]+ \(tolerance 0.02\)"


def test_the_bf16_phase_compares_each_step_and_measures_each_precisions_speed(monkeypatch, capsys):
    """bf16's losses against float32's step by step, within 1%; the tokens/s of each, steps 2-20 (the first
    holds the start-up); a run that logged other steps, or a curve that leaves the tolerance at one step,
    fails; each run is `python -m andrea.train` with train.precision set, as a user runs it."""
    bf16 = _gpu_check_module("bf16")
    monkeypatch.setenv("GPU_CHECK_TEED", "1")
    fp32 = {s: (9.0 - 0.1 * s, 1000.0 * (s > 1) + 10.0) for s in range(1, 21)}
    close = {s: (loss * (1 + 0.004 * (-1) ** s), 2.0 * tps) for s, (loss, tps) in fp32.items()}
    assert bf16._compare_curves(fp32, close) is False
    out = capsys.readouterr().out
    assert "figure: ok bf16 curve: 20 steps within 0.40% of float32's" in out
    assert "figure: bf16 2,020 tokens/s, float32 (TF32) 1,010 tokens/s measured (median of steps 2-20): " \
           "bf16 / float32 2.00" in out
    apart = {**close, 12: (fp32[12][0] * 1.02, 2000.0)}
    assert bf16._compare_curves(fp32, apart) is True
    assert "figure: FAIL bf16 curve: 20 steps within 2.00% of float32's (step 12" in capsys.readouterr().out
    assert bf16._compare_curves(fp32, {s: v for s, v in close.items() if s < 20}) is True
    command = bf16.train_command("bf16", "out", "data", dry=False)
    assert command[1:3] == ["-m", "andrea.train"] and "train.precision=bf16" in command
    assert {"--config", "120m", "train.tokens_per_step=8192", "train.warmup_steps=0"} <= set(command)
    assert command[command.index("--max-steps") + 1] == "20"
    dry = bf16.train_command("bf16", "out", "data", dry=True)
    assert dry[dry.index("--max-steps") + 1] == "4" and "train.precision=bf16" in dry


SLOW_TESTS = """
import time

def test_quick():
    pass

def test_sleeps_past_the_limit():
    time.sleep(120)
"""


def test_a_phase_past_its_limit_is_interrupted_and_leaves_pytests_summary(tmp_path):
    """The phase's timeout sends SIGINT: pytest stops in the running test, prints its summary and
    --durations, and the summary names the test that was running; SIGKILL would leave none of it."""
    (tmp_path / "test_slow.py").write_text(SLOW_TESTS)
    results = tmp_path / "results"
    results.mkdir()
    script = (f'source "{SCRIPT}"; DRY=""; FAILED=0; PY="{sys.executable}"; RESULTS_DIR="{results}"; '
              f'WORK="{tmp_path}"; export -f run_pytest; export PY; '
              f'phase 9 slow 12 run_pytest -v -p no:cacheprovider --durations=5 "{tmp_path}/test_slow.py"; '
              'echo "FAILED=$FAILED"')
    start = time.monotonic()
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert time.monotonic() - start < 60, run.stdout[-2000:]  # stopped at the limit, not after the sleep
    assert "FAILED=1" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    phase = _phases(results / "phases.log")["slow"]
    assert "test_slow.py::test_quick PASSED" in phase
    assert "test_slow.py::test_sleeps_past_the_limit" in phase and "KeyboardInterrupt" in phase, phase
    assert "slowest 5 durations" in phase and re.search(r"=+ 1 passed in [0-9.]+s =+", phase), phase
    summary = (results / "summary.txt").read_text()
    assert re.match(r"FAIL phase 9 slow \d+ s of 12 s \(exit status 124: timed out\)", summary), summary
    assert "last test started: " in summary and "test_sleeps_past_the_limit" in summary, summary
    assert "1 passed in" in summary, summary


def test_the_budget_in_the_header_is_the_one_the_script_runs_with():
    """Each phase's limit three times its estimate on an H200, the limits summing to at most 7 minutes (a
    rerun fits the same 15-minute lease), and the header's figures the ones main() passes to `phase`."""
    text = SCRIPT.read_text()
    budget = dict((name, (int(est), int(limit)))
                  for name, est, limit in re.findall(r"(\w+) (\d+) -> (\d+)", text.split("phase()")[0]))
    runs = {name: int(limit) for name, limit in re.findall(r"^\s+(?:if ! )?phase \d+ (\w+) (\d+) ", text, re.M)}
    assert set(runs) == {name for _, name in PHASES} and budget.keys() == runs.keys(), (budget, runs)
    assert all(budget[name][1] == runs[name] for name in runs), (budget, runs)
    assert all(limit == 3 * est for est, limit in budget.values()), budget
    assert sum(runs.values()) <= MAX_LIMITS and 2 * sum(runs.values()) < 15 * 60, runs
    stated = re.search(r"(\d+) s estimated, (\d+) s of limits", text)
    assert stated and int(stated[1]) == sum(e for e, _ in budget.values()) and int(stated[2]) == sum(runs.values())


def _gpu_check_module(name):
    """A module of scripts/gpu_check, the package the shell script runs (scripts/ on the path, as there)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(f"gpu_check.{name}")


def test_the_step_models_estimate_is_printed_beside_the_measured_step(monkeypatch, capsys):
    from andrea.run import stepmodel
    gpu_check = _gpu_check_module("bench")
    monkeypatch.setenv("GPU_CHECK_TEED", "1")
    monkeypatch.setitem(sys.modules, "andrea.run.stepmodel", None)  # absent: nothing said
    gpu_check._log_step_model({"step_ms_median": 50.0}, dry=False)
    assert capsys.readouterr().out == ""
    fake = types.SimpleNamespace(estimate_step_seconds=lambda hw: {"H200": 0.04, "H100 SXM": 0.05}[hw.name],
                                 profile_for=stepmodel.profile_for)
    monkeypatch.setitem(sys.modules, "andrea.run.stepmodel", fake)
    gpu_check._log_step_model({"step_ms_median": 50.0}, dry=False, card="NVIDIA H200")
    assert capsys.readouterr().out == ("figure: step model 40.0 ms estimated (ANDREA-120M, 8 x 1024, H200), "
                                       "50.0 ms measured: measured / estimated 1.25\n")
    gpu_check._log_step_model({"step_ms_median": 50.0}, dry=False, card="NVIDIA H100 80GB HBM3")
    assert capsys.readouterr().out == ("figure: step model 50.0 ms estimated (ANDREA-120M, 8 x 1024, H100 SXM), "
                                       "50.0 ms measured: measured / estimated 1.00\n")


def test_the_priced_column_is_the_step_models_price_of_each_kernel_on_the_cards_profile():
    gpu_check = _gpu_check_module("bench")
    from andrea.run import pricing, stepmodel
    assert stepmodel.profile_for("NVIDIA H100 80GB HBM3") is pricing.H100
    assert stepmodel.profile_for("NVIDIA H200") is pricing.H200
    h100, h200 = gpu_check.priced_kernel_seconds("NVIDIA H100 80GB HBM3"), gpu_check.priced_kernel_seconds("NVIDIA H200")
    prices = pricing.kernel_prices(pricing.H100)
    assert set(h100) == set(prices) and "flash_attention_fwd" in h100
    assert all(h100[k] == prices[k].seconds + prices[k].launch_s for k in h100)
    # a memory-bound kernel costs more on the H100's slower memory; none costs less
    assert all(h100[k] >= h200[k] for k in h100) and any(h100[k] > h200[k] for k in h100)


def test_kernels_are_compared_on_the_device_two_scalars_read_back(tmp_path):
    """Phase 2 compares ~800 M elements at ANDREA-120M's shapes: on the device, only the two maxima
    come back (the stand-in counts every read)."""
    gpu_check = _gpu_check_module("common")
    with standin_cupy() as cupy:
        rng = np.random.default_rng(0)
        want = rng.standard_normal((64, 50), dtype=np.float32)
        got = want + np.float32(1e-3) * rng.standard_normal((64, 50), dtype=np.float32)
        cupy.standin.reset()
        err = gpu_check.normwise(cupy.asarray(got), cupy.asarray(want))
        reads = list(cupy.standin.reads)
    expected = np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want.astype(np.float64)))
    assert err == pytest.approx(expected, rel=1e-12)
    assert len(reads) == 2 and all(r.nbytes == 8 for r in reads), reads


def test_a_fused_piece_without_cases_is_compared_through_its_sample():
    """Phase 2 runs each fused piece's record: its `cases`, or, where it has none, its self-check's
    sample through CupyOps with the piece on (its kernels launched) and off (none of them)."""
    import dataclasses

    from minitensor.backends import fused_pieces

    gpu_check, normwise = _gpu_check_module("kernels"), _gpu_check_module("common").normwise
    piece = dataclasses.replace(fused_pieces()["layernorm"], cases=None)
    with standin_cupy() as cupy:
        k = gpu_check.KernelInputs(cupy, dry=True)
        [(name, setup, fused, generic, needs_cupy)] = gpu_check.piece_cases(piece, k)
        assert name == "layernorm" and needs_cupy
        launched = []
        for run in (fused, generic):
            cupy.standin.reset()
            outputs = run(setup())
            launched.append({kernel for _, kernel, _ in cupy.standin.kernels})
        errors = [normwise(f, g) for f, g in zip(fused(setup()), generic(setup()), strict=True)]
    assert {"layernorm_fwd", "layernorm_bwd"} <= launched[0] and not launched[1] & {s.name for s in piece.kernels}
    assert len(outputs) == 7 and max(errors) <= 1e-5, errors  # y, dx, dw, db, the skip's sums, a join and its y
    assert len(gpu_check.piece_cases(fused_pieces()["layernorm"], k)) == 4  # the record's own cases


@pytest.mark.skipif(device.gpu_available(), reason="a GPU works here: the check would run every phase")
def test_without_a_gpu_the_check_stops_after_the_device_phase_and_says_so(tmp_path):
    """No GPU (CuPy without a driver, or no CuPy): phase 0 finds none at once, and the check stops
    there with one line saying why, instead of running 9 phases that can only fail."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    start = time.monotonic()
    run = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert time.monotonic() - start < 60, out
    assert "no usable GPU" in out and "stopped after the device phase" in out, out
    verdicts, figures = _summary(tmp_path)
    assert [line.split()[:4] for line in verdicts] == [["FAIL", "phase", "0", "device"]], verdicts
    assert not re.search(r"== phase [1-9]", out) and out.count("FAIL") == 1, out
    assert any("stopped after the device phase" in f for f in figures), figures
    assert _left(tmp_path) == ["gpu_check/phases.log", "gpu_check/summary.txt", "gpu_check_results.txt"]


def test_the_results_land_where_git_ignores_them_and_no_missing_file_is_cited():
    """Without $OUT the results go to the repository's out/, which git ignores (not untracked files in
    the root); the script cites no document the repository does not hold."""
    text = SCRIPT.read_text()
    default = re.search(r"^DEFAULT_OUT=(\S+)", text, re.M)[1]
    for path in ("gpu_check/summary.txt", "gpu_check/phases.log", "gpu_check_results.txt"):
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{default}/{path}"], cwd=ROOT)
        assert ignored.returncode == 0, f"{default}/{path} is not ignored by git"
    for cited in set(re.findall(r"\b([\w/]+\.md)\b", text)):
        assert (ROOT / cited).exists() or (ROOT / "docs" / cited).exists(), cited


BUDGET_CONFTEST = """
import itertools
from gpu_check.budget import Budget

ticks = itertools.count(0, 5)  # each reading of the clock 5 s after the last: every test takes 5 s


def pytest_configure(config):
    config.pluginmanager.register(Budget(deadline=40, clock=lambda: next(ticks)), "budget")
"""


@pytest.mark.parametrize("fail", [False, True])
def test_the_tests_budget_stops_starting_tests_and_reports_a_partial_result(tmp_path, fail):
    """Three tests of 5 s fit a deadline of 40 s (the third ends at 35, and a fourth would end past it):
    the session stops there, says "partial: 3 of 5", and exits as the three say (0, or 1 if one
    failed), not as interrupted."""
    (tmp_path / "conftest.py").write_text(BUDGET_CONFTEST)
    (tmp_path / "test_five.py").write_text("".join(
        f"def test_{i}():\n    assert {not (fail and i == 1)}\n\n" for i in range(5)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=0",
                          str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == (1 if fail else 0), out
    assert "partial: 3 of 5 ran in the budget" in out and "2 not run" in out, out
    assert "test_five.py::test_2 PASSED" in out and "test_five.py::test_3" not in out, out
    assert re.search(r"=+ (1 failed, 2 passed|3 passed) in", out), out
