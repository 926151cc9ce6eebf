/* -- int8 pages (--kv-cache-dtype int8) ---------------------------------------------------------------------
 * A layer's K (and V) pages as int8 values [pages, Hkv, page_size, D] (head-major, as the bf16 pages) beside
 * float32 scales [pages, Hkv, page_size]: one symmetric scale per (token, kv head) row, amax / 127, its values
 * round(x / scale) (x times 1 / scale, nearest even) in -127..127; a row of zeros has scale 0. A row is quantized
 * once, when stored: nothing is requantized as a page fills. A row of D values is D + 4 bytes (132 at D = 128, 0.52
 * of bf16's), so a decode step streams about half the bytes. Row r = (page x Hkv + head) x page_size + offset holds
 * its values at r x D and its scale at r. The decode kernel reads the rows as they are (q . k in int32 against int16
 * queries, V widened to float32 a tile of rows at a time); a prefill chunk's context is gathered dequantized to bf16
 * (gather_kv_int8) for the prefill kernel. */

static inline int64_t kv_row(int64_t slot, int64_t h, int64_t Hkv, int64_t page_size) {
  return (slot / page_size * Hkv + h) * page_size + slot % page_size;
}

/* x [D] bf16 -> q [D] int8 and its scale (any D). */
static inline void quantize_kv_row(const bf16 *x, int64_t D, int8_t *q, float *scale) {
  vf amax = vf_zero();
  for (int64_t d = 0; d < D; d += 16) amax = vf_max(amax, vf_abs(vf_load_bf16_n(x + d, D - d)));
  const float a = vf_reduce_max(amax), s = a / 127.f;
  const vf inv = vf_set1(a > 0.f ? 1.f / s : 0.f);
  for (int64_t d = 0; d < D; d += 16) {
    const vi r = vf_to_vi(vf_mul(vf_load_bf16_n(x + d, D - d), inv));
    if (D - d >= 16) {
      vi_store_i8(q + d, r);
    } else {
      int8_t t[16];
      vi_store_i8(t, r);
      memcpy(q + d, t, D - d);
    }
  }
  *scale = s;
}

/* out [D] = bf16(q x scale) (any D). */
static inline void dequantize_kv_row(const int8_t *q, float scale, int64_t D, bf16 *out) {
  const vf s = vf_set1(scale);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) vf_store_bf16(out + d, vf_mul(vi_to_vf(vi_load_i8(q + d)), s));
  for (; d < D; d++) {
    const float f = round_to_bf16((float)q[d] * scale);
    uint32_t bits;
    memcpy(&bits, &f, 4);
    out[d] = (bf16)(bits >> 16);
  }
}

/* k, v [T, Hkv, D] (token strides ldk, ldv; bf16) quantized into the int8 pages at flat slots (page x page_size +
 * offset); slot < 0 is skipped (padding). */
static void store_kv_int8(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, int8_t *k_cache, float *k_scales,
                        int8_t *v_cache, float *v_scales, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D,
                        int64_t page_size, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (T * Hkv >= 64)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < Hkv; h++) {
      if (slots[t] < 0) continue;
      const int64_t r = kv_row(slots[t], h, Hkv, page_size);
      quantize_kv_row(k + t * ldk + h * D, D, k_cache + r * D, k_scales + r);
      quantize_kv_row(v + t * ldv + h * D, D, v_cache + r * D, v_scales + r);
    }
}

/* out [B, n, Hkv, D] bf16: the first n tokens of each of B sequences' int8 pages (page_table [B, ldp]),
 * dequantized (a prefill chunk's context, and the torch fallback's). Any D. */
static void gather_kv_int8(const int8_t *cache, const float *scales, const int64_t *page_table, int64_t ldp, int64_t B,
                         int64_t n, int64_t Hkv, int64_t D, int64_t page_size, bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * n * Hkv >= 256)
  for (int64_t b = 0; b < B; b++)
    for (int64_t p = 0; p < n; p++) {
      const int64_t page = page_table[b * ldp + p / page_size];
      for (int64_t h = 0; h < Hkv; h++) {
        const int64_t r = (page * Hkv + h) * page_size + p % page_size;
        dequantize_kv_row(cache + r * D, scales[r], D, out + ((b * n + p) * Hkv + h) * D);
      }
    }
}

