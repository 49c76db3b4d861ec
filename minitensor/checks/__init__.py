"""The checks: how minitensor proves its arithmetic, none of them needed to train.

    gradcheck.py    every backward against central finite differences, in float64
    selfcheck.py    the start-up self-check: each fused GPU piece against the Ops code it replaces
                    (its sample, from the piece's record in minitensor/backends/kernels/)
    kernelcheck.py  without a GPU: NVRTC compiles every CUDA kernel; g++ runs each one on the CPU
                    (elementwise operations as C++, RawKernels in a launch emulation)
    __main__.py     `python -m minitensor.checks [--check] [--host-check]`: the kernel checks' command
"""
