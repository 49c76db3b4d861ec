"""`python -m andrea.serve RUN_OR_HF_DIR`: see andrea/serve/cli.py."""

import os

if __name__ == "__main__":  # before NumPy loads OpenBLAS: its threads sleep after each GEMM (BENCHMARKS.md)
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

    from andrea.cli import run_cli  # after the setting above, on purpose
    from andrea.serve.cli import main

    run_cli(main)
