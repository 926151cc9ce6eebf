/* -- attention ------------------------------------------------------------------------------------------- */

/* dst[i] = bf16(src[i] * scale), i < n. */
static void to_bf16_row(const float *src, float scale, int64_t n, bf16 *dst) {
  const vf s = vf_set1(scale);
  for (int64_t i = 0; i < n; i += 16) vf_store_bf16_n(dst + i, vf_mul(vf_load_n(src + i, n - i, 0.0f), s), n - i);
}

/* Softmax numerator in place: s[i] = exp(s[i] - max); returns the sum (and the maximum at *max). */
static float exp_shifted_max(float *s, int64_t n, float *max) {
  vf mx = vf_set1(-INFINITY), sum = vf_zero();
  for (int64_t i = 0; i < n; i += 16) mx = vf_max(mx, vf_load_n(s + i, n - i, -INFINITY));
  *max = vf_reduce_max(mx);
  const vf top = vf_set1(*max);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf e = vf_exp(vf_sub(vf_load(s + i), top));
    vf_store(s + i, e);
    sum = vf_add(sum, e);
  }
  float total = vf_reduce_add(sum);
  if (n - i) {
    vf_store_n(s + i, vf_exp(vf_sub(vf_load_n(s + i, n - i, 0.0f), top)), n - i);
    for (; i < n; i++) total += s[i];
  }
  return total;
}
static float exp_shifted(float *s, int64_t n) {
  float max;
  return exp_shifted_max(s, n, &max);
}

/* K/V rows are scattered over pages (one head's row, then the other heads' rows): fetch ahead. */
static inline void prefetch_row(const bf16 *row, int64_t n, int far) {
  for (int64_t c = 0; c < n; c += 32) prefetch(row + c, far);
}

#ifndef ISA_HAS_PV_SLICE
/* o[g] = bf16(inv[g] * sum_p w[g][p] V[p]) for the G heads of a group, over NC chunks of 16 values of the V
 * rows at v + offset[p]; wr: the weights already rounded to bf16 (as torch's CPU flash attention multiplies
 * P), as float32 [G][ctx]. One head at a time; NC is a constant at each call. */
static inline __attribute__((always_inline)) void pv_head(const bf16 *v, const int64_t *offset, const float *wr,
                                                          int64_t ctx, const int NC, float inv, bf16 *o) {
  vf acc[4];
  for (int c = 0; c < NC; c++) acc[c] = vf_zero();
  for (int64_t p = 0; p < ctx; p++) {
    const bf16 *row = v + offset[p];
    if (p + 8 < ctx) prefetch(v + offset[p + 8], 0);
    const vf wp = vf_set1(wr[p]);
    for (int c = 0; c < NC; c++) acc[c] = vf_fmadd(vf_load_bf16(row + 16 * c), wp, acc[c]);
  }
  for (int c = 0; c < NC; c++) vf_store_bf16(o + 16 * c, vf_mul(acc[c], vf_set1(inv)));
}
#endif

/* The weighted sums of V for the G heads of a group, w [G][ctx] float32 (unnormalized; inv[g] the
 * reciprocal of each head's sum), the weights rounded to bf16 once (as torch's CPU flash attention
 * multiplies P). D % 32 == 0. */
