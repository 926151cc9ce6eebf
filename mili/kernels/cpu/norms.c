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

/* RMSNorm of the T rows of length D (x's rows at stride ldx) into out, weight w [D]; with a residual,
 * s = bf16(x + residual) is written to res_out and normalized. D % 16 == 0. */
void mili_rms_norm(const mili_norm_rows *rows, const bf16 *w, float eps, int nthreads) {
  const bf16 *x = rows->x, *residual = rows->residual;
  bf16 *out = rows->out, *res_out = rows->res_out;
  const int64_t ldx = rows->ldx, T = rows->T, D = rows->D;
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

/* In place on the fused qkv output (heads->qkv, rows of stride ld): per-head RMSNorm of the Hq query heads (weight
 * q_norm [D]) and the Hkv key heads after them (weight k_norm [D]), then rotate-half RoPE with float32 cos/sin [T, D].
 * D % 32 == 0, D <= 1024. */
void mili_qk_norm_rope(const mili_qk_heads *heads, const bf16 *q_norm, const bf16 *k_norm, float eps, int nthreads) {
  bf16 *qkv = heads->qkv;
  const float *cos_t = heads->cos, *sin_t = heads->sin;
  const int64_t ld = heads->ld, T = heads->T, Hq = heads->q_heads, Hkv = heads->kv_heads, D = heads->head_dim;
  const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 16)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_t + t * D, *s = sin_t + t * D;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
      bf16 *head = qkv + t * ld + h * D, normed[1024];
      rms_norm_row(head, h < Hq ? q_norm : k_norm, normed, D, eps);
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
