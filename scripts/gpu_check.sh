#!/usr/bin/env bash
# One command for a lent GPU machine without network: every phase within 7 minutes of limits (each
# limit three times its estimate), so that a rerun fits the same 15-minute lease. The machine already
# has what it needs (CuPy, PyTorch, compute-sanitizer): nothing is installed. Phases, in this order (the
# cheapest failures first), each with its own time limit:
#
#   0 device     Python, NumPy, CuPy, the CUDA runtime and driver, NCCL, the GPU's name and memory; with
#                no usable GPU the check stops here and says so (every later phase needs one)
#   1 preflight  every compile of the check, once: every project kernel (float32, float64), CuPy's own
#                kernels warmed by tiny training steps of each backend the tests build, the start-up
#                self-check with each fused piece timed against the generic code at ANDREA-120M's sizes,
#                one ANDREA-120M training step at 8 x 1024 (TF32) timed (scripts/gpu_check --part preflight)
#   2 tests      the GPU-marked tests with the GPU hypothesis profile against a measured budget
#                (scripts/gpu_check/budget.py: no test started that would end past the phase's deadline;
#                a partial run says "partial: N of M ran in the budget"); -v names each test as it
#                starts, --durations lists each test's time, the slowest first
#   3 kernels    each fused kernel against the generic code at ANDREA-120M shapes, compared on the device,
#                timed; the flash kernels' TF32 path and their bf16 instances (m16n8k16) at head size 64
#                against a float64 reference, at TF32's and bf16's tolerances
#   4 gradients  a small ANDREA trained on CuPy in float32 against NumPy float64 at T = 256 (dense core and
#                fused kernels; blocked generic core): per-step losses, step-0 gradients
#   5 train      python -m andrea.train --device gpu for 3 steps (--stop-at-step), --resume to 6, then
#                python -m andrea.sample --device gpu from the checkpoint
#   6 nccl       python -m andrea.run.allreduce --nccl-self-test (NCCL at one rank)
#   7 sanitize   compute-sanitizer (on PATH or under /usr/local/cuda*/bin) memcheck, then racecheck, over one
#                training step of a 1-layer model with every fused kernel, only the project's kernels
#                instrumented (--kernel-name); CUDA API errors it reports are counted, not fatal (CuPy
#                probes the driver); memory errors and races fail the phase
#   8 bench      ANDREA-120M at 8 x 1024, tf32: true: tokens/s, MFU, peak memory; each project kernel's
#                time in one step (beside the step model's price where it gives one); mma.sync's TF32
#                rate; PyTorch's GPT-2 of the same shape on the same GPU (TF32,
#                scaled_dot_product_attention): the ratio; the step model's estimate beside the measured step
#   9 bf16       python -m andrea.train 20 steps of ANDREA-120M at 8 x 1024 with train.precision=float32, then
#                bf16, from one seed: bf16's losses against float32's, each run's tokens/s
#                (scripts/gpu_check --part bf16)
#
# Every phase sees one CUPY_CACHE_DIR (default: a folder under $TMPDIR, kept between runs): the
# preflight compiles into it, and the summary says how many files each later phase added (none, when
# the preflight compiled everything a phase runs).
#
# Limits (s) against estimates on an H200, each limit three times its estimate. The estimates are
# counted, not measured (no GPU has run this yet), from: ~3 s a process for imports and CUDA's start;
# NVRTC ~0.3 s a project kernel (19 kernels x 2 dtypes, 6 s) and ~0.15 s a CuPy ufunc or reduction
# (~100 distinct in a training step, ~200 in the tests), all compiled in the preflight, two dtypes by two
# processes at once; ~7 us a CuPy call; NumPy references in NumPy alone (ANDREA_CPU_KERNELS=numpy:
# numba's cold compile is the CPU suite's business); the sanitizer ~8 s a tool (its start, a process's
# start under it, the project's kernels instrumented, ~500 launches); 120M steps at the step model's
# ~25 ms, PyTorch's at most twice that, torch's import ~3 s.
#   preflight: process 3 + project kernels 6 + warm-up 2 processes x (3 + ~100 ufuncs x 0.15) = 18 +
#   self-check at head size 64 (7 pieces) 8 + timing at 120M (7 pieces x 8 runs) 2 + model init 2 + the
#   step's ufuncs the warm-up missed (~20 x 0.15) 3 + the step 1 = 43 s.
#   tests: pytest's start 5 + 9 s of tests (the budget stops them at the phase's deadline less 15 s) = 14 s:
#   the stand-in runs every GPU-marked test in CI, the lent GPU as many as 9 s allow.
#   kernels: process 3 + self-check 2 + ~20 comparisons at 120M 3 + the TF32 flash case against float64 1 +
#   the bf16 flash case (its 3 kernels compiled 0.9, run 0.1) 1 = 10 s.
#   sanitize: 2 tools x 8 s = 16 s.
#   bench: 18 s as before, + one step with each launch timed alone 1 = 19 s.
#   bf16: a float32 run of python -m andrea.train: process 3 + model init 2 + 20 steps of 8 x 1024 0.5 + its
#   checkpoint 0.5 = 6; the bf16 run the same 6 + its own compiles (~4 project kernels' bf16 instances x
#   0.3, ~7 CuPy kernels on bfloat16 x 0.15) 2 = 8: 14 s.
#   device 3 -> 9, preflight 43 -> 129, tests 14 -> 42, kernels 10 -> 30, gradients 6 -> 18, train 12 -> 36,
#   nccl 3 -> 9, sanitize 16 -> 48, bench 19 -> 57, bf16 14 -> 42: 140 s estimated, 420 s of limits.
# On a timeout a phase gets SIGINT (Python raises KeyboardInterrupt where it is: pytest still prints
# its summary, --durations and the test it was in) and SIGKILL GRACE s later.
#
#     bash scripts/gpu_check.sh                           (from anywhere)
#     bash scripts/gpu_check.sh --dry-run                 (the same phases at toy sizes: on NumPy, or on
#                                                          the GPU if one works, e.g. the CuPy stand-in
#                                                          of minitensor/checks/cupy_standin; its GPU tests are
#                                                          collected and a few run; 6 times the limits)
#
# Three files under $OUT (default: out/ in the repository, which git ignores; a lent machine returns at
# most 8): $OUT/gpu_check/phases.log, every phase's output under its "== phase N name" line as it ends;
# $OUT/gpu_check/summary.txt, each phase's verdict, time and figures the moment it ends (a machine taken
# back mid-run still reports every phase that finished); $OUT/gpu_check_results.txt, the whole
# transcript. Exit status 0 only if every phase passed.
# `source scripts/gpu_check.sh` defines the functions without running anything (tests use `phase`).

