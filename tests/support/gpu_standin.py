"""The CuPy stand-in (minitensor/checks/cupy_standin), for the tests that run the GPU code paths without a GPU.

    with standin_cupy() as cupy: ...        # in this process: `import cupy` is the stand-in, and
                                            # minitensor's GPU probe finds a usable "GPU"
    cupy = standin_module()                 # the module itself, for a test's parameters
    env = standin_env(report_dir)           # for a command: the stand-in first on PYTHONPATH

Only the tests that ask for it see it (without a GPU, every GPU-marked test does: tests/conftest.py):
the rest of the suite keeps the real CuPy (or none) and reports no GPU. On leaving, the modules,
the probe's cached verdict and the kernels built are what they were.

What the stand-in runs is the project's own code: every xp operation of the CuPy branches, the
ElementwiseKernel operations as C++ and the RawKernels through minitensor's launch emulation.
What only a real GPU can show: NVRTC compiling the kernels for the device and running them
(`python -m minitensor.checks --check` compiles them for sm_80/sm_90 without one), CUDA's float
rounding and its reductions' summation orders, races between blocks, cuBLAS and TF32 numerics,
memory use and speed, streams overlapping, NCCL between GPUs and the driver's errors.
"""

import contextlib
import importlib
import json
import sys
from pathlib import Path

from minitensor import device
from minitensor.backends import cuda
from minitensor.checks import standin

STANDIN = standin.FOLDER
ROOT = Path(__file__).resolve().parents[2]  # the source checkout
_PACKAGES = ("cupy", "cupyx", "cupy_backends")


def _ours(name):
    return name.split(".")[0] in _PACKAGES


def _forget_built_kernels():
    """minitensor keeps the CuPy kernel objects it built: another CuPy's must not be reused."""
    cuda._elementwise_kernel.cache_clear()
    cuda._raw_kernel.cache_clear()


_standin_modules = {}  # imported once per process: minitensor's caches may hold its arrays


@contextlib.contextmanager
def standin_cupy():
    """Within the block `import cupy` gives the stand-in and minitensor sees one usable GPU."""
    saved_modules = {name: mod for name, mod in sys.modules.items() if _ours(name)}
    saved_state = (device._gpu_probe, device._fallback_reported)
    for name in saved_modules:
        del sys.modules[name]
    if _standin_modules:
        sys.modules.update(_standin_modules)
    else:
        sys.path.insert(0, str(STANDIN))
        try:  # every module of it, so that no later import finds the real CuPy's
            for path in sorted(STANDIN.rglob("*.py")):
                parts = path.relative_to(STANDIN).with_suffix("").parts
                importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        finally:
            sys.path.remove(str(STANDIN))
        _standin_modules.update({name: mod for name, mod in sys.modules.items() if _ours(name)})
    _forget_built_kernels()
    device._gpu_probe = None
    try:
        import cupy

        assert getattr(cupy, "STANDIN", False), f"imported {cupy.__file__}, not the stand-in"
        cupy.standin.reset()
        yield cupy
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        _forget_built_kernels()
        device._gpu_probe, device._fallback_reported = saved_state


def standin_module():
    """The stand-in's `cupy` module, without entering it: what the GPU-marked tests are parametrised
    with on a machine without a GPU (tests/conftest.py enters standin_cupy() around each of them)."""
    with standin_cupy() as cupy:
        return cupy


def standin_env(report_dir=None, **extra):
    """The environment of a command that runs on the stand-in; with report_dir, each process of it
    writes its reads there (read them with `reports`)."""
    if report_dir is not None:
        extra["CUPY_STANDIN_REPORT"] = report_dir
    return standin.standin_env(**extra)


def reports(report_dir):
    """The stand-in's reports of every process that wrote one in report_dir, as dicts."""
    return [json.loads(p.read_text()) for p in sorted(Path(report_dir).glob("*.json"))]

