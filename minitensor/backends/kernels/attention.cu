// Causal attention that never stores T x T: FlashAttention-2's algorithm (Dao 2023, "FlashAttention-2:
// Faster Attention with Better Parallelism and Work Partitioning", arXiv:2307.08691; the online softmax of
// Milakov & Gimelshein 2018, arXiv:1805.02867), written here for minitensor's CupyOps.
//
// q, k, v, dq, dk, dv: (BH, T, hs), contiguous, q unscaled (scores are scale * q k^T). y and dy: rows
// of (B, T, n_head, hs), head h = bh % n_head of sequence bh / n_head (the heads of a (B, T, C) output
// read in place; n_head = 1 is the plain (BH, T, hs) layout). lse and delta: (BH, T).
//
// Key tiles of ROWS keys (32 for float, 16 for double), query tiles of FWD_ROWS rows in the forward
// (64, 16: twice the rows per key tile loaded for float) and ROWS in the backward (whose six tiles fill
// the 48 KiB of static shared memory); hs <= HS_MAX, hs a multiple of 16; a block of 4 threads per
// query row of its tile (8, 4 or 2 warps) per (tile, bh), blockIdx.x the tile. Every product is a
// sum of 16 x 8 tiles of 8-deep steps in the warp-level layout of PTX's mma.m16n8k8 (PTX ISA, "Matrix
// Fragments for mma.m16n8k8"): lane = 4 g + t holds the accumulator elements (g, 2t), (g, 2t + 1),
// (g + 8, 2t), (g + 8, 2t + 1). For float with tf32 set the step is `mma.sync ... tf32` on tensor cores
// (operands rounded to TF32 by cvt.rna, sums in float); for double, and float without tf32, the same
// lane computes the same four elements with FMAs. Warp w owns the rows 16 (w % bands) .. + 16 of a
// tile and half of its columns; every warp runs the same number of steps (hs a multiple of 16), so
// each mma is issued by all warps alike (the emulation's mma is a block-wide exchange).
// Scores and probabilities go through shared memory; per row, 4 threads (lanes 4r .. 4r + 3 of the
// softmax's numbering) share its work by shuffles.
//
// forward   y = softmax(scale q k^T + causal mask) v, lse = the rows' log-sum-exp: per query tile, key
//           tiles 0 .. the diagonal (the masked ones never visited), running max and sum, the output
//           accumulator rescaled in registers.
// backward  deterministic, no atomics: flash_attention_bwd_dq (per query tile: delta = rowsum(dy y),
//           written for the next kernel, and dq = scale dS k over key tiles up to the diagonal) then
//           flash_attention_bwd_dkv (per key tile: dv = P^T dy and dk = scale dS^T q over query tiles from
//           the diagonal down), P = exp(scale q k^T - lse) recomputed, dS = P (dP - delta), dP = dy v^T.

