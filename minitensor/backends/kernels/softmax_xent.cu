// Softmax cross-entropy over (N, V) logits (fused piece softmax_xent).

// @kernel softmax_xent_fwd
// One block per row of V logits, of which the first n_valid are the vocabulary's (the rest: the tied
// head's padding, given probability 0). The probabilities overwrite the logits; z[target] is read
// by thread 0 before any write (the writes come after two barriers). A target outside [0, n_valid)
// makes the row's loss NaN rather than reading out of bounds: the check costs no host synchronisation.
// T is what the logits and probabilities are stored in, ACC what the max, the sum and the losses are
// carried in (float for bfloat16).
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void softmax_xent_fwd(T *z, const long long *targets, ACC *losses, const int V,
                                            const int n_valid) {
  __shared__ ACC buf[32];
  const long long row = blockIdx.x;
  T *zr = z + row * V;
  const long long t = targets[row];
  const bool valid = t >= 0 && t < n_valid;
  const ACC picked = threadIdx.x == 0 && valid ? widen(zr[t]) : (ACC)0;
  ACC top = lowest_of(picked);
  for (int j = threadIdx.x; j < n_valid; j += blockDim.x) top = widen(zr[j]) > top ? widen(zr[j]) : top;
  top = block_max(top, buf);
  ACC total = 0;
  for (int j = threadIdx.x; j < n_valid; j += blockDim.x) total += exp_of(widen(zr[j]) - top);
  total = block_sum(total, buf);
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    zr[j] = to_stored<T>(j < n_valid ? exp_of(widen(zr[j]) - top) / total : (ACC)0);
  if (threadIdx.x == 0) losses[row] = valid ? log_of(total) + top - picked : nan_of(top);
}

// @kernel softmax_xent_bwd
// An ElementwiseKernel operation: dz = (probs - onehot(target)) scale, row i / V, column i % V.
const unsigned int row = (unsigned int)i / (unsigned int)V;
const long long col = (long long)((unsigned int)i - row * (unsigned int)V);
dz = (probs - (col == targets[row] ? (T)1 : (T)0)) * scale;

// @kernel softmax_xent_bwd16
// softmax_xent_bwd for bfloat16 probabilities (CuPy's ElementwiseKernel has no bfloat16), in place: one
// thread per element of n < 2**31, dz = (probs - onehot(target)) scale summed in ACC (float) and rounded
// once, as Ops.softmax_xent_backward computes bfloat16 (Ops.summed, Ops.stored): the same two float
// operations, so the same bits.
#include "bf16.cuh"
extern "C" __global__ void softmax_xent_bwd16(T *p, const long long *targets, const int V, const ACC scale,
                                              const int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int row = i / V;
  const int col = i - row * V;
  p[i] = to_stored<T>((widen(p[i]) - (col == targets[row] ? (ACC)1 : (ACC)0)) * scale);
}
