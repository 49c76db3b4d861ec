"""scripts/gpu_check.sh --dry-run: the whole one-shot GPU check runs end to end on NumPy at toy sizes
(the GPU-marked tests deselected, the Python phases, training with --stop-at-step, --resume and
sampling), so a change that breaks a phase fails here, on any machine, not first on a lent GPU; and
each phase's result is in $OUT as it ends."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_and_reports_each_phase(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "FAIL" not in out, out[-4000:]
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
