"""The GPU backend: CuPy, a few kernels of its own, and the fused pieces that their records declare.

`CupyOps` overrides pieces of `minitensor.backends.ops.Ops`, each with code that must equal the Ops
method it replaces, and falls back to `super()` where it does not apply. Its own overrides, always on
(each computes what Ops computes, or in a fixed order where Ops' atomics vary):

    gelu_forward / gelu_backward       'gelu_fwd' / 'gelu_bwd' (ElementwiseKernels, float32 and float64;
                                       bfloat16 through Ops' code: the bf16 MLP runs the fused piece
                                       bias_gelu, whose wrappers launch its bfloat16 RawKernels)
    add_epilogue                       'bias_residual_add' with a bias and a residual (ElementwiseKernel,
                                       the same adds as Ops': float32, float64); on bfloat16 with a bias,
                                       and a residual or none, 'bias_residual_add16' (RawKernel: the adds
                                       in float32, rounded once, as Ops')
    scatter_add_rows                   'scatter_add_rows' (deterministic where add.at's atomics are not)
    linear_weight_grads, gemm          cuBLAS's own GEMM and GEMV (minitensor.backends.cublas): beta 1
                                       accumulates a gradient in the GEMM's output pass, beta 0 writes it
                                       into a view nothing has written since fill_zero (tricks.GradWrites),
                                       transposed operands and longer rows taken as stored
    attention_forward                  the dense core within a memory budget (a 64th of the GPU's memory
                                       per layer: 2.2 GB on an H200, where ANDREA-120M at 8 x 1024 needs
                                       384 MiB), else the query blocks of minitensor.backends.blocked

The fused pieces are declared in minitensor/backends/kernels/, each by its record (`cuda.fused_piece`,
beside its wrappers and its .cu): its name, the Ops methods it replaces, each with the function that
runs it with the kernels, its kernels, the self-check's sample, gpu_check's cases, its timed run
(`minitensor.backends.fused_pieces()` returns them all). Which pieces a CupyOps runs is fixed when it
is built (`CupyOps(xp, fused=...)`; through `minitensor.backends.get_ops(cupy, kernels)`, where
kernels="auto" runs the start-up self-check of minitensor.backends.selection once: each piece's sample
through the Ops code and through the kernel, keeping those that agree): for each of them it binds
the record's functions over the methods they replace, in one place (`_with_piece`), so that where a
function returns cuda.FALLBACK the method runs as it is without the piece. A new piece is its record:
nothing here changes. Given bfloat16 arrays (train.precision=bf16), a piece runs only if one of its
kernels is built for bfloat16 (its spec's `dtypes`); otherwise the method runs without it, down to
the Ops code, which computes bfloat16 in float32 (minitensor.backends.ops).

Every kernel is registered in minitensor.backends.cuda.KERNELS, so that two checks run without a GPU
(`python -m minitensor.checks --check | --host-check`): NVRTC compiles each one, and g++ runs
each elementwise operation on the host against its `reference`, which is the Ops code. Only
CuPy's public API is called here and in the kernels' modules (ElementwiseKernel and RawKernel through
minitensor.backends.cuda, cupy.cuda for the device, cuBLAS through cupy_backends.cuda.libs.cublas in
minitensor.backends.cublas), so a NumPy-backed stand-in of CuPy can run them in CI.
"""

import contextlib

import numpy as np

from minitensor import precision
from minitensor.backends import cublas, cuda
from minitensor.backends.blocked import BlockedAttention
from minitensor.backends.kernels import fused_pieces
from minitensor.backends.kernels.embedding import SCATTER_ADD_ROWS, scatter_add_rows_gpu
from minitensor.backends.kernels.gelu import GELU_BWD, GELU_FWD, add_column_sums
from minitensor.backends.kernels.linear import BIAS_RESIDUAL_ADD, bias_residual_add16_gpu, epilogue16_fits, epilogue_fits
from minitensor.backends.ops import Ops
from minitensor.backends.tricks import keep_grad_writes


