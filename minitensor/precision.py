"""The precision policy: the one place where a run's floating-point types are decided.

    policy = precision.get("bf16")        # "float32" (the default), "float64" (the checks), "bf16"
    policy.master        float32: the flat weights, AdamW's state, the checkpoint
    policy.compute       what activations and GEMM operands are stored in
    policy.accumulate    what sums are carried in: a norm's mean, a softmax's max and sum, a GEMM's
                         dot products, a weight gradient summed over the rows
    policy.c_compute, policy.c_accumulate    the C types the CUDA kernels are built with

In float32 and float64 the three are one type, and everything runs as it always has. In bf16
(mixed precision, as llm.c, nanochat and modded-nanogpt train GPT-2) activations and GEMM operands
are bfloat16 (8 exponent bits, as float32, and 7 mantissa bits: half the bytes and twice the tensor
cores' peak), every sum is carried in float32, and the weights the optimizer updates stay float32;
the bfloat16 copy the forward reads is written by the update itself.

bfloat16 arrays come from ml_dtypes (`pip install -e '.[bf16]'`; CuPy 14.2 reads the same dtype).
NumPy has no bfloat16 arithmetic of its own (ml_dtypes' loops go through float32 one element at a
time), so bf16 is a GPU precision: on NumPy it is refused (`for_arrays`). In a kernel, a bfloat16
is held as its 16 bits (`unsigned short`) and converted to and from float by the kernel
(minitensor/backends/kernels/bf16.cuh), because CuPy's own fp16 headers clash with cuda_bf16.h
under NVRTC.

The rest of the engine asks this module and keeps no list of its own
(tests/rules/test_precision_policy.py): which dtypes an array of the engine may hold (`FLOATS`,
`check_float`, `resolve`), which dtypes a kernel is built for (`kernel_dtypes`), which C type a dtype
is in a kernel (`c_type`), what a dtype is summed in (`accumulate_of`).
"""

import dataclasses

import numpy as np

# the float dtypes NumPy computes in, by name: the generic code's (minitensor.backends.ops)
FLOATS = ("float32", "float64")
BF16 = "bfloat16"  # ml_dtypes' name for it, and CuPy's

BF16_HINT = "pip install -e '.[bf16]'  (ml_dtypes: NumPy's and CuPy's bfloat16 dtype)"

# the C type each float dtype is stored as in a kernel; bfloat16: its 16 bits
C_TYPES = {"float32": "float", "float64": "double", BF16: "unsigned short"}


def bfloat16():
    """The bfloat16 dtype (ml_dtypes'); without ml_dtypes, an ImportError that says how to get it."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"bfloat16 needs ml_dtypes: {BF16_HINT}") from None
    return np.dtype(ml_dtypes.bfloat16)


def name_of(dtype):
    """A dtype's name ("float32", "bfloat16"), from a name (NumPy's aliases too: "f4", "double"), a dtype or
    a scalar type; "bfloat16" needs no ml_dtypes until an array is made."""
    if isinstance(dtype, str) and dtype == BF16:
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        if isinstance(dtype, str):
            return dtype  # a name NumPy does not know: the caller refuses it by name
        raise


def dtype_of(name):
    """np.dtype for a float dtype's name (or a dtype): float32, float64 or bfloat16."""
    name = name_of(name)
    if name == BF16:
        return bfloat16()
    if name not in FLOATS:
        raise ValueError(f"unsupported dtype {name}: use {', '.join(FLOATS)} or {BF16}")
    return np.dtype(name)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A run's floating-point types: see the module's docstring."""

    name: str
    master: str
    compute: str
    accumulate: str

    @property
    def master_dtype(self):
        return dtype_of(self.master)

    @property
    def compute_dtype(self):
        return dtype_of(self.compute)

    @property
    def accumulate_dtype(self):
        return dtype_of(self.accumulate)

    @property
    def c_compute(self):
        return C_TYPES[self.compute]

    @property
    def c_accumulate(self):
        return C_TYPES[self.accumulate]

    @property
    def mixed(self):
        """True where activations are stored in a narrower type than the weights the optimizer keeps."""
        return self.compute != self.master


POLICIES = {
    "float32": Policy("float32", master="float32", compute="float32", accumulate="float32"),
    "float64": Policy("float64", master="float64", compute="float64", accumulate="float64"),
    "bf16": Policy("bf16", master="float32", compute=BF16, accumulate="float32"),
}


def get(name):
    """The policy of that name; anything else is refused in one line."""
    if name not in POLICIES:
        raise ValueError(f"unknown precision {name!r}: use one of {', '.join(POLICIES)}")
    return POLICIES[name]


def for_arrays(policy, xp):
    """The policy, checked against the array module that will run it: bf16 needs CuPy (a GPU)."""
    policy = get(policy) if isinstance(policy, str) else policy
    if policy.mixed and xp is np:
        raise ValueError(f"precision {policy.name} needs a GPU (CuPy): NumPy has no {policy.compute} arithmetic; "
                         f"use train.precision=float32 on a CPU")
    return policy


def resolve(dtype):
    """The float dtype the generic code computes in: float32 (the default, for None) or float64;
    anything else is refused."""
    name = name_of(dtype if dtype is not None else "float32")
    if name not in FLOATS:
        raise ValueError(f"unsupported dtype {name}: use {' or '.join(FLOATS)}")
    return np.dtype(name)


def is_float(dtype, bf16=False):
    """True for float32 and float64 (and for bfloat16 where bf16 says a kernel takes it)."""
    name = name_of(dtype)
    return name in FLOATS or (bf16 and name == BF16)


def check_float(x, what, bf16=False):
    """x itself if it is an array of float32 or float64 (or bfloat16 where bf16 allows); else a
    TypeError naming `what` (the caller's name for it, "layernorm_forward_gpu: x")."""
    dt = getattr(x, "dtype", None)
    if dt is None or not is_float(dt, bf16):
        allowed = " or ".join(FLOATS + ((BF16,) if bf16 else ()))
        raise TypeError(f"{what} must be a {allowed} array, got {getattr(dt, 'name', type(x).__name__)}")
    return x


def accumulate_of(dtype):
    """The dtype a sum over values of `dtype` is carried in: float32 for bfloat16, the dtype itself
    otherwise."""
    name = name_of(dtype)
    return np.dtype("float32") if name == BF16 else np.dtype(name)


def kernel_dtypes(bf16=False):
    """The dtypes a kernel is built for: float32 and float64, and bfloat16 for a kernel written for it
    (its stored type T apart from its summed type ACC: minitensor.backends.cuda.RawSpec)."""
    return FLOATS + ((BF16,) if bf16 else ())


def c_type(dtype):
    """The C type a float dtype is stored as in a kernel ("float", "double", "unsigned short")."""
    name = name_of(dtype)
    if name not in C_TYPES:
        raise ValueError(f"no kernel type for {name}: kernels are built for {', '.join(C_TYPES)}")
    return C_TYPES[name]
