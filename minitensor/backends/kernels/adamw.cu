// AdamW over the whole flat buffer, one elementwise pass (fused piece adamw).

// @kernel adamw_step
// adamw_update's form: m_hat / (sqrt(v_hat) + eps) = (m sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)),
// so the bias corrections are two host scalars (step_size, eps_hat). grad_scale is a one-element
// device array (the clipping scale, computed on the device: reading it would stall the step).
// Each output is computed from the inputs before any is written, so p, m, v may be passed as
// their own outputs (in place).
const T gs = g * grad_scale[0];
const T m1 = beta1 * m_in + ((T)1 - beta1) * gs;
const T v1 = beta2 * v_in + ((T)1 - beta2) * gs * gs;
const T p1 = p_in * ((T)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));
m = m1;
v = v1;
p = p1;

// @kernel adamw_step_copy
// adamw_step's lines, unchanged (tests/gpu/test_adamw_bf16.py holds them equal), and in the same pass the
// bfloat16 copy of the updated weights that the bf16 policy's forward reads: copy = p rounded to nearest,
// ties to even (bf16.cuh's narrow_bf16: ml_dtypes' bits), its 16 bits written through a uint16 view of the
// bfloat16 buffer (CuPy types a bfloat16 array as its own class, whose assignment from 16 bits would
// convert their number).
#include "bf16.cuh"
const T gs = g * grad_scale[0];
const T m1 = beta1 * m_in + ((T)1 - beta1) * gs;
const T v1 = beta2 * v_in + ((T)1 - beta2) * gs * gs;
const T p1 = p_in * ((T)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));
m = m1;
v = v1;
p = p1;
copy = narrow_bf16(p1);
