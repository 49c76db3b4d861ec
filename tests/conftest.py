"""Shared fixtures: the backends every engine test runs on, and CuPy for the kernel tests.

NumPy is always there. The GPU-marked parameters run on CuPy: the real one when a GPU works (a
tiny kernel and a tiny matmul ran), otherwise the CuPy stand-in (minitensor/checks/cupy_standin, ids
`cupy-standin...`, marked `gpu` and `standin`), which each such test enters for its setup, call
and teardown (tests/support/gpu_standin.py), so the rest of the suite still sees no GPU. `pytest -m gpu`
selects the same tests either way. The `cupy` fixture is for tests that run only on CuPy (the
CUDA kernels). `model_backend` runs a whole-model test on every backend, and on CuPy twice: with
the generic kernels and with every fused one in use (`ANDREA(cfg, **model_backend.args)`).

The fast tier, `python -m pytest -q --fast`, is the one a newcomer runs first: the files of
FAST_TIER (the engine's maths and sampling, and andrea's own logic: the LR schedules, the sources,
the experiments' paired statistics, the server's engine), their tests not marked `slow` or `gpu`,
in the `dev` profile; every other file is not even collected.

The hypothesis profiles, registered here once and chosen by ANDREA_TEST_PROFILE or pytest's
--hypothesis-profile: `ci` (the default) runs each test's own count, the max_examples of its
@settings (hypothesis' 100 where it sets none); `dev` (the fast tier's) and `gpu`
(scripts/gpu_check.sh: the lent GPU's minutes go to more kinds of checks rather than more draws of
each) cap every test at a few examples. No profile has a deadline: a loaded machine is not a
failure. `dev` does not shrink a failing example either: shrinking turned one fast failure into
five minutes, and the fast tier is for finding out, at once, that something fails. The stand-in's
parameters always run the gpu profile's count (the NumPy parameters of the same tests keep theirs):
they check that the CuPy code paths run and agree with NumPy, not more draws of the same maths.
"""

import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from gpu_standin import standin_cupy, standin_module
from hypothesis import Phase, settings

from andrea.data.preparation import prepare
from minitensor import device

PROFILES = {"ci": None, "dev": 2, "gpu": 3}  # the most examples a test draws (None: its own count)
NO_SHRINKING = tuple(phase for phase in Phase if phase is not Phase.shrink)
for _name, _cap in PROFILES.items():
    settings.register_profile(_name, deadline=None, **({} if _cap is None else {"max_examples": _cap}),
                              **({"phases": NO_SHRINKING} if _name == "dev" else {}))
