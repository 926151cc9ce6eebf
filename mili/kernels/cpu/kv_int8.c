/* -- int8 pages (--kv-cache-dtype int8) ---------------------------------------------------------------------
 * A layer's K (and V) pages as int8 values [pages, Hkv, page_size x D] beside float32 scales [pages, Hkv, page_size]:
 * one symmetric scale per (token, kv head) row, amax / 127, its values round(x / scale) (x times 1 / scale, nearest
 * even) in -127..127; a row of zeros has scale 0. A row is quantized once, when stored: nothing is requantized as a
 * page fills. A row of D values is D + 4 bytes (132 at D = 128, 0.52 of bf16's), so a decode step streams about half
 * the bytes. The scale of in-page row r of kv head h sits at (page x Hkv + h) x page_size + r; that (page, head)'s
 * page_size x D values are one run, laid out for the decode kernel's products (both exact in int32, with no sum
 * across a vector's lanes):
 * - K: the run's rows in blocks of 16 (the last one of page_size % 16, if any): a block of m rows holds its values
 *   pair by pair, [D / 2][m][2], so 32 bytes are one value pair of 16 rows, and vpdpwssd against a broadcast pair
 *   of the query gives 16 rows' partial dot products, one a lane (k_value_at);
 * - V: the run's rows two by two, interleaved: rows 2i and 2i + 1 as [D][2], so 32 bytes are 16 values of the two
 *   rows, and vpdpwssd against the broadcast pair of their weights adds both into 16 outputs; an odd page_size's last
 *   row alone, [D] (v_value_at).
 * The decode kernel reads the runs as they are (q . k against int16 queries, P V with int16 weights); a prefill
 * chunk's context is gathered dequantized to bf16 (gather_kv_int8) for the prefill kernel; ops.int8_page_rows is
 * the layout's torch form. */

static inline int64_t kv_row(int64_t slot, int64_t h, int64_t Hkv, int64_t page_size) {
  return (slot / page_size * Hkv + h) * page_size + slot % page_size;
}

/* where, in its run, K's value d of in-page row r is, and V's (the layout above) */
static inline int64_t k_value_at(int64_t r, int64_t d, int64_t D, int64_t page_size) {
  const int64_t b = r / 16 * 16, m = page_size - b < 16 ? page_size - b : 16;
  return b * D + d / 2 * 2 * m + 2 * (r - b) + d % 2;
}
static inline int64_t v_value_at(int64_t r, int64_t d, int64_t D, int64_t page_size) {
  return r % 2 == 0 && r + 1 == page_size ? r * D + d : r / 2 * 2 * D + 2 * d + r % 2;
}

/* row r's D values (int8) from its run, K's (v 0) or V's (1), and into it: D / 2 pairs 2 m apart (K), D values 2
 * apart (V, a pair's row) or D in a row (an odd page's last V row). D even. */
static inline void kv_values_io(int8_t *run, int v, int64_t r, int64_t D, int64_t page_size, int8_t *row, int store) {
  if (v && r % 2 == 0 && r + 1 == page_size) {
    if (store) memcpy(run + r * D, row, D);
    else memcpy(row, run + r * D, D);
    return;
  }
  int8_t *at = run + (v ? v_value_at(r, 0, D, page_size) : k_value_at(r, 0, D, page_size));
  if (v) {
    for (int64_t d = 0; d < D; d++)
      if (store) at[2 * d] = row[d];
      else row[d] = at[2 * d];
  } else {
    const int64_t step = k_value_at(r, 2, D, page_size) - k_value_at(r, 0, D, page_size); /* (2 m) */
    for (int64_t p = 0; p < D / 2; p++)
      if (store) memcpy(at + step * p, row + 2 * p, 2);
      else memcpy(row + 2 * p, at + step * p, 2);
  }
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
 * offset); slot < 0 is skipped (padding). D even. */