/* A query head (bf16 [D]) as int16 with one scale, returned: amax / 32767, q16 = q / scale (times its reciprocal)
 * rounded to nearest even. Its error, at most half a step (amax / 65534), is below bf16's own rounding of q. */
static float quantize_q16(const bf16 *q, int64_t D, int16_t *q16) {
  vf amax = vf_zero();
  for (int64_t d = 0; d < D; d += 16) amax = vf_max(amax, vf_abs(vf_load_bf16(q + d)));
  const float a = vf_reduce_max(amax), scale = a / 32767.0f, inv = a > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t d = 0; d < D; d++) q16[d] = (int16_t)nearbyintf(bf16_to_float(q[d]) * inv);
  return scale;
}

#ifndef ISA_HAS_HSUM16
/* lane r of the result = the sum of acc[r]'s lanes (16 rows' dot products at once; the ISA layers that have
 * a transposing tree define their own) */
static inline vi vi_hsum16(const vi *acc) {
  int32_t t[16];
  for (int r = 0; r < 16; r++) t[r] = vi_reduce_add(acc[r]);
  return vi_load(t);
}
#endif

/* s[i] = q16 . (row i's int8 values), exactly in int32 (|dot| <= 127 x 32767 x D: D <= 512 stays within int32), for
 * the n <= 16 consecutive rows at k (row i at k + i D), as one vector (lane i: row i; lanes past n are 0). The 16
 * rows' sums stay in registers and are reduced together (vi_hsum16: a transposing tree, not one horizontal sum a
 * row). D % 32 == 0. */
static inline __attribute__((always_inline)) vi qk_int8_block(const int16_t *q16, int64_t D, const int8_t *k,
                                                              int64_t n) {
  vi acc[16];
  for (int i = 0; i < 16; i++) acc[i] = vi_zero();
  for (int64_t i = 0; i < n; i++)
    for (int64_t d = 0; d < D; d += 32) acc[i] = dot_i8_i16x32(acc[i], k + i * D + d, q16 + d);
  return vi_hsum16(acc);
}

#ifndef ISA_HAS_PV_I16
/* acc[g] [D] += sum_i w[g][i] V[i] for G heads (w[g] at w + 16 g), the n <= 16 consecutive rows at v (row i at
 * v + i D) widened to float32 in registers, 64 values at a time (each row's bytes widened once for the G heads, the
 * G x 4 sums held). D % 32 == 0. */
