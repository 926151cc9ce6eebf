/* The per-ISA layer for aarch64 Advanced SIMD (every 64-bit Arm CPU: Graviton, Ampere, Grace, Apple silicon):
 * each 16-lane vector of kernels.c is four 128-bit registers. bf16 widens by a 16-bit shift (the BF16
 * extension's bfdot is not used); int8 products use sdot where the CPU has the dot product extension
 * (Armv8.2 DotProd: Graviton 2 and later, Apple M1 and later), else smull + pairwise adds. x is signed in
 * both (no offset), and int4's high nibbles are shifted down (sdot is signed x signed). */
#include <arm_neon.h>

#ifdef __ARM_FEATURE_DOTPROD
#define ISA_NAME "neon-dot"
#else
#define ISA_NAME "neon"
#endif
#define MR_MAX 4 /* 32 registers: 4 rows x 1 block of sums (16), the block's weights (8), x (2) */
#define NB_MAX 1
#define NB_ONE 2
#define I4_MR 2
#define I4_NB 1
#define I4_NB_ONE 1
#define INT8_X_OFFSET 0
#define INT4_APART 0

typedef struct { float32x4_t v[4]; } vf;
typedef struct { int32x4_t v[4]; } vi;

#define VF4(expr) do { vf r_; for (int i_ = 0; i_ < 4; i_++) r_.v[i_] = (expr); return r_; } while (0)
#define VI4(expr) do { vi r_; for (int i_ = 0; i_ < 4; i_++) r_.v[i_] = (expr); return r_; } while (0)

