// RMSNorm over the last axis (fused piece rmsnorm): what these kernels must equal is
// Ops.rmsnorm_forward / _backward (the start-up self-check runs the layer both ways on the GPU).
// LayerNorm's kernels (layernorm.cu) less the mean and the bias: one reduction a row forward, one in
// backward. T is what the rows are stored in, ACC what they are summed in (float for bfloat16), as
// in layernorm.cu; rstd and the weight's partial sums are ACC.

// @kernel rmsnorm_fwd
// One block per row of x (N, C): rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd w. Each thread touches
// the same columns in both loops, so y may be x itself.
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void rmsnorm_fwd(const T *x, const T *w, T *y, ACC *rstd, const int C, const ACC eps) {
  __shared__ ACC buf[32];
  const long long row = blockIdx.x;
  const T *xr = x + row * C;
  T *yr = y + row * C;
  ACC sq = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) sq += widen(xr[j]) * widen(xr[j]);
  const ACC r = (ACC)1 / sqrt_of(block_sum(sq, buf) / (ACC)C + eps);
  for (int j = threadIdx.x; j < C; j += blockDim.x) yr[j] = to_stored<T>(widen(xr[j]) * r * widen(w[j]));
  if (threadIdx.x == 0) rstd[row] = r;
}

// @kernel rmsnorm_bwd
// forward was: y = xhat w, xhat = x rstd. Block b handles rows [b rpc, (b + 1) rpc) (rpc =
// rows_per_chunk) one after another: each row's dx = rstd (g - xhat mean(g xhat)), g = dy w, written
// or (with accumulate) written as res + dx, the residual gradient of a pre-norm block, fused (res may be
// dx itself: each thread reads res[j] before it writes dx[j]); and, over the block's rows in order, the
// partial weight sums part_w[b] = sum dy xhat, each thread holding its columns' sums in registers
// (column j = threadIdx.x + k blockDim.x, k < RMS_COLS, so C <= RMS_COLS blockDim.x: rmsnorm.py's
// RMS_COLS is this value). The row's g and xhat stay in registers between the two passes over it.
#include "bf16.cuh"
#include "rows.cuh"
#define RMS_COLS 8
extern "C" __global__ void rmsnorm_bwd(const T *dy, const T *x, const T *w, const ACC *rstd, const T *res, T *dx,
                                       ACC *part_w, const int N, const int C, const int rows_per_chunk,
                                       const int accumulate) {
  __shared__ ACC buf[32];
  ACC acc_w[RMS_COLS], g[RMS_COLS], xhat[RMS_COLS];
  for (int k = 0; k < RMS_COLS; ++k) acc_w[k] = g[k] = xhat[k] = 0;
  const int first = blockIdx.x * rows_per_chunk;
  const int stop = first + rows_per_chunk < N ? first + rows_per_chunk : N;
  for (int row = first; row < stop; ++row) {  /* the same rows for every thread: the barriers match */
    const long long base = (long long)row * C;
    const ACC r = rstd[row];
    ACC sgx = 0;
    for (int k = 0; k < RMS_COLS; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < C) {
        const ACC d = widen(dy[base + j]);
        xhat[k] = widen(x[base + j]) * r;
        g[k] = d * widen(w[j]);
        sgx += g[k] * xhat[k];
        acc_w[k] += d * xhat[k];
      }
    }
    const ACC mgx = block_sum(sgx, buf) / (ACC)C;
    for (int k = 0; k < RMS_COLS; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < C) {
        const ACC v = r * (g[k] - xhat[k] * mgx);
        dx[base + j] = to_stored<T>(accumulate ? widen(res[base + j]) + v : v);
      }
    }
  }
  for (int k = 0; k < RMS_COLS; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < C) part_w[(long long)blockIdx.x * C + j] = acc_w[k];
  }
}

// @kernel rmsnorm_bwd_params
// dw += the sum of part_w's rows over the (chunks, C) partial sums of rmsnorm_bwd: block (32, 8) for
// 32 columns, thread y adding chunks y, y + 8, ... in order, then thread y = 0 the eight in order, so
// the sum is the same on every run (no atomics: rows.cuh's add_column_partials). All ACC, as
// layernorm_bwd_params.
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void rmsnorm_bwd_params(const ACC *part_w, ACC *dw, const int chunks, const int C) {
  __shared__ ACC acc_w[8][32];
  add_column_partials(part_w, dw, chunks, C, acc_w, blockIdx.x);
}