static inline __attribute__((always_inline)) void pv_int8_block(const int8_t *v, int64_t n, int64_t D, const float *w,
                                                                const int G, float *acc) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    vf a[4][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) a[g][c] = vf_load(acc + g * D + d + 16 * c);
    for (int64_t i = 0; i < n; i++) {
      const int8_t *r = v + i * D + d;
      vf x[4];
      for (int c = 0; c < 4; c++) x[c] = vi_to_vf(vi_load_i8(r + 16 * c));
      for (int g = 0; g < G; g++) {
        const vf wi = vf_set1(w[16 * g + i]);
        for (int c = 0; c < 4; c++) a[g][c] = vf_fmadd(x[c], wi, a[g][c]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) vf_store(acc + g * D + d + 16 * c, a[g][c]);
  }
  for (; d < D; d += 32) {
    vf a[4][2];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2; c++) a[g][c] = vf_load(acc + g * D + d + 16 * c);
    for (int64_t i = 0; i < n; i++) {
      const int8_t *r = v + i * D + d;
      const vf x0 = vi_to_vf(vi_load_i8(r)), x1 = vi_to_vf(vi_load_i8(r + 16));
      for (int g = 0; g < G; g++) {
        const vf wi = vf_set1(w[16 * g + i]);
        a[g][0] = vf_fmadd(x0, wi, a[g][0]);
        a[g][1] = vf_fmadd(x1, wi, a[g][1]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2; c++) vf_store(acc + g * D + d + 16 * c, a[g][c]);
  }
}
#endif


/* A decode task's share of the int8 pages: positions p0 .. p0 + n of one sequence (its page table row at pages), all
 * heads. The rows of page j's head h are (pages[j] Hkv + h) page_size + i; a call walks them as blocks of up to 16
 * consecutive rows (within a page and the task's positions), body seeing h (the kv head), row (the block's first),
 * pos (its first position, from p0) and m (its rows). The hardware's prefetchers follow these runs (each page's
 * K, or V, is Hkv x page_size rows in one piece): software prefetches here made the kernel 1.4x slower. */
typedef struct {
  const int64_t *pages;
  int64_t p0, n, Hkv, page_size;
} kv_span;

#define FOR_EACH_BLOCK(sp, row, pos, m, body)                                                                   \
  for (int64_t j = (sp).p0 / (sp).page_size, end = (sp).p0 + (sp).n; j * (sp).page_size < end; j++) {           \
    const int64_t lo_ = j * (sp).page_size > (sp).p0 ? j * (sp).page_size : (sp).p0;                            \
    const int64_t hi_ = (j + 1) * (sp).page_size < end ? (j + 1) * (sp).page_size : end;                        \
    for (int64_t h = 0; h < (sp).Hkv; h++)                                                                      \
      for (int64_t pos = lo_ - (sp).p0; pos < hi_ - (sp).p0; pos += 16) {                                       \
        const int64_t m = hi_ - (sp).p0 - pos < 16 ? hi_ - (sp).p0 - pos : 16;                                  \
        const int64_t row = ((sp).pages[j] * (sp).Hkv + h) * (sp).page_size + ((sp).p0 + pos) % (sp).page_size; \
        body;                                                                                                   \
      }                                                                                                         \
  }

/* scores [Hq][L] (from the span's first position) = q . k x the row's scale x the query's (qscale, which holds the
 * softmax scale too), the queries q16 [Hq][D] int16. */
static void span_scores(const kv_span sp, const int16_t *q16, const float *qscale, const int8_t *k_cache,
                        const float *k_scales, int64_t G, int64_t D, int64_t L, float *scores) {
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf ks = vf_load_n(k_scales + row, m, 0.0f);
    for (int64_t g = 0; g < G; g++) {
      const int64_t hq = h * G + g;
      const vi dots = qk_int8_block(q16 + hq * D, D, k_cache + row * D, m);
      vf_store_n(scores + hq * L + pos, vf_mul(vi_to_vf(dots), vf_mul(ks, vf_set1(qscale[hq]))), m);
    }
  })
}

#ifdef ISA_HAS_PV_I16
/* acc [Hq][D] (float32) = sum over the span's rows of w V, w the softmax's numerators in scores [Hq][L] times each
 * row's V scale: quantized to int16 per head (its largest weight at 32767; the step is below bf16's rounding of the
 * largest) and multiplied with V's rows in int32, two rows a pair (pv_i16_block; |sum| <= L x 32767 x 127 stays
 * within int32 for L <= 512), then scaled back (pv_i16_finish). Scratch: wq int16 [Hq][L], acc32 [Hq][D],
 * wscale [Hq]. */
static void span_values(const kv_span sp, float *scores, const int8_t *v_cache, const float *v_scales, int64_t Hq,
                        int64_t G, int64_t D, int64_t L, int16_t *wq, int32_t *acc32, float *wscale, float *acc) {
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf vs = vf_load_n(v_scales + row, m, 0.0f);
    for (int64_t g = 0; g < G; g++) {
      float *w = scores + (h * G + g) * L + pos;
      vf_store_n(w, vf_mul(vf_load_n(w, m, 0.0f), vs), m);
    }
  })
  for (int64_t hq = 0; hq < Hq; hq++) {
    const float *w = scores + hq * L;
    vf mx = vf_zero();
    for (int64_t i = 0; i < sp.n; i += 16) mx = vf_max(mx, vf_load_n(w + i, sp.n - i, 0.0f));
    const float top = vf_reduce_max(mx), inv = top > 0.0f ? 32767.0f / top : 0.0f;
    for (int64_t i = 0; i < sp.n; i += 16) vi_store_i16_n(wq + hq * L + i, vf_to_vi(vf_mul(vf_load_n(w + i, sp.n - i, 0.0f), vf_set1(inv))), sp.n - i);
    wscale[hq] = top / 32767.0f;
  }
  memset(acc32, 0, sizeof(int32_t) * Hq * D);
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const int8_t *v = v_cache + row * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* (blocks of up to 4 heads: their sums in registers) */
      const int16_t *w = wq + (h * G + g0) * L + pos;
      int32_t *a = acc32 + (h * G + g0) * D;
      switch (G - g0 < 4 ? G - g0 : 4) {
        case 1: pv_i16_block(v, m, D, w, L, 1, a); break;
        case 2: pv_i16_block(v, m, D, w, L, 2, a); break;
        case 3: pv_i16_block(v, m, D, w, L, 3, a); break;
        default: pv_i16_block(v, m, D, w, L, 4, a); break;
      }
    }
  })
  for (int64_t hq = 0; hq < Hq; hq++) pv_i16_finish(acc32 + hq * D, D, wscale[hq], acc + hq * D);
}
#else
/* acc [Hq][D] (float32) = sum over the span's rows of w V, w the softmax's numerators in scores [Hq][L] times each
 * row's V scale, V's rows widened to float32 (pv_int8_block). */
