"""Optional dependencies of the tests (torch, transformers, mpi4py, matplotlib, starlette, openai...).

Outside CI a test that needs one is skipped when it is missing, with the extra to install; in CI
(`CI` set, as `.ci/run` does) every extra is installed, so a missing one is a failure, never a
silent skip.
"""

import importlib
import os

import pytest

EXTRA = {"torch": "reference", "transformers": "reference", "mpi4py": "mpi", "matplotlib": "plot", "numba": "fast",
         "scipy": "fast", "starlette": "serve", "uvicorn": "serve", "openai": "test", "websockets": "test",
         "pyarrow": "parquet", "lm_eval": "eval",
         "tensorboardX": "tensorboard", "tensorboard": "tensorboard", "wandb": "wandb"}


def require(name):
    """The module `name` (a submodule too: "pyarrow.parquet"), or a skip naming its extra (a hard error
    when CI is set)."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    top = name.split(".")[0]
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[{EXTRA.get(top, top)}]')")
