/* -- LoRA adapters: each row's own adapter's low-rank product, added to a linear layer's output --------------
 * A layer keeps `slots` adapters of rank up to `rank` (mili/lora.py, LoRALinear): A packed [columns, K] with slot s's
 * shard j at rows s x width + j x rank (width = shards x rank; columns: slots x width padded to 32), and for each of
 * the layer's output shards j (q|k|v, gate|up, or one) B_j packed [n_j, kb] over the columns of every slot's shard j
 * (slot s at s x rank; kb: slots x rank padded to 32): y[:, shard j] += B_j (A_j x) per row, its slot's part only.
 * u = x A^T runs over every slot at once (a decode step's rows are few: cheaper than a product per adapter); each
 * shard then gathers its rows' own slot's columns (the others zero) and multiplies by B_j, whose block-diagonal
 * zeros (other shards' columns) are never read. */

/* y [M, ldy] (bf16, the layer's output) += each row's adapter's product; slots[m] < 0: row m untouched. The sum is
 * rounded to bf16 as torch's bf16 add rounds it. */
void mili_lora_add(const mili_lora_desc *L, const bf16 *x, int64_t K, bf16 *y, int64_t ldy, int64_t M,
                   const int64_t *slots, int nthreads) {
  int64_t nmax = 0;
  for (int64_t j = 0; j < L->shards; j++) nmax = L->n[j] > nmax ? L->n[j] : nmax;
  const int64_t npad = (nmax + 15) / 16 * 16;
  bf16 *u = malloc(sizeof(bf16) * M * L->columns), *us = malloc(sizeof(bf16) * M * L->kb);
  bf16 *d = malloc(sizeof(bf16) * M * npad);
  mili_linear(L->a, x, u, M, L->columns, K, nthreads);
  for (int64_t j = 0, off = 0; j < L->shards; off += L->n[j], j++) {
    const int64_t n = L->n[j], nj = (n + 15) / 16 * 16;
    for (int64_t m = 0; m < M; m++) { /* this shard's columns of the row's own slot; the rest zero */
      memset(us + m * L->kb, 0, sizeof(bf16) * L->kb);
      if (slots[m] >= 0)
        memcpy(us + m * L->kb + slots[m] * L->rank, u + m * L->columns + slots[m] * L->width + j * L->rank,
               sizeof(bf16) * L->rank);
    }
    mili_linear(L->b[j], us, d, M, nj, L->kb, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * n >= 65536)
    for (int64_t m = 0; m < M; m++) {
      if (slots[m] < 0) continue;
      bf16 *row = y + m * ldy + off;
      const bf16 *add = d + m * nj; /* (mili_linear's rows: nj wide) */
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) vf_store_bf16(row + i, vf_add(vf_load_bf16(row + i), vf_load_bf16(add + i)));
      for (; i < n; i++) {
        const float f = round_to_bf16(bf16_to_float(row[i]) + bf16_to_float(add[i]));
        uint32_t bits;
        memcpy(&bits, &f, 4);
        row[i] = (bf16)(bits >> 16);
      }
    }
  }
  free(u);
  free(us);
  free(d);
}
