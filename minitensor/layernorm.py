"""LayerNorm over the last axis: y = w * (x - mean) / sqrt(var + eps) + b.

Shapes: x (..., C), w and b (C,). The variance is biased (divides by C), eps = 1e-5 (SPEC 1).
The forward caches x and the per-row statistics mean and rstd = 1 / sqrt(var + eps), as llm.c
does, not the normalised tensor: backward recomputes xhat from them. Rows are split over the
CPU threads on NumPy (minitensor.parallel).

On the CPU with numba (minitensor.cpu), `layernorm_forward_cpu` and `layernorm_backward_cpu`
below do each row in one kernel, its C values in cache for all the row's passes. Backward's
dw and db sum over rows in fixed blocks of ROW_BLOCK rows, one partial per block added in
block order: the same sums whatever the thread count.
"""

import numpy as np

from minitensor import cpu, cuda
from minitensor.backend import array_module
from minitensor.layer import Layer
from minitensor.parallel import parallel_for


class LayerNorm(Layer):
    def __init__(self, w, dw, b, db, eps=1e-5):
        self.w, self.dw, self.b, self.db, self.eps = w, dw, b, db, eps

    def forward(self, x):
        if cuda.uses("layernorm", x):
            return self._forward_fused(x)
        xp = array_module(x)
        C = x.shape[-1]
        x2 = x.reshape(-1, C)                                # (N, C)
        N = x2.shape[0]
        y = xp.empty_like(x2)
        mean = xp.empty((N, 1), dtype=x.dtype)
        rstd = xp.empty((N, 1), dtype=x.dtype)
        if _fast(x2, self.w, self.b):
            eps = x.dtype.type(self.eps)
            parallel_for(N, lambda s, e: layernorm_forward_cpu(x2[s:e], self.w, self.b, eps, y[s:e], mean[s:e],
                                                               rstd[s:e]), cost_per_item=C, min_work=FAST_MIN_WORK)
            self._save(x2, mean, rstd, x.shape)
            return y.reshape(x.shape)

        def rows(s, e):
            xs, ys = x2[s:e], y[s:e]
            mean[s:e] = xs.mean(axis=-1, keepdims=True)
            xp.subtract(xs, mean[s:e], out=ys)               # xc
            var = xp.einsum("ij,ij->i", ys, ys)[:, None] / C if xp is np else (ys * ys).mean(-1, keepdims=True)
            rstd[s:e] = 1.0 / xp.sqrt(var + self.eps)
            ys *= rstd[s:e]                                  # xhat
            ys *= self.w
            ys += self.b

        _over_rows(xp, N, C, rows)
        self._save(x2, mean, rstd, x.shape)
        return y.reshape(x.shape)

    def backward(self, dy, residual=None):
        """dx; plus residual (an array of x's shape) if given, added in the same pass: the gradient
        that reaches x around this layer through a skip connection."""
        x2, mean, rstd, shape = self._pop()
        xp = array_module(dy)
        N, C = x2.shape
        if cuda.uses("layernorm", dy):
            return self._backward_fused(dy, residual, x2, mean, rstd, shape)
        dy2 = dy.reshape(N, C)
        dx = xp.empty_like(x2)
        r2 = None if residual is None else residual.reshape(N, C)
        if _fast(x2, dy2, self.w) and (r2 is None or _fast(r2)) and dy2.dtype == x2.dtype:
            self._backward_cpu(x2, mean, rstd, dy2, r2, dx)
            return dx.reshape(shape)
        parts = []

        def rows(s, e):
            xhat = x2[s:e] - mean[s:e]                       # forward was: xhat = (x - mean) * rstd
            xhat *= rstd[s:e]
            g = dy2[s:e]
            # forward was: y = w * xhat + b; the parameter gradients sum over rows
            dw = xp.einsum("ij,ij->j", g, xhat) if xp is np else (g * xhat).sum(0)
            parts.append((s, dw, g.sum(axis=0)))
            dxhat = xp.multiply(g, self.w, out=dx[s:e])
            # xhat depends on x directly and through mean and rstd; with g = dxhat, summing the
            # three paths gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
            proj = (xp.einsum("ij,ij->i", dxhat, xhat) if xp is np else (dxhat * xhat).sum(-1))[:, None] / C
            dxhat -= dxhat.mean(axis=-1, keepdims=True)
            xhat *= proj
            dxhat -= xhat
            dxhat *= rstd[s:e]
            if r2 is not None:
                dxhat += r2[s:e]

        _over_rows(xp, N, C, rows)
        for _, dw, db in sorted(parts, key=lambda p: p[0]):  # a fixed order: bit-reproducible sums
            self.dw += dw
            self.db += db
        return dx.reshape(shape)

    def _forward_fused(self, x):
        """forward through layernorm_fwd: the same cache (x as (N, C) rows, mean, rstd)."""
        xp = array_module(x)
        x2 = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        y, mean, rstd = layernorm_forward_gpu(x2, self.w, self.b, self.eps)
        self._save(x2, mean, rstd, x.shape)
        return y.reshape(x.shape)

    def _backward_fused(self, dy, residual, x2, mean, rstd, shape):
        xp = array_module(dy)
        dy2 = xp.ascontiguousarray(dy.reshape(x2.shape))
        if residual is None:
            dx = layernorm_backward_gpu(dy2, x2, self.w, mean, rstd, self.dw, self.db)
        else:  # the kernel adds dx into a copy of the residual gradient: the caller's array is kept
            dx = layernorm_backward_gpu(dy2, x2, self.w, mean, rstd, self.dw, self.db,
                                        add_to=xp.array(residual.reshape(x2.shape), order="C"))
        return dx.reshape(shape)

    def _backward_cpu(self, x2, mean, rstd, dy2, r2, dx):
        N, C = x2.shape
        n_blocks = -(-N // ROW_BLOCK)
        dw_parts = np.empty((n_blocks, C), x2.dtype)
        db_parts = np.empty((n_blocks, C), x2.dtype)
        res = r2 if r2 is not None else np.empty((0, C), x2.dtype)

        def blocks(first, last):
            s, e = first * ROW_BLOCK, min(last * ROW_BLOCK, N)
            layernorm_backward_cpu(x2[s:e], mean[s:e], rstd[s:e], dy2[s:e], self.w,
                                   res[s:e] if r2 is not None else res, r2 is not None,
                                   dx[s:e], dw_parts[first:last], db_parts[first:last], ROW_BLOCK)

        parallel_for(n_blocks, blocks, cost_per_item=ROW_BLOCK * C, min_work=FAST_MIN_WORK)
        self.dw += dw_parts.sum(axis=0)                      # over axis 0 NumPy adds the rows in order
        self.db += db_parts.sum(axis=0)


ROW_BLOCK = 32  # rows per partial sum of dw and db on the numba path
# Below this many elements the numba kernels run on the calling thread. At 1024 x 768 (120m) a
# forward and backward take ~0.9 ms on one core and ~0.6 on two, with the input in the cores'
# caches as it is between the layers of a step (PyTorch's LayerNorm: ~0.63 ms on two).
FAST_MIN_WORK = 1 << 16


def _fast(*arrays):
    return cpu.enabled(*arrays) and all(a.flags.c_contiguous for a in arrays)


@cpu.kernel()
def layernorm_forward_cpu(x, w, b, eps, y, mean, rstd):
    """x, y (N, C); w, b (C,); mean, rstd (N, 1) written: y = w * (x - mean) * rstd + b per row."""
    t = x.dtype.type
    N, C = x.shape
    inv_c = t(1) / t(C)                                      # an integer C would promote the row to float64
    for i in range(N):
        m = t(0)
        for j in range(C):
            m += x[i, j]
        m *= inv_c
        var = t(0)
        for j in range(C):
            d = x[i, j] - m
            var += d * d
        r = t(1) / np.sqrt(var * inv_c + eps)
        mean[i, 0] = m
        rstd[i, 0] = r
        for j in range(C):
            y[i, j] = (x[i, j] - m) * r * w[j] + b[j]


# no FMA: with C = 1, or any row of equal values, w * dy - mean(w * dy) must be exactly 0, and an
# FMA of the unrounded product against the rounded mean leaves its rounding error times rstd
@cpu.kernel(contract=False)
def layernorm_backward_cpu(x, mean, rstd, dy, w, res, add_res, dx, dw, db, block):
    """x, dy, dx, res (N, C) (res used if add_res); mean, rstd (N, 1); w (C,); dw, db
    (n_blocks, C): row n set to the sums over rows n*block..(n+1)*block, row by row."""
    t = x.dtype.type
    N, C = x.shape
    inv_c = t(1) / t(C)
    for n in range(dw.shape[0]):
        for j in range(C):
            dw[n, j] = t(0)
            db[n, j] = t(0)
        for i in range(n * block, min((n + 1) * block, N)):
            m, r = mean[i, 0], rstd[i, 0]
            # forward was: y = w * xhat + b, xhat = (x - mean) * rstd; with g = w * dy, summing the
            # paths through mean and rstd gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
            sum_g = t(0)
            sum_gx = t(0)
            for j in range(C):
                xhat = (x[i, j] - m) * r
                g = w[j] * dy[i, j]
                sum_g += g
                sum_gx += g * xhat
                dw[n, j] += dy[i, j] * xhat
                db[n, j] += dy[i, j]
            mg, mgx = sum_g * inv_c, sum_gx * inv_c
            for j in range(C):
                xhat = (x[i, j] - m) * r
                d = r * (w[j] * dy[i, j] - mg - xhat * mgx)
                if add_res:
                    d += res[i, j]
                dx[i, j] = d


def _over_rows(xp, N, C, fn):
    if xp is np:
        parallel_for(N, fn, cost_per_item=C)
    else:
        fn(0, N)


# ---------------------------------------------------------------------------------------------
# CUDA: LayerNorm over the last axis, one block per row
#
# What these kernels must equal is LayerNorm's generic code above: the start-up self-check
# (minitensor.selfcheck, `_self_check` below) runs the layer both ways on the GPU. The tests run
# the kernels on the host (kernelcheck.emulate_launch) against the textbook form in
# tests/formulas.py, which they also check against the layer's NumPy code.

# One block per row of x (N, C). With add_residual, x is first updated in place to x + residual
# (the residual join before a pre-norm LayerNorm, fused); otherwise `residual` is not read. Each
# thread touches the same columns in every loop, so y may be x itself.
LAYERNORM_FWD = cuda.register(cuda.RawSpec("layernorm_fwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void layernorm_fwd(T *x, const T *residual, const T *w, const T *b, T *y, T *mean,
                                         T *rstd, const int C, const T eps, const int add_residual) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  T *xr = x + row * C;
  T *yr = y + row * C;
  T sum = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    T v = xr[j];
    if (add_residual) {
      v += residual[row * C + j];
      xr[j] = v;
    }
    sum += v;
  }
  const T m = block_sum(sum, buf) / (T)C;
  T sq = 0;  /* the centred second pass, as NumPy: no cancellation from E[x^2] - E[x]^2 */
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T d = xr[j] - m;
    sq += d * d;
  }
  const T r = (T)1 / sqrt_of(block_sum(sq, buf) / (T)C + eps);
  for (int j = threadIdx.x; j < C; j += blockDim.x) yr[j] = (xr[j] - m) * r * w[j] + b[j];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}
