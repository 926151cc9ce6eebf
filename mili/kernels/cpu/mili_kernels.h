/* MILI's CPU kernels: their ABI, written once. kernels.c includes this header (so the compiler holds each
 * definition to its prototype here), and the Python side reads it (mili/kernels/cpu/abi.py): the ctypes argument and
 * return types of every function below and the ctypes structures of the descriptors, parsed from this text. Keep it
 * to what abi.py reads: the includes and the bf16 typedef, structs as `typedef struct NAME { fields } NAME;` with
 * fields of the scalar types, pointers, arrays of a constant length and the structs above them, and one prototype a
 * declaration. Each function's behaviour is described at its definition, in the family's file named here.
 *
 * bf16 values are uint16_t (the top half of a float32). Every function takes the thread count to use. */
#ifndef MILI_KERNELS_H
#define MILI_KERNELS_H
#include <stdint.h>

typedef uint16_t bf16;

/* -- descriptors ---------------------------------------------------------------------------------------------- */

/* A layer's LoRA adapters (lora.c; mili/lora.py's LoRALinear builds it). */
typedef struct mili_lora_desc {
  const bf16 *a;    /* packed A [columns, k] */
  const bf16 *b[3]; /* per shard: packed B_j [n_j (padded to 16), kb] */
  int64_t n[3];     /* per shard: output features */
  int64_t shards, columns, width, rank, slots, kb;
} mili_lora_desc;

/* One linear layer as the fused decode step runs it (decode_layer.c). */
typedef struct mili_linear_desc {
  const void *w;      /* packed weight */
  const void *scales; /* int8: float per output column; int4, int8g: per column and group (scale_mode's form) */
  const void *aux;    /* int8: column sums (int32); int4, int8g: offsets (as the scales; NULL: symmetric) */
  int64_t n, k;       /* output (a multiple of 16: no padding) and input features */
  int64_t group;      /* int4, int8g: input features per scale, else 0 */
  int64_t scale_mode; /* int4, int8g: SCALES_F16, SCALES_F32 or SCALES_K */
  int64_t sub;        /* int4, int8g with SCALES_K: groups per super-block */
  int64_t int8g;      /* 8-bit weights per group (mili_linear_int8g; 2: signed with offsets), else int4 where group is set */
  int64_t high_bits;  /* int4: bits above the nibble (0, 1, 2) */
  const struct mili_linear_desc *next; /* the layer's next output columns, in another form (a fused layer whose
                                          parts differ in type: Q4_K_M's q|k beside a Q6_K v), or NULL */
  const mili_lora_desc *lora; /* the layer's LoRA adapters (on the first part: the whole layer's output), or NULL */
} mili_linear_desc;

/* One decoder layer (decode_layer.c). */
typedef struct mili_layer_desc {
  int64_t hidden, q_heads, kv_heads, head_dim, inter;
  float eps, scale; /* RMSNorm's epsilon; attention's softmax scale */
  const bf16 *input_norm, *post_norm, *q_norm, *k_norm;
  mili_linear_desc qkv, o, gate_up, down;
} mili_layer_desc;

/* One layer's K/V pages (attention.c, kv_int8.c): bf16 [pages, kv_heads, page_size, head_dim], or (k_scales set) int8
 * values of that shape beside float32 scales [pages, kv_heads, page_size], one a token and kv head (kv_int8.c). */
typedef struct mili_kv_pages {
  void *k, *v;
  float *k_scales, *v_scales; /* int8 pages' scales; NULL: bf16 pages */
  int64_t kv_heads, head_dim, page_size;
} mili_kv_pages;

/* The pages B sequences hold: page_table [B, ldp] (page ids), and how many positions each attends over. */
typedef struct mili_seq_pages {
  const int64_t *page_table;
  int64_t ldp;
  const int64_t *context_lens; /* [B] */
  int64_t B;
} mili_seq_pages;

/* A decode step's T tokens through the fused decoder layers (decode_layer.c). */
typedef struct mili_decode_step {
  bf16 *h;                   /* [T, hidden]: the embeddings in, the last layer's MLP output out */
  bf16 *residual;            /* [T, hidden]: the residual stream out */
  const int64_t *slots;      /* [T]: where each token's K/V go (< 0: skipped) */
  const float *cos, *sin;    /* [T, head_dim] float32: each token's rotary angles */
  bf16 *work;                /* T x (hidden + qkv.n + q_heads x head_dim + hidden + gate_up.n + inter) */
  const int64_t *lora_slots; /* [T]: each token's LoRA adapter slot (< 0: none), or NULL: no adapters this step */
  int64_t T;
} mili_decode_step;

