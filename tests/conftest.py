"""Shared fixtures: the backends every engine test runs on.

NumPy is always there; CuPy joins the list only when a GPU actually works (a tiny kernel and a
tiny matmul ran), so a CPU-only machine runs every check on NumPy and reports the GPU as absent
in the header rather than as skipped gradient checks.
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
