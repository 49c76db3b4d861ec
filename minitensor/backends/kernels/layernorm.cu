// LayerNorm over the last axis (fused piece layernorm): what these kernels must equal is
// Ops.layernorm_forward / _backward (the start-up self-check runs the layer both ways on the GPU).
// T is what the rows are stored in, ACC what they are summed in (float for bfloat16): every value is
// loaded through widen() and computed in ACC, a row's T written through to_stored<T>(); the statistics (mean,
// rstd) and the parameters' partial sums are ACC.

// @kernel layernorm_fwd
// One block per row of x (N, C). With add_bias and add_residual, x is first updated in place to
// (x + bias) + residual, add_epilogue's two adds (the residual join of a pre-norm block, the sublayer's
// last bias with it, fused before the LayerNorm that follows); with add_residual alone to x + residual;
// otherwise `bias` and `residual` are not read. Each thread touches the same columns in every loop, so y
// may be x itself. The row summed is the x stored (the join rounded once to T), which the second pass and
// the backward read.
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void layernorm_fwd(T *x, const T *residual, const T *bias, const T *w, const T *b, T *y,
                                         ACC *mean, ACC *rstd, const int C, const ACC eps, const int add_residual,
                                         const int add_bias) {
  __shared__ ACC buf[32];
  const long long row = blockIdx.x;
  T *xr = x + row * C;
  T *yr = y + row * C;
  ACC sum = 0;
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    ACC v = widen(xr[j]);
    if (add_residual) {
      if (add_bias) v += widen(bias[j]);
      const T joined = to_stored<T>(v + widen(residual[row * C + j]));  /* rounded once, for bfloat16 */
      xr[j] = joined;
      v = widen(joined);
    }
    sum += v;
  }
  const ACC m = block_sum(sum, buf) / (ACC)C;
  ACC sq = 0;  /* the centred second pass, as NumPy: no cancellation from E[x^2] - E[x]^2 */
  for (int j = threadIdx.x; j < C; j += blockDim.x) {
    const ACC d = widen(xr[j]) - m;
    sq += d * d;
  }
  const ACC r = (ACC)1 / sqrt_of(block_sum(sq, buf) / (ACC)C + eps);
  for (int j = threadIdx.x; j < C; j += blockDim.x)
    yr[j] = to_stored<T>((widen(xr[j]) - m) * r * widen(w[j]) + widen(b[j]));
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// @kernel layernorm_bwd
// forward was: y = xhat w + b, xhat = (x - mean) rstd. Block b handles rows [b rpc, (b + 1) rpc)
// (rpc = rows_per_chunk) one after another: each row's dx, written or (with accumulate) written as
// res + dx, the residual gradient of a pre-norm block, fused (res may be dx itself: each thread reads
// res[j] before it writes dx[j]); and, over the block's rows in order, the partial parameter sums
// part_w[b] = sum dy xhat, part_b[b] = sum dy, and with sum_res part_r[b] = sum res (the column sums of
// the skip gradient: the bias gradient of the sublayer it is the output gradient of), each thread
// holding its columns' sums in registers (column j = threadIdx.x + k blockDim.x, k < LN_COLS, so
// C <= LN_COLS blockDim.x: layernorm.py's LN_COLS is this value). The row's dy w and xhat stay in
// registers between the two passes over it.
#include "bf16.cuh"
#include "rows.cuh"
#define LN_COLS 8
extern "C" __global__ void layernorm_bwd(const T *dy, const T *x, const T *w, const ACC *mean, const ACC *rstd,
                                         const T *res, T *dx, ACC *part_w, ACC *part_b, ACC *part_r, const int N,
                                         const int C, const int rows_per_chunk, const int accumulate,
                                         const int sum_res) {
  __shared__ ACC buf[32];
  ACC acc_w[LN_COLS], acc_b[LN_COLS], acc_r[LN_COLS], g[LN_COLS], xhat[LN_COLS];
  for (int k = 0; k < LN_COLS; ++k) acc_w[k] = acc_b[k] = acc_r[k] = g[k] = xhat[k] = 0;
  const int first = blockIdx.x * rows_per_chunk;
  const int stop = first + rows_per_chunk < N ? first + rows_per_chunk : N;
  for (int row = first; row < stop; ++row) {  /* the same rows for every thread: the barriers match */
    const long long base = (long long)row * C;
    const ACC m = mean[row], r = rstd[row];
    ACC sg = 0, sgx = 0;
    for (int k = 0; k < LN_COLS; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < C) {
        const ACC d = widen(dy[base + j]);
        xhat[k] = (widen(x[base + j]) - m) * r;
        g[k] = d * widen(w[j]);
        sg += g[k];
        sgx += g[k] * xhat[k];
        acc_w[k] += d * xhat[k];
        acc_b[k] += d;
      }
    }
    const ACC mg = block_sum(sg, buf) / (ACC)C;
    const ACC mgx = block_sum(sgx, buf) / (ACC)C;
    for (int k = 0; k < LN_COLS; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < C) {
        const ACC v = r * (g[k] - mg - xhat[k] * mgx);
        const ACC s = accumulate ? widen(res[base + j]) : (ACC)0;
        acc_r[k] += s;
        dx[base + j] = to_stored<T>(accumulate ? s + v : v);
      }
    }
  }
  for (int k = 0; k < LN_COLS; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    if (j < C) {
      part_w[(long long)blockIdx.x * C + j] = acc_w[k];
      part_b[(long long)blockIdx.x * C + j] = acc_b[k];
      if (sum_res) part_r[(long long)blockIdx.x * C + j] = acc_r[k];
    }
  }
}

