#!/usr/bin/env bash
# One command for a GPU machine without network: the GPU-marked tests (every fused kernel and every
# layer on CuPy against NumPy), then scripts/gpu_check.py (training parity with NumPy, the fused
# kernels against the generic CuPy path at ANDREA-120M shapes, ANDREA-120M at 8 x 1024 in float32
# and TF32: tokens/s, MFU, peak GPU memory). About 2-3 minutes; every step has a time limit, 5
# minutes in all at worst.
#
#     PYTHONPATH=. bash scripts/gpu_check.sh        (from the repository root)
#
# Everything printed also goes to gpu_check_results.txt in $OUT if set, else the current directory.
# Exit status 0 only if every part passed.

set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export GPU_CHECK_TEED=1  # this script copies the output to the results file, not gpu_check.py
PY="${PYTHON:-$(command -v python3 || command -v python)}"
RESULTS="${OUT:-.}/gpu_check_results.txt"
TEST_LIMIT_S=90

main() {
    local failed=0 status
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    "$PY" - <<'EOF' || failed=1
import sys
import numpy
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}")
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

    echo "== GPU-marked tests: pytest -m gpu (at most ${TEST_LIMIT_S} s)"
    timeout "$TEST_LIMIT_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs
    status=$?
    if [ "$status" -ne 0 ]; then
        echo "FAIL the GPU-marked tests (exit status $status$([ "$status" -eq 124 ] && echo ': timed out'))"
        failed=1
    fi

    echo "== scripts/gpu_check.py"
    "$PY" scripts/gpu_check.py || failed=1

    echo "== NCCL at one rank: python -m andrea.distributed --nccl-self-test (at most 60 s)"
    timeout 60 "$PY" -m andrea.distributed --nccl-self-test || { echo "FAIL the NCCL self-test"; failed=1; }

    if [ "$failed" -eq 0 ]; then echo "== gpu_check: every part passed"; else echo "== gpu_check: SOME PARTS FAILED"; fi
    return "$failed"
}

main 2>&1 | tee "$RESULTS"
exit "${PIPESTATUS[0]}"
