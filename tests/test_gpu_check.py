"""scripts/gpu_check.sh --dry-run: the whole one-shot GPU check runs end to end on NumPy at toy sizes
(the GPU-marked tests deselected, the Python phases, training with --stop-at-step, --resume and
sampling), so a change that breaks a phase fails here, on any machine, not first on a lent GPU; and
each phase's result is in $OUT as it ends."""

import os
import subprocess
import sys
from pathlib import Path

from gpu_standin import reports, standin_env

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_reports_each_phase(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    # verdicts open their line; the sampled text, from a model trained on andrea/'s source, may hold "FAIL"
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert not failed and "SOME PHASES FAILED" not in out, failed or out[-4000:]
    summary = (tmp_path / "gpu_check" / "summary.txt").read_text().splitlines()
    assert [line.split()[2:4] for line in summary] == [["1", "tests"], ["2", "kernels"], ["3", "gradients"],
                                                       ["4", "train"], ["5", "nccl"], ["6", "bench"]], summary
    assert all(line.startswith("ok") for line in summary), summary
    phases = {p.name: p.read_text() for p in (tmp_path / "gpu_check").glob("*-*.txt")}
    assert "ok   cross-entropy fwd" in phases["2-kernels.txt"]
    assert "ok   NumPy float32, blocked core" in phases["3-gradients.txt"]
    train = phases["4-train.txt"]
    assert "stopped at step 3" in train and "resumed from" in train and "step      6/6" in train
    assert "kernels: numba-compiled CPU kernels" in train and "tf32: not applicable" in train
    assert "tokens/s" in phases["6-bench.txt"]
    assert (tmp_path / "gpu_check_results.txt").read_text().count("== phase") == 6


def test_gpu_check_dry_run_on_the_cupy_standin_runs_the_gpu_code_of_every_phase(tmp_path):
    """The same dry run with the CuPy stand-in (tests/gpu_standin.py) as its GPU: every phase takes
    its CuPy branch at toy sizes. Phase 1 compiles every kernel before the GPU tests (collected, not
    run); the bench's training step reads from the device once, as training's does."""
    env = {**standin_env(tmp_path / "reads"), "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "(dry run at toy sizes, device gpu)" in out and "CuPy stand-in" in out
    summary = (tmp_path / "gpu_check" / "summary.txt").read_text().splitlines()
    assert len(summary) == 6 and all(line.startswith("ok") for line in summary), summary
    phases = {p.name: p.read_text() for p in (tmp_path / "gpu_check").glob("*-*.txt")}

    tests = phases["1-tests.txt"]
    compiled = tests.index("compiled 26 kernels (every kernel x float32, float64)")
    assert compiled < tests.index("tests collected") and "tests/test_model.py::" in tests
    assert "self-check in" in phases["2-kernels.txt"] and "skip" not in phases["2-kernels.txt"]
    assert phases["2-kernels.txt"].count("ok   ") == 14  # the self-check, 12 kernels, the part
    assert "ok   CuPy float32, dense core, kernels auto (kernels: fused " in phases["3-gradients.txt"]
    train = phases["4-train.txt"]
    assert "on gpu (float32)" in train and "kernels: fused " in train and "generic for" not in train
    assert "stopped at step 3" in train and "resumed from" in train and "step      6/6" in train
    assert "NCCL self-test: ok" in phases["5-nccl.txt"]

    bench = [r for r in reports(tmp_path / "reads")
             if any(f.endswith(":part_bench") for read in r["reads"] for f in read[2])]
    assert len(bench) == 1
    in_step = [read for read in bench[0]["reads"]
               if any(f.split(":")[0].endswith("gpu_check.py") and f.endswith(":step") for f in read[2])]
    assert len(in_step) == 4, [read[2][-1] for read in in_step]  # 4 steps: 1 warm-up, 2 timed, 1 split
