"""Device selection: NumPy on the CPU, CuPy on an NVIDIA GPU.

The device is chosen once, at the entry point (`get_device("auto" | "cpu" | "gpu")`, or the
`ANDREA_DEVICE` environment variable when no device is given): a `Device` names the array module
its arrays live in. The model then builds its compute backend (an Ops of minitensor.backends) for
that module (`minitensor.backends.get_ops(device.xp)`) and hands it to every layer. Only this
file and the GPU backend import CuPy, and only on demand: importing minitensor without CuPy, or
with CuPy but no GPU, costs nothing and cannot fail.

A GPU counts as usable only after a tiny elementwise kernel and a tiny matmul have run on it:
CuPy imports fine without a driver, and a missing NVRTC or cuBLAS shows only at the first
kernel or GEMM.
"""

import os
import sys
from dataclasses import dataclass

import numpy as np

from minitensor import precision

DEVICES = ("auto", "cpu", "gpu")
INSTALL_HINT = "pip install 'andrea[cuda12]' or 'andrea[cuda13]' (matching your CUDA driver)"
NO_DRIVER_HINT = ("CuPy is installed, but no NVIDIA driver or GPU answers here (`nvidia-smi` shows what the "
                  "machine has): run on a machine with an NVIDIA GPU and its driver, with the cuda extra that "
                  "matches the driver's CUDA version, or leave --device unset to run on the CPU")


class GPUUnavailable(RuntimeError):
    """`--device gpu` was asked for but no usable GPU is there; the message says why."""


@dataclass(frozen=True)
class Device:
    """Where a model's arrays live: the array module, and the device's name."""

    xp: object
    name: str  # "cpu" or "gpu"


_gpu_probe = None  # (ok: bool, reason: str), cached after the first probe
_fallback_reported = False


def _probe_gpu():
    """Returns (True, "") if CuPy can run a kernel and a matmul here, else (False, why)."""
    global _gpu_probe
    if _gpu_probe is not None:
        return _gpu_probe
    try:
        import cupy
    except ImportError:
        _gpu_probe = (False, "CuPy is not installed")
        return _gpu_probe
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver
        _gpu_probe = (False, f"no CUDA device ({_first_line(e)})")
        return _gpu_probe
    if n == 0:
        _gpu_probe = (False, "no CUDA device found")
        return _gpu_probe
    try:
        a = cupy.arange(4, dtype=cupy.float32)
        b = (a * 2 + 1).sum()  # an elementwise and a reduction kernel: needs NVRTC
        float(b)
    except Exception as e:
        _gpu_probe = (False, f"CuPy cannot compile or run a kernel; is NVRTC installed? ({_first_line(e)})")
        return _gpu_probe
    try:
        m = cupy.ones((4, 4), dtype=cupy.float32)
        float((m @ m)[0, 0])
    except Exception as e:
        _gpu_probe = (False, f"CuPy cannot run a matmul; is cuBLAS installed? ({_first_line(e)})")
        return _gpu_probe
    _gpu_probe = (True, "")
    return _gpu_probe


def _first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def unavailable(why: str, option: str = "--device gpu") -> str:
    """The message for a GPU asked for by `option` that the probe found unusable for the reason `why`,
    with what to do: install CuPy when it is missing, find a GPU and its driver when CuPy is there
    but no device answers, install the cuda extra's libraries when a kernel or a GEMM fails."""
    no_driver = "InsufficientDriver" in why or "NoDevice" in why or "no CUDA device" in why
    return f"{option}: no usable GPU: {why}. {NO_DRIVER_HINT if no_driver else 'To use one: ' + INSTALL_HINT}"


def gpu_available():
    """True if a GPU is usable through CuPy; never raises."""
    return _probe_gpu()[0]


def resolve_device(device=None):
    """Normalises a device request: None means $ANDREA_DEVICE, else "auto"."""
    if device is None:
        device = os.environ.get("ANDREA_DEVICE", "auto") or "auto"
    device = str(device).lower()
    if device == "cuda":
        device = "gpu"
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    return device