static void store_kv_int8(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, int8_t *k_cache, float *k_scales,
                        int8_t *v_cache, float *v_scales, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D,
                        int64_t page_size, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (T * Hkv >= 64)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < Hkv; h++) {
      if (slots[t] < 0) continue;
      const int64_t r = kv_row(slots[t], h, Hkv, page_size), off = slots[t] % page_size, run = (r - off) * D;
      int8_t q[D];
      quantize_kv_row(k + t * ldk + h * D, D, q, k_scales + r);
      kv_values_io(k_cache + run, 0, off, D, page_size, q, 1);
      quantize_kv_row(v + t * ldv + h * D, D, q, v_scales + r);
      kv_values_io(v_cache + run, 1, off, D, page_size, q, 1);
    }
}

/* out [B, n, Hkv, D] bf16: the first n tokens of each of B sequences' int8 pages (page_table [B, ldp]),
 * dequantized (a prefill chunk's context, and the torch fallback's), K (v 0) or V (1). */
static void gather_kv_int8(const int8_t *cache, const float *scales, int v, const int64_t *page_table, int64_t ldp,
                         int64_t B, int64_t n, int64_t Hkv, int64_t D, int64_t page_size, bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * n * Hkv >= 256)
  for (int64_t b = 0; b < B; b++)
    for (int64_t p = 0; p < n; p++) {
      const int64_t page = page_table[b * ldp + p / page_size], off = p % page_size;
      for (int64_t h = 0; h < Hkv; h++) {
        const int64_t r = (page * Hkv + h) * page_size + off;
        int8_t q[D];
        kv_values_io((int8_t *)cache + (r - off) * D, v, off, D, page_size, q, 0);
        dequantize_kv_row(q, scales[r], D, out + ((b * n + p) * Hkv + h) * D);
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

/* The q . k of one K block of 16 rows (k: [D / 2][16][2], the layout above) for G <= KV_QK_HEADS query heads (q16
 * [G][D]): dots[g] lane i = q16[g] . row i, exactly in int32 (|dot| <= 127 x 32767 x D: D <= 512 stays within
 * int32). Each pair of values of the 16 rows is widened once for the G heads; two sums a head (even and odd pairs)
 * keep vpdpwssd's latency covered. D % 4 == 0. */
static inline __attribute__((always_inline)) void qk_block16(const int8_t *k, const int16_t *q16, int64_t D, const int G,
                                                             vi *dots) {
  vi a[KV_QK_HEADS], b[KV_QK_HEADS];
  for (int g = 0; g < G; g++) a[g] = b[g] = vi_zero();
  for (int64_t p = 0; p < D / 2; p += 2) {
    const vw x = vw_load_i8(k + 32 * p), y = vw_load_i8(k + 32 * p + 32);
    for (int g = 0; g < G; g++) {
      int32_t q0, q1; /* (the query's values 2p, 2p + 1 and 2p + 2, 2p + 3 as int16 pairs) */
      memcpy(&q0, q16 + g * D + 2 * p, 4);
      memcpy(&q1, q16 + g * D + 2 * p + 2, 4);
      a[g] = vi_dp_pairs(a[g], x, q0);
      b[g] = vi_dp_pairs(b[g], y, q1);
    }
  }
  for (int g = 0; g < G; g++) dots[g] = vi_add(a[g], b[g]);
}

/* acc[g] [D] (int32) += the first n pairs of rows of one V run (v: its interleaved pairs, pair i at v + 2 D i), each
 * pair times its two weights (an int32 of two int16: w[g][i], pair i's at w + g ldw + 2 i), for G heads: the G x NC
 * sums of NC x 16 values in registers, d0 onwards. */
static inline __attribute__((always_inline)) void pv_pairs_cols(const int8_t *v, int64_t n, int64_t D, int64_t d0,
                                                                const int16_t *w, int64_t ldw, const int G,
                                                                const int NC, int32_t *acc) {
  vi s[KV_PV_SUMS];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) s[g * NC + c] = vi_load(acc + g * D + d0 + 16 * c);
  for (int64_t i = 0; i < n; i++) {
    int32_t wp[KV_PV_SUMS];
    for (int g = 0; g < G; g++) memcpy(wp + g, w + g * ldw + 2 * i, 4);
    for (int c = 0; c < NC; c++) {
      const vw x = vw_load_i8(v + 2 * D * i + 2 * (d0 + 16 * c));
      for (int g = 0; g < G; g++) s[g * NC + c] = vi_dp_pairs(s[g * NC + c], x, wp[g]);
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) vi_store(acc + g * D + d0 + 16 * c, s[g * NC + c]);
}
/* The (G, NC) shapes pv_pairs takes, widest first for each G: each a function of its own (inlined into one, GCC's
 * register allocation spilled the sums and the pass ran 1.4x slower). */
#if KV_PV_SUMS >= 16
#define PV_WIDE_SHAPES(X) X(1, 8) X(2, 8) X(3, 4) X(4, 4)
#else
#define PV_WIDE_SHAPES(X)
#endif
#define PV_SHAPES(X) PV_WIDE_SHAPES(X) X(1, 4) X(2, 2) X(3, 1) X(4, 1) X(1, 2) X(2, 1) X(1, 1)
#define PV_FN(g_, nc_)                                                                                           \
  static __attribute__((noinline)) void pv_cols_##g_##_##nc_(const int8_t *v, int64_t n, int64_t D, int64_t d0, \
                                                             const int16_t *w, int64_t ldw, int32_t *acc) {     \
    pv_pairs_cols(v, n, D, d0, w, ldw, g_, nc_, acc);                                                            \
  }
PV_SHAPES(PV_FN)
#undef PV_FN

/* the same for 1 <= G <= 4 heads, all of D (D % 16 == 0): as many values a pass as the sums' registers hold */
static inline void pv_pairs(const int8_t *v, int64_t n, int64_t D, const int16_t *w, int64_t ldw, int G,
                            int32_t *acc) {
  for (int64_t d0 = 0; d0 < D;) {
#define PV_CASE(g_, nc_)                                               \
  if (G == g_ && d0 + 16 * nc_ <= D) {                                 \
    pv_cols_##g_##_##nc_(v, n, D, d0, w, ldw, acc), d0 += 16 * nc_;    \
    continue;                                                          \
  }
    PV_SHAPES(PV_CASE)
#undef PV_CASE
  }
}

/* A decode task's share of the int8 pages: positions p0 .. p0 + n of one sequence (its page table row at pages), all
 * heads. The hardware's prefetchers follow each page's K (then V) as one piece of Hkv runs: software prefetches of
 * the next page's runs made no difference (2026-12-04; in the row-major kernel of 2026-11 they cost 1.4x). */
typedef struct {
  const int64_t *pages;
  int64_t p0, n, Hkv, page_size;
} kv_span;

/* For each page j the span touches, in order: its in-page rows lo .. hi within the span, pos0 the span's position of
 * in-page row 0 (negative on a first page the span starts inside). */
#define FOR_EACH_PAGE(sp, j, lo, hi, pos0, ...) /* (the body: __VA_ARGS__, commas and all) */              \
  for (int64_t j = (sp).p0 / (sp).page_size, end_ = (sp).p0 + (sp).n; j * (sp).page_size < end_; j++) {     \
    const int64_t pos0 = j * (sp).page_size - (sp).p0, lo = pos0 < 0 ? -pos0 : 0;                            \
    const int64_t hi = (j + 1) * (sp).page_size < end_ ? (sp).page_size : end_ - j * (sp).page_size;         \
    __VA_ARGS__                                                                                               \
  }

/* scores [Hq][L] (from the span's first position) = q . k x the row's scale x the query's (qscale, which holds the
 * softmax scale too), the queries q16 [Hq][D] int16, and vsc [Hkv][L] the rows' V scales (for span_values): each K
 * block of 16 rows (a shorter last block of a page copied into 16 zero rows first) for KV_QK_HEADS query heads a
 * pass, the lanes within the span stored. */
static void span_scores(const kv_span sp, const int16_t *q16, const float *qscale, const int8_t *k_cache,
                        const float *k_scales, const float *v_scales, int64_t G, int64_t D, int64_t L, float *scores,
                        float *vsc) {
  const int64_t ps = sp.page_size;
  FOR_EACH_PAGE(sp, j, lo, hi, pos0, {
    for (int64_t h = 0; h < sp.Hkv; h++) {
      const int64_t run = (sp.pages[j] * sp.Hkv + h) * ps; /* (the row of in-page row 0) */
      memcpy(vsc + h * L + pos0 + lo, v_scales + run + lo, sizeof(float) * (hi - lo));
      for (int64_t b = lo / 16 * 16; b < hi; b += 16) {
        const int64_t m = ps - b < 16 ? ps - b : 16, r0 = lo > b ? lo - b : 0, r1 = (hi < b + m ? hi : b + m) - b;
        const int8_t *k = k_cache + (run + b) * D;
        int8_t padded[16 * 512];
        if (m < 16) {
          memset(padded, 0, 16 * D);
          for (int64_t p = 0; p < D / 2; p++) memcpy(padded + 32 * p, k + 2 * m * p, 2 * m);
          k = padded;
        }
        const vf ks = vf_load_n(k_scales + run + b, m, 0.0f);
        for (int64_t g0 = 0; g0 < G; g0 += KV_QK_HEADS) {
          const int64_t gn = G - g0 < KV_QK_HEADS ? G - g0 : KV_QK_HEADS, hq0 = h * G + g0;
          vi dots[KV_QK_HEADS];
          switch (gn) {
            case 1: qk_block16(k, q16 + hq0 * D, D, 1, dots); break;
#if KV_QK_HEADS >= 4
            case 3: qk_block16(k, q16 + hq0 * D, D, 3, dots); break;
            case 4: qk_block16(k, q16 + hq0 * D, D, 4, dots); break;
#endif
            default: qk_block16(k, q16 + hq0 * D, D, 2, dots); break;
          }
          for (int64_t g = 0; g < gn; g++) {
            const vf sc = vf_mul(vi_to_vf(dots[g]), vf_mul(ks, vf_set1(qscale[hq0 + g])));
            float *dst = scores + (hq0 + g) * L + pos0 + b; /* (lane 0's position; lanes r0 .. r1 are the span's) */
            if (r0 == 0) {
              vf_store_n(dst, sc, r1);
            } else {
              float t[16];
              vf_store(t, sc);
              memcpy(dst + r0, t + r0, sizeof(float) * (r1 - r0));
            }
          }
        }
      }
    }
  })
}

/* The chunk's softmax and P V: per head, its maximum m (max[hq]), e = exp(s - m) and their total (total[hq]); the
 * weights w = e x the row's V scale (vsc, span_scores'), quantized to int16 per head (its largest weight at 32767;
 * the step is below bf16's rounding of the largest) into wq [Hq][L + 2] (a zero on either side of the span's
 * weights: a V pair half outside the span weighs 0); acc [Hq][D] (float32) = sum over the span's rows of w V, with V's
 * row pairs in int32 (pv_pairs; |sum| <= L x 32767 x 127 stays within int32 for L <= 512), scaled back. Scratch:
 * scores (overwritten by the weights), wq, acc32 [Hq][D], wscale [Hq]. */
static void span_values(const kv_span sp, float *scores, const float *vsc, const int8_t *v_cache, int64_t Hq,
                        int64_t G, int64_t D, int64_t L, int16_t *wq, int32_t *acc32, float *wscale, float *max,
                        float *total, float *acc) {
  const int64_t ps = sp.page_size, ldw = L + 2, n = sp.n;
  for (int64_t hq = 0; hq < Hq; hq++) {
    float *w = scores + hq * L;
    const float *vs = vsc + hq / G * L;
    vf mx = vf_set1(-INFINITY), sum = vf_zero(), wmx = vf_zero();
    for (int64_t i = 0; i < n; i += 16) mx = vf_max(mx, vf_load_n(w + i, n - i, -INFINITY));
    max[hq] = vf_reduce_max(mx);
    const vf top = vf_set1(max[hq]);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) { /* (exp_shifted_max's loop and order, the V scales and the weights' maximum in the same pass) */
      const vf e = vf_exp(vf_sub(vf_load(w + i), top)), x = vf_mul(e, vf_load(vs + i));
      sum = vf_add(sum, e);
      wmx = vf_max(wmx, x);
      vf_store(w + i, x);
    }
    float t = vf_reduce_add(sum);
    if (n - i) {
      float e[16];
      vf_store(e, vf_exp(vf_sub(vf_load_n(w + i, n - i, 0.0f), top)));
      const vf x = vf_mul(vf_load_n(e, n - i, 0.0f), vf_load_n(vs + i, n - i, 0.0f));
      wmx = vf_max(wmx, x);
      vf_store_n(w + i, x, n - i);
      for (int64_t k = 0; k < n - i; k++) t += e[k];
    }
    total[hq] = t;
    const float wtop = vf_reduce_max(wmx), inv = wtop > 0.0f ? 32767.0f / wtop : 0.0f;
    int16_t *row = wq + hq * ldw + 1;
    for (int64_t k = 0; k < n; k += 16) vi_store_i16_n(row + k, vf_to_vi(vf_mul(vf_load_n(w + k, n - k, 0.0f), vf_set1(inv))), n - k);
    row[-1] = row[n] = 0;
    wscale[hq] = wtop / 32767.0f;
  }
  memset(acc32, 0, sizeof(int32_t) * Hq * D);
  FOR_EACH_PAGE(sp, j, lo, hi, pos0, {
    const int64_t i0 = lo / 2, i1 = (hi + 1) / 2 < ps / 2 ? (hi + 1) / 2 : ps / 2; /* (the pairs within the span) */
    for (int64_t h = 0; h < sp.Hkv; h++) {
      const int8_t *v = v_cache + (sp.pages[j] * sp.Hkv + h) * ps * D;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int gn = G - g0 < 4 ? (int)(G - g0) : 4;
        const int64_t hq0 = h * G + g0;
        if (i1 > i0) pv_pairs(v + 2 * D * i0, i1 - i0, D, wq + hq0 * ldw + 1 + pos0 + 2 * i0, ldw, gn, acc32 + hq0 * D);
        if (ps % 2 && hi == ps) { /* an odd page's last row, alone: as a pair with a zero row at weight 0 */
          int8_t pair[2 * 512];
          int16_t w[8];
          for (int64_t d = 0; d < D; d++) pair[2 * d] = v[(ps - 1) * D + d], pair[2 * d + 1] = 0;
          for (int g = 0; g < gn; g++) w[2 * g] = wq[(hq0 + g) * ldw + 1 + pos0 + ps - 1], w[2 * g + 1] = 0;
          pv_pairs(pair, 1, D, w, 2, gn, acc32 + hq0 * D);
        }
      }
    }
  })
  for (int64_t hq = 0; hq < Hq; hq++)
    for (int64_t d = 0; d < D; d += 16)
      vf_store(acc + hq * D + d, vf_mul(vi_to_vf(vi_load(acc32 + hq * D + d)), vf_set1(wscale[hq])));
}

