/* -- norms, RoPE, SwiGLU --------------------------------------------------------------------------------- */

/* One row of RMSNorm as torch rounds it: out = bf16(w * bf16(s / sqrt(mean(s^2) + eps))). D % 16 == 0. */
static inline void rms_norm_row(const bf16 *s, const bf16 *w, bf16 *out, int64_t D, float eps) {
  vf sq = vf_zero();
  for (int64_t i = 0; i < D; i += 16) {
    const vf v = vf_load_bf16(s + i);
    sq = vf_fmadd(v, v, sq);
  }
  const vf inv = vf_set1(1.0f / sqrtf(vf_reduce_add(sq) / (float)D + eps));
  for (int64_t i = 0; i < D; i += 16) {
    const vf normed = vf_round_bf16(vf_mul(vf_load_bf16(s + i), inv));
    vf_store_bf16(out + i, vf_mul(vf_load_bf16(w + i), normed));
  }
}

/* RMSNorm over rows of length D (x rows at stride ldx); with a residual, s = bf16(x + residual) is
 * written to res_out and normalized. D % 16 == 0. */
void mili_rms_norm(const bf16 *x, int64_t ldx, const bf16 *residual, const bf16 *w, bf16 *out, bf16 *res_out,
                   int64_t T, int64_t D, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D >= 65536)
  for (int64_t t = 0; t < T; t++) {
    const bf16 *src = x + t * ldx;
    if (residual) {
      for (int64_t i = 0; i < D; i += 16)
        vf_store_bf16(res_out + t * D + i, vf_add(vf_load_bf16(src + i), vf_load_bf16(residual + t * D + i)));
      src = res_out + t * D;
    }
    rms_norm_row(src, w, out + t * D, D, eps);
  }
}

/* In place on the fused qkv output (rows of stride ld): per-head RMSNorm of the Hq query heads (weight
 * qw) and the Hkv key heads after them (weight kw), then rotate-half RoPE with float32 cos/sin [T, D].
 * D % 32 == 0, D <= 1024. */
void mili_qk_norm_rope(bf16 *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const bf16 *qw,
                       const bf16 *kw, float eps, const float *cos_t, const float *sin_t, int nthreads) {
  const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 16)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_t + t * D, *s = sin_t + t * D;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
      bf16 *head = qkv + t * ld + h * D, normed[1024];
      rms_norm_row(head, h < Hq ? qw : kw, normed, D, eps);
      for (int64_t i = 0; i < half; i += 16) {
        const vf lo = vf_load_bf16(normed + i), hi = vf_load_bf16(normed + half + i);
        vf_store_bf16(head + i, vf_fnmadd(hi, vf_load(s + i), vf_mul(lo, vf_load(c + i))));
        vf_store_bf16(head + half + i, vf_fmadd(lo, vf_load(s + half + i), vf_mul(hi, vf_load(c + half + i))));
      }
    }
  }
}

/* out[t, i] = bf16(silu(gate[t, i])) * up[t, i] (rounded as torch's bf16 ops), rows = [gate (I) | up (I)].
 * I % 16 == 0. */
void mili_silu_and_mul(const bf16 *gate_up, bf16 *out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 65536)
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < I; i += 16) {
      const vf g = vf_load_bf16(gate_up + t * 2 * I + i), u = vf_load_bf16(gate_up + t * 2 * I + I + i);
      const vf e = vf_exp(vf_sub(vf_zero(), g));
      const vf silu = vf_div(g, vf_add(vf_set1(1.0f), e));
      vf_store_bf16(out + t * I + i, vf_mul(vf_round_bf16(silu), u));
    }
}
