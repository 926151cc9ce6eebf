/* -- sampling -------------------------------------------------------------------------------------------- */

#ifndef ISA_HAS_ARGMAX
/* The first index of the largest of the N bf16 values (torch's argmax: the first NaN counts as the largest).
 * bf16 compares as its sign-magnitude bits; one pass, no conversion. */
static inline int64_t argmax_row(const bf16 *row, int64_t N) {
  int64_t best = 0;
  float top = -INFINITY;
  for (int64_t i = 0; i < N; i++) {
    const float v = bf16_to_float(row[i]);
    if (v != v) return i;
    if (v > top) top = v, best = i;
  }
  return best;
}
#endif

/* out[r] = the first index of the largest of the N bf16 values of row r (rows at stride ld): greedy
 * sampling straight from the lm_head's output, where torch's argmax over a float32 copy of a batch of
 * 152k-wide rows took several ms. */
void mili_argmax_rows(const bf16 *x, int64_t ld, int64_t R, int64_t N, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1)
  for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * ld, N);
}

/* Structured outputs: logits[rows[j], t] = -inf for every token t whose bit is 0 in row rows[j] of an
 * xgrammar bitmask (int32 words, bit b of word w = token 32 w + b; rows at stride ldm, logits at ld,
 * V tokens). A word of all ones (the common case inside a JSON string) is skipped. */
void mili_apply_bitmask(float *logits, int64_t ld, const int32_t *bitmask, int64_t ldm, const int64_t *rows,
                        int64_t nrows, int64_t V, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nrows > 1)
  for (int64_t j = 0; j < nrows; j++) {
    float *row = logits + rows[j] * ld;
    const uint32_t *words = (const uint32_t *)(bitmask + rows[j] * ldm);
    for (int64_t w = 0; w * 32 < V; w++) {
      uint32_t drop = ~words[w];
      const int64_t left = V - w * 32;
      if (left < 32) drop &= (uint32_t)((1ull << left) - 1);
      for (; drop; drop &= drop - 1) row[w * 32 + __builtin_ctz(drop)] = -INFINITY;
    }
  }
}
