/* The per-ISA layer for AVX2 + FMA + F16C (Haswell and later, Zen 1 to 3, Intel's Core 12th-14th generation
 * and Core Ultra): each 16-lane vector of kernels.c is a pair of 256-bit registers.
 * AVX2 has no bf16 instructions: widening is a 16-bit shift, narrowing rounds to nearest even as torch does.
 * int8 products: with AVX-VNNI (Alder Lake and later; on a CPU with AVX-512 VNNI, its EVEX form of the same
 * 256-bit instruction) vpdpbusd, x offset by 128 as on AVX-512; without it vpmaddubsw + vpmaddwd on
 * (|x|, sign(w, x)), llama.cpp's trick: |x| <= 127 and |w| <= 127 keep each pair's sum within int16. */
#include <immintrin.h>

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define ISA_VNNI 1
#define ISA_NAME "avx2-vnni"
#else
#define ISA_VNNI 0
#define ISA_NAME "avx2"
#endif
#define MR_MAX 4 /* 16 ymm registers: 4 rows x 1 block of sums (8), the block's weights (4), x (2) */
#define NB_MAX 1
#define NB_ONE 4 /* at M = 1: four blocks' sums (8 registers), one block's weights at a time */
#define I4_MR 2 /* int4: 2 rows x 1 block; at M = 1 2 blocks, each with two sums (8 registers) */
#define I4_NB 1
#define I4_NB_ONE 2
#define INT8_X_OFFSET (ISA_VNNI ? 128 : 0)
#define INT4_APART ISA_VNNI /* vpmaddubsw would saturate on the high nibbles in place */

typedef struct { __m256 a, b; } vf;  /* lanes 0-7, 8-15 */
typedef struct { __m256i a, b; } vi;

#define VF2(expr_a, expr_b) return (vf){(expr_a), (expr_b)}
#define VI2(expr_a, expr_b) return (vi){(expr_a), (expr_b)}

