// The bf16 flash attention kernels' shared code (kernels/attention.cu, the *_bf16 sections): tiles of bfloat16
// (T, unsigned short: bf16.cuh) in shared memory, the mma.m16n8k16 bf16 step (PTX on a GPU, the emulation's own
// on the host) and its fragments, two bfloat16 to a 32-bit register. Templates over the head size HS, as
// flash.cuh's, so that each instance is straight-line code with its fragment loads free to move ahead.
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", .bf16), lane 4 g + t:
//   A (16 x 16): a[0] = A(g, 2t), A(g, 2t + 1) (low half, high half); a[1] = the same of row g + 8;
//                a[2], a[3] = those of columns 2t + 8, 2t + 9
//   B (16 x 8):  b[0] = B(2t, g), B(2t + 1, g); b[1] = B(2t + 8, g), B(2t + 9, g)
//   C (16 x 8, float): C(g, 2t), C(g, 2t + 1), C(g + 8, 2t), C(g + 8, 2t + 1), as m16n8k8's
#ifdef __CUDACC__
/* c += a b for one 16 x 8 x 16 step, bfloat16 operands, float accumulators (warp-wide: every lane calls it) */
__device__ __forceinline__ void mma_bf16(float *c, const unsigned *a, const unsigned *b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* lo and hi rounded to bfloat16 (nearest, ties to even) in one register, lo in the low half */
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
/* ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (PTX ISA, "Warp-level matrix load instruction: ldmatrix"):
   four 8 x 8 matrices of 16-bit values, lanes 8 i .. 8 i + 7 giving the addresses of matrix i's rows (16
   bytes each, in shared memory); transposed, lane 4 g + t receives in r[i] matrix i's elements (2t, g) (low
   half) and (2t + 1, g) (high half): B operands down a tile's columns, as mma.m16n8k16 takes them */
__device__ __forceinline__ void ldsm_x4_trans(unsigned *r, const T *row) {
  asm volatile("{\n .reg .u64 a;\n cvta.to.shared.u64 a, %4;\n"
               " ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [a];\n}"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "l"(row));
}
#else
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  return (unsigned)narrow_bf16(lo) | (unsigned)narrow_bf16(hi) << 16;
}
/* the emulation's (minitensor/checks/emulation.py), the call's site named for the counts */
__device__ __forceinline__ void ldsm_x4_trans(unsigned *r, const T *row) {
  emu_ldsm_x4_trans(r, row, __builtin_return_address(0));
}
#endif

/* Heads up to 64 wide. Row stride of every tile, in bfloat16: 16-byte rows (vector stores) of 36 words, 4
   more than a multiple of 32, so that a 32-bit fragment read (rows g, words t) falls in 32 distinct banks
   (row g starts at bank 4 g), and so do the 8 rows of 16 bytes of each matrix ldmatrix reads. */
constexpr int HS_MAX = 64;
constexpr int LD = HS_MAX + 8;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float lowest() { return -3.40282347e+38f; }

/* Fragments from a row-major tile s (stride LD) in shared memory, at row r0 and column c0:
   a_frag: A(i, k) = s(r0 + i, c0 + k)   (16 x 16; 32-bit reads: two columns at once)
   b_rows: B(k, n) = s(r0 + n, c0 + k)   (16 x 8, B = the tile's rows transposed: k^T, v^T, q^T, dy^T)
   b_cols: B(k, n) = s(r0 + k, c0 + n) in b[0..1] and B(k, n) = s(r0 + k, c0 + 8 + n) in b[2..3]: two 16 x 8
           B operands of the tile itself (its rows down a column in each register) by one ldmatrix.trans of
           the matrices at (rows r0.., columns c0..), (r0 + 8.., c0..), (r0.., c0 + 8..), (r0 + 8.., c0 + 8..) */