#define KV_CHUNK 256 /* positions a decode task: a sequence's chunks run on any thread (at most 512: span_values) */

/* decode_attention_bf16 over int8 pages (k_cache, v_cache with their scales; the other arguments as there), split
 * like flash decoding: a task is one sequence's chunk of KV_CHUNK positions for all its heads, so it reads each
 * page's K, then each page's V, as one run of Hkv x page_size rows (read head by head, the runs would be a page's
 * share, page_size x D bytes, Hkv runs apart). Per task: the queries as int16 (a scale per head: quantize_q16); the
 * scores of K's blocks of 16 rows of a page and kv head in int32 against the group's queries (span_scores); the
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
    float *scores = malloc(sizeof(float) * (Hq * L + Hkv * L + 2 * Hq)), *vsc = scores + Hq * L;
    float *qscale = vsc + Hkv * L, *wscale = qscale + Hq;
    int16_t *q16 = malloc(sizeof(int16_t) * (Hq * D + Hq * (L + 2))), *wq = q16 + Hq * D;
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
      span_scores(sp, q16, qscale, k_cache, k_scales, v_scales, G, D, L, scores, vsc);
      float *part = partial + task * Hq * (D + 2);
      span_values(sp, scores, vsc, v_cache, Hq, G, D, L, wq, acc32, wscale, part + Hq * D, part + Hq * D + Hq, part);
    }
    free(scores);
    free(q16);
    free(acc32);
#pragma omp for collapse(2) schedule(static) /* (after the tasks' barrier, in the same team: one fork a call) */
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
  gather_kv_int8(which ? kv->v : kv->k, which ? kv->v_scales : kv->k_scales, which, seqs->page_table, seqs->ldp, seqs->B, n,
                 kv->kv_heads, kv->head_dim, kv->page_size, out, nthreads);
}
