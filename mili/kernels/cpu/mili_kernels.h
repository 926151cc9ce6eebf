/* MILI's CPU kernels: their ABI, written once. kernels.c includes this header (so the compiler holds each
 * definition to its prototype here), and the Python side reads it (mili/kernels/cpu/abi.py): the ctypes argument and
 * return types of every function below, the ctypes structures of the descriptors and the enums' constants, parsed
 * from this text. Keep it to what abi.py reads: the includes and the bf16 typedef, enums with each value written,
 * structs as `typedef struct NAME { fields } NAME;` with fields of the scalar types, pointers, arrays of a constant
 * length and the structs above them, and one prototype a declaration. Each function's behaviour is described at its definition, in the family's file named here.
 *
 * bf16 values are uint16_t (the top half of a float32). Every function takes the thread count to use. */
#ifndef MILI_KERNELS_H
#define MILI_KERNELS_H
#include <stdint.h>

typedef uint16_t bf16;

/* scale_mode's values (linear.c: the int4 and int8g kernels' scales) */
enum { SCALES_F16 = 0, SCALES_F32 = 1, SCALES_K = 2 };

/* -- descriptors ---------------------------------------------------------------------------------------------- */

/* A layer's LoRA adapters (lora.c; mili/lora.py's LoRALinear builds it). */
typedef struct mili_lora_desc {
  const bf16 *a;    /* packed A [columns, k] */
  const bf16 *b[3]; /* per shard: packed B_j [n_j (padded to 16), kb] */
  int64_t n[3];     /* per shard: output features */
  int64_t shards, columns, width, rank, slots, kb;
} mili_lora_desc;

/* One linear layer's packed weights: the int8, int4 and int8g kernels' operand (linear.c), and each of the fused
 * decode step's linears (decode_layer.c). */
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

/* RMSNorm's T rows (norms.c), with a residual added first where one is given. */
typedef struct mili_norm_rows {
  const bf16 *x;        /* [T, D] at row stride ldx: the rows in */
  int64_t ldx;          /* x's row stride (elements) */
  const bf16 *residual; /* [T, D]: s = bf16(x + residual) is normalized, or NULL: s = x */
  bf16 *res_out;        /* [T, D]: s, where residual is set (may be residual itself: in place) */
  bf16 *out;            /* [T, D]: the normalized rows */
  int64_t T, D;         /* rows; features (D % 16 == 0) */
} mili_norm_rows;

/* The query and key heads of T rows of a fused qkv output, for q/k-norm + RoPE in place (norms.c). */
typedef struct mili_qk_heads {
  bf16 *qkv;                           /* [T, ld]: each row q (q_heads x head_dim) | k (kv_heads x head_dim) | the
                                          rest (v, padding: untouched) */
  int64_t ld, T;                       /* qkv's row stride (elements); rows */
  int64_t q_heads, kv_heads, head_dim; /* head_dim % 32 == 0, <= 1024 */
  const float *cos, *sin;              /* [T, head_dim] float32: each row's rotary angles */
} mili_qk_heads;

/* One sequence's prefill chunk as causal attention reads it (attention.c): its Lq queries are the last Lq of the Lk
 * positions whose K/V are k, v. */
typedef struct mili_prefill_chunk {
  const bf16 *q;                       /* [Lq, q_heads, head_dim] at token stride ldq */
  const bf16 *k, *v;                   /* [Lk, kv_heads, head_dim] at token strides ldk, ldv */
  int64_t ldq, ldk, ldv;               /* q's, k's and v's token strides (elements) */
  int64_t Lq, Lk;                      /* queries; positions (Lq <= Lk) */
  int64_t q_heads, kv_heads, head_dim; /* head_dim % 32 == 0 */
} mili_prefill_chunk;

/* One Gated DeltaNet layer as its decode step reads it (gdn.c): its weights, its shape and its state slots. The
 * conv's C = 2 k_heads k_dim + v_heads v_dim channels are q | k | v. */
typedef struct mili_gdn_layer {
  const float *conv_w;          /* [C, conv_width] float32: the depthwise causal conv's weights */
  const float *A_log, *dt_bias; /* [v_heads] float32: the decay's parameters */
  void *conv_states;            /* [slots, C, conv_width - 1]: each slot's last inputs (bf16_io's dtype; in place) */
  float *ssm_states;            /* [slots, v_heads, k_dim, v_dim] float32: each slot's state S (in place) */
  int64_t k_heads, v_heads;     /* key heads; value heads (a multiple of k_heads) */
  int64_t k_dim, v_dim;         /* a key head's features (<= 1024); a value head's (a multiple of 16) */
  int64_t conv_width;           /* the conv's taps */
  int64_t bf16_io;              /* 1: the step's qkv and ba and the conv states are bf16; 0: float32 */
} mili_gdn_layer;

/* A decode step's B sequences into a Gated DeltaNet layer (gdn.c), one token each. */
typedef struct mili_gdn_step {
  const void *qkv;      /* [B, ldq]: each token's q | k | v (C channels) before the conv, in bf16_io's dtype */
  const void *ba;       /* [B, ldba]: b | a (v_heads each), in bf16_io's dtype */
  int64_t ldq, ldba;    /* qkv's and ba's row strides (elements) */
  const int64_t *slots; /* [B]: each sequence's state slot */
  const uint8_t *fresh; /* [B]: nonzero where a sequence starts (its states from zeros), or NULL: none does */
  int64_t B;            /* sequences */
} mili_gdn_step;

/* -- the build (common.h, linear.c) ------------------------------------------------------------------------------ */
const char *mili_isa(void);   /* the ISA layer this library was built with */
int mili_amx_init(void);      /* 0 where Linux grants the AMX tile state (builds without AMX: -1) */
void mili_use_amx(int on);    /* the linear layers on AMX tiles (after mili_amx_init) */
int mili_uses_amx(void);

/* -- linear layers (linear.c): y [M, N] = x [M, K] @ W^T over packed weights -------------------------------------- */
void mili_linear(const bf16 *w, const bf16 *x, bf16 *y, int64_t M, int64_t N, int64_t K, int nthreads);
/* int8, int4 and int8g over l, one part of a layer (its next and lora are not read: decode_layer.c walks them);
 * int4 and int8g: y's rows ldy apart */
void mili_linear_int8(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int nthreads);
void mili_linear_int4(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int64_t ldy, int nthreads);
void mili_linear_int8g(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int64_t ldy, int nthreads);

/* -- norms, RoPE, SwiGLU (norms.c) ------------------------------------------------------------------------------- */
void mili_rms_norm(const mili_norm_rows *rows, const bf16 *w, float eps, int nthreads);
void mili_qk_norm_rope(const mili_qk_heads *heads, const bf16 *q_norm, const bf16 *k_norm, float eps, int nthreads);
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
/* causal attention of a prefill chunk: out [Lq, q_heads, head_dim] (token stride ldo) */
void mili_prefill_attention(const mili_prefill_chunk *c, float scale, bf16 *out, int64_t ldo, int nthreads);

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
/* out [B, v_heads, v_dim] float32; the layer's states updated in place */
void mili_gdn_decode(const mili_gdn_layer *L, const mili_gdn_step *step, float *out, int nthreads);

#endif