__device__ __forceinline__ void a_frag(unsigned *a, const T *s, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  a[0] = *(const unsigned *)(s + (r0 + g) * LD + c0 + 2 * t);
  a[1] = *(const unsigned *)(s + (r0 + g + 8) * LD + c0 + 2 * t);
  a[2] = *(const unsigned *)(s + (r0 + g) * LD + c0 + 2 * t + 8);
  a[3] = *(const unsigned *)(s + (r0 + g + 8) * LD + c0 + 2 * t + 8);
}

__device__ __forceinline__ void b_rows(unsigned *b, const T *s, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  b[0] = *(const unsigned *)(s + (r0 + g) * LD + c0 + 2 * t);
  b[1] = *(const unsigned *)(s + (r0 + g) * LD + c0 + 2 * t + 8);
}

__device__ __forceinline__ void b_cols(unsigned *b, const T *s, int r0, int c0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4_trans(b, s + (r0 + (lane & 15)) * LD + c0 + 8 * (lane >> 4));
}

/* The A operand (16 x 16) of two accumulator tiles c0, c1 (16 x 8 each, columns 2t, 2t + 1 in lane t), in
   place: the accumulator's layout is the A operand's, its columns 0-7 and 8-15 the two tiles. Rounded to
   bfloat16, as FlashAttention-2 rounds P and dS for their products. a_from_accs: every pair of N tiles, as
   soon as they are final (their floats then free their registers). */
__device__ __forceinline__ void a_from_acc(unsigned *a, const float *c0, const float *c1) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

template <int N> __device__ __forceinline__ void a_from_accs(unsigned (*a)[4], const float (*c)[4]) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k) a_from_acc(a[k], c[2 * k], c[2 * k + 1]);
}

/* the bfloat16 pair in w plus the pair in b, summed in float and rounded once: bf16(a + b) per half */
__device__ __forceinline__ unsigned add_pair(unsigned w, unsigned b) {
  return pack_bf16(widen((T)(w & 0xffffu)) + widen((T)(b & 0xffffu)), widen((T)(w >> 16)) + widen((T)(b >> 16)));
}

/* ROWS rows r0.. of a matrix whose row r is src[r * stride ..] (HS wide) into the tile dst (stride LD) by the
   block's THREADS threads; rows at or past n_ctx as zeros. With BIAS, bias[c] is added to column c (c_attn's
   bias, to q, k and v as they are read: summed in float and rounded to bfloat16 once, as Ops' add of two
   bfloat16 arrays). 16-byte vectors (8 bfloat16, moved as their bits), 8 lanes to a row of 128 bytes:
   conflict-free stores. */
template <int ROWS, int THREADS, int HS, bool BIAS = false>
__device__ __forceinline__ void load_tile(T *dst, const T *src, int r0, int n_ctx, long long stride,
                                          const T *bias = nullptr) {
  constexpr int PER_ROW = HS / 8;
#pragma unroll (BIAS ? 1 : 2) /* a row and its bias in flight, or two rows: the same registers */
  for (int e0 = 0; e0 < ROWS * PER_ROW; e0 += THREADS) {
    const int e = e0 + threadIdx.x, r = e / PER_ROW, c = (e - r * PER_ROW) * 8;
    if (ROWS * PER_ROW % THREADS && e >= ROWS * PER_ROW) break;
    float4 v = {0.0f, 0.0f, 0.0f, 0.0f};  /* zero bits: bfloat16 zeros */
    if (r0 + r < n_ctx) {
      v = *(const float4 *)(src + (r0 + r) * stride + c);
      if constexpr (BIAS) {
        const float4 b = *(const float4 *)(bias + c);
        v.x = __uint_as_float(add_pair(__float_as_uint(v.x), __float_as_uint(b.x)));
        v.y = __uint_as_float(add_pair(__float_as_uint(v.y), __float_as_uint(b.y)));
        v.z = __uint_as_float(add_pair(__float_as_uint(v.z), __float_as_uint(b.z)));
        v.w = __uint_as_float(add_pair(__float_as_uint(v.w), __float_as_uint(b.w)));
      }
    }
    *(float4 *)(dst + r * LD + c) = v;
  }
}

