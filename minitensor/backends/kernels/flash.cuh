// The flash attention kernels' shared code (kernels/attention.cu): tiles in shared memory, the mma.m16n8k8
// step (PTX on a GPU, the emulation's own on the host) and its fragments. Everything a kernel's hot loop
// runs is a template over the head size HS and TF32 (tensor cores or FMAs), so that each instance the
// kernels are compiled for (attention.cu's explicit instantiations) is straight-line code: the products
// fully unrolled, no branch on either, the fragment loads free to be scheduled ahead of their mma.
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

/* Heads up to 64 wide in float; in double (the float64 checks' path) up to 32, so that a warp's operands
   and accumulators of double width stay in its registers. */
constexpr int HS_MAX = sizeof(T) == 4 ? 64 : 32;
/* Row stride of every tile in shared memory: a multiple of 4 (16-byte rows for vector stores) and 4
   more than a multiple of 32 words, so that the 8 rows g and 4 columns t a float fragment read touches
   fall in 32 distinct banks (row g starts at bank 4 g). */
constexpr int LD = HS_MAX + 4;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float fa_exp(float v) { return expf(v); }
__device__ __forceinline__ double fa_exp(double v) { return exp(v); }
__device__ __forceinline__ float fa_log(float v) { return logf(v); }
__device__ __forceinline__ double fa_log(double v) { return log(v); }
__device__ __forceinline__ float fa_lowest(float) { return -3.40282347e+38f; }
__device__ __forceinline__ double fa_lowest(double) { return -1.7976931348623157e+308; }

/* An operand of the tensor cores, rounded to TF32 once, where it is stored (float with TF32; else as is). */
template <int TF32> __device__ __forceinline__ float operand(float v) {
  if constexpr (TF32) return __uint_as_float(to_tf32(v));
  return v;
}
template <int TF32> __device__ __forceinline__ double operand(double v) { return v; }

/* c (16 x 8, the accumulator layout) += a (16 x 8) b (8 x 8), every lane of the warp calling it. Lane
   4 g + t holds a = A(g, t), A(g + 8, t), A(g, t + 4), A(g + 8, t + 4); b = B(t, g), B(t + 4, g);
   c = C(g, 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8, 2t + 1) (PTX ISA, "Matrix Fragments for
   mma.m16n8k8", .tf32). Without tensor cores (double; float without tf32) the same product by FMAs:
   each lane gathers rows g, g + 8 of A and columns 2t, 2t + 1 of B from the lanes holding them. */
template <class U> __device__ void fma_step(U *c, const U *a, const U *b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int k = 0; k < 8; ++k) {
    const int hi = k >> 2, from_a = 4 * g + (k & 3), from_b = 8 * t + (k & 3);
    const U a0 = __shfl_sync(FULL, a[hi ? 2 : 0], from_a), a1 = __shfl_sync(FULL, a[hi ? 3 : 1], from_a);
    const U b0 = __shfl_sync(FULL, b[hi], from_b), b1 = __shfl_sync(FULL, b[hi], from_b + 4);
    c[0] += a0 * b0;
    c[1] += a0 * b1;
    c[2] += a1 * b0;
    c[3] += a1 * b1;
  }
}

template <int TF32> __device__ __forceinline__ void mma_step(float *c, const float *a, const float *b) {
  if constexpr (TF32) {
    const unsigned ua[4] = {__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3])};
    const unsigned ub[2] = {__float_as_uint(b[0]), __float_as_uint(b[1])};
    mma_tf32(c, ua, ub);
  } else {
    fma_step(c, a, b);
  }
}

template <int TF32> __device__ __forceinline__ void mma_step(double *c, const double *a, const double *b) {
  fma_step(c, a, b);
}

/* Fragments from a row-major tile s (stride LD) in shared memory, at row r0 and column c0:
   a_frag: A(i, k) = s(r0 + i, c0 + k)                (a 16 x 8 A operand)
   b_rows: B(k, n) = s(r0 + n, c0 + k)                (B = the tile's rows transposed: k^T, v^T, q^T, dy^T)
   b_cols: B(k, n) = s(r0 + 2 (k % 4) + k / 4, c0 + n) (B = the tile itself, its rows in the order of
           the k index of an A operand made from an accumulator: a_from_acc) */