// @kernel layernorm_bwd_params
// dw += the sum of part_w's rows, db += part_b's, and with sum_res dr += part_r's, over the (chunks, C)
// partial sums of layernorm_bwd: block (32, 8) for 32 columns, thread y adding chunks y, y + 8, ... in
// order, then thread y = 0 the eight in order, so the sums are the same on every run (no atomics). All
// ACC: the weight gradients are summed in float32 under bf16 (the master weights' dtype). The blocks past
// the first ceil(C / 32) add up another backward's partial column sums in the same way, more_out += the sum
// of more's rows over (more_chunks, more_C) (rows.cuh's add_column_partials, as column_sums_add): a bias
// gradient whose kernel left its last reduction to this launch (CupyOps.deferred_bias_sums), one launch
// fewer.
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void layernorm_bwd_params(const ACC *part_w, const ACC *part_b, const ACC *part_r, ACC *dw,
                                                ACC *db, ACC *dr, const int chunks, const int C,
                                                const int sum_res, const ACC *more, ACC *more_out,
                                                const int more_chunks, const int more_C) {
  __shared__ ACC acc_w[8][32];
  __shared__ ACC acc_b[8][32];
  __shared__ ACC acc_r[8][32];
  const int blocks = (C + 31) / 32;
  if (blockIdx.x >= blocks) {  /* the whole block: add_column_partials' barrier is reached by all or none */
    add_column_partials(more, more_out, more_chunks, more_C, acc_w, blockIdx.x - blocks);
    return;
  }
  const int j = blockIdx.x * 32 + threadIdx.x;
  ACC sw = 0, sb = 0, sr = 0;
  if (j < C) {
    for (int c = threadIdx.y; c < chunks; c += 8) {
      sw += part_w[(long long)c * C + j];
      sb += part_b[(long long)c * C + j];
      if (sum_res) sr += part_r[(long long)c * C + j];
    }
  }
  acc_w[threadIdx.y][threadIdx.x] = sw;
  acc_b[threadIdx.y][threadIdx.x] = sb;
  acc_r[threadIdx.y][threadIdx.x] = sr;
  __syncthreads();
  if (threadIdx.y == 0 && j < C) {
    for (int k = 1; k < 8; ++k) {
      sw += acc_w[k][threadIdx.x];
      sb += acc_b[k][threadIdx.x];
      sr += acc_r[k][threadIdx.x];
    }
    dw[j] += sw;
    db[j] += sb;
    if (sum_res) dr[j] += sr;
  }
}
