"""Device selection: cpu always works, auto falls back with one notice, gpu without a GPU says why."""

import numpy as np
import pytest

from minitensor import device


def test_cpu_is_numpy():
    assert device.get_device("cpu").xp is np


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        device.resolve_device("tpu")


def test_device_from_environment(monkeypatch):
    monkeypatch.setenv("ANDREA_DEVICE", "cpu")
    assert device.resolve_device(None) == "cpu"
    monkeypatch.delenv("ANDREA_DEVICE")
    assert device.resolve_device(None) == "auto"


@pytest.mark.skipif(device.gpu_available(), reason="this machine has a GPU")
def test_gpu_without_gpu_explains_and_auto_falls_back(capsys, monkeypatch):
    with pytest.raises(device.GPUUnavailable, match="no usable GPU: .*pip install"):
        device.get_device("gpu")
    monkeypatch.setattr(device, "_fallback_reported", False)
    assert device.get_device("auto").xp is np
    assert device.get_device("auto").xp is np
    assert capsys.readouterr().err.count("running on the CPU") == 1


def test_probe_reports_missing_cupy(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    monkeypatch.setattr(device, "_gpu_probe", None)
    assert device._probe_gpu() == (False, "CuPy is not installed")
    monkeypatch.setattr(device, "_gpu_probe", None)


def test_array_module_and_to_numpy():
    a = np.ones(3)
    assert device.array_module(a) is np
    assert device.to_numpy(a) is a
    with pytest.raises(ValueError, match="unsupported dtype"):
        device.resolve_dtype("float16")