static void pv_all(const bf16 *v, const int64_t *offset, const float *w, int64_t ctx, int64_t G, int64_t D,
                   const float *inv, bf16 *o) {
#ifdef ISA_HAS_PV_SLICE /* bf16 pairs of positions, G x NC <= 8 slices of 32 values */
  const int64_t npairs = (ctx + 1) / 2;
  uint32_t *wb = malloc(sizeof(uint32_t) * G * npairs);
  for (int64_t g = 0; g < G; g++) {
    bf16 *dst = (bf16 *)(wb + g * npairs);
    to_bf16_row(w + g * ctx, 1.0f, ctx, dst);
    if (ctx % 2) dst[ctx] = 0;
  }
  for (int64_t d0 = 0; d0 < D;) {
    const int64_t left = (D - d0) / 32;
#define PV(g, nc) do { pv_slice(v + d0, offset, wb, npairs, ctx, g, nc, inv, o + d0, D); d0 += 32 * (nc); } while (0)
    if (G == 1 && left >= 4) PV(1, 4);
    else if (G == 2 && left >= 4) PV(2, 4);
    else if (G == 2 && left >= 2) PV(2, 2);
    else if (G == 4 && left >= 2) PV(4, 2);
    else if (G == 8) PV(8, 1);
    else if (G == 1 && left >= 2) PV(1, 2);
    else {
      for (int64_t g = 0; g < G; g++)
        pv_slice(v + d0, offset, wb + g * npairs, npairs, ctx, 1, 1, inv + g, o + g * D + d0, D);
      d0 += 32;
    }
#undef PV
  }
  free(wb);
#else
  float *wr = malloc(sizeof(float) * G * ctx);
  for (int64_t i = 0; i < G * ctx; i++) wr[i] = round_to_bf16(w[i]);
  for (int64_t g = 0; g < G; g++)
    for (int64_t d0 = 0; d0 < D;) {
      if (D - d0 >= 64) {
        pv_head(v + d0, offset, wr + g * ctx, ctx, 4, inv[g], o + g * D + d0);
        d0 += 64;
      } else {
        pv_head(v + d0, offset, wr + g * ctx, ctx, 2, inv[g], o + g * D + d0);
        d0 += 32;
      }
    }
  free(wr);
#endif
}

/* The CPU backend's pages are head-major, [pages, Hkv, page_size, D]: a (sequence, kv head) task reads
 * page_size x D contiguous values a page (4 KB for Qwen3's 16 x 128 bf16) where the token-major layout
 * [pages, page_size, Hkv, D] gave it D values every Hkv x D (256 B every 2 KB), which this machine's memory
 * serves at about a third of the streaming rate (benchmarks/NOTES.md, step 9). */

/* k, v [T, Hkv, D] (token strides ldk, ldv) into the caches at flat slots (page x page_size + offset);
 * slot < 0 is skipped (padding). */
static void store_kv_bf16(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, bf16 *k_cache, bf16 *v_cache,
                   const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t page_size) {
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    const int64_t base = (slots[t] / page_size * Hkv * page_size + slots[t] % page_size) * D;
    for (int64_t h = 0; h < Hkv; h++) {
      memcpy(k_cache + base + h * page_size * D, k + t * ldk + h * D, sizeof(bf16) * D);
      memcpy(v_cache + base + h * page_size * D, v + t * ldv + h * D, sizeof(bf16) * D);
    }
  }
}

/* Decode attention over the paged pool, reading each page in place: B sequences with one query token
 * each, q [B, Hq, D] (token stride ldq), head-major caches [pages, Hkv, page_size, D], page_table [B, ldp]
 * (int64), context_lens [B] (int64). One task per (sequence, kv head): its `group` query heads share each
 * K and V row loaded. Scores, softmax and the weighted sum of V are float32. D % 32 == 0. */
static void decode_attention_bf16(const bf16 *q, int64_t ldq, const bf16 *k_cache, const bf16 *v_cache,
                           const int64_t *page_table, int64_t ldp, const int64_t *context_lens, bf16 *out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                           int nthreads) {
  const int64_t group = Hq / Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
  for (int64_t task = 0; task < B * Hkv; task++) {
    const int64_t b = task / Hkv, h = task % Hkv, ctx = context_lens[b];
    float *scores = malloc(sizeof(float) * (group * ctx + group));
    float *inv = scores + group * ctx;
    int64_t *offset = malloc(sizeof(int64_t) * ctx); /* of each position's K/V row for this head */
    for (int64_t p = 0; p < ctx; p++)
      offset[p] = ((page_table[b * ldp + p / page_size] * Hkv + h) * page_size + p % page_size) * D;
    const bf16 *qh = q + b * ldq + h * group * D;
    for (int64_t p = 0; p < ctx; p++) {
      const bf16 *kr = k_cache + offset[p];
      if (p + 8 < ctx) {
        prefetch_row(k_cache + offset[p + 8], D, 0);
        prefetch_row(v_cache + offset[p + 8], D, 1);
      }
      for (int64_t g = 0; g < group; g++) {
        vf s = vf_zero();
        for (int64_t c = 0; c < D; c += 32) s = dot_bf16x32(s, qh + g * D + c, kr + c);
        scores[g * ctx + p] = vf_reduce_add(s) * scale;
      }
    }
    for (int64_t g = 0; g < group; g++) inv[g] = 1.0f / exp_shifted(scores + g * ctx, ctx);
    pv_all(v_cache, offset, scores, ctx, group, D, inv, out + (b * Hq + h * group) * D);
    free(scores);
    free(offset);
  }
}

