"""What the stand-in counts, for the tests to read (not part of CuPy's API).

    reads           every device-to-host read since the last reset(), oldest first (Read)
    kernels         {(kind, name, dtype)} of the kernels built (an ElementwiseKernel, a RawKernel)
    skipped_gemms   matmuls of more than GEMM_LIMIT multiply-adds that were not computed (below)
    free_bytes      what cupy.cuda.runtime.memGetInfo() reports free (a test may lower it)

With CUPY_STANDIN_REPORT=DIR in the environment, each process writes DIR/<pid>.json at exit:
{"reads": [[what, nbytes, [caller frames]], ...], "kernels": [...], "skipped_gemms": n}, so a
test can count the reads of a command it ran (`python -m andrea.train --device gpu ...`).

GEMMs: `andrea.run.perf.matmul_peak_flops` measures the GPU's peak on 8192^3 products, ~20 s each on
a CPU. A matmul of more than GEMM_LIMIT multiply-adds is therefore not computed, and counted: its
output gets a NaN in every 64 x 64 tile, so a result that were used would show. Every GEMM of the models
the tests train is far below the limit.

bfloat16 matmuls: CuPy 14.2 runs a 2-D one as cublasGemmEx with float32 compute (cupy/_core/
_routines_linalg.pyx at v14.2.0, tensordot_core_v11): the output bfloat16, rounded once from float32
sums. NumPy's matmul on ml_dtypes' bfloat16 gives float32 instead, so `bf16_matmul` computes it as
CuPy does. A batched bfloat16 matmul is refused: CuPy 14.2 sends any dtype whose char is not one of
'efdFD' (bfloat16's is 'E') to its integer GEMM kernel (the same file, line 992), whose result is
wrong; minitensor.backends.cublas computes those through gemmStridedBatchedEx instead.
"""

import atexit
import json
import os
from collections import namedtuple

import numpy as np

Read = namedtuple("Read", "what nbytes frames")

GEMM_LIMIT = 1 << 32
TOTAL_BYTES = 16 << 30

reads = []
kernels = set()
skipped_gemms = 0
free_bytes = int(os.environ.get("CUPY_STANDIN_FREE_BYTES", TOTAL_BYTES))


def reset():
    global skipped_gemms
    reads.clear()
    kernels.clear()
    skipped_gemms = 0


def reads_from(function_name):
    """The reads made while a function of that name was running (anywhere up the stack)."""
    return [r for r in reads if any(f.endswith(f":{function_name}") for f in r.frames)]


def gemm_too_big(a, b):
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.ndim < 2 or b.ndim < 2:
        return False
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return int(np.prod(batch, dtype=np.int64)) * a.shape[-2] * a.shape[-1] * b.shape[-1] > GEMM_LIMIT


def skipped_gemm(a, b, out=None):
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    return skipped_into(np.empty(shape, np.result_type(a, b)) if out is None else out)


def skipped_into(out):
    """A product not computed, counted: a NaN in every 64 x 64 tile of its output, so any use of it shows."""
    global skipped_gemms
    skipped_gemms += 1
    out[..., ::64, ::64] = np.nan
    return out


def is_bf16(*arrays):
    return any(isinstance(a, np.ndarray) and a.dtype.name == "bfloat16" for a in arrays)


def bf16_matmul(a, b, out=None):
    """matmul with a bfloat16 operand, as CuPy 14.2 computes it (the module's docstring)."""
    if max(np.ndim(a), np.ndim(b)) > 2:
        raise TypeError(f"a batched bfloat16 matmul {np.shape(a)} @ {np.shape(b)}: CuPy 14.2 computes it in its "
                        f"integer kernel, wrongly; use minitensor.backends.cublas.matmul (gemmStridedBatchedEx)")
    dtype = np.result_type(a, b)
    product = np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(dtype)  # float32 sums, rounded once
    if out is None:
        return product
    out[...] = product
    return out


def _report():
    folder = os.environ.get("CUPY_STANDIN_REPORT")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump({"reads": [list(r) for r in reads], "kernels": sorted(map(list, kernels)),
                   "skipped_gemms": skipped_gemms}, f)


atexit.register(_report)
