// The flash attention kernels' shared code (kernels/attention.cu): the tile constants, the mma.m16n8k8
// step (PTX on a GPU, the launch emulation's own on the host), the tile loads and products.
#ifdef __CUDACC__
__device__ __forceinline__ unsigned to_tf32(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
/* c += a b for one 16 x 8 x 8 step, the fragments in mma.m16n8k8's layout (warp-wide: every lane calls it) */
__device__ __forceinline__ void mma_tf32(float *c, const unsigned *a, const unsigned *b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

constexpr int ROWS = sizeof(T) == 4 ? 32 : 16;      /* keys of a key tile; rows of the backward's query tiles */
constexpr int FWD_ROWS = sizeof(T) == 4 ? 64 : 16;  /* rows of the forward's query tiles */
constexpr int HS_MAX = 64;
constexpr int ACC = HS_MAX / 16;  /* 8-wide accumulator tiles of a (rows, hs) product per warp */
/* A block has 4 threads per query row of its tile: QR / 16 bands of 16 rows, 2 warps (column halves) each. */

__device__ __forceinline__ float fa_exp(float v) { return expf(v); }
__device__ __forceinline__ double fa_exp(double v) { return exp(v); }
__device__ __forceinline__ float fa_log(float v) { return logf(v); }
__device__ __forceinline__ double fa_log(double v) { return log(v); }
__device__ __forceinline__ float fa_lowest(float) { return -3.40282347e+38f; }
__device__ __forceinline__ double fa_lowest(double) { return -1.7976931348623157e+308; }

/* c (the lane's four elements of a 16 x 8 tile, the layout above) += A (16 x kdim) B (kdim x 8) by FMAs:
   A(i, k) = a[i si + k sk], B(k, n) = b[k bk + n bn], both in shared memory. */
template <class U> __device__ void fma_tile(U *c, const U *a, int si, int sk, const U *b, int bk, int bn, int kdim) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k = 0; k < kdim; ++k) {
    const U a0 = a[g * si + k * sk], a1 = a[(g + 8) * si + k * sk];
    const U b0 = b[k * bk + 2 * t * bn], b1 = b[k * bk + (2 * t + 1) * bn];
    c[0] += a0 * b0;
    c[1] += a0 * b1;
    c[2] += a1 * b0;
    c[3] += a1 * b1;
  }
}

/* the same with tensor cores where tf32 (float only; kdim a multiple of 8): 8-deep mma.sync steps, the
   operands rounded to TF32. tf32 is the same for the whole block, so every warp issues alike. */
__device__ void mma_tile(float *c, const float *a, int si, int sk, const float *b, int bk, int bn, int kdim,
                         int tf32) {
  if (!tf32) return fma_tile(c, a, si, sk, b, bk, bn, kdim);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k0 = 0; k0 < kdim; k0 += 8) {
    const unsigned fa[4] = {to_tf32(a[g * si + (k0 + t) * sk]), to_tf32(a[(g + 8) * si + (k0 + t) * sk]),
                            to_tf32(a[g * si + (k0 + t + 4) * sk]), to_tf32(a[(g + 8) * si + (k0 + t + 4) * sk])};
    const unsigned fb[2] = {to_tf32(b[(k0 + t) * bk + g * bn]), to_tf32(b[(k0 + t + 4) * bk + g * bn])};
    mma_tf32(c, fa, fb);
  }
}

__device__ void mma_tile(double *c, const double *a, int si, int sk, const double *b, int bk, int bn, int kdim,
                         int) {
  fma_tile(c, a, si, sk, b, bk, bn, kdim);
}

/* (rows, n) tile of rows r0.. of a matrix whose row r is src[r * stride ..], into dst (row length n);
   rows at or past n_ctx as zeros */
__device__ void load_tile(T *dst, const T *src, int r0, int rows, int n_ctx, int n, long long stride) {
  for (int e = threadIdx.x; e < rows * n; e += blockDim.x) {
    const int r = e / n, c = e - r * n;
    dst[e] = r0 + r < n_ctx ? src[(r0 + r) * stride + c] : (T)0;
  }
}