GRACE=10         # s between SIGINT and SIGKILL
BUDGET_MARGIN=15 # s of the tests phase kept for pytest's summary after the last test it starts
DEFAULT_OUT=out  # the results' folder without $OUT, in the repository: git ignores it
DRY_SCALE=6      # a dry run runs on a CPU (2 shared cores in CI), maybe under the CuPy stand-in

phase() {  # phase <number> <name> <time limit in s> <command...>
    local n="$1" name="$2" limit="$3" start status file
    shift 3
    [ -n "$DRY" ] && limit=$((DRY_SCALE * limit))
    file="${WORK:-$RESULTS_DIR}/$n-$name.txt"
    echo "== phase $n: $name (at most $limit s)"
    start=$(date +%s)
    cached=$(cache_files)
    # through bash -c, so a phase may be one of the functions below (exported); unbuffered, so what a
    # phase printed is in its file even if it is killed; PHASE_DEADLINE for a budget inside the phase
    PHASE_DEADLINE=$((start + limit)) PYTHONUNBUFFERED=1 \
        timeout -s INT -k "$GRACE" "$limit" bash -c '"$@"' phase "$@" > "$file" 2>&1
    status=$?
    [ -n "$cached" ] && [ "$n" -gt 0 ] && [ "$DEVICE" = gpu ] \
        && echo "figure: kernel cache: $(( $(cache_files) - cached )) files added" >> "$file"
    cat "$file"
    { echo "== phase $n $name"; cat "$file"; } >> "$RESULTS_DIR/phases.log"
    record "$n" "$name" "$status" "$(( $(date +%s) - start ))" "$limit" "$file"
    return "$status"
}

