"""Where the CuPy stand-in is, and the environment of a command that runs on it.

    minitensor/checks/cupy_standin/    a NumPy-backed `cupy` (and `cupy_backends`) for CuPy 14.2
    env = standin_env()                os.environ with that folder first on PYTHONPATH

Its compute mode runs minitensor's GPU code paths on the CPU: every xp operation of the CuPy
branches, the ElementwiseKernel operations as C++ and the RawKernels through the launch emulation
(minitensor.checks.emulation); its recording mode (cupy/_record.py) runs CuPy code at any size
without computing and records every launch, which is what andrea's step model prices
(andrea.run.stepmodel). It ships with the package, so both work from an installed andrea.

The folder is no package of minitensor's: `import cupy` finds it only in a process that puts it
first on its path (a command started with `standin_env()`, or a test inside
tests/support/gpu_standin.standin_cupy()); everything else keeps the real CuPy, or none.
"""

import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "cupy_standin"
SOURCES = Path(__file__).resolve().parents[2]  # the folder minitensor (and andrea) are imported from


def standin_env(**variables):
    """os.environ for a command that imports the stand-in as `cupy`: FOLDER first on PYTHONPATH, then
    the folder this minitensor was imported from, then PYTHONPATH as it was; without ANDREA_DEVICE or
    CUPY_STANDIN_REPORT, which a caller sets again through `variables` when it means them."""
    env = {k: v for k, v in os.environ.items() if k not in ("ANDREA_DEVICE", "CUPY_STANDIN_REPORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(FOLDER), str(SOURCES), *filter(None, [env.get("PYTHONPATH")])])
    env.update({k: str(v) for k, v in variables.items()})
    return env
