"""The precision policy's answers the engine asks instead of keeping its own lists (issue 47 item 1):
which dtypes the generic code takes (resolve, is_float), which a kernel is built for (kernel_dtypes),
what a dtype is summed in and its C type, and the kernels' type names built from them."""

import numpy as np
import pytest

from minitensor import precision
from minitensor.backends import cuda
from minitensor.device import resolve_dtype


def test_resolve_is_the_policys_and_refuses_in_one_line():
    assert resolve_dtype(None) == np.float32 and resolve_dtype("float64") == np.float64
    assert resolve_dtype(np.float32) == precision.resolve(np.float32)
    assert resolve_dtype("f4") == np.float32 and resolve_dtype("double") == np.float64  # NumPy's aliases
    for bad in ("bfloat16", "float16", np.int32, "nonsense"):
        with pytest.raises(ValueError, match="unsupported dtype .*: use float32 or float64"):
            resolve_dtype(bad)


def test_names_need_no_ml_dtypes():
    """"bfloat16" as a name is answered without making the dtype (NumPy alone does not know it)."""
    assert precision.name_of("bfloat16") == "bfloat16" and precision.name_of(np.float32) == "float32"
    assert precision.accumulate_of("bfloat16") == np.float32
    assert precision.accumulate_of(np.float64) == np.float64
    assert precision.c_type("bfloat16") == "unsigned short" and precision.c_type(np.dtype("float32")) == "float"
    assert precision.is_float("bfloat16", bf16=True) and not precision.is_float("bfloat16")
    with pytest.raises(ValueError, match="no kernel type for int32"):
        precision.c_type(np.int32)


def test_kernel_dtypes_and_type_names():
    assert precision.kernel_dtypes() == precision.FLOATS == cuda.DTYPES
    assert precision.kernel_dtypes(bf16=True) == (*precision.FLOATS, precision.BF16)
    assert cuda.type_names("float32") == "typedef float T;\ntypedef float ACC;"
    assert cuda.type_names(np.float64) == "typedef double T;\ntypedef double ACC;"
    assert cuda.type_names("bfloat16") == "typedef unsigned short T;\ntypedef float ACC;"
    assert {k: cuda.C_TYPES[k] for k in precision.C_TYPES} == precision.C_TYPES  # the float part is the policy's
    assert cuda.C_TYPES["int64"] == "long long"


def test_a_kernel_refuses_a_dtype_the_policy_does_not_build_it_for():
    spec = cuda.RawSpec("k", inline='extern "C" __global__ void k(T *x, ACC *s) {}')
    assert spec.dtypes == precision.FLOATS
    with pytest.raises(TypeError, match="k is built for float32, float64, not bfloat16"):
        cuda.launch(spec, "bfloat16", (1,), (32,), ())
    assert cuda.raw_params(spec) == [("x", "T", True), ("s", "ACC", True)]
    x, s = np.zeros(3, np.float32), np.zeros(1, np.float64)
    with pytest.raises(TypeError, match="argument s must be a contiguous array of float32"):
        cuda.check_launch_args(spec, np.float32, (x, s))  # ACC of float32 is float32
    cuda.check_launch_args(spec, np.float64, (x.astype(np.float64), s))