/* s (QR x ROWS, shared) = A B^T for A (QR, hs) and B (ROWS, hs) tiles in shared memory: each warp the
   8-wide column tiles of its half of its band */
template <int QR> __device__ void scores(T *s, const T *a, const T *b, int hs, int tf32) {
  const int warp = threadIdx.x >> 5, band = warp % (QR / 16), half = warp / (QR / 16);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int u = 0; u < ROWS / 16; ++u) {
    const int n0 = (half * (ROWS / 16) + u) * 8;
    T c[4] = {0, 0, 0, 0};
    mma_tile(c, a + band * 16 * hs, hs, 1, b + n0 * hs, 1, hs, hs, tf32);
    T *out = s + (band * 16 + g) * ROWS + n0 + 2 * t;
    out[0] = c[0];
    out[1] = c[1];
    out[8 * ROWS] = c[2];
    out[8 * ROWS + 1] = c[3];
  }
}

/* acc (this warp's ACC accumulator tiles of a (QR, hs) result) += A B, A(i, k) = a[i si + k sk] over
   kdim = ROWS, B (ROWS, hs) row-major in shared memory */
template <int QR> __device__ void accumulate(T (*acc)[4], const T *a, int si, int sk, const T *b, int hs,
                                             int tf32) {
  const int warp = threadIdx.x >> 5, band = warp % (QR / 16), half = warp / (QR / 16), tiles = hs / 16;
#pragma unroll
  for (int u = 0; u < ACC; ++u)
    if (u < tiles) mma_tile(acc[u], a + band * 16 * si, si, sk, b + (half * tiles + u) * 8, hs, 1, ROWS, tf32);
}

/* rows r0.. of a (QR, hs) result from the accumulators, times scale (and per row, row_factor[r]), into
   dst row r at dst[r * stride]; rows at or past n_ctx not written */
template <int QR> __device__ void store_acc(T *dst, long long stride, T (*acc)[4], int r0, int n_ctx, int hs,
                                            T scale, const T *row_factor) {
  const int warp = threadIdx.x >> 5, band = warp % (QR / 16), half = warp / (QR / 16), tiles = hs / 16;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < ACC; ++u)
    if (u < tiles)
      for (int h = 0; h < 2; ++h) {
        const int r = band * 16 + g + 8 * h, col = (half * tiles + u) * 8 + 2 * t;
        const T f = scale * (row_factor ? row_factor[r] : (T)1);
        if (r0 + r < n_ctx) {
          dst[(r0 + r) * stride + col] = acc[u][2 * h] * f;
          dst[(r0 + r) * stride + col + 1] = acc[u][2 * h + 1] * f;
        }
      }
}

__device__ __forceinline__ T quad_max(T v) {
  for (int o = 1; o < 4; o <<= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

__device__ __forceinline__ T quad_sum(T v) {
  for (int o = 1; o < 4; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* the rows' lse and delta of query tile i0 into shared memory (0 past n_ctx) */
__device__ void load_rows(T *lse_s, T *delta_s, const T *lse, const T *delta, int i0, int n_ctx) {
  for (int r = threadIdx.x; r < ROWS; r += blockDim.x) {
    lse_s[r] = i0 + r < n_ctx ? lse[i0 + r] : (T)0;
    delta_s[r] = i0 + r < n_ctx ? delta[i0 + r] : (T)0;
  }
}

/* in place over ss (scores -> P) and ps (dP -> dS) of query tile i0 against key tile j0 */
__device__ void probs_and_grads(T *ss, T *ps, const T *lse_s, const T *delta_s, int i0, int j0, int n_ctx,
                                T scale) {
  for (int e = threadIdx.x; e < ROWS * ROWS; e += blockDim.x) {
    const int r = e / ROWS, c = e - r * ROWS;
    const T p = j0 + c <= i0 + r && i0 + r < n_ctx ? fa_exp(scale * ss[e] - lse_s[r]) : (T)0;
    ss[e] = p;
    ps[e] = p * (ps[e] - delta_s[r]);
  }
}
