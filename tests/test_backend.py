"""Device selection: cpu always works, auto falls back with one notice, gpu without a GPU says why."""

import numpy as np
import pytest

from minitensor import backend


def test_cpu_is_numpy():
    assert backend.get_backend("cpu").xp is np


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.resolve_device("tpu")


def test_device_from_environment(monkeypatch):
    monkeypatch.setenv("ANDREA_DEVICE", "cpu")
    assert backend.resolve_device(None) == "cpu"
    monkeypatch.delenv("ANDREA_DEVICE")
    assert backend.resolve_device(None) == "auto"


@pytest.mark.skipif(backend.gpu_available(), reason="this machine has a GPU")
def test_gpu_without_gpu_explains_and_auto_falls_back(capsys, monkeypatch):
    with pytest.raises(backend.GPUUnavailable, match="no usable GPU: .*pip install"):
        backend.get_backend("gpu")
    monkeypatch.setattr(backend, "_fallback_reported", False)
    assert backend.get_backend("auto").xp is np
    assert backend.get_backend("auto").xp is np
    assert capsys.readouterr().err.count("running on the CPU") == 1


def test_probe_reports_missing_cupy(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(backend, "_gpu_probe", None)
    assert backend._probe_gpu() == (False, "CuPy is not installed")
    monkeypatch.setattr(backend, "_gpu_probe", None)


def test_array_module_and_to_numpy():
    a = np.ones(3)
    assert backend.array_module(a) is np
    assert backend.to_numpy(a) is a
    with pytest.raises(ValueError, match="unsupported dtype"):
        backend.resolve_dtype("float16")