/* q, k and v as c_attn writes them, read in place: rows of a (B, T, 3, n_head, HS) array (c_attn's (B * T, 3 C)
   output), the rows of head bh's q from qkv_head on, 3 n_head HS apart; its k's n_head HS further, its v's
   2 n_head HS; c_attn's bias for each at the same offset within a row ((bh % n_head) HS, + n_head HS, + 2 n_head
   HS). Its gradients are written in the same layout. */
template <int HS> __device__ __forceinline__ long long qkv_head(int bh, int n_ctx, int n_head) {
  return ((long long)(bh / n_head) * n_ctx * 3 * n_head + bh % n_head) * HS;
}

/* this warp's A operands of its 16 rows r0.. of a tile, for every 16-deep step of the head */
template <int HS> __device__ __forceinline__ void a_frags(unsigned (*a)[4], const T *s, int r0) {
#pragma unroll
  for (int k = 0; k < HS / 16; ++k) a_frag(a[k], s, r0, 16 * k);
}

/* c[n] (16 x 8 column tiles n = 0 .. N - 1) = A B, the A operands in registers (a[k] per 16-deep step over
   the head), B(k, n) = s(n, k): a product against a tile's rows (q k^T, dy v^T, k q^T, v dy^T). Straight-line
   code, HS / 16 x N mma, N independent accumulators a step: their latencies overlap. */
template <int N, int HS>
__device__ __forceinline__ void rows_product(float (*c)[4], const unsigned (*a)[4], const T *s) {
#pragma unroll
  for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < HS / 16; ++k)
#pragma unroll
    for (int n = 0; n < N; ++n) {
      unsigned b[2];
      b_rows(b, s, 8 * n, 16 * k);
      mma_bf16(c[n], a[k], b);
    }
}

/* acc[m] (16 x 8 column tiles of the head) += P s for P (16 x 8 N, its A operands in registers: a[k] per
   16-deep step, a_from_accs) and s a tile of 8 N rows: a product over a tile's rows (P v, dS k, P^T dy,
   dS^T q) */
template <int N, int HS>
__device__ __forceinline__ void acc_product(float (*acc)[4], const unsigned (*a)[4], const T *s) {
#pragma unroll
  for (int k = 0; k < N / 2; ++k)
#pragma unroll
    for (int m = 0; m < HS / 8; m += 2) {
      unsigned b[4];
      b_cols(b, s, 16 * k, 8 * m);
      mma_bf16(acc[m], a[k], b);
      mma_bf16(acc[m + 1], a[k], b + 2);
    }
}

/* rows r0 + g, r0 + g + 8 of this warp's accumulators (a (16, HS) result) times scale / row_div[half],
   rounded to bfloat16, into dst row r at dst[r * stride]; rows at or past n_ctx not written. Two adjacent
   columns in one 32-bit store. */
template <int HS>
__device__ __forceinline__ void store_acc(T *dst, long long stride, const float (*acc)[4], int r0, int n_ctx,
                                          float scale, const float *row_div) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < HS / 8; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (r0 + g + 8 * h < n_ctx)
        *(unsigned *)(dst + (r0 + g + 8 * h) * stride + 8 * m + 2 * t) =
            pack_bf16(acc[m][2 * h] * scale / row_div[h], acc[m][2 * h + 1] * scale / row_div[h]);
}

__device__ __forceinline__ float quad_max(float v) {
  for (int o = 1; o < 4; o <<= 1) {
    const float u = __shfl_xor_sync(FULL, v, o);
    v = u > v ? u : v;
  }
  return v;
}

__device__ __forceinline__ float quad_sum(float v) {
  for (int o = 1; o < 4; o <<= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}
