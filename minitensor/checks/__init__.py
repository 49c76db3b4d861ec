"""The checks: how minitensor proves its arithmetic, none of them needed to train.

    gradcheck.py    every backward against central finite differences, in float64
    kernelcheck.py  without a GPU: NVRTC compiles every CUDA kernel; g++ runs each one on the CPU
                    (elementwise operations as C++, RawKernels in a launch emulation)
    emulation.py    a RawKernel run on the CPU, a fiber per CUDA thread; traffic.py its counting
                    build (shared-memory wavefronts, L2 sectors, mma steps)
    counts.py       registers, spills, occupancy and those counts per kernel (`--counts`)
    __main__.py     `python -m minitensor.checks [--check] [--host-check] [--counts]`: the kernel checks' command
    standin.py      where the CuPy stand-in is (cupy_standin/: a NumPy-backed `cupy` that runs the GPU
                    code paths on the CPU, or records their launches without computing) and the
                    environment of a command that runs on it
"""