"""))

# forward was: y = xhat w + b, xhat = (x - mean) rstd. One block per row: dx, written or (with
# accumulate) added into dx, the residual gradient of a pre-norm block, fused.
LAYERNORM_BWD = cuda.register(cuda.RawSpec("layernorm_bwd", cuda.ROW_COMMON + r"""
extern "C" __global__ void layernorm_bwd(const T *dy, const T *x, const T *w, const T *mean, const T *rstd,
                                         T *dx, const int C, const int accumulate) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const T *dyr = dy + row * C;
  const T *xr = x + row * C;
  T *dxr = dx + row * C;
  const T m = mean[row], r = rstd[row];
  T sg = 0, sgx = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T g = dyr[j] * w[j];
    sg += g;
    sgx += g * ((xr[j] - m) * r);
  }
  const T mg = block_sum(sg, buf) / (T)C;
  const T mgx = block_sum(sgx, buf) / (T)C;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const T v = r * (dyr[j] * w[j] - mg - (xr[j] - m) * r * mgx);
    dxr[j] = accumulate ? dxr[j] + v : v;
  }
}
"""))

# dw = sum over rows of dy xhat, db = sum over rows of dy, as partial sums per chunk of rows:
# block (32, 8) sums 32 columns over one chunk; the wrapper adds the (chunks, C) partials in a
# fixed order, so the result is deterministic (no atomics).
LN_PARAM_BLOCK = (32, 8)
LAYERNORM_BWD_PARAMS = cuda.register(cuda.RawSpec("layernorm_bwd_params", r"""
extern "C" __global__ void layernorm_bwd_params(const T *dy, const T *x, const T *mean, const T *rstd,
                                                T *part_w, T *part_b, const int N, const int C,
                                                const int rows_per_chunk) {
  __shared__ T acc_w[8][32];
  __shared__ T acc_b[8][32];
  const int j = blockIdx.x * 32 + threadIdx.x;
  const int first = blockIdx.y * rows_per_chunk;
  const int stop = first + rows_per_chunk < N ? first + rows_per_chunk : N;
  T sw = 0, sb = 0;
  if (j < C) {
    for (int i = first + threadIdx.y; i < stop; i += 8) {
      const long long k = (long long)i * C + j;
      const T g = dy[k];
      sw += g * ((x[k] - mean[i]) * rstd[i]);
      sb += g;
    }
  }
  acc_w[threadIdx.y][threadIdx.x] = sw;
  acc_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && j < C) {
    for (int k = 1; k < 8; ++k) {
      sw += acc_w[k][threadIdx.x];
      sb += acc_b[k][threadIdx.x];
    }
    part_w[(long long)blockIdx.y * C + j] = sw;
    part_b[(long long)blockIdx.y * C + j] = sb;
  }
}
"""))


def layernorm_forward_gpu(x, w, b, eps=1e-5, residual=None, out=None):
    """LayerNorm of the rows of x (..., C) (CuPy, contiguous); returns (y, mean, rstd), y shaped
    like x, mean and rstd (N, 1) as minitensor/layernorm.py caches them (N = x.size / C).

    With `residual` (x's shape), x is first updated in place to x + residual, the residual join
    of a pre-norm block fused into the normalisation; the caller then caches x as the input.
    `out` may be x itself."""
    fn = "layernorm_forward_gpu"
    N, C = cuda.rows(fn, x)
    cuda.vector(fn, "w", w, x)
    cuda.vector(fn, "b", b, x)
    for name, a in (("residual", residual), ("out", out)):
        if a is not None:
            cuda.like(fn, name, a, x)
    xp = array_module(x)
    y = xp.empty_like(x) if out is None else out
    mean = xp.empty((N, 1), dtype=x.dtype)
    rstd = xp.empty((N, 1), dtype=x.dtype)
    if N:
        cuda.launch(LAYERNORM_FWD, x.dtype, (N,), (cuda.threads(C, 128),),
                (x, x if residual is None else residual, w, b, y, mean, rstd, np.int32(C), x.dtype.type(eps),
                 np.int32(residual is not None)))
    return y, mean, rstd


def layernorm_backward_gpu(dy, x, w, mean, rstd, dw, db, add_to=None):
    """dx of LayerNorm from dy and the forward's x, w, mean, rstd (all CuPy, contiguous; x and dy
    (..., C), mean and rstd N values); accumulates dw += sum(dy xhat), db += sum(dy) over rows.

    Returns a new dx, or, with `add_to` (x's shape), adds dx into add_to and returns it: the
    residual gradient of a pre-norm block, fused."""
    fn = "layernorm_backward_gpu"
    N, C = cuda.rows(fn, x)
    cuda.like(fn, "dy", dy, x)
    cuda.vector(fn, "w", w, x)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.size != N or a.dtype != x.dtype or not a.flags.c_contiguous:
            raise ValueError(f"{fn}: {name} must hold {N} contiguous {x.dtype} values, got {a.dtype} {a.shape}")
    for name, a in (("dw", dw), ("db", db)):
        if a.shape != (C,):
            raise ValueError(f"{fn}: {name} must have shape ({C},), got {a.shape}")
    if add_to is not None:
        cuda.like(fn, "add_to", add_to, x)
    xp = array_module(x)
    dx = xp.empty_like(x) if add_to is None else add_to
    if not N:
        return dx
    cuda.launch(LAYERNORM_BWD, x.dtype, (N,), (cuda.threads(C, 128),),
            (dy, x, w, mean, rstd, dx, np.int32(C), np.int32(add_to is not None)))
    rows_per_chunk = max(64, -(-N // 128))  # at most 128 chunks: enough blocks to fill a GPU
    chunks = -(-N // rows_per_chunk)
    part_w = xp.empty((chunks, C), dtype=x.dtype)
    part_b = xp.empty((chunks, C), dtype=x.dtype)
    cuda.launch(LAYERNORM_BWD_PARAMS, x.dtype, (-(-C // 32), chunks), LN_PARAM_BLOCK,
            (dy, x, mean, rstd, part_w, part_b, np.int32(N), np.int32(C), np.int32(rows_per_chunk)))
    dw += part_w.sum(axis=0)
    db += part_b.sum(axis=0)
    return dx


@cuda.self_check("layernorm")
def _self_check(xp, rng):
    """LayerNorm forward and backward (with a residual gradient) over 40 rows of 100 columns."""
    def draw(*shape, scale=1.0, shift=0.0):
        return xp.asarray((shift + scale * rng.standard_normal(shape)).astype(np.float32))

    C = 100  # not a multiple of the 32-thread warps
    dw, db = xp.zeros(C, np.float32), xp.zeros(C, np.float32)
    ln = LayerNorm(draw(C, shift=1.0), dw, draw(C), db)
    y = ln.forward(draw(4, 10, C, scale=3.0, shift=0.5))
    dx = ln.backward(draw(4, 10, C), residual=draw(4, 10, C))
    return y, dx, dw, db
