"""The checks: how minitensor proves its arithmetic, none of them needed to train.

    gradcheck.py    every backward against central finite differences, in float64
    selfcheck.py    the start-up self-check: each fused GPU kernel against the Ops code it replaces
    cupy_checks.py  the inputs and layer pieces that self-check runs
    kernelcheck.py  without a GPU: NVRTC compiles every CUDA kernel; g++ runs each one on the CPU
                    (elementwise operations as C++, RawKernels in a launch emulation)
    __main__.py     `python -m minitensor.checks [--check] [--host-check]`: the kernel checks' command
"""
