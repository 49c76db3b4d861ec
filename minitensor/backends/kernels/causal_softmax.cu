// The causal softmax over (..., T, T) attention scores (fused piece causal_softmax): forward,
// backward, and the probabilities recomputed from the saved log-sum-exp.

// @kernel causal_softmax_fwd
// One block per row; row r of a matrix attends to columns 0..r only (r = the row's index mod T).
// The masked columns are never read and are written as exact zeros; p may be s itself. T is what s and
// p are stored in, ACC what the max, the sum and lse are carried in (float for bfloat16).
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void causal_softmax_fwd(const T *s, T *p, ACC *lse, const int n_ctx, const ACC scale,
                                              const int write_lse) {
  __shared__ ACC buf[32];
  const long long row = blockIdx.x;
  const int last = row % n_ctx;
  const T *sr = s + row * n_ctx;
  T *pr = p + row * n_ctx;
  ACC top = lowest_of(scale);
  for (int j = threadIdx.x; j <= last; j += blockDim.x) {
    const ACC z = scale * widen(sr[j]);
    top = z > top ? z : top;
  }
  top = block_max(top, buf);  /* finite: every row keeps its diagonal entry */
  ACC total = 0;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) total += exp_of(scale * widen(sr[j]) - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x)
    pr[j] = to_stored<T>(j <= last ? exp_of(scale * widen(sr[j]) - top) / total : (ACC)0);
  if (write_lse && threadIdx.x == 0) lse[row] = top + log_of(total);
}

// @kernel causal_softmax_bwd
// forward was: p = softmax(z) by rows, z = scale s + mask. ds may be dp itself. Sums in ACC.
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void causal_softmax_bwd(const T *dp, const T *p, T *ds, const int n_ctx, const ACC scale) {
  __shared__ ACC buf[32];
  const long long row = blockIdx.x;
  const int last = row % n_ctx;
  const T *dpr = dp + row * n_ctx;
  const T *pr = p + row * n_ctx;
  T *dsr = ds + row * n_ctx;
  ACC dot = 0;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) dot += widen(dpr[j]) * widen(pr[j]);
  dot = block_sum(dot, buf);
  for (int j = threadIdx.x; j < n_ctx; j += blockDim.x)
    dsr[j] = to_stored<T>(j <= last ? scale * (widen(pr[j]) * (widen(dpr[j]) - dot)) : (ACC)0);
}

// @kernel causal_softmax_recompute
// An ElementwiseKernel operation: flat index i is row i / n_ctx (over all matrices), column i % n_ctx.
const unsigned int row = (unsigned int)i / (unsigned int)n_ctx;
const unsigned int col = (unsigned int)i - row * (unsigned int)n_ctx;
p = col <= row % (unsigned int)n_ctx ? exp(scale * s - lse[row]) : (T)0;
