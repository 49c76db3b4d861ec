"""Skip markers shared by the kernel tests: NVRTC (through CuPy), a host C++ compiler, nvdisasm."""

import os
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


def nvdisasm_or_skip():
    """nvdisasm (minitensor.checks.sass), or a skip saying why; in CI (`CI` set), where the kernel-check extra
    brings it, a missing one fails."""
    from minitensor.checks import sass

    try:
        return sass.nvdisasm()
    except sass.NvdisasmMissing as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