__device__ __forceinline__ void a_frag(T *a, const T *s, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  a[0] = s[(r0 + g) * LD + c0 + t];
  a[1] = s[(r0 + g + 8) * LD + c0 + t];
  a[2] = s[(r0 + g) * LD + c0 + t + 4];
  a[3] = s[(r0 + g + 8) * LD + c0 + t + 4];
}

__device__ __forceinline__ void b_rows(T *b, const T *s, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  b[0] = s[(r0 + g) * LD + c0 + t];
  b[1] = s[(r0 + g) * LD + c0 + t + 4];
}

__device__ __forceinline__ void b_cols(T *b, const T *s, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  b[0] = s[(r0 + 2 * t) * LD + c0 + g];
  b[1] = s[(r0 + 2 * t + 1) * LD + c0 + g];
}

/* The A operand (k = 8 columns) of an accumulator tile c (16 x 8, columns 2t, 2t + 1 in lane t) in
   registers, no exchange: its k index t stands for column 2t and t + 4 for 2t + 1, so the B operand
   it multiplies is read with b_cols. Rounded to TF32 where the product runs on tensor cores. */
template <int TF32> __device__ __forceinline__ void a_from_acc(T *a, const T *c) {
  a[0] = operand<TF32>(c[0]);
  a[1] = operand<TF32>(c[2]);
  a[2] = operand<TF32>(c[1]);
  a[3] = operand<TF32>(c[3]);
}

/* 16 bytes of p (4 floats or 2 doubles) into v */
__device__ __forceinline__ void load16(T *v, const T *p) {
  if constexpr (sizeof(T) == 4) *(float4 *)v = *(const float4 *)p;
  else *(double2 *)v = *(const double2 *)p;
}

/* ROWS rows r0.. of a matrix whose row r is src[r * stride ..] (HS wide) into the tile dst (stride LD)
   by the block's THREADS threads, operands rounded as the products need them; rows at or past n_ctx as
   zeros. With BIAS, bias[c] is added to column c first (c_attn's bias, to q, k and v as they are read:
   the sum, then its rounding, as a separate add and load would give). 16-byte vectors, 8 lanes to a row
   of 128 bytes: conflict-free stores. */
template <int ROWS, int THREADS, int HS, int TF32, bool BIAS = false>
__device__ __forceinline__ void load_tile(T *dst, const T *src, int r0, int n_ctx, long long stride,
                                          const T *bias = nullptr) {
  constexpr int PER = 16 / sizeof(T), PER_ROW = HS / PER;
#pragma unroll 2 /* two 16-byte loads in flight a thread: more would hold registers the hot loop needs */
  for (int e0 = 0; e0 < ROWS * PER_ROW; e0 += THREADS) {
    const int e = e0 + threadIdx.x, r = e / PER_ROW, c = (e - r * PER_ROW) * PER;
    if (ROWS * PER_ROW % THREADS && e >= ROWS * PER_ROW) break;
    T v[PER];
    if (r0 + r < n_ctx) {
      load16(v, src + (r0 + r) * stride + c);
      if constexpr (BIAS) {
        T b[PER];
        load16(b, bias + c);
#pragma unroll
        for (int i = 0; i < PER; ++i) v[i] += b[i];
      }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) v[i] = r0 + r < n_ctx ? operand<TF32>(v[i]) : (T)0;
    if constexpr (PER == 4) *(float4 *)(dst + r * LD + c) = *(float4 *)v;
    else *(double2 *)(dst + r * LD + c) = *(double2 *)v;
  }
}

/* q, k and v as c_attn writes them, read in place: rows of a (B, T, 3, n_head, HS) array (c_attn's (B * T, 3 C)
   output), the rows of head bh's q from qkv_head on, 3 n_head HS apart; its k's n_head HS further, its v's
   2 n_head HS; c_attn's bias for each at the same offset within a row ((bh % n_head) HS, + n_head HS, + 2 n_head
   HS). Its gradients are written in the same layout. */
