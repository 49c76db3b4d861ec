"""Shared fixtures: the backends every engine test runs on, and CuPy for the kernel tests.

NumPy is always there; CuPy joins the list only when a GPU actually works (a tiny kernel and a
tiny matmul ran), so a CPU-only machine runs every check on NumPy and reports the GPU as absent
in the header rather than as skipped gradient checks. The `cupy` fixture is for tests that run
only on a GPU (the CUDA kernels): it skips them with the probe's reason when none works.
`model_backend` runs a whole-model test on every backend, and on CuPy twice: with the generic
kernels and with every fused one in use (`ANDREA(cfg, **model_backend.args)`).

With ANDREA_TEST_PROFILE=gpu (scripts/gpu_check.sh), every hypothesis test runs at most
GPU_EXAMPLES examples without a deadline: the lent GPU's minutes go to more kinds of checks
rather than more draws of each (the CPU suite keeps its counts).
"""

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import settings

from andrea.prepare import prepare
from minitensor import backend

GPU_EXAMPLES = 3


def available_backends():
    xps = [pytest.param(np, id="numpy")]
    if backend.gpu_available():
        import cupy

        xps.append(pytest.param(cupy, id="cupy", marks=pytest.mark.gpu))
    return xps


def backends_line():
    ok, why = backend._probe_gpu()
    return f"andrea backends: numpy{', cupy (GPU)' if ok else ''}" + ("" if ok else f"; GPU tests not run: {why}")


def pytest_report_header(config):
    return backends_line()


def pytest_terminal_summary(terminalreporter):
    """The same line at the end, where `pytest -q` (which hides the header) shows it too."""
    terminalreporter.write_line(backends_line())


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


class ModelBackend(NamedTuple):
    xp: object
    kernels: str | None  # the GPU's fused kernels, 'generic' or 'fused' (None on NumPy)

    @property
    def args(self):
        """ANDREA's keyword arguments for this backend."""
        return {"device": "cpu" if self.xp is np else "gpu", "kernels": self.kernels}


def model_backends():
    backends = [pytest.param(ModelBackend(np, None), id="numpy")]
    if backend.gpu_available():
        import cupy

        backends += [pytest.param(ModelBackend(cupy, "generic"), id="cupy-generic", marks=pytest.mark.gpu),
                     pytest.param(ModelBackend(cupy, "fused"), id="cupy-fused", marks=pytest.mark.gpu)]
    return backends


@pytest.fixture(scope="module", params=model_backends())
def model_backend(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ANDREA_TEST_PROFILE") != "gpu":
        return
    for item in items:
        test = getattr(item, "obj", None)
        current = getattr(test, "_hypothesis_internal_use_settings", None)
        if current is not None:  # read by hypothesis when the test runs
            test._hypothesis_internal_use_settings = settings(
                current, max_examples=min(current.max_examples, GPU_EXAMPLES), deadline=None)


STDLIB_JSON = Path(json.__file__).parent  # the stdlib's json package: ~100 KB of Python, on every machine


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data directory prepared from STDLIB_JSON with the ids that small corpus gives, once per test
    module (a module's tests may damage theirs; test_distributed prepares its own)."""
    d = tmp_path_factory.mktemp("data")
    prepare([str(STDLIB_JSON)], d, allow_smaller_vocab=True, progress=False)
    return d