class CupyOps(BlockedAttention, Ops):
    name = "cupy"
    # the dense attention core when all heads' probabilities fit this many bytes (None: a 64th of
    # the GPU's memory)
    dense_max_bytes = None
    # the flash kernels' float32 products on TF32 tensor cores: None as the cuBLAS math mode says
    # (train.tf32), True or False whatever it says (the self-check checks both)
    flash_tf32 = None

    def __init__(self, xp, fused=(), kernels_line=None):
        """fused: the fused pieces to run (names of their records, minitensor.backends.fused_pieces()),
        the others through the Ops code; kernels_line: the log line that says how they were chosen."""
        super().__init__(xp)
        pieces = fused_pieces()
        unknown = set(fused) - set(pieces)
        if unknown:
            raise ValueError(f"unknown fused pieces {sorted(unknown)}: choose from {', '.join(pieces)}")
        self.in_use = frozenset(fused)
        self.kernels_line = kernels_line or f"kernels: fused {', '.join(sorted(self.in_use)) or 'none'}"
        for piece in pieces.values():
            if piece.name in self.in_use:
                bf16 = any(precision.BF16 in getattr(k, "dtypes", precision.FLOATS) or getattr(k, "writes_bf16", False)
                           for k in piece.kernels)
                for method, run in piece.replaces.items():
                    setattr(self, method, _with_piece(self, run, getattr(self, method), bf16))
        keep_grad_writes(self)            # linear_weight_grads writes first gradients: every write counted

    def __repr__(self):
        return f"CupyOps(fused {', '.join(sorted(self.in_use)) or 'none'})"

    def fused(self, name):
        """Whether the fused piece `name` runs (chosen when this backend was built)."""
        return name in self.in_use

    def fill_zero(self, a):
        super().fill_zero(a)
        self.grad_writes.zeroed(a)

    # --- bias gradients from partial sums (the flash backward's, the bf16 GELU backward's) ---

    _pending = None  # within deferred_bias_sums: the partial sums left to a later pass, [(part, out, dtype)]

    @contextlib.contextmanager
    def deferred_bias_sums(self):
        """Ops.deferred_bias_sums: add_partial_sums keeps what it is given for take_partial_sums (the
        LayerNorm backward's second launch adds it up); what is left is added at the scope's end. Nested,
        the outer scope's."""
        if self._pending is not None:
            yield
            return
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            for part, out, dtype in pending:
                add_column_sums(part, out, dtype)

    def add_partial_sums(self, part, out, dtype):
        """out += the sum of part's rows: a bias gradient from the partial column sums (chunks, n) a kernel
        of dtype wrote (in its summed type), by column_sums_add now, or within deferred_bias_sums by a later
        pass (take_partial_sums) or at the scope's end."""
        if self._pending is None:
            add_column_sums(part, out, dtype)
        else:
            self._pending.append((part, out, dtype))

    def take_partial_sums(self, dtype):
        """(part, out) of partial sums left by add_partial_sums, in dtype's summed type, for a pass of dtype
        that adds them up in a launch of its own (out += the sum of part's rows): taken, they are its to add;
        None where none is left."""
        for i, (part, out, kept) in enumerate(self._pending or ()):
            if precision.accumulate_of(kept) == precision.accumulate_of(dtype):
                del self._pending[i]
                return part, out
        return None

    # --- Linear ---

    def add_epilogue(self, y, b=None, r=None):
        """y += b and y += r in one pass ('bias_residual_add', the same two float adds in the same
        order) when both are given, as in the residual branches' last products; on bfloat16 y, with a bias and
        a residual or none ('bias_residual_add16', summed in float32 and rounded once, as Ops')."""
        if b is not None and epilogue16_fits(y, b, r):
            return bias_residual_add16_gpu(y, b, r)
        if b is None or r is None or not epilogue_fits(y, b, r):
            return super().add_epilogue(y, b, r)
        BIAS_RESIDUAL_ADD.kernel()(y, b, np.int32(y.shape[-1]), r, y)

    def linear_weight_grads(self, x, dy, dW, db):
        """dW = x^T dy by cuBLAS with beta 0 into a view nothing has written since fill_zero (the first
        micro-batch after zero_grad: tricks.GradWrites, self.grad_writes), else beta 1 (the gradient
        accumulated in the GEMM's output pass: no temporary, no add); db likewise as the GEMV dy^T ones
        (minitensor.backends.cublas). Ops' code where cuBLAS cannot take an operand as it is laid out."""
        if not cublas.gemm(x.T, dy, dW, 0.0 if self.grad_writes.first(dW) else 1.0):
            return super().linear_weight_grads(x, dy, dW, db)  # Ops adds (to zeros, where it was first)
        self.add_bias_grad(dy, db)

    def add_bias_grad(self, dy, db):
        """db = or += the GEMV dy^T ones by cuBLAS (beta 0 into a view nothing has written since
        fill_zero), or CuPy's sum where cuBLAS cannot read dy in place (nothing where db is None)."""
        if db is None:
            return
        beta = 0.0 if self.grad_writes.first(db) else 1.0
        if cublas.colsum(dy, db, _ones(self.xp, dy.shape[0], dy.dtype), beta):
            return
        if beta == 0.0:
            dy.sum(axis=0, out=db)
        else:
            db += dy.sum(axis=0)

    def matmul(self, a, b):
        """bfloat16 products by cuBLAS (cublas.matmul: gemmEx or its strided batch, float32 sums rounded
        once to bfloat16), never CuPy's matmul, whose batched bfloat16 product is wrong in 14.2; other
        dtypes as Ops computes them."""
        if a.dtype.name == precision.BF16 and b.dtype == a.dtype and a.ndim == b.ndim and a.ndim in (2, 3):
            return cublas.matmul(a, b)
        return super().matmul(a, b)

    def gemm(self, a, b, out, accumulate=False):
        """By cuBLAS with beta 1 to accumulate, taking operands and out with longer rows or transposed
        as they are laid out (CuPy's matmul would copy them)."""
        if not cublas.gemm(a, b, out, 1.0 if accumulate else 0.0):
            super().gemm(a, b, out, accumulate)

    # --- GELU ---

    def gelu_forward(self, x):
        if x.dtype.name not in GELU_FWD.dtypes:
            return super().gelu_forward(x)
        return GELU_FWD.kernel()(x)

    def gelu_backward(self, x, dy, recompute_output=False):
        if x.dtype.name not in GELU_BWD.dtypes or dy.dtype != x.dtype:
            return super().gelu_backward(x, dy, recompute_output)
        dx = GELU_BWD.kernel()(x, dy)
        return (dx, self.gelu_forward(x)) if recompute_output else dx

    # --- attention ---

    def attention_forward(self, qkv4, b, y4, block=128, keep_probs_max_bytes=16 << 20, dense=None):
        """Unless dense or blocks are asked for: the dense core (all heads' probabilities in memory)
        within a memory budget, else Ops' query blocks."""
        if dense is None:
            B, nh, T, _ = qkv4[0].shape
            dense = B * nh * T * T * y4.itemsize <= (self.dense_max_bytes or _gpu_memory(self.xp) // 64)
        return super().attention_forward(qkv4, b, y4, block, keep_probs_max_bytes, dense)

    # --- embedding ---

    def scatter_add_rows(self, dW, idx, rows):
        """dW[idx[i]] += rows[i], deterministic (Ops' add.at is atomic on CuPy: its sums' order
        varies from run to run): the positions sorted by (id, position), then one thread per id
        and column adds that id's rows in position order, the order of the numba CPU kernel."""
        if (rows.dtype.name not in SCATTER_ADD_ROWS.dtypes or dW.dtype != precision.accumulate_of(rows.dtype)
                or dW.ndim != 2 or not dW.flags.c_contiguous):
            return super().scatter_add_rows(dW, idx, rows)
        scatter_add_rows_gpu(dW, idx, rows)


def _with_piece(ops, run, without, bf16=False):
    """The method `ops` runs for one that a fused piece in use replaces: the record's function
    run(ops, ...), or, where it returns cuda.FALLBACK or (unless bf16: the piece has kernels built for
    bfloat16) an argument is bfloat16, without(...), the method as it was before (Ops', CupyOps' own,
    or another piece's)."""
    def method(*args, **kwargs):
        if not bf16 and _holds_bfloat16((*args, *kwargs.values())):
            return without(*args, **kwargs)
        out = run(ops, *args, **kwargs)
        return without(*args, **kwargs) if out is cuda.FALLBACK else out

    method.__name__, method.__qualname__, method.__doc__ = run.__name__, run.__qualname__, run.__doc__
    method.runs, method.without = run, without
    return method


def _holds_bfloat16(values):
    """Whether any of the values (arrays, or lists and tuples of them) is a bfloat16 array."""
    for value in values:
        for a in value if isinstance(value, (list, tuple)) else (value,):
            if getattr(getattr(a, "dtype", None), "name", None) == precision.BF16:
                return True
    return False


_gpu_memory_bytes = {}
_ones_kept = {}  # (CuPy module, device, dtype) -> a device vector of ones (_ones)


def _ones(xp, n, dtype):
    """A device vector of at least n ones of dtype on the current device, kept (copied from the host
    once: no launch)."""
    key = (xp, xp.cuda.Device().id, np.dtype(dtype))
    have = _ones_kept.get(key)
    if have is None or have.shape[0] < n:
        have = _ones_kept[key] = xp.asarray(np.ones(n, dtype))
    return have


def _gpu_memory(xp):
    """The current GPU's total memory in bytes, asked once per device."""
    device = xp.cuda.Device()
    if device.id not in _gpu_memory_bytes:
        _gpu_memory_bytes[device.id] = device.mem_info[1]
    return _gpu_memory_bytes[device.id]
