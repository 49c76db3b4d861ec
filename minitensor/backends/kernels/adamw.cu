// AdamW over the whole flat buffer, one elementwise pass (fused piece adamw).

// @kernel adamw_step
// adamw_update's form: m_hat / (sqrt(v_hat) + eps) = (m sqrt(c2) / c1) / (sqrt(v) + eps sqrt(c2)),
// so the bias corrections are two host scalars (step_size, eps_hat). grad_scale is a one-element
// device array (the clipping scale, computed on the device: reading it would stall the step).
// p, m, v may be passed as their own outputs (in place): adamw.cuh reads every input first.
#include "adamw.cuh"
adamw_update(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale[0], step_size, eps_hat, decay, p, m, v)

// @kernel adamw_step_copy
// adamw_step, and in the same pass the bfloat16 copy of the updated weights that the bf16 policy's
// forward reads: copy = p rounded to nearest, ties to even (bf16.cuh's narrow_bf16, ml_dtypes' bits),
// its 16 bits written through a uint16 view of the bfloat16 buffer (CuPy would type a bfloat16 array as
// its own class, whose assignment from 16 bits converts their number).
#include "adamw.cuh"
#include "bf16.cuh"
adamw_update(p_in, m_in, v_in, g, mask, beta1, beta2, grad_scale[0], step_size, eps_hat, decay, p, m, v);
copy = narrow_bf16(p)
