"""Shared fixtures: the backends every engine test runs on, and CuPy for the kernel tests.

NumPy is always there; CuPy joins the list only when a GPU actually works (a tiny kernel and a
tiny matmul ran), so a CPU-only machine runs every check on NumPy and reports the GPU as absent
in the header rather than as skipped gradient checks. The `cupy` fixture is for tests that run
only on a GPU (the CUDA kernels): it skips them with the probe's reason when none works.
"""

import numpy as np
import pytest

from minitensor import backend


def available_backends():
    xps = [pytest.param(np, id="numpy")]
    if backend.gpu_available():
        import cupy

        xps.append(pytest.param(cupy, id="cupy", marks=pytest.mark.gpu))
    return xps


def pytest_report_header(config):
    ok, why = backend._probe_gpu()
    return f"andrea backends: numpy{', cupy (GPU)' if ok else ''}" + ("" if ok else f"; GPU tests not run: {why}")


@pytest.fixture(scope="session", params=available_backends())
def xp(request):
    return request.param


@pytest.fixture(scope="module")
def cupy():
    ok, why = backend._probe_gpu()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    import cupy

    return cupy