static void span_values(const kv_span sp, float *scores, const int8_t *v_cache, const float *v_scales, int64_t Hq,
                        int64_t G, int64_t D, int64_t L, int16_t *wq, int32_t *acc32, float *wscale, float *acc) {
  (void)wq, (void)acc32, (void)wscale;
  memset(acc, 0, sizeof(float) * Hq * D);
  float w[64];
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf vs = vf_load_n(v_scales + row, m, 0.0f);
    const int8_t *v = v_cache + row * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* (blocks of up to 4 heads: their sums in registers) */
      const int64_t gb = G - g0 < 4 ? G - g0 : 4;
      for (int64_t g = 0; g < gb; g++) /* (each weight times its row's V scale) */
        vf_store(w + 16 * g, vf_mul(vf_load_n(scores + (h * G + g0 + g) * L + pos, m, 0.0f), vs));
      float *a = acc + (h * G + g0) * D;
      switch (gb) {
        case 1: pv_int8_block(v, m, D, w, 1, a); break;
        case 2: pv_int8_block(v, m, D, w, 2, a); break;
        case 3: pv_int8_block(v, m, D, w, 3, a); break;
        default: pv_int8_block(v, m, D, w, 4, a); break;
      }
    }
  })
}
#endif

#define KV_CHUNK 256 /* positions a decode task: a sequence's chunks run on any thread (at most 512: span_values) */

/* decode_attention_bf16 over int8 pages (k_cache, v_cache with their scales; the other arguments as there), split
 * like flash decoding: a task is one sequence's chunk of KV_CHUNK positions for all its heads, so it reads each
 * page's K, then each page's V, as one run of Hkv x page_size rows (read head by head, the runs would be a page's
 * share, page_size x D bytes, Hkv runs apart). Per task: the queries as int16 (a scale per head: quantize_q16); the
 * scores of blocks of up to 16 rows of a page and kv head in int32 against the group's queries (span_scores); the
 * chunk's softmax in float32 (its own maximum); V's weighted sum (span_values). Then per sequence and head, the
 * chunks' sums rescaled to the largest maximum M and added: sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) s_c. The
 * chunks are fixed by the positions, not the threads: the result does not depend on the thread count. Each K and V
 * row is read from memory once. D % 32 == 0, D <= 512; any page size. */
