"""cupy.cuda.runtime (stand-in): one device; its free memory is cupy.standin.free_bytes."""

from cupy import standin

CUDA_VERSION = 13000
# cudaDataType_t (cupy_backends/cuda/api/_runtime_enum.pxd at v14.2.0, lines 24-34), which CuPy's runtime
# module exports
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14


class CUDARuntimeError(RuntimeError):
    pass


def getDeviceCount():  # noqa: N802 (CUDA's names)
    return 1


def _check(device):
    if device != 0:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {device} (the stand-in has one)")


def getDevice():  # noqa: N802
    return 0


def setDevice(device):  # noqa: N802
    _check(device)


def memGetInfo():  # noqa: N802
    """(free, total) bytes of the current device."""
    return standin.free_bytes, standin.TOTAL_BYTES


def getDeviceProperties(device):  # noqa: N802
    _check(device)
    return {"name": b"CuPy stand-in (NumPy on the CPU)", "totalGlobalMem": standin.TOTAL_BYTES, "major": 9,
            "minor": 0, "multiProcessorCount": 1, "maxThreadsPerBlock": 1024, "warpSize": 32}


def runtimeGetVersion():  # noqa: N802
    return CUDA_VERSION


def driverGetVersion():  # noqa: N802
    return CUDA_VERSION


def deviceSynchronize():  # noqa: N802
    pass
