// Causal attention that never stores T x T: FlashAttention-2's algorithm (Dao 2023, "FlashAttention-2:
// Faster Attention with Better Parallelism and Work Partitioning", arXiv:2307.08691; the online softmax of
// Milakov & Gimelshein 2018, arXiv:1805.02867), written here for minitensor's CupyOps.
//
// q, k, v: c_attn's output read in place, rows of a (B, T, 3, n_head, hs) array (its (B * T, 3 C)), c_attn's
// bias b (3 C) added as they are read (load_tile); dq, dk, dv written in place into an array of the same
// layout (what c_attn's backward reads); q unscaled (scores are scale * q k^T). y and dy: rows of (B, T,
// n_head, hs), head h = bh % n_head of sequence bh / n_head (the heads of a (B, T, C) output read in place;
// n_head = 1 is the plain (BH, T, hs) layout). lse and delta: (BH, T). hs a multiple of 16, at most HS_MAX.
//
// The layout (kernels/flash.cuh): each warp owns 16 rows of a product and every column of it, so that
// its A operands stay in registers (q, dy, k or v of its rows, loaded and rounded to TF32 once per
// block) and only B operands come from shared memory, each read once per warp. Tiles in shared memory
// are row-major with a row stride of LD = 68 words: every fragment read there is conflict-free, and so
// is every 16-byte store that fills them. Scores never leave registers: a warp's accumulator of
// q k^T becomes the A operand of the next product in place (flash.cuh, a_from_acc), the keys of a
// tile taken in the order that makes that so. Rows are masked per element on the diagonal; a warp
// whose rows see none of a tile (above the diagonal) skips it. Blocks are numbered so that the longest
// (most tiles) start first.
//
// forward   y = softmax(scale q k^T + causal mask) v, lse = the rows' log-sum-exp: per query tile,
//           key tiles 0 .. the diagonal, running max and sum, the output accumulator rescaled.
// backward  deterministic, no atomics: flash_attention_bwd_dq (per query tile: delta = rowsum(dy y),
//           written for the next kernel, and dq = scale dS k over the key tiles up to the diagonal)
//           then flash_attention_bwd_dkv (per key tile: dv = P^T dy and dk = scale dS^T q over the
//           query tiles from the diagonal down), P = exp(scale q k^T - lse) recomputed, dS = P (dP -
//           delta), dP = dy v^T. Without atomics, the scores and dP are computed twice (7 products
//           against the 5 of a backward that adds dq atomically). With sum_bias each block also sums the
//           columns of the gradients it stores, as stored (colsums.cuh): c_attn's bias gradient, a row of
//           bias_sums (B * tiles, 3 C) per sequence and tile of 64 rows, which column_sums_add adds up
//           (kernels/attention.py, flash_backward), instead of a GEMV that reads all of dq, dk, dv again.
//
// float with tf32 runs every product on tensor cores (mma.sync m16n8k8, operands rounded by cvt.rna
// where they are stored, sums in float); double, and float without tf32, the same fragments by FMAs.
//
// Each kernel is a template over HS (the head size) and TF32, both fixed at compile time: the products
// unroll completely, the hot loop holds no branch on either, and each instance gets the registers its
// own code needs. The launch's hs and tf32 arguments name the instance (the wrapper picks it;
// minitensor.backends.cuda.RawSpec.template); the source NVRTC compiles ends with the explicit
// instantiations of the instances it holds (RawSpec.source). __launch_bounds__ caps the registers at
// what the occupancy each kernel declares needs (kernels/attention.py: RawSpec.warps_per_sm).
//
// The *_bf16 sections are the same three kernels for bfloat16 q, k, v, y, dy and gradients (T is unsigned
// short, ACC float): products on mma.sync m16n8k16 bf16 (kernels/flash16.cuh), every accumulator and the
// softmax statistics (lse, delta) float, P and dS rounded to bfloat16 for their products; templates over HS
// alone, compiled in bfloat16 only.

