"""CuPy's GEMM compute type per dtype (stand-in): CUPY_TF32 read once, set_compute_type overrides.

The constants are CuPy 14.2's (cupy/_core/_routines_linalg.pyx); the stand-in's matmuls are NumPy's
whatever the type says, so this only records what the code asked for.
"""

import os

import numpy as np

COMPUTE_TYPE_TBD, COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_PEDANTIC = 0, 1, 2
COMPUTE_TYPE_FP16, COMPUTE_TYPE_FP32, COMPUTE_TYPE_FP64, COMPUTE_TYPE_BF16, COMPUTE_TYPE_TF32 = 3, 4, 5, 6, 7
_NAMES = {v: k for k, v in globals().items() if k.startswith("COMPUTE_TYPE_")}
_types = {}


def get_compute_type(dtype):
    dtype = np.dtype(dtype)
    if dtype not in _types:
        tf32 = dtype == np.float32 and os.environ.get("CUPY_TF32", "0") != "0"
        _types[dtype] = COMPUTE_TYPE_TF32 if tf32 else COMPUTE_TYPE_DEFAULT
    return _types[dtype]


def set_compute_type(dtype, compute_type):
    if compute_type not in _NAMES:
        raise ValueError(f"unknown compute type {compute_type}")
    _types[np.dtype(dtype)] = compute_type


def compute_type_to_str(compute_type):
    return _NAMES.get(compute_type, "COMPUTE_TYPE_UNKNOWN")