// @kernel flash_attention_fwd
// y and lse per query tile of FWD_ROWS rows, over key tiles up to the diagonal.
#include "flash.cuh"
extern "C" __global__ void flash_attention_fwd(const T *q, const T *k, const T *v, T *y, T *lse, const int n_ctx,
                                               const int hs, const int n_head, const T scale, const int tf32) {
  __shared__ T qs[FWD_ROWS * HS_MAX], ks[ROWS * HS_MAX], vs[ROWS * HS_MAX], ss[FWD_ROWS * ROWS];
  __shared__ T row_alpha[FWD_ROWS], row_inv[FWD_ROWS];
  const int bh = blockIdx.y, i0 = blockIdx.x * FWD_ROWS;
  const long long head = (long long)bh * n_ctx * hs;
  const int row = threadIdx.x >> 2, sub = threadIdx.x & 3, qi = i0 + row;
  const int warp = threadIdx.x >> 5, band = warp % (FWD_ROWS / 16), g = (threadIdx.x & 31) >> 2;
  T acc[ACC][4];
  for (int u = 0; u < ACC; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0;
  T top = fa_lowest(scale), total = 0;  /* the row's running max and sum (its 4 threads alike) */
  load_tile(qs, q + head, i0, FWD_ROWS, n_ctx, hs, hs);
  for (int j0 = 0; j0 < i0 + FWD_ROWS && j0 < n_ctx; j0 += ROWS) {  /* key tiles up to the diagonal */
    __syncthreads();  /* the previous tile's reads are done */
    load_tile(ks, k + head, j0, ROWS, n_ctx, hs, hs);
    load_tile(vs, v + head, j0, ROWS, n_ctx, hs, hs);
    __syncthreads();
    scores<FWD_ROWS>(ss, qs, ks, hs, tf32);
    __syncthreads();
    T m = top;
    for (int c = sub; c < ROWS; c += 4)
      if (j0 + c <= qi) m = m > scale * ss[row * ROWS + c] ? m : scale * ss[row * ROWS + c];
    m = quad_max(m);
    T sum = 0;
    for (int c = sub; c < ROWS; c += 4) {
      const T p = j0 + c <= qi ? fa_exp(scale * ss[row * ROWS + c] - m) : (T)0;
      ss[row * ROWS + c] = p;
      sum += p;
    }
    const T alpha = fa_exp(top - m);  /* 0 on the first tile: top is the lowest value */
    total = total * alpha + quad_sum(sum);
    top = m;
    if (sub == 0) row_alpha[row] = alpha;
    __syncthreads();
    const T a0 = row_alpha[band * 16 + g], a1 = row_alpha[band * 16 + g + 8];
    for (int u = 0; u < ACC; ++u) {
      acc[u][0] *= a0;
      acc[u][1] *= a0;
      acc[u][2] *= a1;
      acc[u][3] *= a1;
    }
    accumulate<FWD_ROWS>(acc, ss, ROWS, 1, vs, hs, tf32);  /* acc += P v */
  }
  if (sub == 0) {
    row_inv[row] = (T)1 / total;
    if (qi < n_ctx) lse[(long long)bh * n_ctx + qi] = top + fa_log(total);
  }
  __syncthreads();
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * hs;
  store_acc<FWD_ROWS>(y + y_head, (long long)n_head * hs, acc, i0, n_ctx, hs, (T)1, row_inv);
}

// @kernel flash_attention_bwd_dq
// delta = rowsum(dy y) and dq per query tile of ROWS rows (before flash_attention_bwd_dkv).
#include "flash.cuh"
extern "C" __global__ void flash_attention_bwd_dq(const T *q, const T *k, const T *v, const T *y, const T *dy,
                                                  const T *lse, T *delta, T *dq, const int n_ctx, const int hs,
                                                  const int n_head, const T scale, const int tf32) {
  __shared__ T qs[ROWS * HS_MAX], dys[ROWS * HS_MAX], ks[ROWS * HS_MAX], vs[ROWS * HS_MAX];
  __shared__ T ss[ROWS * ROWS], ps[ROWS * ROWS], lse_s[ROWS], delta_s[ROWS];
  const int bh = blockIdx.y, i0 = blockIdx.x * ROWS;
  const long long head = (long long)bh * n_ctx * hs;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * hs, stride = (long long)n_head * hs;
  const int row = threadIdx.x >> 2, sub = threadIdx.x & 3;
  load_tile(qs, q + head, i0, ROWS, n_ctx, hs, hs);
  load_tile(dys, dy + y_head, i0, ROWS, n_ctx, hs, stride);
  __syncthreads();
  T d = 0;  /* delta = rowsum(dy y) = rowsum(dP P) */
  for (int c = sub; c < hs; c += 4)
    if (i0 + row < n_ctx) d += dys[row * hs + c] * y[y_head + (i0 + row) * stride + c];
  d = quad_sum(d);
  if (sub == 0 && i0 + row < n_ctx) delta[(long long)bh * n_ctx + i0 + row] = d;
  if (sub == 0) delta_s[row] = d;
  for (int r = threadIdx.x; r < ROWS; r += blockDim.x) lse_s[r] = i0 + r < n_ctx ? lse[(long long)bh * n_ctx + i0 + r] : (T)0;
  T acc[ACC][4];
  for (int u = 0; u < ACC; ++u) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0;
  for (int j0 = 0; j0 <= i0; j0 += ROWS) {
    __syncthreads();
    load_tile(ks, k + head, j0, ROWS, n_ctx, hs, hs);
    load_tile(vs, v + head, j0, ROWS, n_ctx, hs, hs);
    __syncthreads();
    scores<ROWS>(ss, qs, ks, hs, tf32);   /* S */
    scores<ROWS>(ps, dys, vs, hs, tf32);  /* dP = dy v^T */
    __syncthreads();
    probs_and_grads(ss, ps, lse_s, delta_s, i0, j0, n_ctx, scale);
    __syncthreads();
    accumulate<ROWS>(acc, ps, ROWS, 1, ks, hs, tf32);  /* dq += dS k */
  }
  store_acc<ROWS>(dq + head, hs, acc, i0, n_ctx, hs, scale, nullptr);
}

// @kernel flash_attention_bwd_dkv
// dk and dv per key tile, over query tiles from the diagonal down.
#include "flash.cuh"
extern "C" __global__ void flash_attention_bwd_dkv(const T *q, const T *k, const T *v, const T *dy, const T *lse,
                                                   const T *delta, T *dk, T *dv, const int n_ctx, const int hs,
                                                   const int n_head, const T scale, const int tf32) {
  __shared__ T ks[ROWS * HS_MAX], vs[ROWS * HS_MAX], qs[ROWS * HS_MAX], dys[ROWS * HS_MAX];
  __shared__ T ss[ROWS * ROWS], ps[ROWS * ROWS], lse_s[ROWS], delta_s[ROWS];
  const int bh = blockIdx.y, j0 = blockIdx.x * ROWS;
  const long long head = (long long)bh * n_ctx * hs;
  const long long y_head = ((long long)(bh / n_head) * n_ctx * n_head + bh % n_head) * hs, stride = (long long)n_head * hs;
  load_tile(ks, k + head, j0, ROWS, n_ctx, hs, hs);
  load_tile(vs, v + head, j0, ROWS, n_ctx, hs, hs);
  T acc_k[ACC][4], acc_v[ACC][4];
  for (int u = 0; u < ACC; ++u)
    for (int e = 0; e < 4; ++e) acc_k[u][e] = acc_v[u][e] = 0;
  for (int i0 = j0; i0 < n_ctx; i0 += ROWS) {  /* query tiles from the diagonal down */
    __syncthreads();
    load_tile(qs, q + head, i0, ROWS, n_ctx, hs, hs);
    load_tile(dys, dy + y_head, i0, ROWS, n_ctx, hs, stride);
    load_rows(lse_s, delta_s, lse + (long long)bh * n_ctx, delta + (long long)bh * n_ctx, i0, n_ctx);
    __syncthreads();
    scores<ROWS>(ss, qs, ks, hs, tf32);   /* S: rows are queries, columns keys */
    scores<ROWS>(ps, dys, vs, hs, tf32);  /* dP */
    __syncthreads();
    probs_and_grads(ss, ps, lse_s, delta_s, i0, j0, n_ctx, scale);
    __syncthreads();
    accumulate<ROWS>(acc_v, ss, 1, ROWS, dys, hs, tf32);  /* dv += P^T dy */
    accumulate<ROWS>(acc_k, ps, 1, ROWS, qs, hs, tf32);   /* dk += dS^T q */
  }
  store_acc<ROWS>(dk + head, hs, acc_k, j0, n_ctx, hs, scale, nullptr);
  store_acc<ROWS>(dv + head, hs, acc_v, j0, n_ctx, hs, (T)1, nullptr);
}