cache_files() {  # how many files CuPy's kernel cache holds (nothing where there is no cache folder)
    [ -d "${CUPY_CACHE_DIR:-}" ] && find "$CUPY_CACHE_DIR" -type f | wc -l
}

record() {  # the verdict line and the phase's figures, appended to summary.txt (and printed)
    local n="$1" name="$2" status="$3" seconds="$4" limit="$5" file="$6" verdict="ok  " why=""
    if [ "$status" -ne 0 ]; then
        verdict="FAIL"; FAILED=1; why=" (exit status $status"
        [ "$status" -eq 124 ] || [ "$status" -eq 137 ] && why+=": timed out"
        why+=")"
    fi
    {
        echo "$verdict phase $n $name $seconds s of $limit s$why"
        figures "$file" "$status" | sed 's/^/       /'
    } | tee -a "$RESULTS_DIR/summary.txt"
}

figures() {  # figures <phase file> <status>: the lines worth keeping from a phase's output
    local file="$1" status="$2"
    sed -n 's/^figure: //p' "$file"
    grep -E '^[0-9/]+ tests? collected' "$file" | tail -1  # pytest --collect-only -q
    grep -E '^partial: [0-9]+ of [0-9]+ ran in the budget' "$file" | tail -1  # gpu_check/budget.py
    grep -E '^(done: step|NCCL self-test: )' "$file" | cut -d'|' -f1-3  # andrea.train's last line, NCCL's
    # pytest's closing line ("= 148 passed, 2 failed in 51.2s =") and its three slowest tests
    grep -E '^=+ .*[0-9]+ (passed|failed|error|errors|skipped|deselected).* in [0-9.]+s' "$file" | tail -1 \
        | sed -E 's/^=+ //; s/ =+$//'
    grep -A3 -E '^=+ slowest ([0-9]+ )?durations' "$file" | grep -E '^[0-9.]+s ' | sed 's/^/slow: /'
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then  # pytest -v names each test as it starts
        grep -E '^[^ ]+\.py::[^ ]+' "$file" | tail -1 | sed -E 's/^/last test started: /; s/ +$//'
    fi
    if [ "$status" -ne 0 ]; then
        grep -E '^(FAIL|FAILED|ERROR) ' "$file" | head -8
        tail -1 "$file" | sed 's/^/last line: /'
    fi
}

run_pytest() {  # pytest with SIGINT raising KeyboardInterrupt even where the caller ignored it
    "$PY" -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' "$@"
}

gpu_tests() {  # CuPy's kernels are in the cache already: the preflight warmed them
    local select=(tests)
    if [ -n "$DRY" ]; then  # every GPU-marked test collected (none without a GPU: pytest's status 5)...
        ANDREA_TEST_PROFILE=gpu run_pytest -m gpu -q -p no:cacheprovider --collect-only tests
        local status=$?
        [ "$status" -eq 5 ] || [ "$status" -eq 0 ] || return 1
        [ "$DEVICE" = gpu ] || return 0  # with no GPU (not even the stand-in) they would only skip
        select=(tests/engine/test_optim.py tests/engine/test_softmax.py)  # ... and 3 run, as the real check runs all
    fi
    # each test's time (those over 0.1 s), the slowest first; none started past the deadline
    ANDREA_TEST_PROFILE=gpu run_pytest -m gpu -v -rfE -p no:cacheprovider -p gpu_check.budget \
        --budget-deadline "$((PHASE_DEADLINE - BUDGET_MARGIN))" --durations=0 --durations-min=0.1 "${select[@]}"
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
        "$PY" -m andrea.run.allreduce --help > /dev/null && echo "dry run: the NCCL self-test needs a GPU (entry point found)"
        return
    fi
    "$PY" -m andrea.run.allreduce --nccl-self-test
}

