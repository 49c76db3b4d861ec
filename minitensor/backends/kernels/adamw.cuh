// AdamW's update of one parameter, shared by the sections of adamw.cu (its form explained there).
// Each output is computed from the inputs before any is written, so p, m, v may be their own inputs.
template <class S>
__device__ __forceinline__ void adamw_update(const S &p_in, const S &m_in, const S &v_in, const S &g, const S &mask,
                                             const S beta1, const S beta2, const S scale, const S step_size,
                                             const S eps_hat, const S decay, S &p, S &m, S &v) {
  const S gs = g * scale;
  const S m1 = beta1 * m_in + ((S)1 - beta1) * gs;
  const S v1 = beta2 * v_in + ((S)1 - beta2) * gs * gs;
  const S p1 = p_in * ((S)1 - decay * mask) - step_size * (m1 / (sqrt(v1) + eps_hat));
  m = m1;
  v = v1;
  p = p1;
}