settings.load_profile(os.environ.get("ANDREA_TEST_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parents[1]
# The fast tier (`--fast`): these folders and files, their tests not marked slow or gpu (README: its time).
FAST_TIER = (
    "tests/engine/",                    # every layer, the ops, the optimizer, the flat buffers, sampling
    "tests/app/test_schedule.py",       # the LR schedules
    "tests/app/test_sources.py",        # the sources: documents, the split, bad records
    "tests/app/test_data_documents.py",
    "tests/app/test_data_split_edges.py",
    "tests/app/test_paired.py",         # the experiments' paired statistics
    "tests/app/test_serve.py",          # the server's engine: completions against andrea.sample, stops, logprobs
)


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: FAST_TIER of tests/conftest.py, without slow or gpu tests, 'dev' profile")


def _in_fast_tier(path: Path) -> bool:
    """Whether the file or folder `path` is, holds or lies in a part of FAST_TIER."""
    try:
        rel = path.resolve().relative_to(ROOT).as_posix() + ("/" if path.is_dir() else "")
    except ValueError:
        return False
    return any(rel.startswith(part) or part.startswith(rel) for part in FAST_TIER)


def pytest_ignore_collect(collection_path, config):
    if config.getoption("fast") and not _in_fast_tier(Path(collection_path)):
        return True
    return None


def _gpu():
    """(cupy, id prefix, marks) of the GPU-marked parameters: the real CuPy on a working GPU,
    else the stand-in."""
    if device.gpu_available():
        import cupy

        return cupy, "cupy", [pytest.mark.gpu]
    return standin_module(), "cupy-standin", [pytest.mark.gpu, pytest.mark.standin]


GPU_CUPY, GPU_ID, GPU_MARKS = _gpu()
ON_STANDIN = GPU_ID == "cupy-standin"


def available_backends():
    return [pytest.param(np, id="numpy"), pytest.param(GPU_CUPY, id=GPU_ID, marks=GPU_MARKS)]


def backends_line():
    ok, why = device._probe_gpu()
    if ok:
        return "andrea backends: numpy, cupy (GPU)"
    return f"andrea backends: numpy, cupy stand-in for the GPU-marked tests (no usable GPU: {why})"


def _profile(config) -> str:
    """The hypothesis profile of this session: the one named, else `dev` for --fast, else ci."""
    named = config.getoption("hypothesis_profile", None) or os.environ.get("ANDREA_TEST_PROFILE")
    return named or ("dev" if config.getoption("fast") else "ci")


def pytest_configure(config):
    config.addinivalue_line("markers", "standin: runs on the CuPy stand-in (minitensor.checks.standin), no GPU here")
    config.addinivalue_line("markers", "real_gpu(reason): a GPU-marked test the stand-in cannot run (skipped there)")
    if config.getoption("fast") and not config.getoption("hypothesis_profile", None):
        settings.load_profile(_profile(config))


def pytest_report_header(config):
    return backends_line()


def pytest_terminal_summary(terminalreporter):
    """The same line at the end, where `pytest -q` (which hides the header) shows it too."""
    terminalreporter.write_line(backends_line())


@pytest.fixture(scope="session", params=available_backends())
def xp(request):
    return request.param


if ON_STANDIN:
    @pytest.fixture(scope="module", params=[pytest.param(GPU_CUPY, id=GPU_ID, marks=GPU_MARKS)])
    def cupy(request):
        return request.param
else:
    @pytest.fixture(scope="module")
    def cupy():
        ok, why = device._probe_gpu()
        if not ok:
            pytest.skip(f"no usable GPU: {why}")
        return GPU_CUPY


class ModelBackend(NamedTuple):
    xp: object
    kernels: str | None  # the GPU's fused kernels, 'generic' or 'fused' (None on NumPy)

    @property
    def args(self):
        """ANDREA's keyword arguments for this backend."""
        return {"device": "cpu" if self.xp is np else "gpu", "kernels": self.kernels}


def model_backends():
    return [pytest.param(ModelBackend(np, None), id="numpy")] + [
        pytest.param(ModelBackend(GPU_CUPY, kernels), id=f"{GPU_ID}-{kernels}", marks=GPU_MARKS)
        for kernels in ("generic", "fused")]


@pytest.fixture(scope="module", params=model_backends())
def model_backend(request):
    return request.param


def _few_examples(test, cap):
    """A hypothesis test's settings with at most `cap` examples (None for another test, or no cap)."""
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    if current is None or cap is None:
        return None
    return settings(current, max_examples=min(current.max_examples, cap))


def pytest_collection_modifyitems(config, items):
    for item in items:
        real = item.get_closest_marker("real_gpu")
        # the stand-in's params, or the stand-in first on PYTHONPATH (which the probe takes for a GPU)
        if real and (item.get_closest_marker("standin") or getattr(GPU_CUPY, "STANDIN", False)):
            item.add_marker(pytest.mark.skip(reason=f"needs a real GPU: {real.args[0]}"))
    if config.getoption("fast"):  # the tier's files only were collected: now its quick tests
        slow = [item for item in items if item.get_closest_marker("slow") or item.get_closest_marker("gpu")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            left_out = set(slow)
            items[:] = [item for item in items if item not in left_out]
    profile = _profile(config)
    for item in items:
        test = getattr(item, "obj", None)
        few = _few_examples(test, PROFILES.get(profile))
        if few is not None:  # read by hypothesis when the test runs
            test._hypothesis_internal_use_settings = few


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A stand-in test runs its setup, call and teardown inside standin_cupy(), with the GPU
    profile's examples (the test function is shared with its NumPy parameters, which keep theirs)."""
    if item.get_closest_marker("standin") is None:
        yield
        return
    test = getattr(item, "obj", None)
    few = _few_examples(test, PROFILES["gpu"])
    kept = few and test._hypothesis_internal_use_settings
    with standin_cupy():
        if few:
            test._hypothesis_internal_use_settings = few
        try:
            yield
        finally:
            if few:
                test._hypothesis_internal_use_settings = kept


STDLIB_JSON = Path(json.__file__).parent  # the stdlib's json package: ~100 KB of Python, on every machine


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data directory prepared from STDLIB_JSON with the ids that small corpus gives, once per test
    module (a module's tests may damage theirs; test_distributed prepares its own)."""
    d = tmp_path_factory.mktemp("data")
    prepare([str(STDLIB_JSON)], d, allow_smaller_vocab=True, progress=False)
    return d
