"""minitensor.memory: the malloc thresholds are raised on glibc, and every opt-out is respected; and
importing the library changes nothing in the process (the entry points make those choices)."""

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

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


def test_the_entry_points_are_recognised_from_the_command_line():
    import andrea

    assert andrea.entry_point(["python", "-m", "andrea.train", "--out", "x"]) == "andrea.train"
    assert andrea.entry_point(["python", "-c", "import andrea"]) is None
    assert andrea.entry_point(["python", "script.py", "-m"]) is None
    # as `python -m andrea.train` starts: andrea/__init__.py runs before anything loads NumPy
    code = ("import sys; sys.orig_argv = ['python', '-m', 'andrea.train']; import andrea, os; "
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'numpy' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for want, extra in (("4", {}), ("7", {"OPENBLAS_THREAD_TIMEOUT": "7"})):  # the environment wins
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        assert out.stdout.split() == [want, "False"]
