/* -- one decoder layer of a decode step in one call --------------------------------------------------------
 * The model's layer (norm, qkv, q/k-norm + RoPE, KV store, attention, o_proj, norm, gate_up, SwiGLU, down)
 * as a sequence of the kernels above, so that a decode step crosses from Python once per layer instead of
 * ~15 times (the Python and torch work between kernels was a quarter of a batch-32 step). Same kernels,
 * same order, same roundings: the result is bit for bit the module path's. */
/* (mili_linear_desc and mili_layer_desc: mili_kernels.h) */

/* A layer's output features: its parts' (next) together. */
static int64_t linear_n(const mili_linear_desc *l) {
  int64_t n = 0;
  for (; l; l = l->next) n += l->n;
  return n;
}

/* y [M, linear_n(l)] = x @ W^T, each part of the layer into its columns. (Parts are int4 or int8g: those kernels take
 * a row stride; a plain layer is one part.) */
static void run_linear(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, const int64_t *lora_slots,
                       int nthreads) {
  const int64_t ldy = linear_n(l);
  if (l->lora && lora_slots) { /* the layer, then its adapters' products added */
    mili_linear_desc base = *l;
    base.lora = NULL;
    run_linear(&base, x, y, M, NULL, nthreads);
    mili_lora_add(l->lora, x, l->k, y, ldy, M, lora_slots, nthreads);
    return;
  }
  for (; l; y += l->n, l = l->next) {
    if (l->int8g) mili_linear_int8g(l, x, y, M, ldy, nthreads);
    else if (l->group) mili_linear_int4(l, x, y, M, ldy, nthreads);
    else if (l->scales) mili_linear_int8(l, x, y, M, nthreads);
    else mili_linear(l->w, x, y, M, l->n, l->k, nthreads);
  }
}

/* One decoder layer over a decode step's T tokens (mili_decode_step: the tokens, their K/V slots and rotary angles, the
 * work space, their LoRA slots), one per sequence of seqs, its K/V in kv. step->h in: the layer's input; out: its MLP
 * output (in place). step->residual: the residual stream in and out (in place); with first != 0 there is none yet
 * and h is the stream. */
void mili_decode_layer(const mili_layer_desc *L, int first, const mili_kv_pages *kv, const mili_seq_pages *seqs,
                       const mili_decode_step *step, int nthreads) {
  const int64_t T = step->T, H = L->hidden, D = L->head_dim, Hq = L->q_heads, Hkv = L->kv_heads;
  const int64_t nqkv = linear_n(&L->qkv);
  bf16 *h = step->h, *residual = step->residual, *normed = step->work, *qkv = normed + T * H, *attn = qkv + T * nqkv;
  bf16 *o = attn + T * Hq * D, *gate_up = o + T * H, *act = gate_up + T * linear_n(&L->gate_up);
  if (first) memcpy(residual, h, sizeof(bf16) * T * H); /* the stream starts as the embeddings */
  const mili_norm_rows in_rows = {.x = h, .ldx = H, .residual = first ? NULL : residual,
                                  .res_out = first ? NULL : residual, .out = normed, .T = T, .D = H};
  mili_rms_norm(&in_rows, L->input_norm, L->eps, nthreads);
  run_linear(&L->qkv, normed, qkv, T, step->lora_slots, nthreads);
  const mili_qk_heads heads = {.qkv = qkv, .ld = nqkv, .T = T, .q_heads = Hq, .kv_heads = Hkv, .head_dim = D,
                               .cos = step->cos, .sin = step->sin};
  mili_qk_norm_rope(&heads, L->q_norm, L->k_norm, L->eps, nthreads);
  mili_store_kv(qkv + Hq * D, nqkv, qkv + (Hq + Hkv) * D, nqkv, step->slots, T, kv, nthreads);
  mili_decode_attention(qkv, nqkv, Hq, L->scale, kv, seqs, attn, nthreads);
  run_linear(&L->o, attn, o, T, step->lora_slots, nthreads);
  const mili_norm_rows post_rows = {.x = o, .ldx = H, .residual = residual, .res_out = residual, .out = normed,
                                    .T = T, .D = H};
  mili_rms_norm(&post_rows, L->post_norm, L->eps, nthreads);
  run_linear(&L->gate_up, normed, gate_up, T, step->lora_slots, nthreads);
  mili_silu_and_mul(gate_up, act, T, L->inter, nthreads);
  run_linear(&L->down, act, h, T, step->lora_slots, nthreads);
}

/* A decode step's n decoder layers in one call: mili_decode_layer for each in turn (the first starts the residual
 * stream), layer i's pages at kv[i]. (One call a step rather than one a layer: Python's 28 calls cost ~0.35 ms of a
 * 0.6B's 14 ms 4-bit step.) */
void mili_decode_layers(const mili_layer_desc *layers, const mili_kv_pages *kv, int64_t n, const mili_seq_pages *seqs,
                        const mili_decode_step *step, int nthreads) {
  for (int64_t i = 0; i < n; i++) mili_decode_layer(&layers[i], i == 0, &kv[i], seqs, step, nthreads);
}