/* Causal attention of one sequence's prefill chunk c (Hq = q_heads, Hkv = kv_heads, D = head_dim): q [Lq, Hq, D]
 * (token stride ldq) are the last Lq of the Lk positions whose K/V are k, v [Lk, Hkv, D] (token strides ldk, ldv);
 * out [Lq, Hq, D] (stride ldo).
 * Both products run on the linear layers' micro-kernel: each head's K is packed as a weight [Lk, D]
 * (scores = Q K^T), its V^T as a weight [D, Lk] (out = P V, P the softmax in bf16, as torch's CPU flash
 * attention also multiplies it). One task per (kv head, 16 queries): its group's G x 16 query rows share
 * every packed K and V row, and only the key blocks the causal mask leaves are computed. D % 32 == 0. */
void mili_prefill_attention(const mili_prefill_chunk *c, float scale, bf16 *out, int64_t ldo, int nthreads) {
  const bf16 *q = c->q, *k = c->k, *v = c->v;
  const int64_t ldq = c->ldq, ldk = c->ldk, ldv = c->ldv, Lq = c->Lq, Lk = c->Lk;
  const int64_t Hq = c->q_heads, Hkv = c->kv_heads, D = c->head_dim;
  const int64_t G = Hq / Hkv, nkb = (Lk + 15) / 16, Lkp = nkb * 16, QB = 16, nqb = (Lq + QB - 1) / QB;
  bf16 *kp = malloc(sizeof(bf16) * Hkv * Lkp * D); /* [Hkv][nkb][D/2][16][2] */
  bf16 *vp = malloc(sizeof(bf16) * Hkv * D * Lkp); /* [Hkv][D/16][Lkp/2][16][2] */
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static)
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t key = 0; key < Lkp; key++) {
      const bf16 *kr = k + key * ldk + h * D, *vr = v + key * ldv + h * D;
      bf16 *kdst = kp + (h * nkb + key / 16) * 16 * D + (key % 16) * 2;
      bf16 *vdst = vp + h * D * Lkp + (key / 2) * 32 + key % 2;
      for (int64_t d = 0; d < D; d++) {
        kdst[(d / 2) * 32 + d % 2] = key < Lk ? kr[d] : 0;
        vdst[(d / 16) * 16 * Lkp + (d % 16) * 2] = key < Lk ? vr[d] : 0;
      }
    }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(dynamic)
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t qb = 0; qb < nqb; qb++) {
      const int64_t i0 = qb * QB, n = Lq - i0 < QB ? Lq - i0 : QB, rows = G * n;
      const int64_t width = (Lk - Lq + i0 + n + 15) / 16 * 16; /* keys the block's last query sees, padded */
      bf16 *xq = malloc(sizeof(bf16) * rows * D), *pr = malloc(sizeof(bf16) * rows * width);
      float *sc = malloc(sizeof(float) * rows * width);
      for (int64_t g = 0; g < G; g++) /* row g * n + i: query i0 + i of head h * G + g */
        for (int64_t i = 0; i < n; i++) memcpy(xq + (g * n + i) * D, q + (i0 + i) * ldq + (h * G + g) * D, D * 2);
      gemm_serial((const uint8_t *)(kp + h * Lkp * D), D * 32, width / 16, xq, D, rows, D / 2,
                  NULL, sc, width);
      for (int64_t r = 0; r < rows; r++) {
        const int64_t valid = Lk - Lq + i0 + r % n + 1;
        float *sr = sc + r * width;
        for (int64_t c = 0; c < valid; c++) sr[c] *= scale;
        const float inv = 1.0f / exp_shifted(sr, valid);
        bf16 *prow = pr + r * width;
        to_bf16_row(sr, inv, valid, prow);
        memset(prow + valid, 0, sizeof(bf16) * (width - valid));
      }
      for (int64_t g = 0; g < G; g++)
        gemm_serial((const uint8_t *)(vp + h * D * Lkp), Lkp * 32, D / 16, pr + g * n * width, width, n, width / 2,
                    out + i0 * ldo + (h * G + g) * D, NULL, ldo);
      free(xq);
      free(pr);
      free(sc);
    }
  free(kp);
  free(vp);
}
