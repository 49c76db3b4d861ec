// The embedding's backward: dW[id] += the rows at that id's positions, summed in position order.

// @kernel scatter_add_rows
// Block (k, j) handles position k of the sorted order and columns j*blockDim..: only the first
// position of each id's run works, adding that run's rows one after another (no atomics, so the
// same sums in the same order on every run). Blocks of the other positions return at once. dW is ACC:
// under bf16 the rows are bfloat16 and the weight gradient float32 (the master weights' dtype).
#include "bf16.cuh"
extern "C" __global__ void scatter_add_rows(ACC *dW, const T *rows, const long long *order,
                                            const long long *sorted_ids, const long long n, const int C) {
  const long long first = blockIdx.x;
  const long long c = (long long)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C || (first > 0 && sorted_ids[first - 1] == sorted_ids[first])) return;
  const long long id = sorted_ids[first];
  ACC acc = dW[id * C + c];
  for (long long k = first; k < n && sorted_ids[k] == id; ++k) acc += widen(rows[order[k] * C + c]);
  dW[id * C + c] = acc;
}
