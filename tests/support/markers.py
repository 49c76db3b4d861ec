"""Skip markers shared by the kernel tests: NVRTC (through CuPy) and a host C++ compiler."""

import shutil

import pytest

from minitensor.backends import cuda

toolchain_reason = None
try:
    cuda.toolchain()
except cuda.ToolchainMissing as e:
    toolchain_reason = str(e)

needs_nvrtc = pytest.mark.skipif(toolchain_reason is not None, reason=str(toolchain_reason))
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the host checks")