static void decode_attention_int8(const bf16 *q, int64_t ldq, const int8_t *k_cache, const float *k_scales,
                                const int8_t *v_cache, const float *v_scales, const int64_t *page_table, int64_t ldp,
                                const int64_t *context_lens, bf16 *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t page_size, float scale, int nthreads) {
  const int64_t G = Hq / Hkv, L = KV_CHUNK;
  int64_t *first = malloc(sizeof(int64_t) * (B + 1)); /* sequence b's tasks: first[b] .. first[b + 1] */
  first[0] = 0;
  for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + (context_lens[b] + L - 1) / L;
  const int64_t ntasks = first[B];
  float *partial = malloc(sizeof(float) * ntasks * Hq * (D + 2)); /* per task and head: D sums, maximum, total */
#pragma omp parallel num_threads(nthreads) if (ntasks > 1)
  {
    float *scores = malloc(sizeof(float) * (Hq * L + 2 * Hq)), *qscale = scores + Hq * L, *wscale = qscale + Hq;
    int16_t *q16 = malloc(sizeof(int16_t) * (Hq * D + Hq * L)), *wq = q16 + Hq * D;
    int32_t *acc32 = malloc(sizeof(int32_t) * Hq * D);
    int64_t quantized = -1; /* (the sequence whose queries q16 holds) */
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < ntasks; task++) {
      int64_t b = 0;
      while (first[b + 1] <= task) b++;
      const int64_t p0 = (task - first[b]) * L;
      const kv_span sp = {page_table + b * ldp, p0, context_lens[b] - p0 < L ? context_lens[b] - p0 : L, Hkv, page_size};
      if (quantized != b) {
        for (int64_t hq = 0; hq < Hq; hq++) qscale[hq] = quantize_q16(q + b * ldq + hq * D, D, q16 + hq * D) * scale;
        quantized = b;
      }
      span_scores(sp, q16, qscale, k_cache, k_scales, G, D, L, scores);
      float *part = partial + task * Hq * (D + 2);
      for (int64_t hq = 0; hq < Hq; hq++) /* the chunk's softmax: its maximum, exp(s - max), their total */
        part[Hq * D + Hq + hq] = exp_shifted_max(scores + hq * L, sp.n, part + Hq * D + hq);
      span_values(sp, scores, v_cache, v_scales, Hq, G, D, L, wq, acc32, wscale, part);
    }
    free(scores);
    free(q16);
    free(acc32);
  }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * Hq >= 8)
  for (int64_t b = 0; b < B; b++)
    for (int64_t hq = 0; hq < Hq; hq++) { /* the chunks rescaled to the largest maximum and added */
      float top = -INFINITY, total = 0.0f;
      for (int64_t t = first[b]; t < first[b + 1]; t++) {
        const float mt = partial[t * Hq * (D + 2) + Hq * D + hq];
        top = mt > top ? mt : top;
      }
      for (int64_t t = first[b]; t < first[b + 1]; t++) { /* (each chunk's maximum becomes its factor exp(m_c - M)) */
        float *part = partial + t * Hq * (D + 2);
        part[Hq * D + hq] = expf(part[Hq * D + hq] - top);
        total += part[Hq * D + hq] * part[Hq * D + Hq + hq];
      }
      for (int64_t t = first[b]; t < first[b + 1]; t++) partial[t * Hq * (D + 2) + Hq * D + hq] /= total;
      for (int64_t d = 0; d < D; d += 16) {
        vf o = vf_zero();
        for (int64_t t = first[b]; t < first[b + 1]; t++) {
          const float *part = partial + t * Hq * (D + 2);
          o = vf_fmadd(vf_load(part + hq * D + d), vf_set1(part[Hq * D + hq]), o);
        }
        vf_store_bf16(out + (b * Hq + hq) * D + d, o);
      }
    }
  free(partial);
  free(first);
}

/* -- the pages' entry points: either kind, told apart by the descriptor (k_scales set: int8) ---------------------- */

void mili_store_kv(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, const int64_t *slots, int64_t T,
                   const mili_kv_pages *kv, int nthreads) {
  if (kv->k_scales)
    store_kv_int8(k, ldk, v, ldv, kv->k, kv->k_scales, kv->v, kv->v_scales, slots, T, kv->kv_heads, kv->head_dim,
                  kv->page_size, nthreads);
  else
    store_kv_bf16(k, ldk, v, ldv, kv->k, kv->v, slots, T, kv->kv_heads, kv->head_dim, kv->page_size);
}

void mili_decode_attention(const bf16 *q, int64_t ldq, int64_t Hq, float scale, const mili_kv_pages *kv,
                           const mili_seq_pages *seqs, bf16 *out, int nthreads) {
  if (kv->k_scales)
    decode_attention_int8(q, ldq, kv->k, kv->k_scales, kv->v, kv->v_scales, seqs->page_table, seqs->ldp,
                          seqs->context_lens, out, seqs->B, Hq, kv->kv_heads, kv->head_dim, kv->page_size, scale,
                          nthreads);
  else
    decode_attention_bf16(q, ldq, kv->k, kv->v, seqs->page_table, seqs->ldp, seqs->context_lens, out, seqs->B, Hq,
                          kv->kv_heads, kv->head_dim, kv->page_size, scale, nthreads);
}

void mili_gather_kv_int8(const mili_kv_pages *kv, int which, const mili_seq_pages *seqs, int64_t n, bf16 *out,
                         int nthreads) {
  gather_kv_int8(which ? kv->v : kv->k, which ? kv->v_scales : kv->k_scales, seqs->page_table, seqs->ldp, seqs->B, n,
                 kv->kv_heads, kv->head_dim, kv->page_size, out, nthreads);
}