// @kernel flash_attention_fwd
// y and lse per query tile of FWD_Q rows (16 per warp), over key tiles of FWD_K keys up to the diagonal.
#include "flash.cuh"
constexpr int FWD_Q = sizeof(T) == 4 ? 128 : 64;
constexpr int FWD_K = sizeof(T) == 4 ? 64 : 32;
constexpr int FWD_THREADS = 2 * FWD_Q;
/* at namespace scope, not in the template: the same for every instance, and in the emulation's counting
   build a static of a template would leave the section that marks shared memory (minitensor.checks.traffic) */
__shared__ __align__(16) T kv[2 * FWD_K * LD];  /* the k tile, then the v tile; q passes through first */
template <int HS, int TF32>
__global__ void __launch_bounds__(FWD_THREADS, 2)
flash_attention_fwd(const T *qkv, const T *b, T *y, T *lse, const int n_ctx, const int hs, const int n_head,
                    const T scale, const int tf32) {
  const T *ks = kv, *vs = kv + FWD_K * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * FWD_Q, r0 = i0 + 16 * warp;
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  T qa[HS / 8][4];  /* this warp's rows of q, A operands */
  load_tile<FWD_Q, FWD_THREADS, HS, TF32, true>(kv, qkv + head, i0, n_ctx, row, bq);
  __syncthreads();
  a_frags<HS>(qa, kv, 16 * warp);
  T acc[HS / 8][4] = {};
  T top[2] = {fa_lowest(scale), fa_lowest(scale)}, total[2] = {0, 0};  /* rows g, g + 8: running max, sum */
  for (int j0 = 0; j0 < i0 + FWD_Q && j0 < n_ctx; j0 += FWD_K) {
    __syncthreads();  /* the previous tile's reads are done */
    load_tile<FWD_K, FWD_THREADS, HS, TF32, true>(kv, qkv + head + part, j0, n_ctx, row, bq + part);
    load_tile<FWD_K, FWD_THREADS, HS, TF32, true>(kv + FWD_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
    __syncthreads();
    if (j0 > r0 + 15) continue;  /* every key of the tile is after this warp's rows */
    T s[FWD_K / 8][4];
    rows_product<FWD_K / 8, HS, TF32>(s, qa, ks);  /* q k^T */
    T m[2] = {top[0], top[1]}, sum[2] = {0, 0};
#pragma unroll
    for (int n = 0; n < FWD_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const bool seen = j0 + 8 * n + 2 * t + (e & 1) <= r0 + g + 8 * (e >> 1);
        s[n][e] = seen ? scale * s[n][e] : fa_lowest(scale);
        m[e >> 1] = s[n][e] > m[e >> 1] ? s[n][e] : m[e >> 1];
      }
    for (int h = 0; h < 2; ++h) m[h] = quad_max(m[h]);
#pragma unroll
    for (int n = 0; n < FWD_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        /* P, unnormalised, with no branch around each exp: a masked score (the lowest value) gives exp(lowest
           - m) = 0, m being finite (every row sees key 0 on the first tile) */
        s[n][e] = fa_exp(s[n][e] - m[e >> 1]);
        sum[e >> 1] += s[n][e];
      }
    for (int h = 0; h < 2; ++h) {
      const T alpha = fa_exp(top[h] - m[h]);  /* 0 on the first tile: top is the lowest value */
      total[h] = total[h] * alpha + quad_sum(sum[h]);
      top[h] = m[h];
#pragma unroll
      for (int u = 0; u < HS / 8; ++u) acc[u][2 * h] *= alpha, acc[u][2 * h + 1] *= alpha;
    }
    acc_product<FWD_K / 8, HS, TF32>(acc, s, vs);  /* acc += P v */
  }
  if (t == 0)
    for (int h = 0; h < 2; ++h)
      if (r0 + g + 8 * h < n_ctx) lse[(long long)bh * n_ctx + r0 + g + 8 * h] = top[h] + fa_log(total[h]);
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS;
  store_acc<HS>(y + y_head, (long long)n_head * HS, acc, r0, n_ctx, (T)1, total);
}

// @kernel flash_attention_bwd_dq
// delta = rowsum(dy y) and dq per query tile of DQ_Q rows (16 per warp), over key tiles of DQ_K keys up to
// the diagonal (before flash_attention_bwd_dkv).
#include "flash.cuh"
#include "colsums.cuh"
constexpr int DQ_Q = 64;
constexpr int DQ_K = sizeof(T) == 4 ? 32 : 16;
constexpr int DQ_THREADS = 2 * DQ_Q;
__shared__ __align__(16) T tiles[2 * DQ_Q * LD];  /* q and dy, then the k and v tiles (namespace scope: see the forward) */
template <int HS, int TF32>
__global__ void __launch_bounds__(DQ_THREADS, 3)
flash_attention_bwd_dq(const T *qkv, const T *b, const T *y, const T *dy, const T *lse, T *delta, T *dqkv,
                       ACC *bias_sums, const int n_ctx, const int hs, const int n_head, const T scale,
                       const int sum_bias, const int tf32) {
  const T *ks = tiles, *vs = tiles + DQ_K * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * DQ_Q, r0 = i0 + 16 * warp;
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS, stride = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  load_tile<DQ_Q, DQ_THREADS, HS, TF32, true>(tiles, qkv + head, i0, n_ctx, row, bq);
  load_tile<DQ_Q, DQ_THREADS, HS, 0>(tiles + DQ_Q * LD, dy + y_head, i0, n_ctx, stride);  /* dy as it is: delta needs it */
  __syncthreads();
  T qa[HS / 8][4], dya[HS / 8][4], d[2] = {0, 0}, row_lse[2];
  a_frags<HS>(qa, tiles, 16 * warp);
  a_frags<HS>(dya, tiles + DQ_Q * LD, 16 * warp);
  for (int h = 0; h < 2; ++h) {  /* delta = rowsum(dy y) = rowsum(dP P), lanes t, t + 4, ... of the row */
    const int r = r0 + g + 8 * h;
    if (r < n_ctx)
      for (int c = t; c < HS; c += 4) d[h] += tiles[(DQ_Q + 16 * warp + g + 8 * h) * LD + c] * y[y_head + r * stride + c];
    d[h] = quad_sum(d[h]);
    if (t == 0 && r < n_ctx) delta[(long long)bh * n_ctx + r] = d[h];
    row_lse[h] = r < n_ctx ? lse[(long long)bh * n_ctx + r] : (T)0;
  }
#pragma unroll
  for (int u = 0; u < HS / 8; ++u)
    for (int e = 0; e < 4; ++e) dya[u][e] = operand<TF32>(dya[u][e]);
  T acc[HS / 8][4] = {};
  for (int j0 = 0; j0 < i0 + DQ_Q && j0 < n_ctx; j0 += DQ_K) {
    __syncthreads();  /* q and dy are in registers / the previous tile's reads are done */
    load_tile<DQ_K, DQ_THREADS, HS, TF32, true>(tiles, qkv + head + part, j0, n_ctx, row, bq + part);
    load_tile<DQ_K, DQ_THREADS, HS, TF32, true>(tiles + DQ_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
    __syncthreads();
    if (j0 > r0 + 15) continue;
    T s[DQ_K / 8][4], dp[DQ_K / 8][4];
    rows_product<DQ_K / 8, HS, TF32>(s, qa, ks);   /* S = q k^T */
    rows_product<DQ_K / 8, HS, TF32>(dp, dya, vs); /* dP = dy v^T */
#pragma unroll
    for (int n = 0; n < DQ_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, r = r0 + g + 8 * h;
        const bool seen = j0 + 8 * n + 2 * t + (e & 1) <= r && r < n_ctx;
        const T e_all = fa_exp(scale * s[n][e] - row_lse[h]), p = seen ? e_all : (T)0;  /* a select, no branch */
        dp[n][e] = p * (dp[n][e] - d[h]);  /* dS */
      }
    acc_product<DQ_K / 8, HS, TF32>(acc, dp, ks);  /* dq += dS k */
  }
  const T ones[2] = {1, 1};
  store_acc<HS>(dqkv + head, row, acc, r0, n_ctx, scale, ones);
  if (sum_bias) {  /* dq's column sums over the tile: its row of bias_sums, q's columns of head bh % n_head */
    __syncthreads();  /* every warp's last reads of the tiles are done: they hold the sums now */
    T *sums = tiles;
    warp_column_sums<HS>(sums + warp * HS, acc, r0, n_ctx, [scale](T a) { return a * scale; });
    __syncthreads();
    add_warp_sums<HS, DQ_THREADS / 32>(bias_sums + ((long long)(bh / n_head) * gridDim.x + i0 / DQ_Q) * row
                                       + bh % n_head * HS, part, sums, 1);
  }
}

// @kernel flash_attention_bwd_dkv
// dk and dv per key tile of DKV_K keys (16 per warp), over query tiles of DKV_Q rows from the diagonal down.
#include "flash.cuh"
#include "colsums.cuh"
constexpr int DKV_K = 64;
constexpr int DKV_Q = sizeof(T) == 4 ? 32 : 16;
constexpr int DKV_THREADS = 2 * DKV_K;
__shared__ __align__(16) T tiles[2 * DKV_K * LD];  /* k and v, then the q and dy tiles (namespace scope: see the forward) */
__shared__ T lse_s[DKV_Q], delta_s[DKV_Q];
template <int HS, int TF32>
__global__ void __launch_bounds__(DKV_THREADS, 2)
flash_attention_bwd_dkv(const T *qkv, const T *b, const T *dy, const T *lse, const T *delta, T *dqkv,
                        ACC *bias_sums, const int n_ctx, const int hs, const int n_head, const T scale,
                        const int sum_bias, const int tf32) {
  const T *qs = tiles, *dys = tiles + DKV_Q * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, j0 = blockIdx.x * DKV_K, c0 = j0 + 16 * warp;  /* this warp's keys c0 .. c0 + 15 */
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS, stride = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  load_tile<DKV_K, DKV_THREADS, HS, TF32, true>(tiles, qkv + head + part, j0, n_ctx, row, bq + part);
  load_tile<DKV_K, DKV_THREADS, HS, TF32, true>(tiles + DKV_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
  __syncthreads();
  T ka[HS / 8][4], va[HS / 8][4];
  a_frags<HS>(ka, tiles, 16 * warp);
  a_frags<HS>(va, tiles + DKV_K * LD, 16 * warp);
  T acc_k[HS / 8][4] = {}, acc_v[HS / 8][4] = {};
  for (int i0 = j0 - j0 % DKV_Q; i0 < n_ctx; i0 += DKV_Q) {  /* query tiles from the diagonal down */
    __syncthreads();  /* k and v are in registers / the previous tile's reads are done */
    load_tile<DKV_Q, DKV_THREADS, HS, TF32, true>(tiles, qkv + head, i0, n_ctx, row, bq);
    load_tile<DKV_Q, DKV_THREADS, HS, TF32>(tiles + DKV_Q * LD, dy + y_head, i0, n_ctx, stride);
    for (int r = threadIdx.x; r < DKV_Q; r += blockDim.x) {
      lse_s[r] = i0 + r < n_ctx ? lse[(long long)bh * n_ctx + i0 + r] : (T)0;
      delta_s[r] = i0 + r < n_ctx ? delta[(long long)bh * n_ctx + i0 + r] : (T)0;
    }
    __syncthreads();
    if (i0 + DKV_Q - 1 < c0) continue;  /* every query of the tile is before this warp's keys */
    T st[DKV_Q / 8][4], dpt[DKV_Q / 8][4];
    rows_product<DKV_Q / 8, HS, TF32>(st, ka, qs);    /* S^T = k q^T: rows keys, columns queries */
    rows_product<DKV_Q / 8, HS, TF32>(dpt, va, dys);  /* dP^T = v dy^T */
#pragma unroll
    for (int n = 0; n < DKV_Q / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * n + 2 * t + (e & 1), query = i0 + col;
        const bool seen = c0 + g + 8 * (e >> 1) <= query && query < n_ctx;
        const T e_all = fa_exp(scale * st[n][e] - lse_s[col]), p = seen ? e_all : (T)0;  /* a select, no branch */
        st[n][e] = p;                               /* P^T */
        dpt[n][e] = p * (dpt[n][e] - delta_s[col]); /* dS^T */
      }
    acc_product<DKV_Q / 8, HS, TF32>(acc_v, st, dys);  /* dv += P^T dy */
    acc_product<DKV_Q / 8, HS, TF32>(acc_k, dpt, qs);  /* dk += dS^T q */
  }
  const T ones[2] = {1, 1};
  store_acc<HS>(dqkv + head + part, row, acc_k, c0, n_ctx, scale, ones);
  store_acc<HS>(dqkv + head + 2 * part, row, acc_v, c0, n_ctx, (T)1, ones);
  if (sum_bias) {  /* dk's and dv's column sums over the tile: its row of bias_sums, k's and v's columns */
    __syncthreads();  /* every warp's last reads of the tiles are done: they hold the sums now */
    T *sums = tiles;
    warp_column_sums<HS>(sums + warp * HS, acc_k, c0, n_ctx, [scale](T a) { return a * scale; });
    warp_column_sums<HS>(sums + (DKV_THREADS / 32 + warp) * HS, acc_v, c0, n_ctx, [](T a) { return a; });
    __syncthreads();
    add_warp_sums<HS, DKV_THREADS / 32>(bias_sums + ((long long)(bh / n_head) * gridDim.x + blockIdx.x) * row
                                        + part + bh % n_head * HS, part, sums, 2);
  }
}

// @kernel flash_attention_fwd_bf16
// The forward in bfloat16: q, k, v, y stored as bfloat16, lse float; the products on mma.m16n8k16 bf16
// (kernels/flash16.cuh), the scores, running max and sum, P and the output accumulator float, P rounded to
// bfloat16 for P v (FlashAttention-2's mixed precision). Warps and masks as flash_attention_fwd's; key tiles
// of 32, not 64: with 64, the fragments ldmatrix loads ahead of P v push the forward past its 128 registers.
#include "bf16.cuh"
#include "flash16.cuh"
constexpr int FWD_Q = 128, FWD_K = 32, FWD_THREADS = 2 * FWD_Q;  /* keys 32 a tile: 64 spill (ptxas, sm_90) */
__shared__ __align__(16) T kv[FWD_Q * LD];  /* q passes through first; then the k tile, then the v tile */
template <int HS>
__global__ void __launch_bounds__(FWD_THREADS, 2)
flash_attention_fwd_bf16(const T *qkv, const T *b, T *y, ACC *lse, const int n_ctx, const int hs, const int n_head,
                         const ACC scale) {
  const T *ks = kv, *vs = kv + FWD_K * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * FWD_Q, r0 = i0 + 16 * warp;
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  unsigned qa[HS / 16][4];  /* this warp's rows of q, A operands */
  load_tile<FWD_Q, FWD_THREADS, HS, true>(kv, qkv + head, i0, n_ctx, row, bq);
  __syncthreads();
  a_frags<HS>(qa, kv, 16 * warp);
  float acc[HS / 8][4] = {};
  float top[2] = {lowest(), lowest()}, total[2] = {0.0f, 0.0f};  /* rows g, g + 8: running max, sum */
  for (int j0 = 0; j0 < i0 + FWD_Q && j0 < n_ctx; j0 += FWD_K) {
    __syncthreads();  /* the previous tile's reads are done */
    load_tile<FWD_K, FWD_THREADS, HS, true>(kv, qkv + head + part, j0, n_ctx, row, bq + part);
    load_tile<FWD_K, FWD_THREADS, HS, true>(kv + FWD_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
    __syncthreads();
    if (j0 > r0 + 15) continue;  /* every key of the tile is after this warp's rows */
    float s[FWD_K / 8][4];
    rows_product<FWD_K / 8, HS>(s, qa, ks);  /* q k^T */
    float m[2] = {top[0], top[1]}, sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < FWD_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const bool seen = j0 + 8 * n + 2 * t + (e & 1) <= r0 + g + 8 * (e >> 1);
        s[n][e] = seen ? scale * s[n][e] : lowest();
        m[e >> 1] = s[n][e] > m[e >> 1] ? s[n][e] : m[e >> 1];
      }
    for (int h = 0; h < 2; ++h) m[h] = quad_max(m[h]);
#pragma unroll
    for (int n = 0; n < FWD_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {  /* P, unnormalised; a masked score gives exp(lowest - m) = 0 */
        s[n][e] = expf(s[n][e] - m[e >> 1]);
        sum[e >> 1] += s[n][e];  /* the sum of P before its rounding, as FlashAttention-2's */
      }
    unsigned pa[FWD_K / 16][4];  /* P rounded to bfloat16, the A operands of P v */
    a_from_accs<FWD_K / 8>(pa, s);
    for (int h = 0; h < 2; ++h) {
      const float alpha = expf(top[h] - m[h]);  /* 0 on the first tile: top is the lowest value */
      total[h] = total[h] * alpha + quad_sum(sum[h]);
      top[h] = m[h];
#pragma unroll
      for (int u = 0; u < HS / 8; ++u) acc[u][2 * h] *= alpha, acc[u][2 * h + 1] *= alpha;
    }
    acc_product<FWD_K / 8, HS>(acc, pa, vs);  /* acc += bf16(P) v */
  }
  if (t == 0)
    for (int h = 0; h < 2; ++h)
      if (r0 + g + 8 * h < n_ctx) lse[(long long)bh * n_ctx + r0 + g + 8 * h] = top[h] + logf(total[h]);
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS;
  store_acc<HS>(y + y_head, (long long)n_head * HS, acc, r0, n_ctx, 1.0f, total);
}

// @kernel flash_attention_bwd_dq_bf16
// delta = rowsum(dy y) (float, from the bfloat16 dy and y) and dq (bfloat16) per query tile, as
// flash_attention_bwd_dq; P, dP and dS float, dS rounded to bfloat16 for dS k.
#include "bf16.cuh"
#include "flash16.cuh"
#include "colsums.cuh"
constexpr int DQ_Q = 64, DQ_K = 32, DQ_THREADS = 2 * DQ_Q;
__shared__ __align__(16) T tiles[2 * DQ_Q * LD];  /* q and dy, then the k and v tiles */
template <int HS>
__global__ void __launch_bounds__(DQ_THREADS, 4)
flash_attention_bwd_dq_bf16(const T *qkv, const T *b, const T *y, const T *dy, const ACC *lse, ACC *delta, T *dqkv,
                            ACC *bias_sums, const int n_ctx, const int hs, const int n_head, const ACC scale,
                            const int sum_bias) {
  const T *ks = tiles, *vs = tiles + DQ_K * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * DQ_Q, r0 = i0 + 16 * warp;
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS, stride = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  load_tile<DQ_Q, DQ_THREADS, HS, true>(tiles, qkv + head, i0, n_ctx, row, bq);
  load_tile<DQ_Q, DQ_THREADS, HS>(tiles + DQ_Q * LD, dy + y_head, i0, n_ctx, stride);
  __syncthreads();
  unsigned qa[HS / 16][4], dya[HS / 16][4];
  float d[2] = {0.0f, 0.0f}, row_lse[2];
  a_frags<HS>(qa, tiles, 16 * warp);
  a_frags<HS>(dya, tiles + DQ_Q * LD, 16 * warp);
  for (int h = 0; h < 2; ++h) {  /* delta = rowsum(dy y), lanes t, t + 4, ... of the row */
    const int r = r0 + g + 8 * h;
    if (r < n_ctx)
      for (int c = t; c < HS; c += 4) d[h] += widen(tiles[(DQ_Q + 16 * warp + g + 8 * h) * LD + c]) * widen(y[y_head + r * stride + c]);
    d[h] = quad_sum(d[h]);
    if (t == 0 && r < n_ctx) delta[(long long)bh * n_ctx + r] = d[h];
    row_lse[h] = r < n_ctx ? lse[(long long)bh * n_ctx + r] : 0.0f;
  }
  float acc[HS / 8][4] = {};
  for (int j0 = 0; j0 < i0 + DQ_Q && j0 < n_ctx; j0 += DQ_K) {
    __syncthreads();  /* q and dy are in registers / the previous tile's reads are done */
    load_tile<DQ_K, DQ_THREADS, HS, true>(tiles, qkv + head + part, j0, n_ctx, row, bq + part);
    load_tile<DQ_K, DQ_THREADS, HS, true>(tiles + DQ_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
    __syncthreads();
    if (j0 > r0 + 15) continue;
    float s[DQ_K / 8][4], dp[DQ_K / 8][4];
    rows_product<DQ_K / 8, HS>(s, qa, ks);   /* S = q k^T */
    rows_product<DQ_K / 8, HS>(dp, dya, vs); /* dP = dy v^T */
#pragma unroll
    for (int n = 0; n < DQ_K / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, r = r0 + g + 8 * h;
        const bool seen = j0 + 8 * n + 2 * t + (e & 1) <= r && r < n_ctx;
        const float e_all = expf(scale * s[n][e] - row_lse[h]), p = seen ? e_all : 0.0f;  /* a select, no branch */
        dp[n][e] = p * (dp[n][e] - d[h]);  /* dS */
      }
    unsigned dsa[DQ_K / 16][4];
    a_from_accs<DQ_K / 8>(dsa, dp);
    acc_product<DQ_K / 8, HS>(acc, dsa, ks);  /* dq += bf16(dS) k */
  }
  const float ones[2] = {1.0f, 1.0f};
  store_acc<HS>(dqkv + head, row, acc, r0, n_ctx, scale, ones);
  if (sum_bias) {  /* dq's column sums as stored (bfloat16, widened), as flash_attention_bwd_dq's */
    __syncthreads();
    ACC *sums = (ACC *)tiles;
    warp_column_sums<HS>(sums + warp * HS, acc, r0, n_ctx, [scale](float a) { return widen(narrow_bf16(a * scale)); });
    __syncthreads();
    add_warp_sums<HS, DQ_THREADS / 32>(bias_sums + ((long long)(bh / n_head) * gridDim.x + i0 / DQ_Q) * row
                                       + bh % n_head * HS, part, sums, 1);
  }
}

// @kernel flash_attention_bwd_dkv_bf16
// dk and dv (bfloat16) per key tile, as flash_attention_bwd_dkv; P^T and dS^T float, rounded to bfloat16
// for P^T dy and dS^T q.
#include "bf16.cuh"
#include "flash16.cuh"
#include "colsums.cuh"
constexpr int DKV_K = 64, DKV_Q = 32, DKV_THREADS = 2 * DKV_K;
__shared__ __align__(16) T tiles[2 * DKV_K * LD];  /* k and v, then the q and dy tiles */
__shared__ float lse_s[DKV_Q], delta_s[DKV_Q];
template <int HS>
__global__ void __launch_bounds__(DKV_THREADS, 3)
flash_attention_bwd_dkv_bf16(const T *qkv, const T *b, const T *dy, const ACC *lse, const ACC *delta, T *dqkv,
                             ACC *bias_sums, const int n_ctx, const int hs, const int n_head, const ACC scale,
                             const int sum_bias) {
  const T *qs = tiles, *dys = tiles + DKV_Q * LD;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int bh = blockIdx.y, j0 = blockIdx.x * DKV_K, c0 = j0 + 16 * warp;  /* this warp's keys c0 .. c0 + 15 */
  const long long head = qkv_head<HS>(bh, n_ctx, n_head), row = 3LL * n_head * HS, part = (long long)n_head * HS;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * HS, stride = (long long)n_head * HS;
  const T *bq = b + bh % n_head * HS;
  load_tile<DKV_K, DKV_THREADS, HS, true>(tiles, qkv + head + part, j0, n_ctx, row, bq + part);
  load_tile<DKV_K, DKV_THREADS, HS, true>(tiles + DKV_K * LD, qkv + head + 2 * part, j0, n_ctx, row, bq + 2 * part);
  __syncthreads();
  unsigned ka[HS / 16][4], va[HS / 16][4];
  a_frags<HS>(ka, tiles, 16 * warp);
  a_frags<HS>(va, tiles + DKV_K * LD, 16 * warp);
  float acc_k[HS / 8][4] = {}, acc_v[HS / 8][4] = {};
  for (int i0 = j0 - j0 % DKV_Q; i0 < n_ctx; i0 += DKV_Q) {  /* query tiles from the diagonal down */
    __syncthreads();  /* k and v are in registers / the previous tile's reads are done */
    load_tile<DKV_Q, DKV_THREADS, HS, true>(tiles, qkv + head, i0, n_ctx, row, bq);
    load_tile<DKV_Q, DKV_THREADS, HS>(tiles + DKV_Q * LD, dy + y_head, i0, n_ctx, stride);
    for (int r = threadIdx.x; r < DKV_Q; r += blockDim.x) {
      lse_s[r] = i0 + r < n_ctx ? lse[(long long)bh * n_ctx + i0 + r] : 0.0f;
      delta_s[r] = i0 + r < n_ctx ? delta[(long long)bh * n_ctx + i0 + r] : 0.0f;
    }
    __syncthreads();
    if (i0 + DKV_Q - 1 < c0) continue;  /* every query of the tile is before this warp's keys */
    /* dv's product before dP^T's: P^T's bfloat16 copy is dead before dP^T is live (168 registers, 3 blocks
       an SM, no spill) */
    float st[DKV_Q / 8][4], dpt[DKV_Q / 8][4];
    rows_product<DKV_Q / 8, HS>(st, ka, qs);    /* S^T = k q^T: rows keys, columns queries */
#pragma unroll
    for (int n = 0; n < DKV_Q / 8; ++n)
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * n + 2 * t + (e & 1), query = i0 + col;
        const bool seen = c0 + g + 8 * (e >> 1) <= query && query < n_ctx;
        const float e_all = expf(scale * st[n][e] - lse_s[col]);
        st[n][e] = seen ? e_all : 0.0f;             /* P^T, a select, no branch */
      }
    unsigned pa[DKV_Q / 16][4], dsa[DKV_Q / 16][4];
    a_from_accs<DKV_Q / 8>(pa, st);
    acc_product<DKV_Q / 8, HS>(acc_v, pa, dys);  /* dv += bf16(P^T) dy */
    rows_product<DKV_Q / 8, HS>(dpt, va, dys);  /* dP^T = v dy^T */
#pragma unroll
    for (int n = 0; n < DKV_Q / 8; ++n)
      for (int e = 0; e < 4; ++e)
        dpt[n][e] = st[n][e] * (dpt[n][e] - delta_s[8 * n + 2 * t + (e & 1)]); /* dS^T */
    a_from_accs<DKV_Q / 8>(dsa, dpt);
    acc_product<DKV_Q / 8, HS>(acc_k, dsa, qs);  /* dk += bf16(dS^T) q */
  }
  const float ones[2] = {1.0f, 1.0f};
  store_acc<HS>(dqkv + head + part, row, acc_k, c0, n_ctx, scale, ones);
  store_acc<HS>(dqkv + head + 2 * part, row, acc_v, c0, n_ctx, 1.0f, ones);
  if (sum_bias) {  /* dk's and dv's column sums as stored, as flash_attention_bwd_dkv's */
    __syncthreads();
    ACC *sums = (ACC *)tiles;
    warp_column_sums<HS>(sums + warp * HS, acc_k, c0, n_ctx, [scale](float a) { return widen(narrow_bf16(a * scale)); });
    warp_column_sums<HS>(sums + (DKV_THREADS / 32 + warp) * HS, acc_v, c0, n_ctx,
                         [](float a) { return widen(narrow_bf16(a)); });
    __syncthreads();
    add_warp_sums<HS, DKV_THREADS / 32>(bias_sums + ((long long)(bh / n_head) * gridDim.x + blockIdx.x) * row
                                        + part + bh % n_head * HS, part, sums, 2);
  }
}
