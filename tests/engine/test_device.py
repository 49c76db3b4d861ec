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
    # what to do: install CuPy when it is missing, else find the driver or GPU (never CuPy again)
    with pytest.raises(device.GPUUnavailable, match="no usable GPU: .*(pip install|no NVIDIA driver or GPU answers)"):
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


@pytest.mark.parametrize("why, said, not_said", [
    ("no CUDA device (CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
     "runtime version)", "CuPy is installed, but no NVIDIA driver or GPU answers here", "pip install"),
    ("no CUDA device found", "CuPy is installed, but no NVIDIA driver or GPU answers here", "pip install"),
    ("CuPy is not installed", "To use one: pip install 'andrea[cuda12]'", "driver or GPU answers"),
])
def test_gpu_asked_for_says_what_is_missing_cupy_or_the_driver(monkeypatch, why, said, not_said):
    """CuPy installed without a driver was told to install CuPy (issue 48): now the driver or GPU."""
    monkeypatch.setattr(device, "_probe_gpu", lambda: (False, why))
    with pytest.raises(device.GPUUnavailable) as info:
        device.get_device("gpu")
    assert str(info.value).startswith(f"--device gpu: no usable GPU: {why}. ")
    assert said in str(info.value) and not_said not in str(info.value)
