// Shared by the row kernels: overloads that keep float maths in float, and block-wide reductions.
// The reductions need a 1-D block of a multiple of 32 threads (at most 1024), all calling them
// (they use __syncthreads and full-warp shuffles); every thread gets the result; `buf` is 32 ACCs of
// shared memory, reusable by the next call. NVRTC has no INFINITY or NAN: the bit patterns instead.
// A kernel's section takes it with #include "bf16.cuh" then #include "rows.cuh" (the loader,
// minitensor.backends.cuda.cu_code, pastes them in: NVRTC is given one source). T is the stored type,
// ACC the summed one (float for bfloat16, else T), typedef'd before it (minitensor.backends.cuda.type_names):
// the reductions and the maths run in ACC.
__device__ __forceinline__ float exp_of(float v) { return expf(v); }
__device__ __forceinline__ double exp_of(double v) { return exp(v); }
__device__ __forceinline__ float log_of(float v) { return logf(v); }
__device__ __forceinline__ double log_of(double v) { return log(v); }
__device__ __forceinline__ float sqrt_of(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_of(double v) { return sqrt(v); }
__device__ __forceinline__ float lowest_of(float) { return -3.40282347e+38f; }
__device__ __forceinline__ double lowest_of(double) { return -1.7976931348623157e+308; }
__device__ __forceinline__ float nan_of(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double nan_of(double) { return __longlong_as_double(0x7ff8000000000000LL); }

__device__ ACC block_sum(ACC v, ACC *buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  /* buf may still be read by the previous call */
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < n_warps ? buf[lane] : (ACC)0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ ACC block_max(ACC v, ACC *buf) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const ACC u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  v = lane < n_warps ? buf[lane] : lowest_of(v);
  for (int o = 16; o > 0; o >>= 1) {
    const ACC u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

/* out[j] += the sum of part's rows, over (chunks, C) partial column sums (a backward's, per chunk of rows),
   for the 32 columns j = block 32 + threadIdx.x (block: blockIdx.x, or its place among the blocks of a
   launch that adds up more than one set): a block of (32, 8) threads, thread y adding chunks y, y + 8, ...
   in order into acc[y] (8 x 32 ACCs of shared memory), then thread y = 0 the eight in order, so the sums are
   the same on every run (no atomics). */
__device__ void add_column_partials(const ACC *part, ACC *out, const int chunks, const int C, ACC (*acc)[32],
                                    const int block) {
  const int j = block * 32 + threadIdx.x;
  ACC s = 0;
  if (j < C) {
    for (int c = threadIdx.y; c < chunks; c += 8) s += part[(long long)c * C + j];
  }
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < C) {
    for (int k = 1; k < 8; ++k) s += acc[k][threadIdx.x];
    out[j] += s;
  }
}