find_sanitizer() {  # compute-sanitizer on PATH, else where CUDA toolkits install it
    local found
    found=$(command -v compute-sanitizer) && { echo "$found"; return; }
    for found in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
                 /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        [ -x "$found" ] && { echo "$found"; return; }
    done
    return 1
}

sanitize() {  # compute-sanitizer over one training step with every fused kernel
    local tool status=0 sanitizer kernels filter errors api
    if [ -n "$DRY" ]; then
        echo "figure: compute-sanitizer skipped (dry run: it needs a real GPU); the step it checks ran bare"
        "$PY" scripts/gpu_check --part sanitize $DRY
        return
    fi
    if ! sanitizer=$(find_sanitizer); then
        echo "FAIL compute-sanitizer is neither on PATH nor under /usr/local/cuda*/bin (a CUDA toolkit brings it)"
        return 1
    fi
    # only the project's kernels instrumented: cuBLAS's and CuPy's own are not ours to check
    kernels=$("$PY" -c 'from minitensor.backends import all_kernels; print("|".join(all_kernels()))') || return 1
    for tool in memcheck racecheck; do
        echo "== $sanitizer --tool $tool (kernels: $kernels)"
        SECONDS=0
        filter=(--kernel-name "regex=^($kernels)")
        # a print limit high enough that every API error is printed: they are counted from the printout
        "$sanitizer" --tool "$tool" "${filter[@]}" --print-limit 1000 "$PY" scripts/gpu_check --part sanitize \
            > "$WORK/$tool.txt" 2>&1
        if ! grep -q "figure: CuPy 1-layer step" "$WORK/$tool.txt"; then  # the filter refused, or the step failed
            head -5 "$WORK/$tool.txt"
            echo "the step did not run under --kernel-name: again, every kernel instrumented"
            "$sanitizer" --tool "$tool" --print-limit 1000 "$PY" scripts/gpu_check --part sanitize \
                > "$WORK/$tool.txt" 2>&1
        fi
        cat "$WORK/$tool.txt"
        # API errors (CuPy probing the driver) are recorded; memory errors and races fail the phase
        api=$(grep -c "Program hit" "$WORK/$tool.txt")
        errors=$(sed -n -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/p; s/.*RACECHECK SUMMARY: [0-9]+ hazards? displayed \(([0-9]+) errors?.*/\1/p' \
            "$WORK/$tool.txt" | tail -1)
        errors=${errors:-unknown}
        [ "$tool" = memcheck ] && [ "$errors" != unknown ] && errors=$(( errors > api ? errors - api : 0 ))
        echo "figure: $tool in $SECONDS s: $errors memory errors or races, $api CUDA API errors recorded"
        grep -q "figure: CuPy 1-layer step" "$WORK/$tool.txt" || { echo "FAIL $tool: the step did not finish"; status=1; }
        [ "$errors" = 0 ] || status=1
    done
    return "$status"
}

device_line() {
    "$PY" - "$DEVICE" <<'PYEOF'
import sys
import numpy
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}")
if sys.argv[1] == "gpu":
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        print(f"cupy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
              f"driver {cupy.cuda.runtime.driverGetVersion()}, {props['name'].decode()}, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB, {props['multiProcessorCount']} SMs")
        try:
            from cupy.cuda import nccl
            print(f"figure: NCCL {nccl.get_version()}, driver {cupy.cuda.runtime.driverGetVersion()}, "
                  f"{props['name'].decode()}")
        except Exception as e:  # the NCCL phase says more
            print(f"figure: NCCL not loadable ({type(e).__name__}: {e}), driver {cupy.cuda.runtime.driverGetVersion()}")
    except Exception as e:
        print(f"no usable GPU: {type(e).__name__}: {e}")
        sys.exit(1)
PYEOF
}

setup() {  # the environment every phase sees
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || exit 2
    # the results: $OUT as given (relative to where the check was started), else out/, which git ignores
    OUT="$(mkdir -p "${OUT:-$root/$DEFAULT_OUT}" && cd "${OUT:-$root/$DEFAULT_OUT}" && pwd)" || exit 2
    cd "$root" || exit 2
    # the repository for andrea, scripts/ for the check's own package (gpu_check/: its parts and pytest plugin)
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/scripts"
    export GPU_CHECK_TEED=1  # this script keeps the results files, not scripts/gpu_check
    # one kernel cache for every phase, kept between runs: the preflight compiles, the others reuse
    export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/andrea-gpu-check-kernel-cache}"
    mkdir -p "$CUPY_CACHE_DIR"
    PY="${PYTHON:-$(command -v python3 || command -v python)}"
    DEVICE=gpu
    if [ -n "$DRY" ]; then
        DEVICE=$("$PY" -c 'from minitensor.device import gpu_available; print("gpu" if gpu_available() else "cpu")') \
            || DEVICE=cpu
    fi
    # the GPU check's NumPy references run NumPy alone: numba's kernels are the CPU suite's, and their
    # cold compile on a fresh tree (~1 min) would eat the lent minutes
    [ "$DEVICE" = gpu ] && export ANDREA_CPU_KERNELS="${ANDREA_CPU_KERNELS:-numpy}"
    RESULTS_DIR="$OUT/gpu_check"
    mkdir -p "$RESULTS_DIR"
    WORK="$(mktemp -d)"
    export -f gpu_tests run_pytest train_stop_resume_sample nccl_one_rank sanitize find_sanitizer cache_files
    export PY DRY DEVICE WORK RESULTS_DIR OUT BUDGET_MARGIN
}

