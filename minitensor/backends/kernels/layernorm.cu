// LayerNorm over the last axis (fused piece layernorm): what these kernels must equal is
// Ops.layernorm_forward / _backward (the start-up self-check runs the layer both ways on the GPU).

// @kernel layernorm_fwd
// One block per row of x (N, C). With add_residual, x is first updated in place to x + residual
// (the residual join before a pre-norm LayerNorm, fused); otherwise `residual` is not read. Each
// thread touches the same columns in every loop, so y may be x itself.
#include "rows.cuh"
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

// @kernel layernorm_bwd
// forward was: y = xhat w + b, xhat = (x - mean) rstd. One block per row: dx, written or (with
// accumulate) written as res + dx, the residual gradient of a pre-norm block, fused. res may be dx
// itself (each thread reads res[j] before it writes dx[j]).
#include "rows.cuh"
extern "C" __global__ void layernorm_bwd(const T *dy, const T *x, const T *w, const T *mean, const T *rstd,
                                         const T *res, T *dx, const int C, const int accumulate) {
  __shared__ T buf[32];
  const long long row = blockIdx.x;
  const T *dyr = dy + row * C;
  const T *xr = x + row * C;
  const T *resr = res + row * C;
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
    dxr[j] = accumulate ? resr[j] + v : v;
  }
}

// @kernel layernorm_bwd_params
// dw = sum over rows of dy xhat, db = sum over rows of dy, as partial sums per chunk of rows:
// block (32, 8) sums 32 columns over one chunk; the wrapper adds the (chunks, C) partials in a
// fixed order, so the result is deterministic (no atomics).
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
