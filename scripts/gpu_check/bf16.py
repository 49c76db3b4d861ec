"""Phase 9, bf16: 20 bf16 training steps against float32's, and the tokens/s of each.

`python -m andrea.train` twice from the same seed and data, --set train.precision=float32 then bf16,
ANDREA-120M at 8 x 1024 (one micro-batch a step: --set train.tokens_per_step=8192), 20 steps, no warm-up
(the loss moves from the first step), fused kernels: each step's loss from metrics.jsonl, bf16's within
CURVE_TOLERANCE of float32's; the median tokens/s of steps 2-20 of each, and their ratio. Through the
command line only, as a user runs it. The dry run: 4 steps of a 1-layer tiny model at 2 x 32 on the GPU
it has (the CuPy stand-in, whose steps take seconds on a CPU); on the CPU, where bf16 is refused (NumPy has no bfloat16 arithmetic), no training. The
bf16 kernels themselves are compared with float64 in the kernels phase (kernels.py: BF16_TOLERANCE).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_check.common import gpu_here, log, verdict

# bf16 against float32, step by step: step 0's loss agrees to ~u = 2**-8 (the same float32 masters, the
# logits rounded once, the loss summed in float32), later steps drift as each update starts from gradients
# rounded to bf16 on their way; 1% (~2.5 u) of the loss holds 20 steps of that, where a broken bf16 path
# (a gradient lost, a wrong layout) errs by tens of percent within a few steps.
CURVE_TOLERANCE = 0.01
STEPS = 20
DRY_STEPS = 4
ROOT = Path(__file__).resolve().parents[2]


def part_bf16(dry):
    if not gpu_here(dry):
        log("figure: bf16 training not run (dry run on the CPU: train.precision=bf16 needs a GPU, NumPy has no "
            "bfloat16 arithmetic)")
        return False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(os.environ.get("WORK") or tmp)
        runs = {}
        for precision in ("float32", "bf16"):
            runs[precision] = _train(precision, work, dry)
            if runs[precision] is None:
                return True
    return _compare_curves(runs["float32"], runs["bf16"], DRY_STEPS if dry else STEPS)


def train_command(precision, out, data_dir, dry):
    """The `python -m andrea.train` command of one run: the same seed, data and schedule in either
    precision, one micro-batch a step, a loss logged every step."""
    sizes = (["--config", "tiny", "--set", "model.n_layer=1", "--set", "model.context_length=32",
              "--set", "train.batch_size=2", "--set", "train.tokens_per_step=64"] if dry else
             ["--config", "120m", "--set", "train.tokens_per_step=8192"])
    sets = [f"train.precision={precision}", "train.warmup_steps=0", "train.kernels=fused", "train.log_interval=1",
            f"train.eval_interval={10 * STEPS}", "train.eval_batches=1", f"train.checkpoint_interval={10 * STEPS}",
            "train.sample_tokens=0", f"data.inputs={ROOT / 'andrea'}", f"data.data_dir={data_dir}",
            "data.allow_smaller_vocab=true"]
    return ([sys.executable, "-m", "andrea.train", *sizes, "--device", "gpu", "--out", str(out), "--overwrite",
             "--max-steps", str(DRY_STEPS if dry else STEPS)] + [arg for s in sets for arg in ("--set", s)])


def _train(precision, work, dry):
    """{step: (loss, tokens/s)} of one run from its metrics.jsonl; None (said why) if it failed."""
    out = work / f"bf16-phase-{precision}"
    start = time.perf_counter()
    proc = subprocess.run(train_command(precision, out, work / "data", dry), capture_output=True, text=True,
                          cwd=ROOT)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode:
        log(f"FAIL train.precision={precision}: exit status {proc.returncode}: {lines[-1] if lines else ''}")
        return None
    steps = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "tokens_per_s" in r:
            steps[r["step"]] = (r["loss"], r["tokens_per_s"])
    log(f"train.precision={precision}: {len(steps)} steps in {time.perf_counter() - start:.1f} s (start-up "
        f"included); " + next((line for line in lines if line.startswith("kernels:")), "kernels: not said"))
    return steps


def _compare_curves(fp32, bf16, steps=STEPS):
    """True if bf16's loss leaves CURVE_TOLERANCE of float32's at any step, or the runs differ in steps."""
    if sorted(fp32) != sorted(bf16) or sorted(fp32) != list(range(1, steps + 1)):
        log(f"FAIL bf16 curve: steps logged {sorted(bf16)} against float32's {sorted(fp32)} (want 1-{steps})")
        return True
    gaps = {s: abs(bf16[s][0] - fp32[s][0]) / abs(fp32[s][0]) for s in fp32}
    worst = max(gaps, key=gaps.get)
    ok = gaps[worst] <= CURVE_TOLERANCE
    speed = {name: statistics.median(r[s][1] for s in r if s > 1) for name, r in (("float32", fp32), ("bf16", bf16))}
    log(f"losses float32: {', '.join(f'{fp32[s][0]:.4f}' for s in sorted(fp32))}",
        f"losses bf16:    {', '.join(f'{bf16[s][0]:.4f}' for s in sorted(bf16))}")
    log(f"figure: {verdict(ok).strip()} bf16 curve: {steps} steps within {100 * gaps[worst]:.2f}% of float32's "
        f"(step {worst}; tolerance {100 * CURVE_TOLERANCE:g}%), loss {fp32[steps][0]:.4f} -> bf16 "
        f"{bf16[steps][0]:.4f}")
    log(f"figure: bf16 {speed['bf16']:,.0f} tokens/s, float32 (TF32) {speed['float32']:,.0f} tokens/s measured "
        f"(median of steps 2-{steps}): bf16 / float32 {speed['bf16'] / speed['float32']:.2f}")
    return not ok
