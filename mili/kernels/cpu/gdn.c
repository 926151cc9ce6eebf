/* ---- Gated DeltaNet: one decode step of B sequences, in place on their state slots ----------------------
 * The hybrid models' linear-attention mixer after its projections (mili/kernels/gated_delta.py is the torch
 * reference, with HF's numerics). For each sequence b (slot slots[b]; a fresh one starts from zeros):
 *  1. the depthwise causal conv over the C = 2 Hk Dk + Hv Dv channels q|k|v: the slot's last K - 1 inputs
 *     and this one, SiLU; the conv state shifts by one;
 *  2. per value head h (key head h / (Hv / Hk)): q, k L2-normalised (q scaled by 1/sqrt(Dk)),
 *     g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), then on the float32 state S [Dk, Dv]:
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
 * Two passes over S: one reads it (S^T k), one updates it and forms S^T q, where torch's ops take ~8.
 * (L: the layer, Hk = k_heads, Hv = v_heads, Dk = k_dim, Dv = v_dim, K = conv_width; step: the B sequences.)
 * qkv [B, ldq] and ba [B, ldba] (b | a, Hv each) and the conv states are bf16 when bf16_io, else float32;
 * in bf16 the conv output, its SiLU and beta are rounded as torch's bf16 ops round them. Dv % 16 == 0. */
static inline float io_load(const void *p, int64_t i, int bf16_io) {
  return bf16_io ? bf16_to_float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

void mili_gdn_decode(const mili_gdn_layer *L, const mili_gdn_step *step, float *out, int nthreads) {
  const void *qkv = step->qkv, *ba = step->ba;
  const int64_t ldq = step->ldq, ldba = step->ldba, B = step->B;
  const int64_t *slots = step->slots;
  const uint8_t *fresh = step->fresh;
  const float *conv_w = L->conv_w, *A_log = L->A_log, *dt_bias = L->dt_bias;
  void *conv_states = L->conv_states;
  float *ssm_states = L->ssm_states;
  const int64_t Hk = L->k_heads, Hv = L->v_heads, Dk = L->k_dim, Dv = L->v_dim, K = L->conv_width;
  const int bf16_io = (int)L->bf16_io;
  const int64_t C = 2 * Hk * Dk + Hv * Dv, W = K - 1, rep = Hv / Hk;
  float *xs = malloc(sizeof(float) * B * C); /* the conv's output, float32 */
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * C >= 4096)
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = 0; c < C; c++) {
      const int zero = fresh && fresh[b];
      const int64_t at = (slots[b] * C + c) * W;
      const float x = io_load(qkv, b * ldq + c, bf16_io), *w = conv_w + c * K;
      float y = w[W] * x;
      for (int64_t j = 0; j < W; j++) {
        const float s = zero ? 0.0f : io_load(conv_states, at + j, bf16_io);
        y += w[j] * s;
        if (j > 0) { /* shift: the state keeps the last W inputs */
          if (bf16_io) ((bf16 *)conv_states)[at + j - 1] = zero ? 0 : ((bf16 *)conv_states)[at + j];
          else ((float *)conv_states)[at + j - 1] = s;
        }
      }
      if (W > 0) {
        if (bf16_io) ((bf16 *)conv_states)[at + W - 1] = ((const bf16 *)qkv)[b * ldq + c];
        else ((float *)conv_states)[at + W - 1] = x;
      }
      if (bf16_io) y = round_to_bf16(y);
      y = y / (1.0f + expf(-y));
      xs[b * C + c] = bf16_io ? round_to_bf16(y) : y;
    }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * Hv > 1)
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hv; h++) {
      const int64_t kh = h / rep;
      const float *q = xs + b * C + kh * Dk, *k = xs + b * C + Hk * Dk + kh * Dk, *v = xs + b * C + 2 * Hk * Dk + h * Dv;
      float qn[1024], kn[1024], qq = 0.0f, kk = 0.0f;
      for (int64_t i = 0; i < Dk; i++) qq += q[i] * q[i], kk += k[i] * k[i];
      const float qs = 1.0f / sqrtf(qq + 1e-6f) / sqrtf((float)Dk), ks = 1.0f / sqrtf(kk + 1e-6f);
      for (int64_t i = 0; i < Dk; i++) qn[i] = q[i] * qs, kn[i] = k[i] * ks;
      const float a = io_load(ba, b * ldba + Hv + h, bf16_io) + dt_bias[h];
      const float softplus = a > 20.0f ? a : log1pf(expf(a));
      const float decay = expf(-expf(A_log[h]) * softplus);
      float beta = 1.0f / (1.0f + expf(-io_load(ba, b * ldba + h, bf16_io)));
      if (bf16_io) beta = round_to_bf16(beta);
      float *S = ssm_states + (slots[b] * Hv + h) * Dk * Dv, *o = out + (b * Hv + h) * Dv;
      if (fresh && fresh[b]) memset(S, 0, sizeof(float) * Dk * Dv);
      for (int64_t j = 0; j < Dv; j += 16) { /* 16 value columns at a time, both passes */
        vf mem = vf_zero(), acc = vf_zero();
        for (int64_t i = 0; i < Dk; i++) mem = vf_fmadd(vf_load(S + i * Dv + j), vf_set1(kn[i]), mem);
        const vf dec = vf_set1(decay);
        const vf delta = vf_mul(vf_sub(vf_load(v + j), vf_mul(mem, dec)), vf_set1(beta));
        for (int64_t i = 0; i < Dk; i++) {
          const vf s = vf_fmadd(vf_set1(kn[i]), delta, vf_mul(vf_load(S + i * Dv + j), dec));
          vf_store(S + i * Dv + j, s);
          acc = vf_fmadd(s, vf_set1(qn[i]), acc);
        }
        vf_store(o + j, acc);
      }
    }
  free(xs);
}