def get_device(device=None, quiet=False):
    """Returns the Device for a request, or raises GPUUnavailable for an unusable "gpu".

    "auto" uses the GPU when one works, and otherwise falls back to NumPy, saying so once on
    stderr (unless quiet).
    """
    global _fallback_reported
    device = resolve_device(device)
    if device == "cpu":
        return Device(np, "cpu")
    ok, why = _probe_gpu()
    if ok:
        import cupy

        return Device(cupy, "gpu")
    if device == "gpu":
        raise GPUUnavailable(unavailable(why))
    if not quiet and not _fallback_reported:
        print(f"note: no usable GPU ({why}); running on the CPU with NumPy", file=sys.stderr)
        _fallback_reported = True
    return Device(np, "cpu")


def quiet_fallback():
    """get_device says its CPU-fallback note no more in this process (the ranks after the first
    of a data-parallel run: rank 0 says it once for all)."""
    global _fallback_reported
    _fallback_reported = True


def array_module(x):
    """numpy or cupy, whichever owns the array x (NumPy for anything that is not a CuPy array)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def to_numpy(x):
    """A NumPy copy (or the array itself) of a NumPy or CuPy array."""
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


def resolve_dtype(dtype):
    """float32 (the default) or float64; anything else is refused: the precision policy decides
    (minitensor.precision.resolve)."""
    return precision.resolve(dtype)


# cuBLAS math modes (cublas_api.h): CUBLAS_DEFAULT_MATH and CUBLAS_TF32_TENSOR_OP_MATH.
CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 3


def set_tf32(xp, enabled):
    """TF32 tensor-core GEMMs on or off for this process on CuPy, whatever CUPY_TF32 says; returns
    a line with the mode read back from CuPy. Nothing to set on NumPy.

    CuPy 14.2 takes two paths: 2-D products call gemmEx with the compute type of
    `_routines_linalg.get_compute_type(float32)`, which reads CUPY_TF32 once and caches it, and
    `set_compute_type` overrides at any time; batched (3-D) matmul calls gemmStridedBatchedEx with
    a plain float32 compute type, which cuBLAS runs on TF32 tensor cores only when the handle's
    math mode says so. Both are private APIs of CuPy's minor version (the cuda extras pin it).
    """
    if xp is np:
        return "tf32: not applicable on the CPU (NumPy float32 GEMMs)"
    from cupy._core import _routines_linalg as linalg
    from cupy_backends.cuda.libs import cublas

    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if enabled else linalg.COMPUTE_TYPE_DEFAULT)
    handle = xp.cuda.device.get_cublas_handle()
    _math_modes[handle] = CUBLAS_TF32_TENSOR_OP_MATH if enabled else CUBLAS_DEFAULT_MATH
    cublas.setMathMode(handle, _math_modes[handle])
    compute = linalg.get_compute_type(np.float32)
    mode = cublas.getMathMode(handle)
    effective = compute == linalg.COMPUTE_TYPE_TF32 and mode & CUBLAS_TF32_TENSOR_OP_MATH
    return (f"tf32: {'on' if effective else 'off'} (2-D GEMMs: compute type {linalg.compute_type_to_str(compute)}; "
            f"batched GEMMs: cuBLAS math mode {mode}; CUPY_TF32 in the environment is not used)")


# handle -> the math mode set_tf32 chose for it: what the GEMMs through the handle rely on
_math_modes = {}


def math_mode(handle):
    """The cuBLAS math mode the handle's GEMMs run in, set back first to what set_tf32 chose if a call
    changed it: CuPy's float16 and bfloat16 matmuls set the handle's math mode to the default and leave
    it so, which would silently turn TF32 off for every later GEMM through the handle (the flash
    kernels read it too). minitensor.backends.cublas calls this before each GEMM."""
    from cupy_backends.cuda.libs import cublas

    mode = cublas.getMathMode(handle)
    want = _math_modes.get(handle)
    if want is not None and mode & 0xF != want:
        cublas.setMathMode(handle, want)
        return want
    return mode & 0xF
