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
