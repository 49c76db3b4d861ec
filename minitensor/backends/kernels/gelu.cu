// GELU in the form of Ops.gelu_forward / gelu_backward (sigmoid(2u) = 0.5 (1 + tanh u)):
//   sig = 1 / (1 + exp(x (-2AC x^2 - 2C))),  y = x sig,  dx = dy sig (1 + (1 - sig) x (2AC3 x^2 + 2C))
// with AC = 0.044715 sqrt(2/pi), AC3 = 3 AC, C = sqrt(2/pi), written out as the literals
// -2AC = -0.07135481627260025, -2C = -1.5957691216057308, 2AC3 = 0.21406444881780073, 2C = 1.5957691216057308
// (tests/gpu/test_kernels.py checks them against minitensor.backends.ops' constants). exp = inf (x below
// about -10) gives y = -0 and dx = 0, as it should.
//
// ElementwiseKernel operations (their parameters: the specs in kernels/gelu.py).
// The bias kernels: y = GELU(x + b), b broadcast over the rows, x the matmul output (N, C). `i` is
// the flat C-order index over x's shape, so `i % C` is the column even for strided x; the 32-bit
// cast avoids a 64-bit modulo per element (the wrappers refuse 2**31 elements or more).

// @kernel gelu_fwd
y = x / ((T)1 + exp(x * (x * x * (T)-0.07135481627260025 + (T)-1.5957691216057308)));

// @kernel gelu_bwd
const T x2 = x * x;
const T sig = (T)1 / ((T)1 + exp(x * (x2 * (T)-0.07135481627260025 + (T)-1.5957691216057308)));
dx = (((T)1 - sig) * (x * (x2 * (T)0.21406444881780073 + (T)1.5957691216057308)) + (T)1) * sig * dy;

// @kernel bias_gelu_fwd
const T h = x + b[(unsigned int)i % (unsigned int)C];
y = h / ((T)1 + exp(h * (h * h * (T)-0.07135481627260025 + (T)-1.5957691216057308)));

// @kernel bias_gelu_bwd
const T h = x + b[(unsigned int)i % (unsigned int)C];
const T x2 = h * h;
const T sig = (T)1 / ((T)1 + exp(h * (x2 * (T)-0.07135481627260025 + (T)-1.5957691216057308)));
dh = (((T)1 - sig) * (h * (x2 * (T)0.21406444881780073 + (T)1.5957691216057308)) + (T)1) * sig * dy;

// @kernel bias_gelu_bwd_fwd
// The backward and the recomputed output in one pass (MLP.backward needs both): h read once,
// the exp shared. y = h / den is the forward's expression, dh the backward's (sig = 1 / den).
const T h = x + b[(unsigned int)i % (unsigned int)C];
const T h2 = h * h;
const T den = (T)1 + exp(h * (h2 * (T)-0.07135481627260025 + (T)-1.5957691216057308));
const T sig = (T)1 / den;
dh = (((T)1 - sig) * (h * (h2 * (T)0.21406444881780073 + (T)1.5957691216057308)) + (T)1) * sig * dy;
y = h / den;

// The same formulas as RawKernels over a stored type T and a summed type ACC (kernels/bf16.cuh), for
// bfloat16 arrays (CuPy's ElementwiseKernel has no bfloat16): h = widen(x) + widen(b) in ACC (float
// for bfloat16, exact for two bfloat16 values within 16 binary orders of each other), the GELU in
// ACC, each output rounded once (to_stored<T>), as Ops.bias_gelu_forward / _backward compute
// bfloat16 (Ops.summed, Ops.stored). One thread per element, n < 2**31 elements of rows of C.
// float32 and float64 keep the ElementwiseKernels above (these build for them too: the policy).

// @kernel bias_gelu_fwd16
#include "bf16.cuh"
extern "C" __global__ void bias_gelu_fwd16(const T *x, const T *b, T *y, const int C, const int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const ACC h = widen(x[i]) + widen(b[(unsigned int)i % (unsigned int)C]);
  y[i] = to_stored<T>(h / ((ACC)1 + exp(h * (h * h * (ACC)-0.07135481627260025 + (ACC)-1.5957691216057308))));
}

// @kernel bias_gelu_bwd16
#include "bf16.cuh"
// dh may be dy itself: each thread reads dy[i] before it writes dh[i].
extern "C" __global__ void bias_gelu_bwd16(const T *x, const T *b, const T *dy, T *dh, const int C, const int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const ACC h = widen(x[i]) + widen(b[(unsigned int)i % (unsigned int)C]);
  const ACC h2 = h * h;
  const ACC sig = (ACC)1 / ((ACC)1 + exp(h * (h2 * (ACC)-0.07135481627260025 + (ACC)-1.5957691216057308)));
  dh[i] = to_stored<T>((((ACC)1 - sig) * (h * (h2 * (ACC)0.21406444881780073 + (ACC)1.5957691216057308)) + (ACC)1)
                       * sig * widen(dy[i]));
}

// @kernel bias_gelu_bwd_fwd16
#include "bf16.cuh"
// The backward and the recomputed output in one pass, as bias_gelu_bwd_fwd: h read once, the exp shared;
// and with sum_db the column sums of dh, the bias's gradient, over the block's rows. x, dy, dh, y are
// (N, C) rows; thread x of block (bx, by) takes column j = bx blockDim.x + x down rows [by rpc,
// (by + 1) rpc) (rpc = rows_per_chunk) in order, a warp's 32 columns side by side in each row, and
// writes the sum of its dh as stored (what a GEMV over dh would read) to part[by][j];
// column_sums_add then adds the chunks' sums in order (no atomics: the same bits on every run).
extern "C" __global__ void bias_gelu_bwd_fwd16(const T *x, const T *b, const T *dy, T *dh, T *y, ACC *part,
                                               const int C, const int N, const int rows_per_chunk,
                                               const int sum_db) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= C) return;
  const ACC bj = widen(b[j]);
  const int first = blockIdx.y * rows_per_chunk;
  const int stop = first + rows_per_chunk < N ? first + rows_per_chunk : N;
  ACC s = 0;
  for (int row = first; row < stop; ++row) {
    const long long i = (long long)row * C + j;
    const ACC h = widen(x[i]) + bj;
    const ACC h2 = h * h;
    const ACC den = (ACC)1 + exp(h * (h2 * (ACC)-0.07135481627260025 + (ACC)-1.5957691216057308));
    const ACC sig = (ACC)1 / den;
    const T d = to_stored<T>((((ACC)1 - sig) * (h * (h2 * (ACC)0.21406444881780073 + (ACC)1.5957691216057308))
                              + (ACC)1) * sig * widen(dy[i]));
    dh[i] = d;
    s += widen(d);
    y[i] = to_stored<T>(h / den);
  }
  if (sum_db) part[(long long)blockIdx.y * C + j] = s;
}

// @kernel column_sums_add
// out += the sum of part's rows, over (chunks, C) partial column sums (bias_gelu_bwd_fwd16's), in a fixed
// order (rows.cuh's add_column_partials, as rmsnorm_bwd_params). All ACC (float32 under bf16: the gradient
// buffer's dtype).
#include "bf16.cuh"
#include "rows.cuh"
extern "C" __global__ void column_sums_add(const ACC *part, ACC *out, const int chunks, const int C) {
  __shared__ ACC acc[8][32];
  add_column_partials(part, out, chunks, C, acc, blockIdx.x);
}