static inline vf vf_zero(void) { VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float x) { VF2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf vf_load(const float *p) { VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline vf vf_add(vf x, vf y) { VF2(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
static inline vf vf_sub(vf x, vf y) { VF2(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
static inline vf vf_mul(vf x, vf y) { VF2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline vf vf_div(vf x, vf y) { VF2(_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)); }
static inline vf vf_max(vf x, vf y) { VF2(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
static inline vf vf_min(vf x, vf y) { VF2(_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)); }
static inline vf vf_abs(vf x) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  VF2(_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m));
}
static inline vf vf_fmadd(vf x, vf y, vf z) { VF2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static inline vf vf_fnmadd(vf x, vf y, vf z) { VF2(_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)); }
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_reduce_add(vf x) { return hsum8(_mm256_add_ps(x.a, x.b)); }
static inline float vf_reduce_max(vf x) {
  __m256 m = _mm256_max_ps(x.a, x.b);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vf_round(vf x) {
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  VF2(_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode));
}
static inline __m256 pow2_8(__m256 n) { /* 2^n for integral n in [-126, 128] (128: infinity) */
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_scale2(vf x, vf n) { VF2(_mm256_mul_ps(x.a, pow2_8(n.a)), _mm256_mul_ps(x.b, pow2_8(n.b))); }

static inline vi vi_zero(void) { VI2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline vi vi_set1(int32_t x) { VI2(_mm256_set1_epi32(x), _mm256_set1_epi32(x)); }
static inline vi vi_load(const int32_t *p) {
  VI2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 8)));
}
static inline void vi_store(int32_t *p, vi x) {
  _mm256_storeu_si256((__m256i *)p, x.a);
  _mm256_storeu_si256((__m256i *)(p + 8), x.b);
}
static inline vi vi_load_i8(const int8_t *p) {
  VI2(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}

/* acc + the pairwise int16 products of a and b (vpmaddwd; with AVX-VNNI, vpdpwssd: the add in one) */
static inline __attribute__((always_inline)) __m256i dp_i16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
/* The int8 pages' products (kv_int8.c): 32 int8 widened to int16, as 16 pairs (values 2i, 2i + 1: pair i), in two
 * registers of 8 pairs */
typedef struct { __m256i a, b; } vw;
static inline vw vw_load_i8(const int8_t *p) {
  return (vw){_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
              _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
/* lane i of acc + pair i of x . (pair's low int16, its high int16); |products| stay within int32 */
static inline vi vi_dp_pairs(vi acc, vw x, int32_t pair) {
  const __m256i w = _mm256_set1_epi32(pair);
  VI2(dp_i16(acc.a, x.a, w), dp_i16(acc.b, x.b, w));
}
#define KV_QK_HEADS 2 /* query heads a pass of q . k (two sums each), and P V's sums in registers (16 ymm) */
#define KV_PV_SUMS 4
/* the first n (<= 16 of) lanes' low 16 bits at p */
static inline void vi_store_i16_n(int16_t *p, vi x, int64_t n) {
  int16_t t[16];
  _mm256_storeu_si256((__m256i *)t, _mm256_permute4x64_epi64(_mm256_packs_epi32(x.a, x.b), 0xd8));
  memcpy(p, t, sizeof(int16_t) * (n < 16 ? n : 16));
}
static inline vi vi_add(vi x, vi y) { VI2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
static inline vi vi_sub(vi x, vi y) { VI2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
static inline vi vi_shl(vi x, int n) { VI2(_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)); }
static inline vi vi_sra(vi x, int n) { VI2(_mm256_srai_epi32(x.a, n), _mm256_srai_epi32(x.b, n)); }
static inline vf vi_to_vf(vi x) { VF2(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
static inline vi vf_to_vi(vf x) { VI2(_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)); } /* nearest even */
static inline int32_t vi_reduce_add(vi x) {
  __m256i s = _mm256_add_epi32(x.a, x.b);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
static inline void vi_store_i8(int8_t *p, vi x) { /* each lane's low byte */
  const __m256i byte = _mm256_set1_epi32(0xff);
  __m256i t = _mm256_packus_epi32(_mm256_and_si256(x.a, byte), _mm256_and_si256(x.b, byte)); /* a0-3 b0-3 | a4-7 b4-7 */
  t = _mm256_permute4x64_epi64(t, 0xd8);                                                      /* a0-7 | b0-7 */
  _mm_storeu_si128((__m128i *)p, _mm_packus_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}

static inline __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
static inline vf vf_load_bf16(const uint16_t *p) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)p);
  VF2(widen8(_mm256_castsi256_si128(v)), widen8(_mm256_extracti128_si256(v, 1)));
}
static inline __m256i narrow8(__m256 v) { /* bf16 bits in each lane's low half, nearest even, NaN quiet */
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  const __m256i q = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
  return _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan)), 16);
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
  const __m256i t = _mm256_permute4x64_epi64(_mm256_packus_epi32(narrow8(v.a), narrow8(v.b)), 0xd8);
  _mm256_storeu_si256((__m256i *)p, t);
}
static inline vf vf_load_f16(const uint16_t *p) {
  VF2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}

/* -- the linear layers' operands: a 64-byte row of a packed block (16 columns x 2 bf16 / 4 int8 / 8 int4) -- */
#define ISA_X_F32 1 /* the bf16 products read x widened to float32 once (x_f32): two broadcast loads a pair */
typedef struct { __m256 hi, lo; } xpair; /* x[k + 1] and x[k], broadcast */
static inline xpair x_f32(const float *x) { return (xpair){_mm256_broadcast_ss(x + 1), _mm256_broadcast_ss(x)}; }
typedef struct { __m256 h0, l0, h1, l1; } wrow; /* columns 0-7 and 8-15: w[c][k + 1] (hi) and w[c][k] (lo) */
static inline wrow w_bf16(const uint8_t *p) {
  const __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 32));
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  wrow r;
  r.h0 = _mm256_castsi256_ps(_mm256_and_si256(a, high));
  r.l0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
  r.h1 = _mm256_castsi256_ps(_mm256_and_si256(b, high));
  r.l1 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  return r;
}
/* a weight row widened: w[c][k] into even[c], w[c][k + 1] into odd[c] (a float32 panel for many rows of x) */
static inline void w_bf16_widen(const uint8_t *p, float *even, float *odd) {
  const wrow w = w_bf16(p);
  _mm256_storeu_ps(even, w.l0);
  _mm256_storeu_ps(even + 8, w.l1);
  _mm256_storeu_ps(odd, w.h0);
  _mm256_storeu_ps(odd + 8, w.h1);
}
#define F32_MR 6 /* the float32 panel kernel's rows: 12 ymm of sums, 2 of weights, 1 broadcast */
static inline vf dot_bf16(vf acc, xpair x, wrow w) {
  VF2(_mm256_fmadd_ps(w.l0, x.lo, _mm256_fmadd_ps(w.h0, x.hi, acc.a)),
      _mm256_fmadd_ps(w.l1, x.lo, _mm256_fmadd_ps(w.h1, x.hi, acc.b)));
}
/* 32 bf16 of a against 32 of b, summed into the 16 lanes (attention's q . k) */
static inline vf dot_bf16x32(vf acc, const uint16_t *a, const uint16_t *b) {
  const vf a0 = vf_load_bf16(a), a1 = vf_load_bf16(a + 16), b0 = vf_load_bf16(b), b1 = vf_load_bf16(b + 16);
  return vf_fmadd(a1, b1, vf_fmadd(a0, b0, acc));
}

typedef struct { __m256i x, ax; } xq4; /* 4 int8 of x broadcast (offset by INT8_X_OFFSET), and |x| */
typedef struct { __m256i a, b; } wrow8;
static inline xq4 x_int8(const int8_t *x) {
  int32_t word;
  memcpy(&word, x, 4);
  xq4 r;
  r.x = _mm256_set1_epi32(word);
  r.ax = _mm256_abs_epi8(r.x);
  return r;
}
static inline wrow8 w_int8(const uint8_t *p) {
  wrow8 r;
  r.a = _mm256_loadu_si256((const __m256i *)p);
  r.b = _mm256_loadu_si256((const __m256i *)(p + 32));
  return r;
}
#define INT8_TARGET
#if ISA_VNNI
#ifdef __AVXVNNI__
#define DPBUSD _mm256_dpbusd_avx_epi32
#else
#define DPBUSD _mm256_dpbusd_epi32
#endif
static inline vi dot_int8(vi acc, xq4 x, wrow8 w) { VI2(DPBUSD(acc.a, x.x, w.a), DPBUSD(acc.b, x.x, w.b)); }
static inline vi dot_int4(vi acc, xq4 x, wrow8 w) { VI2(DPBUSD(acc.a, w.a, x.x), DPBUSD(acc.b, w.b, x.x)); }
typedef vi i4acc; /* int4's running sums between flushes: int32 (vpdpbusd accumulates in int32) */
#define I4_STEPS (1 << 30)
static inline i4acc i4_zero(void) { return vi_zero(); }
static inline i4acc i4_dot(i4acc t, xq4 x0, wrow8 lo, xq4 x1, wrow8 hi) { return dot_int4(dot_int4(t, x0, lo), x1, hi); }
static inline vi i4_flush(vi acc, i4acc t) { return vi_add(acc, t); }
#else
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
/* x signed: |x| x sign(w, x) = x w, pairs within int16 (|x|, |w| <= 127) */
static inline vi dot_int8(vi acc, xq4 x, wrow8 w) {
  VI2(dot_u8s8(acc.a, x.ax, _mm256_sign_epi8(w.a, x.x)), dot_u8s8(acc.b, x.ax, _mm256_sign_epi8(w.b, x.x)));
}
/* nibbles (0..15) unsigned times x signed: pairs within int16 */
static inline vi dot_int4(vi acc, xq4 x, wrow8 w) { VI2(dot_u8s8(acc.a, w.a, x.x), dot_u8s8(acc.b, w.b, x.x)); }
/* int4's running sums between flushes: int16 lanes, each the sum of a pair of products per vpmaddubsw; a step
 * (low and high nibbles) adds at most 4 x 15 x 127 = 7620 to a lane, so 4 steps stay within int16, and one
 * vpmaddwd per 4 steps widens them (where one per product pair took half the multiply ports). With hb high bits
 * (values up to 31 or 63) a step adds up to 15748 or 32004: I4_STEPS >> hb steps (2, 1) a flush. */
typedef struct { __m256i a, b; } i4acc;
#define I4_STEPS 4
static inline i4acc i4_zero(void) { return (i4acc){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline i4acc i4_dot(i4acc t, xq4 x0, wrow8 lo, xq4 x1, wrow8 hi) {
  t.a = _mm256_add_epi16(t.a, _mm256_add_epi16(_mm256_maddubs_epi16(lo.a, x0.x), _mm256_maddubs_epi16(hi.a, x1.x)));
  t.b = _mm256_add_epi16(t.b, _mm256_add_epi16(_mm256_maddubs_epi16(lo.b, x0.x), _mm256_maddubs_epi16(hi.b, x1.x)));
  return t;
}
static inline vi i4_flush(vi acc, i4acc t) {
  const __m256i one = _mm256_set1_epi16(1);
  VI2(_mm256_add_epi32(acc.a, _mm256_madd_epi16(t.a, one)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(t.b, one)));
}
#endif
/* int8g (8-bit weights per group, kernels.c): with VNNI, u unsigned (0..255) times x signed in one vpdpbusd.
 * Without it vpmaddubsw would saturate (a pair of 255 x 127 is past int16), so the sums are of x v, v = u - 128
 * (the top bit flipped): |v| x sign(x, v), llama.cpp's order (|v| <= 128 is exact unsigned, where sign(v, x)
 * would wrap at v = -128); a pair is then at most 2 x 128 x 127 = 32512, within int16. */
#define I8G_MR 2
#define I8G_NB 1
#define I8G_NB_ONE 2
#if ISA_VNNI
#define I8G_SIGNED 0 /* the sums are of x u */
typedef wrow8 wrowg;
static inline wrowg w_int8g(const uint8_t *p) { return w_int8(p); }
static inline vi dot_int8g(vi acc, xq4 x, wrowg w) { VI2(DPBUSD(acc.a, w.a, x.x), DPBUSD(acc.b, w.b, x.x)); }
#else
#define I8G_SIGNED 1 /* the sums are of x (u - 128) */
typedef struct { __m256i a, b, aa, ab; } wrowg; /* v, and |v| */
static inline wrowg w_int8g(const uint8_t *p) {
  const __m256i top = _mm256_set1_epi8((char)0x80);
  wrowg r;
  r.a = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), top);
  r.b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 32)), top);
  r.aa = _mm256_abs_epi8(r.a);
  r.ab = _mm256_abs_epi8(r.b);
  return r;
}
static inline vi dot_int8g(vi acc, xq4 x, wrowg w) {
  VI2(dot_u8s8(acc.a, w.aa, _mm256_sign_epi8(x.x, w.a)), dot_u8s8(acc.b, w.ab, _mm256_sign_epi8(x.x, w.b)));
}
#endif
static inline void w_int4(const uint8_t *p, wrow8 *lo, wrow8 *hi, int in_place) {
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8((char)0xF0);
  const __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 32));
  lo->a = _mm256_and_si256(a, low);
  lo->b = _mm256_and_si256(b, low);
  hi->a = in_place ? _mm256_and_si256(a, high) : _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
  hi->b = in_place ? _mm256_and_si256(b, high) : _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
}
/* int4 with high bits: each value's hb bits above its nibble ORed into lo and hi at bit 4 (see isa_avx512.h for the
 * plane's lanes of 16 hb bytes; here a ymm holds two of them at hb 1, one at hb 2) */