template <int HS> __device__ __forceinline__ long long qkv_head(int bh, int n_ctx, int n_head) {
  return ((long long)(bh / n_head) * n_ctx * 3 * n_head + bh % n_head) * HS;
}

/* this warp's A operands of its 16 rows r0.. of a tile, for every 8-deep step of the head */
template <int HS> __device__ __forceinline__ void a_frags(T (*a)[4], const T *s, int r0) {
#pragma unroll
  for (int k = 0; k < HS / 8; ++k) a_frag(a[k], s, r0, 8 * k);
}

/* c[n] (16 x 8 column tiles n = 0 .. N - 1) = A B, the A operands in registers (a[k] per 8-deep step
   over the head), B(k, n) = s(r0 + n, k): a product against a tile's rows (q k^T, dy v^T, k q^T, v dy^T).
   On tensor cores, straight-line code (HS / 8 x N mma, no branch): the compiler issues the shared-memory
   loads of the B fragments ahead of the mma that use them. By FMAs (float64, float32 without TF32: the
   checks' path), a loop over the steps, not unrolled: 64 FMAs and shuffles a step would make the code
   (and its compile) ten times larger. */
template <int N, int HS, int TF32>
__device__ __forceinline__ void rows_product(T (*c)[4], const T (*a)[4], const T *s) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0;
#pragma unroll (TF32 ? HS / 8 : 1)
  for (int k = 0; k < HS / 8; ++k)  /* per step, N independent accumulators: their mma latencies overlap */
#pragma unroll
    for (int n = 0; n < N; ++n) {
      T b[2];
      b_rows(b, s, 8 * n, 8 * k);
      mma_step<TF32>(c[n], a[k], b);
    }
}

/* acc[m] (16 x 8 column tiles of the head) += P s for P (16 x 8 N, accumulator tiles p[k] in registers)
   and s a tile of 8 N rows: a product over a tile's rows (P v, dS k, P^T dy, dS^T q). Unrolled, or
   not, as rows_product. */
template <int N, int HS, int TF32>
__device__ __forceinline__ void acc_product(T (*acc)[4], const T (*p)[4], const T *s) {
#pragma unroll (TF32 ? N : 1)
  for (int k = 0; k < N; ++k) {
    T a[4];
    a_from_acc<TF32>(a, p[k]);
#pragma unroll
    for (int m = 0; m < HS / 8; ++m) {
      T b[2];
      b_cols(b, s, 8 * k, 8 * m);
      mma_step<TF32>(acc[m], a, b);
    }
  }
}

/* rows r0 + g, r0 + g + 8 of this warp's accumulators (a (16, HS) result) times scale / row_div[half],
   into dst row r at dst[r * stride]; rows at or past n_ctx not written */
template <int HS>
__device__ __forceinline__ void store_acc(T *dst, long long stride, const T (*acc)[4], int r0, int n_ctx, T scale,
                                          const T *row_div) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < HS / 8; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (r0 + g + 8 * h < n_ctx) {  /* two adjacent columns in one store: 4 lanes fill a 32-byte sector */
          T pair[2] = {acc[m][2 * h] * scale / row_div[h], acc[m][2 * h + 1] * scale / row_div[h]};
          T *out = dst + (r0 + g + 8 * h) * stride + 8 * m + 2 * t;
          if (sizeof(T) == 4) *(float2 *)out = *(float2 *)pair;
          else *(double2 *)out = *(double2 *)pair;
        }
}

__device__ __forceinline__ T quad_max(T v) {
  for (int o = 1; o < 4; o <<= 1) {
    const T u = __shfl_xor_sync(FULL, v, o);
    v = u > v ? u : v;
  }
  return v;
}

__device__ __forceinline__ T quad_sum(T v) {
  for (int o = 1; o < 4; o <<= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}