/* -- the build (common.h, linear.c) ------------------------------------------------------------------------------ */
const char *mili_isa(void);   /* the ISA layer this library was built with */
int mili_amx_init(void);      /* 0 where Linux grants the AMX tile state (builds without AMX: -1) */
void mili_use_amx(int on);    /* the linear layers on AMX tiles (after mili_amx_init) */
int mili_uses_amx(void);

/* -- linear layers (linear.c): y [M, N] = x [M, K] @ W^T over packed weights -------------------------------------- */
void mili_linear(const bf16 *w, const bf16 *x, bf16 *y, int64_t M, int64_t N, int64_t K, int nthreads);
void mili_linear_int8(const int8_t *w, const float *sw, const int32_t *colsum, const bf16 *x, bf16 *y, int64_t M,
                      int64_t N, int64_t K, int nthreads);
void mili_linear_int4(const uint8_t *w, const void *ws, const void *wb, const bf16 *x, bf16 *y, int64_t M, int64_t N,
                      int64_t K, int64_t group, int scale_mode, int64_t sub, int high_bits, int64_t ldy, int nthreads);
void mili_linear_int8g(const uint8_t *w, const void *ws, const void *wb, const bf16 *x, bf16 *y, int64_t M, int64_t N,
                       int64_t K, int64_t group, int scale_mode, int64_t sub, int signed_q, int64_t ldy, int nthreads);

/* -- norms, RoPE, SwiGLU (norms.c) ------------------------------------------------------------------------------- */
void mili_rms_norm(const bf16 *x, int64_t ldx, const bf16 *residual, const bf16 *w, bf16 *out, bf16 *res_out,
                   int64_t T, int64_t D, float eps, int nthreads);
void mili_qk_norm_rope(bf16 *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const bf16 *qw,
                       const bf16 *kw, float eps, const float *cos_t, const float *sin_t, int nthreads);
void mili_silu_and_mul(const bf16 *gate_up, bf16 *out, int64_t T, int64_t I, int nthreads);

/* -- attention over the pages, bf16 or int8 (attention.c, kv_int8.c) ------------------------------------------ */
/* k, v [T, kv_heads, head_dim] (token strides ldk, ldv) into the pages at flat slots (page x page_size + offset) */
void mili_store_kv(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, const int64_t *slots, int64_t T,
                   const mili_kv_pages *kv, int nthreads);
/* one query token a sequence, q [B, Hq, head_dim] (sequence stride ldq), over its pages in place: out [B, Hq, D] */
void mili_decode_attention(const bf16 *q, int64_t ldq, int64_t Hq, float scale, const mili_kv_pages *kv,
                           const mili_seq_pages *seqs, bf16 *out, int nthreads);
/* int8 pages: the first n positions of each sequence's K (which 0) or V (1), dequantized: out [B, n, kv_heads, D] */
void mili_gather_kv_int8(const mili_kv_pages *kv, int which, const mili_seq_pages *seqs, int64_t n, bf16 *out,
                         int nthreads);
void mili_prefill_attention(const bf16 *q, int64_t ldq, const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv,
                            bf16 *out, int64_t ldo, int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, int nthreads);

/* -- LoRA (lora.c) ----------------------------------------------------------------------------------------------- */
void mili_lora_add(const mili_lora_desc *L, const bf16 *x, int64_t K, bf16 *y, int64_t ldy, int64_t M,
                   const int64_t *slots, int nthreads);

/* -- a decode step's decoder layers in one call (decode_layer.c) ------------------------------------------------- */
void mili_decode_layer(const mili_layer_desc *L, int first, const mili_kv_pages *kv, const mili_seq_pages *seqs,
                       const mili_decode_step *step, int nthreads);
void mili_decode_layers(const mili_layer_desc *layers, const mili_kv_pages *kv, int64_t n, const mili_seq_pages *seqs,
                        const mili_decode_step *step, int nthreads);

/* -- sampling (sampling.c) --------------------------------------------------------------------------------------- */
void mili_argmax_rows(const bf16 *x, int64_t ld, int64_t R, int64_t N, int64_t *out, int nthreads);
void mili_apply_bitmask(float *logits, int64_t ld, const int32_t *bitmask, int64_t ldm, const int64_t *rows,
                        int64_t nrows, int64_t V, int nthreads);

/* -- Gated DeltaNet's decode step (gdn.c) ------------------------------------------------------------------------ */
void mili_gdn_decode(const void *qkv, int64_t ldq, const void *ba, int64_t ldba, int bf16_io, void *conv_states,
                     float *ssm_states, const int64_t *slots, const uint8_t *fresh, const float *conv_w,
                     const float *A_log, const float *dt_bias, float *out, int64_t B, int64_t Hk, int64_t Hv,
                     int64_t Dk, int64_t Dv, int64_t K, int nthreads);

#endif