static inline void w_int4_high(const uint8_t *h, wrow8 *lo, wrow8 *hi, const int hb) {
  const __m256i e = hb == 2 ? _mm256_loadu_si256((const __m256i *)h)
                            : _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)h));
  const __m256i mask = _mm256_set1_epi8((char)(hb == 2 ? 0x30 : 0x10));
  const __m256i up_a = hb == 2 ? _mm256_set1_epi64x(4) : _mm256_setr_epi64x(4, 4, 3, 3);
  const __m256i up_b = hb == 2 ? _mm256_set1_epi64x(2) : _mm256_setr_epi64x(2, 2, 1, 1);
  const __m256i down_a = hb == 2 ? _mm256_set1_epi64x(0) : _mm256_setr_epi64x(0, 0, 1, 1);
  const __m256i down_b = hb == 2 ? _mm256_set1_epi64x(2) : _mm256_setr_epi64x(2, 2, 3, 3);
  lo->a = _mm256_or_si256(lo->a, _mm256_and_si256(_mm256_sllv_epi64(e, up_a), mask));
  lo->b = _mm256_or_si256(lo->b, _mm256_and_si256(_mm256_sllv_epi64(e, up_b), mask));
  hi->a = _mm256_or_si256(hi->a, _mm256_and_si256(_mm256_srlv_epi64(e, down_a), mask));
  hi->b = _mm256_or_si256(hi->b, _mm256_and_si256(_mm256_srlv_epi64(e, down_b), mask));
}
static inline void w_store8(uint8_t *p, wrow8 v, int add) {
  const __m256i k = _mm256_set1_epi8((char)add);
  _mm256_storeu_si256((__m256i *)p, _mm256_add_epi8(v.a, k));
  _mm256_storeu_si256((__m256i *)(p + 32), _mm256_add_epi8(v.b, k));
}

/* One constant hint per call: GCC 12 dropped the whole prefetch, without a word, where the hint was
 * `far ? _MM_HINT_T1 : _MM_HINT_T0` and this was inlined into always_inline kernels (the linear micro-kernels'
 * prefetches never reached the library; benchmarks/NOTES.md, step 13). */
static inline __attribute__((always_inline)) void prefetch(const void *p, int far) {
  if (far) __builtin_prefetch(p, 0, 2); /* prefetcht1 */
  else __builtin_prefetch(p, 0, 3);     /* prefetcht0 */
}
