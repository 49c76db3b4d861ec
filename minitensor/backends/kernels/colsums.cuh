// Column sums of a result held in mma accumulators, for a bias gradient summed by the kernel that writes the
// gradient it is the column sums of (the flash backward's dq, dk, dv: c_attn's bias, kernels/attention.cu).
// A warp's 16 x HS result: lane 4 g + t holds columns 8 m + 2 t and 8 m + 2 t + 1 (m < HS / 8) of rows g and
// g + 8 (acc[m][0..1] and acc[m][2..3], the m16n8k8 / m16n8k16 accumulator layout). No atomics: a fixed
// shuffle tree within a warp, the warps added in order, so the sums are the same on every run. ACC sums
// (float under bf16). A kernel's section takes it with #include "colsums.cuh" after its flash header.

/* sums[c], c < HS (this warp's, in shared memory): the sum of stored(acc value) down column c over the
   warp's rows r0 + g, r0 + g + 8 that are below n_ctx (stored: the value as the kernel stores it, so that
   the sums are those of the gradient as c_attn's backward reads it) */
template <int HS, class Stored>
__device__ __forceinline__ void warp_column_sums(ACC *sums, const ACC (*acc)[4], int r0, int n_ctx, Stored stored) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < HS / 8; ++m)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      ACC s = 0;
      for (int h = 0; h < 2; ++h)
        if (r0 + g + 8 * h < n_ctx) s += stored(acc[m][2 * h + e]);
      for (int o = 4; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);  /* over g: the 8 row pairs */
      if (g == 0) sums[8 * m + 2 * t + e] = s;
    }
}

/* After a __syncthreads: for each of `parts` results (sums: parts x WARPS x HS, as warp_column_sums wrote
   them, warp w's rows after warp w - 1's), dst[p * p_stride + c] = the WARPS warps' sums of column c added in
   order; thread c < parts HS writes one */
template <int HS, int WARPS>
__device__ __forceinline__ void add_warp_sums(ACC *dst, long long p_stride, const ACC *sums, int parts) {
  for (int i = threadIdx.x; i < parts * HS; i += blockDim.x) {
    const int p = i / HS, c = i % HS;
    ACC s = 0;
    for (int w = 0; w < WARPS; ++w) s += sums[(p * WARPS + w) * HS + c];
    dst[p * p_stride + c] = s;
  }
}
