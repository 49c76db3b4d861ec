"""scripts/gpu_check.py --dry-run: the one-shot GPU check runs end to end on NumPy at toy sizes, so a
change to a layer that the GPU check compares against (its cache, its scale) fails here, on any
machine, not first on a lent GPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "FAIL" not in out, out[-3000:]
    assert "ok   cross-entropy fwd" in out and "ok   parity" in out, out[-3000:]