main() {
    FAILED=0
    : > "$RESULTS_DIR/summary.txt"
    : > "$RESULTS_DIR/phases.log"
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)${DRY:+ (dry run at toy sizes, device $DEVICE)}"
    echo "== results in $RESULTS_DIR/ and $OUT/gpu_check_results.txt; kernel cache $CUPY_CACHE_DIR"
    export -f device_line
    if ! phase 0 device 9 device_line && [ -z "$DRY" ]; then
        echo "== gpu_check: no usable GPU (phase 0 says why): stopped after the device phase, as every other" \
             "phase needs one; bash scripts/gpu_check.sh --dry-run runs them at toy sizes without a GPU" \
            | tee -a "$RESULTS_DIR/summary.txt"
        return 1
    fi
    phase 1 preflight 129 "$PY" scripts/gpu_check --part preflight $DRY
    phase 2 tests 42 gpu_tests
    phase 3 kernels 30 "$PY" scripts/gpu_check --part kernels $DRY
    phase 4 gradients 18 "$PY" scripts/gpu_check --part gradients $DRY
    phase 5 train 36 train_stop_resume_sample
    phase 6 nccl 9 nccl_one_rank
    phase 7 sanitize 48 sanitize
    phase 8 bench 57 "$PY" scripts/gpu_check --part bench $DRY
    phase 9 bf16 42 "$PY" scripts/gpu_check --part bf16 $DRY
    echo "== summary"
    cat "$RESULTS_DIR/summary.txt"
    if [ "$FAILED" -eq 0 ]; then echo "== gpu_check: every phase passed"; else echo "== gpu_check: SOME PHASES FAILED"; fi
    echo "== results in $RESULTS_DIR/ and $OUT/gpu_check_results.txt"
    return "$FAILED"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
    set -u
    DRY=""
    [ "${1:-}" = "--dry-run" ] && DRY="--dry-run"
    setup
    trap 'rm -rf "$WORK"' EXIT
    main 2>&1 | tee "$OUT/gpu_check_results.txt"
    exit "${PIPESTATUS[0]}"
fi