static inline vf vf_zero(void) { VF4(vdupq_n_f32(0.0f)); }
static inline vf vf_set1(float x) { VF4(vdupq_n_f32(x)); }
static inline vf vf_load(const float *p) { VF4(vld1q_f32(p + 4 * i_)); }
static inline void vf_store(float *p, vf v) { for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.v[i]); }
static inline vf vf_add(vf x, vf y) { VF4(vaddq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_sub(vf x, vf y) { VF4(vsubq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_mul(vf x, vf y) { VF4(vmulq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_div(vf x, vf y) { VF4(vdivq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_max(vf x, vf y) { VF4(vmaxq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_min(vf x, vf y) { VF4(vminq_f32(x.v[i_], y.v[i_])); }
static inline vf vf_abs(vf x) { VF4(vabsq_f32(x.v[i_])); }
static inline vf vf_fmadd(vf x, vf y, vf z) { VF4(vfmaq_f32(z.v[i_], x.v[i_], y.v[i_])); }  /* x y + z */
static inline vf vf_fnmadd(vf x, vf y, vf z) { VF4(vfmsq_f32(z.v[i_], x.v[i_], y.v[i_])); } /* z - x y */
static inline float vf_reduce_add(vf x) {
  return vaddvq_f32(vaddq_f32(vaddq_f32(x.v[0], x.v[1]), vaddq_f32(x.v[2], x.v[3])));
}
static inline float vf_reduce_max(vf x) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(x.v[0], x.v[1]), vmaxq_f32(x.v[2], x.v[3])));
}
static inline vf vf_round(vf x) { VF4(vrndnq_f32(x.v[i_])); }
static inline float32x4_t pow2_4(float32x4_t n) { /* 2^n for integral n in [-126, 128] */
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
static inline vf vf_scale2(vf x, vf n) { VF4(vmulq_f32(x.v[i_], pow2_4(n.v[i_]))); }

static inline vi vi_zero(void) { VI4(vdupq_n_s32(0)); }
static inline vi vi_set1(int32_t x) { VI4(vdupq_n_s32(x)); }
static inline vi vi_load(const int32_t *p) { VI4(vld1q_s32(p + 4 * i_)); }
static inline void vi_store(int32_t *p, vi x) { for (int i = 0; i < 4; i++) vst1q_s32(p + 4 * i, x.v[i]); }
static inline vi vi_load_i8(const int8_t *p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
  vi r;
  r.v[0] = vmovl_s16(vget_low_s16(lo));
  r.v[1] = vmovl_s16(vget_high_s16(lo));
  r.v[2] = vmovl_s16(vget_low_s16(hi));
  r.v[3] = vmovl_s16(vget_high_s16(hi));
  return r;
}

/* The int8 pages' products (kv_int8.c): 32 int8 widened to int16, as 16 pairs (values 2i, 2i + 1: pair i), in four
 * registers of 4 pairs */
typedef struct { int16x8_t v[4]; } vw;
static inline vw vw_load_i8(const int8_t *p) {
  const int8x16_t a = vld1q_s8(p), b = vld1q_s8(p + 16);
  return (vw){{vmovl_s8(vget_low_s8(a)), vmovl_high_s8(a), vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b)}};
}
/* lane i of acc + pair i of x . (pair's low int16, its high int16): the products widened (smull), then each pair's
 * two added (addp) */
static inline vi vi_dp_pairs(vi acc, vw x, int32_t pair) {
  const int16x8_t w = vreinterpretq_s16_s32(vdupq_n_s32(pair));
  VI4(vaddq_s32(acc.v[i_], vpaddq_s32(vmull_s16(vget_low_s16(x.v[i_]), vget_low_s16(w)), vmull_high_s16(x.v[i_], w))));
}
#define KV_QK_HEADS 2 /* query heads a pass of q . k (two sums each), and P V's sums in registers (32 q registers) */
#define KV_PV_SUMS 4
static inline vi vi_add(vi x, vi y) { VI4(vaddq_s32(x.v[i_], y.v[i_])); }
static inline vi vi_sub(vi x, vi y) { VI4(vsubq_s32(x.v[i_], y.v[i_])); }
static inline vi vi_shl(vi x, int n) { VI4(vshlq_s32(x.v[i_], vdupq_n_s32(n))); }
static inline vi vi_sra(vi x, int n) { VI4(vshlq_s32(x.v[i_], vdupq_n_s32(-n))); }
static inline vf vi_to_vf(vi x) { VF4(vcvtq_f32_s32(x.v[i_])); }
static inline vi vf_to_vi(vf x) { VI4(vcvtnq_s32_f32(x.v[i_])); } /* nearest even */
/* the first n (<= 16 of) lanes' low 16 bits at p */
static inline void vi_store_i16_n(int16_t *p, vi x, int64_t n) {
  int16_t t[16];
  for (int i = 0; i < 4; i++) vst1_s16(t + 4 * i, vmovn_s32(x.v[i]));
  memcpy(p, t, sizeof(int16_t) * (n < 16 ? n : 16));
}
static inline int32_t vi_reduce_add(vi x) {
  return vaddvq_s32(vaddq_s32(vaddq_s32(x.v[0], x.v[1]), vaddq_s32(x.v[2], x.v[3])));
}
static inline void vi_store_i8(int8_t *p, vi x) { /* each lane's low byte */
  const uint16x8_t lo = vcombine_u16(vmovn_u32(vreinterpretq_u32_s32(x.v[0])), vmovn_u32(vreinterpretq_u32_s32(x.v[1])));
  const uint16x8_t hi = vcombine_u16(vmovn_u32(vreinterpretq_u32_s32(x.v[2])), vmovn_u32(vreinterpretq_u32_s32(x.v[3])));
  vst1q_s8(p, vreinterpretq_s8_u8(vcombine_u8(vmovn_u16(lo), vmovn_u16(hi))));
}

static inline float32x4_t widen4(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
static inline vf vf_load_bf16(const uint16_t *p) {
  const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
  vf r;
  r.v[0] = widen4(vget_low_u16(a));
  r.v[1] = widen4(vget_high_u16(a));
  r.v[2] = widen4(vget_low_u16(b));
  r.v[3] = widen4(vget_high_u16(b));
  return r;
}
static inline uint16x4_t narrow4(float32x4_t v) { /* nearest even, NaN quiet */
  const uint32x4_t x = vreinterpretq_u32_f32(v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(x, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(x, vaddq_u32(vdupq_n_u32(0x7fff), odd));
  const uint32x4_t q = vorrq_u32(x, vdupq_n_u32(0x400000));
  return vshrn_n_u32(vbslq_u32(vceqq_f32(v, v), r, q), 16);
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
  vst1q_u16(p, vcombine_u16(narrow4(v.v[0]), narrow4(v.v[1])));
  vst1q_u16(p + 8, vcombine_u16(narrow4(v.v[2]), narrow4(v.v[3])));
}
static inline vf vf_load_f16(const uint16_t *p) { VF4(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i_)))); }

/* -- the linear layers' operands: a 64-byte row of a packed block (16 columns x 2 bf16 / 4 int8 / 8 int4) -- */
#define ISA_X_F32 1 /* the bf16 products read x widened to float32 once (x_f32) */
typedef struct { float32x4_t hi, lo; } xpair; /* x[k + 1] and x[k], broadcast */
static inline xpair x_f32(const float *x) { return (xpair){vld1q_dup_f32(x + 1), vld1q_dup_f32(x)}; }
typedef struct { float32x4_t hi[4], lo[4]; } wrow;
static inline wrow w_bf16(const uint8_t *p) {
  wrow r;
  for (int i = 0; i < 4; i++) {
    const uint32x4_t v = vld1q_u32((const uint32_t *)(p + 16 * i));
    r.hi[i] = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xffff0000u)));
    r.lo[i] = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
  }
  return r;
}
static inline void w_bf16_widen(const uint8_t *p, float *even, float *odd) {
  const wrow w = w_bf16(p);
  for (int i = 0; i < 4; i++) {
    vst1q_f32(even + 4 * i, w.lo[i]);
    vst1q_f32(odd + 4 * i, w.hi[i]);
  }
}
#define F32_MR 6 /* the float32 panel kernel's rows: 24 q registers of sums, 4 of weights, 1 broadcast */
static inline vf dot_bf16(vf acc, xpair x, wrow w) { VF4(vfmaq_f32(vfmaq_f32(acc.v[i_], w.hi[i_], x.hi), w.lo[i_], x.lo)); }
static inline vf dot_bf16x32(vf acc, const uint16_t *a, const uint16_t *b) {
  return vf_fmadd(vf_load_bf16(a + 16), vf_load_bf16(b + 16), vf_fmadd(vf_load_bf16(a), vf_load_bf16(b), acc));
}

typedef int8x16_t xq4; /* 4 int8 of x, repeated */
typedef struct { int8x16_t v[4]; } wrow8; /* 4 x (4 columns x 4 k) */
static inline xq4 x_int8(const int8_t *x) {
  int32_t word;
  memcpy(&word, x, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(word));
}
static inline wrow8 w_int8(const uint8_t *p) {
  wrow8 r;
  for (int i = 0; i < 4; i++) r.v[i] = vld1q_s8((const int8_t *)p + 16 * i);
  return r;
}
#define INT8_TARGET
#ifdef __ARM_FEATURE_DOTPROD
static inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) { return vdotq_s32(acc, w, x); }
#else
static inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) { /* 4 columns' 4-term dot products */
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
  return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
}
#endif
static inline vi dot_int8(vi acc, xq4 x, wrow8 w) { VI4(dot4(acc.v[i_], w.v[i_], x)); }
static inline vi dot_int4(vi acc, xq4 x, wrow8 w) { VI4(dot4(acc.v[i_], w.v[i_], x)); }
typedef vi i4acc; /* int4's running sums between flushes (see isa_avx2.h): int32 here, flushed once a group */
#define I4_STEPS (1 << 30)
static inline i4acc i4_zero(void) { return vi_zero(); }
static inline i4acc i4_dot(i4acc t, xq4 x0, wrow8 lo, xq4 x1, wrow8 hi) { return dot_int4(dot_int4(t, x0, lo), x1, hi); }
static inline vi i4_flush(vi acc, i4acc t) { return vi_add(acc, t); }
/* int8g (8-bit weights per group, kernels.c): sdot is signed x signed, so the sums are of x v, v = u - 128 (the
 * top bit flipped), as are smull's without the dot product (|x v| <= 127 x 128 fits int16) */
#define I8G_SIGNED 1
#define I8G_MR 2
#define I8G_NB 1
#define I8G_NB_ONE 2
typedef wrow8 wrowg;
static inline wrowg w_int8g(const uint8_t *p) {
  wrowg r;
  for (int i = 0; i < 4; i++) r.v[i] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16 * i), vdupq_n_u8(0x80)));
  return r;
}
static inline vi dot_int8g(vi acc, xq4 x, wrowg w) { VI4(dot4(acc.v[i_], w.v[i_], x)); }
static inline void w_int4(const uint8_t *p, wrow8 *lo, wrow8 *hi, int in_place) {
  (void)in_place; /* (INT4_APART is 0: never asked) */
  for (int i = 0; i < 4; i++) {
    const uint8x16_t v = vld1q_u8(p + 16 * i);
    lo->v[i] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
    hi->v[i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  }
}
/* int4 with high bits: each value's hb bits above its nibble ORed into lo and hi at bit 4 (see isa_avx512.h for the
 * plane's lanes of 16 hb bytes; register i of a row is in lane i / hb, at its byte 16 (i % hb)) */
static inline void w_int4_high(const uint8_t *h, wrow8 *lo, wrow8 *hi, const int hb) {
  const uint8x16_t mask = vdupq_n_u8(hb == 2 ? 0x30 : 0x10);
  for (int i = 0; i < 4; i++) {
    const uint8x16_t e = vld1q_u8(h + 16 * (i % hb));
    const int lane = i / hb;
    const uint8x16_t up = vandq_u8(vshlq_u8(e, vdupq_n_s8((int8_t)(4 - hb * lane))), mask);
    const uint8x16_t down = vandq_u8(vshlq_u8(e, vdupq_n_s8((int8_t)(-hb * lane))), mask); /* (negative: right) */
    lo->v[i] = vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(lo->v[i]), up));
    hi->v[i] = vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(hi->v[i]), down));
  }
}
static inline void w_store8(uint8_t *p, wrow8 v, int add) {
  for (int i = 0; i < 4; i++) vst1q_u8(p + 16 * i, vaddq_u8(vreinterpretq_u8_s8(v.v[i]), vdupq_n_u8((uint8_t)add)));
}

static inline void prefetch(const void *p, int far) {
  if (far) __builtin_prefetch(p, 0, 2);
  else __builtin_prefetch(p, 0, 3);
}
