"""The Python phases of the GPU check, one part at a time: `bash scripts/gpu_check.sh` runs them in its order.

    python scripts/gpu_check --part preflight            # one part, in this process (gpu_check.sh: its
                                                         # own time limit, SIGINT on a timeout)
    python scripts/gpu_check --dry-run                   # every part at toy sizes: on NumPy without a
                                                         # GPU, on the GPU if one works
    python scripts/gpu_check --parts preflight,kernels   # some parts, each in a fresh process

Parts (with --parts each in a fresh process with its own time limit, so a CUDA error or a hang in
one does not hide the others; exit status 1 if any failed), each in its module here:

    preflight  (preflight.py) every compile, once: the project's kernels, CuPy's own warmed by tiny
               training steps, the start-up self-check timed at 8 x 1024, one ANDREA-120M step
    kernels    (kernels.py) each fused kernel against the generic code at ANDREA-120M's shapes; the
               flash kernels' TF32 path and bf16 instances at head size 64 against float64
    gradients  (gradients.py) float32 training on CuPy against NumPy float64 at T = 256
    sanitize   (sanitize.py) the step gpu_check.sh runs under compute-sanitizer
    bench      (bench.py) ANDREA-120M's throughput in TF32, per-kernel times, PyTorch beside it
    bf16       (bf16.py) 20 steps of `python -m andrea.train --set train.precision=bf16` against
               float32's, tokens/s of each

budget.py is the pytest plugin of the tests phase (a budget of time, a partial result said as such);
common.py and steps.py what the parts share. Everything printed also goes to gpu_check_results.txt in
$OUT if set, else the current directory (unless gpu_check.sh already keeps it).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

if __package__ in (None, ""):  # `python scripts/gpu_check`: this package and the repository importable
    SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:1] = [SCRIPTS, os.path.dirname(SCRIPTS)]

from gpu_check.common import log, verdict  # noqa: E402  (after the path above)

# seconds each, at most (gpu_check.sh allows a little more)
PARTS = {"preflight": 125, "kernels": 28, "gradients": 16, "sanitize": 18, "bench": 53, "bf16": 38}
DRY_TIME_SCALE = 6  # a dry run's limits are 6 times these: it runs on a CPU, maybe under the CuPy stand-in


def run_part(name, dry):
    """Runs one part here: True if it failed."""
    import importlib

    module = importlib.import_module(f"gpu_check.{name}")
    return getattr(module, f"part_{name}")(dry)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes, on NumPy when no GPU works: exercises this script without a GPU")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)}")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # internal: part compile's warm-up steps of one dtype
    ap.add_argument("--part", choices=list(PARTS), help="one part, in this process, with no time limit of its own")
    args = ap.parse_args(argv)
    # Ctrl-C and gpu_check.sh's timeout (SIGINT) raise KeyboardInterrupt where the part is, so its
    # traceback says what was running, even where the caller had SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.warm:
        from gpu_check.preflight import warm_steps

        return 0 if warm_steps(args.warm) else 1
    if args.part:
        return 1 if run_part(args.part, args.dry_run) else 0
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    summary, results = [], []
    for name in args.parts.split(","):
        log(f"== {name}")
        status, seconds = _run_part_process(name, args.dry_run, results)
        summary.append((name, status, seconds))
    return _log_summary(summary, results)


def _run_part_process(name, dry, results):
    """Runs one part in a fresh process under its time limit, logs what it printed (its stderr's
    tail if it failed) and appends its RESULT lines to `results`: (exit status or why none, seconds)."""
    env = dict(os.environ, GPU_CHECK_TEED="1")
    cmd = [sys.executable, os.path.dirname(os.path.abspath(__file__)), "--part", name] + (["--dry-run"] if dry else [])
    start = time.perf_counter()
    try:
        limit = PARTS[name] * (DRY_TIME_SCALE if dry else 1)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        out, err, status = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, status = _text(e.stdout), _text(e.stderr), f"timed out after {limit} s"
    seconds = time.perf_counter() - start
    for line in out.splitlines():
        if line.startswith("RESULT "):
            results.append(json.loads(line[len("RESULT "):]))
        else:
            log(line)
    if status != 0:
        log(*(f"  stderr: {line}" for line in err.strip().splitlines()[-15:]))
    return status, seconds


def _log_summary(summary, results):
    """The verdict of each part and the benchmark's figures; the exit status, 1 if any part failed."""
    log("== summary")
    for name, status, seconds in summary:
        log(f"{verdict(status == 0)} {name:<14} {seconds:6.1f} s" + (f"  (exit status {status})" if status else ""))
    for r in results:
        if r["mode"].startswith("torch"):
            log(f"     {r['mode']:<12} {r['tokens_per_s_median']:>10,.0f} tokens/s on {r['device']}")
            continue
        log(f"     {r['mode']:<12} {r['tokens_per_s']:>10,.0f} tokens/s  MFU {100 * r['mfu_fp32_peak']:.1f}% of FP32 "
            f"peak, {100 * r['mfu_tf32_peak']:.1f}% of TF32 peak  "
            + (f"pool peak {r['pool_used_peak_gib']:.2f} GiB" if "pool_used_peak_gib" in r else ""))
    failed = [name for name, status, _ in summary if status != 0]
    log("all parts passed" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


if __name__ == "__main__":
    sys.exit(main())

