#!/usr/bin/env bash
# One command for a lent GPU machine without network, done in under 4 minutes on an H200 from a cold
# kernel cache. Phases, in this order, each with its own time limit (the sum is the worst case):
#
#   1 tests      every kernel compiled first (gpu_check.py --parts compile: a cold kernel cache
#                costs its time there, not in the timed tests), then the GPU-marked tests (every
#                layer, the whole model and every fused kernel on CuPy against NumPy) with the
#                GPU hypothesis profile: few examples, directional gradient checks; --durations
#                shows where the time went
#   2 kernels    the start-up self-check (which fused kernels agree with the generic path), then
#                each fused kernel against the generic code at ANDREA-120M shapes, timed
#   3 gradients  a small ANDREA trained on CuPy in float32 against NumPy float64 at T = 256, with
#                the dense attention core and fused kernels, and with the blocked generic core
#                (two query blocks): per-step losses and step-0 gradients
#   4 train      python -m andrea.train --device gpu for 3 steps (--stop-at-step), --resume to 6,
#                then python -m andrea.sample --device gpu from the checkpoint
#   5 nccl       python -m andrea.run.distributed --nccl-self-test (NCCL at one rank)
#   6 bench      ANDREA-120M at 8 x 1024 with tf32: true: tokens/s, MFU, peak GPU memory
#
#     PYTHONPATH=. bash scripts/gpu_check.sh              (from the repository root)
#     bash scripts/gpu_check.sh --dry-run                 (the same phases at toy sizes: on NumPy, or on
#                                                          the GPU if one works, e.g. the CuPy stand-in
#                                                          of tests/cupy_standin; its GPU tests are
#                                                          collected, not run; 4 times the time limits)
#
# Each phase's output goes to $OUT/gpu_check/<n>-<name>.txt (OUT defaults to the current directory)
# and a verdict line to $OUT/gpu_check/summary.txt the moment the phase ends, so a machine taken
# back mid-run still reports every phase that finished; the whole transcript also goes to
# $OUT/gpu_check_results.txt. Exit status 0 only if every phase passed.

set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export GPU_CHECK_TEED=1  # this script keeps the results files, not gpu_check.py
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DRY=""
DEVICE=gpu
if [ "${1:-}" = "--dry-run" ]; then
    DRY="--dry-run"
    DEVICE=$("$PY" -c 'from minitensor.backend import gpu_available; print("gpu" if gpu_available() else "cpu")') \
        || DEVICE=cpu
fi
RESULTS_DIR="${OUT:-.}/gpu_check"
mkdir -p "$RESULTS_DIR"
: > "$RESULTS_DIR/summary.txt"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

phase() {  # phase <number> <name> <time limit in s> <command...>
    local n="$1" name="$2" limit="$3" start status verdict
    shift 3
    [ -n "$DRY" ] && limit=$((4 * limit))  # a dry run runs on a CPU, maybe under the CuPy stand-in
    echo "== phase $n: $name (at most $limit s)"
    start=$(date +%s)
    # through bash -c, so a phase may be one of the functions below (exported)
    timeout "$limit" bash -c '"$@"' phase "$@" > "$RESULTS_DIR/$n-$name.txt" 2>&1
    status=$?
    cat "$RESULTS_DIR/$n-$name.txt"
    if [ "$status" -eq 0 ]; then verdict="ok  "; else verdict="FAIL"; FAILED=1; fi
    echo "$verdict phase $n $name $(( $(date +%s) - start )) s$([ "$status" -ne 0 ] && echo " (exit status $status$([ "$status" -eq 124 ] && echo ': timed out'))")" \
        | tee -a "$RESULTS_DIR/summary.txt"
}

gpu_tests() {
    "$PY" scripts/gpu_check.py --parts compile $DRY || return 1
    if [ -n "$DRY" ]; then  # the GPU-marked tests collected only (none without a GPU, which pytest calls 5)
        ANDREA_TEST_PROFILE=gpu "$PY" -m pytest -m gpu -q -p no:cacheprovider --collect-only tests
        local status=$?
        [ "$status" -eq 5 ] || [ "$status" -eq 0 ]
        return
    fi
    ANDREA_TEST_PROFILE=gpu "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs --durations=15 tests
}

train_stop_resume_sample() {
    local run="$WORK/run" common
    common=(--config tiny --device "$DEVICE" --out "$run" --max-steps 6
            --set "data.inputs=$PWD/andrea" --set "data.data_dir=$WORK/data" --set data.allow_smaller_vocab=true
            --set train.log_interval=1 --set train.eval_interval=3 --set train.eval_batches=2
            --set train.checkpoint_interval=3 --set train.sample_tokens=0 --set train.batch_size=8)
    if [ -n "$DRY" ]; then common+=(--set train.batch_size=2 --set model.context_length=32 --set model.n_layer=1); fi
    "$PY" -m andrea.train "${common[@]}" --stop-at-step 3 || return 1
    "$PY" -m andrea.train "${common[@]}" --resume || return 1
    "$PY" -m andrea.sample --device "$DEVICE" --checkpoint "$run" --prompt "def " --max-new-tokens 40
}

nccl_one_rank() {  # NCCL refuses two ranks on one GPU: the communicator and an all-reduce at one rank
    if [ "$DEVICE" != gpu ]; then
        "$PY" -m andrea.run.distributed --help > /dev/null && echo "dry run: the NCCL self-test needs a GPU (entry point found)"
        return
    fi
    "$PY" -m andrea.run.distributed --nccl-self-test
}

export -f gpu_tests train_stop_resume_sample nccl_one_rank
export PY DRY DEVICE WORK

main() {
    FAILED=0
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)${DRY:+ (dry run at toy sizes, device $DEVICE)}"
    "$PY" - "$DEVICE" <<'EOF' || FAILED=1
import sys
import numpy
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}")
if sys.argv[1] == "gpu":
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
              f"driver {cupy.cuda.runtime.driverGetVersion()}, {props['name'].decode()}, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB")
    except Exception as e:
        print(f"no usable GPU: {type(e).__name__}: {e}")
        sys.exit(1)
EOF
    phase 1 tests 70 gpu_tests
    phase 2 kernels 25 "$PY" scripts/gpu_check.py --parts kernels $DRY
    phase 3 gradients 25 "$PY" scripts/gpu_check.py --parts gradients $DRY
    phase 4 train 40 train_stop_resume_sample
    phase 5 nccl 20 nccl_one_rank
    phase 6 bench 50 "$PY" scripts/gpu_check.py --parts bench $DRY
    echo "== summary"
    cat "$RESULTS_DIR/summary.txt"
    if [ "$FAILED" -eq 0 ]; then echo "== gpu_check: every phase passed"; else echo "== gpu_check: SOME PHASES FAILED"; fi
    return "$FAILED"
}

main 2>&1 | tee "${OUT:-.}/gpu_check_results.txt"
exit "${PIPESTATUS[0]}"
