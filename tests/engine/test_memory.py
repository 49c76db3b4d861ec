"""minitensor.memory: the malloc thresholds are raised on glibc, and every opt-out is respected; and
importing the library changes nothing in the process (the entry points make those choices)."""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from andrea import BLAS_THREAD_TIMEOUT

_libc = ctypes.util.find_library("c") or ""
glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in _libc, reason="glibc only")


def _set_in_fresh_process(**env):
    code = "import json, minitensor.memory as m; print(json.dumps(m.keep_freed_memory()))"
    full = {k: v for k, v in os.environ.items()
            if k not in ("ANDREA_MALLOC_TUNE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@glibc
def test_both_thresholds_raised_by_default():
    assert _set_in_fresh_process() == {"mmap_threshold": 1 << 30, "trim_threshold": 1 << 30}


@glibc
def test_opt_out_and_user_settings_are_left_alone():
    assert _set_in_fresh_process(ANDREA_MALLOC_TUNE="0") == {}
    assert _set_in_fresh_process(MALLOC_MMAP_THRESHOLD_="65536") == {"trim_threshold": 1 << 30}
    assert _set_in_fresh_process(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1") == {"mmap_threshold": 1 << 30}


def test_it_does_its_work_once():
    import minitensor.memory as m

    first = m.keep_freed_memory()
    assert m.keep_freed_memory() is first


def test_importing_the_library_tunes_nothing():
    """minitensor and andrea as libraries: no environment variable, no malloc setting, no NumPy yet."""
    code = ("import os, sys, andrea, minitensor; numpy_first = 'numpy' in sys.modules; "
            "import minitensor.layers.layernorm, minitensor.memory as m; from andrea import ANDREA; "
            "print(numpy_first, os.environ.get('OPENBLAS_THREAD_TIMEOUT'), m._done)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "None", "None"]


def test_the_entry_points_set_the_blas_timeout_before_numpy_loads():
    """train, bench and sample set OPENBLAS_THREAD_TIMEOUT=4 when run as __main__, a value already in
    the environment winning, in the first statement after `import os`: before anything loads NumPy."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("train", "bench", "sample"):
        body = ast.parse((root / "andrea" / f"{name}.py").read_text()).body
        first = [node for node in body[1:] if not isinstance(node, ast.Expr)][:2]  # after the docstring
        assert isinstance(first[0], ast.Import) and [a.name for a in first[0].names] == ["os"], name
        assert isinstance(first[1], ast.If) and "OPENBLAS_THREAD_TIMEOUT" in ast.unparse(first[1]), name
    code = ("import os, runpy, sys\n"
            "for name in ('train', 'bench', 'sample'):\n"
            "    sys.argv = [name, '--help']\n"
            "    try:\n"
            "        runpy.run_module('andrea.' + name, run_name='__main__')\n"
            "    except SystemExit:\n"
            "        pass\n"
            "    print('TIMEOUT', os.environ.pop('OPENBLAS_THREAD_TIMEOUT', None))\n"
            "    os.environ.update(KEEP)\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for want, extra in ((BLAS_THREAD_TIMEOUT, {}), ("7", {"OPENBLAS_THREAD_TIMEOUT": "7"})):  # the environment wins
        out = subprocess.run([sys.executable, "-c", f"KEEP = {extra!r}\n" + code], env={**env, **extra},
                             capture_output=True, text=True, check=True)
        assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("TIMEOUT ")] == [want] * 3


@glibc
def test_a_library_script_gets_the_entry_points_settings_in_one_call():
    """andrea.tune_process() before NumPy: the entry points' OPENBLAS_THREAD_TIMEOUT and malloc
    thresholds; a timeout the user set is kept; after NumPy, a warning that the timeout comes too late."""
    code = ("import json, os, warnings, andrea; warnings.simplefilter('error'); done = andrea.tune_process(); "
            "import numpy; print(json.dumps([done, os.environ['OPENBLAS_THREAD_TIMEOUT']]))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "ANDREA_MALLOC_TUNE",
           "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    cases = (({}, {"OPENBLAS_THREAD_TIMEOUT": BLAS_THREAD_TIMEOUT}, BLAS_THREAD_TIMEOUT),
             ({"OPENBLAS_THREAD_TIMEOUT": "7"}, {}, "7"))  # a value already there wins
    for extra, set_here, want in cases:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        assert json.loads(out.stdout) == [{**set_here, "mmap_threshold": 1 << 30, "trim_threshold": 1 << 30}, want]
    late = subprocess.run([sys.executable, "-c", "import numpy, andrea; andrea.tune_process()"], env=env,
                          capture_output=True, text=True, check=True)
    assert "came after NumPy was imported" in late.stderr
