// The Linear layer's epilogue (an ElementwiseKernel operation).

// @kernel bias_residual_add
// y = (y + b) + r, Ops.add_epilogue's two adds in one pass; y is its own output (in place).
y = (y_in + b[(unsigned int)i % (unsigned int)C]) + r;

// @kernel bias_residual_add16
#include "bf16.cuh"
// The epilogue as a RawKernel over a stored type T and a summed type ACC (kernels/bf16.cuh), for
// bfloat16 (CuPy's ElementwiseKernel has none): y = (y + b) + r summed in ACC (float for bfloat16),
// rounded once, as Ops.add_epilogue computes bfloat16; with_residual 0: y = y + b (r unread).
// One thread per element, n < 2**31 elements of rows of C; y in place.
extern "C" __global__ void bias_residual_add16(const T *b, const T *r, T *y, const int C, const int n,
                                               const int with_residual) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  ACC v = widen(y[i]) + widen(b[(unsigned int)i % (unsigned int)C]);
  if (with_residual) v += widen(r[i]);
  y[i] = to_stored<T>(v);
}
