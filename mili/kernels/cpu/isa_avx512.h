/* The per-ISA layer for AVX-512 (F/BW/VL): Skylake-X and later, Zen 4 and later. See kernels.c for what each
 * operation means; here each is one or two instructions on a 512-bit register.
 * AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids) gives vdpbf16ps and the bf16 conversions; without it
 * (Skylake-X to Ice Lake) they are emulated in AVX-512F: a bf16 is the top half of a float32, so widening is
 * a shift, the dot product of a pair is two FMAs (the odd element first, as vdpbf16ps adds them), narrowing
 * rounds to nearest even, NaNs kept quiet. AVX-512 VNNI gives vpdpbusd (u8 x s8 into int32); without it
 * the int8, int4 and int8g layers run aten's kernels instead (kernels.int8_available), and these functions are
 * compiled but never called. AMX (the linear layers' tiles) lives in kernels.c, built with this layer. */
#include <immintrin.h>

#define ISA_NAME "avx512"
#define ISA_HAS_AMX 1
#define MR_MAX 6  /* rows x 16-column blocks of sums kept in registers by the linear micro-kernel (32 zmm) */
#define NB_MAX 4
#define NB_ONE 4  /* blocks at M = 1 */
#define I4_MR 2   /* the int4 micro-kernel's rows, and blocks at M > 1 and M = 1 */
#define I4_NB 4
#define I4_NB_ONE 4
#define INT8_X_OFFSET 128 /* vpdpbusd takes x unsigned: q + 128, taken off with the weights' column sums */
#define INT4_APART 1 /* vpdpbusd takes int4's high nibbles in place (x 16, no shift): see int4_micro */

typedef __m512 vf;  /* 16 float32 */
typedef __m512i vi; /* 16 int32 */

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b */
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf a, vf n) { return _mm512_scalef_ps(a, n); } /* a 2^n, n integral */

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vi vi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
static inline void vi_store(int32_t *p, vi a) { _mm512_storeu_si512(p, a); }
static inline vi vi_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* acc + the pairwise int16 products of a and b (vpdpwssd with AVX-512 VNNI: vpmaddwd and the add in one) */
static inline __m512i dp_i16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
/* The int8 pages' products (kv_int8.c): 32 int8 widened to int16, as 16 pairs (values 2i, 2i + 1: pair i) */
typedef __m512i vw;
static inline vw vw_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
/* lane i of acc + pair i of x . (pair's low int16, its high int16) */
static inline vi vi_dp_pairs(vi acc, vw x, int32_t pair) { return dp_i16(acc, x, _mm512_set1_epi32(pair)); }
#define KV_QK_HEADS 4 /* query heads a pass of q . k (two sums each), and P V's sums in registers (32 zmm) */
#define KV_PV_SUMS 16
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
static inline vi vi_shl(vi a, int n) { return _mm512_slli_epi32(a, n); }
static inline vi vi_sra(vi a, int n) { return _mm512_srai_epi32(a, n); }
static inline vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vi vf_to_vi(vf a) { return _mm512_cvtps_epi32(a); } /* nearest even */
static inline int32_t vi_reduce_add(vi a) { return _mm512_reduce_add_epi32(a); }
static inline void vi_store_i8(int8_t *p, vi a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }

#ifdef __AVX512BF16__
static inline vf vf_load_bf16(const uint16_t *p) { return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)p)); }
static inline void vf_store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline vf dot_bf16_pairs(vf acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#else
static inline vf vf_load_bf16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(x, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
static inline vf dot_bf16_pairs(vf acc, __m512i a, __m512i b) {
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}
#endif
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* -- the linear layers' operands: a 64-byte row of a packed block (16 columns x 2 bf16 / 4 int8 / 8 int4) -- */
#define ISA_X_F32 0 /* x stays bf16: vdpbf16ps takes its pairs as they are */
typedef __m512i xpair; /* one x word (2 bf16), broadcast */
typedef __m512i wrow;  /* a weight row as the dot product takes it */
static inline xpair x_bf16(const uint16_t *x) { int32_t w; memcpy(&w, x, 4); return _mm512_set1_epi32(w); }
static inline wrow w_bf16(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vf dot_bf16(vf acc, xpair x, wrow w) { return dot_bf16_pairs(acc, x, w); }
/* 32 bf16 of a against 32 of b, pairwise into the 16 lanes (attention's q . k) */
static inline vf dot_bf16x32(vf acc, const uint16_t *a, const uint16_t *b) {
  return dot_bf16_pairs(acc, _mm512_loadu_si512(a), _mm512_loadu_si512(b));
}

typedef __m512i xq4;  /* 4 int8 of x (offset by INT8_X_OFFSET), broadcast */
typedef __m512i wrow8;
static inline xq4 x_int8(const int8_t *x) { int32_t w; memcpy(&w, x, 4); return _mm512_set1_epi32(w); }
static inline wrow8 w_int8(const uint8_t *p) { return _mm512_loadu_si512(p); }
#define INT8_TARGET __attribute__((target("avx512vnni")))
/* acc[c] += sum_j x[j] w[c][j]: x unsigned (q + 128), w signed */
INT8_TARGET static inline vi dot_int8(vi acc, xq4 x, wrow8 w) { return _mm512_dpbusd_epi32(acc, x, w); }
/* int4: lo/hi are the row's low nibbles (k0..3) and high nibbles (k4..7) of 16 columns, unsigned; the high
 * ones masked in place (16 times their value) when in_place, else shifted down */
static inline void w_int4(const uint8_t *p, wrow8 *lo, wrow8 *hi, int in_place) {
  const __m512i v = _mm512_loadu_si512(p), low = _mm512_set1_epi8(0x0F);
  *lo = _mm512_and_si512(v, low);
  *hi = in_place ? _mm512_and_si512(v, _mm512_set1_epi8((char)0xF0)) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}
/* acc[c] += sum_j w[c][j] x[j]: w unsigned (nibbles), x signed (no offset) */
INT8_TARGET static inline vi dot_int4(vi acc, xq4 x, wrow8 w) { return _mm512_dpbusd_epi32(acc, w, x); }
/* int4 with high bits (kernels.c, int4_micro): ORs each value's hb bits above its nibble (1: Q5_K, 2: Q6_K) into lo
 * and hi at bit 4, from the row's 16 hb bytes at h. The plane is read in lanes of 16 hb bytes: byte i of lane L holds
 * lo's value 16 hb L + i at bit hb L and hi's at bit 4 + hb L, so the bytes broadcast to every lane and one variable
 * shift per 64-bit lane brings each lane's own bits to bit 4 (the mask drops the others). lo and hi: nibbles alone
 * (w_int4 with in_place 0). */
static inline void w_int4_high(const uint8_t *h, wrow8 *lo, wrow8 *hi, const int hb) {
  const __m512i e = hb == 2 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)h))
                            : _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)h));
  const __m512i up = hb == 2 ? _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2) : _mm512_setr_epi64(4, 4, 3, 3, 2, 2, 1, 1);
  const __m512i down = hb == 2 ? _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2) : _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3);
  const __m512i mask = _mm512_set1_epi8((char)(hb == 2 ? 0x30 : 0x10));
  *lo = _mm512_ternarylogic_epi64(*lo, _mm512_sllv_epi64(e, up), mask, 0xF8); /* lo | (shifted & mask) */
  *hi = _mm512_ternarylogic_epi64(*hi, _mm512_srlv_epi64(e, down), mask, 0xF8);
}
/* a row of 64 bytes, each plus add (int4 with high bits expanded to int8g's layout for many rows) */
static inline void w_store8(uint8_t *p, wrow8 v, int add) { _mm512_storeu_si512(p, _mm512_add_epi8(v, _mm512_set1_epi8((char)add))); }
typedef vi i4acc; /* int4's running sums between flushes (see isa_avx2.h): int32 here, flushed once a group */
#define I4_STEPS (1 << 30)
static inline i4acc i4_zero(void) { return vi_zero(); }
INT8_TARGET static inline i4acc i4_dot(i4acc t, xq4 x0, wrow8 lo, xq4 x1, wrow8 hi) { return dot_int4(dot_int4(t, x0, lo), x1, hi); }
static inline vi i4_flush(vi acc, i4acc t) { return vi_add(acc, t); }
/* int8g (8-bit weights per group, kernels.c): u unsigned (0..255) times x signed, as int4's nibbles */
#define I8G_SIGNED 0 /* the sums are of x u */
#define I8G_MR 2
#define I8G_NB 4
#define I8G_NB_ONE 4
typedef __m512i wrowg;
static inline wrowg w_int8g(const uint8_t *p) { return _mm512_loadu_si512(p); }
INT8_TARGET static inline vi dot_int8g(vi acc, xq4 x, wrowg w) { return _mm512_dpbusd_epi32(acc, w, x); }

/* -- optional specializations kernels.c takes when defined ------------------------------------------------ */
/* A chunk of 32 values summed as interleaved pairs (vpunpck{l,h}wd): lane i of l holds value 8 (i / 4) + i % 4, of h 4
 * more; first and second get values 0-15 and 16-31 in order. */
static inline void pair_order(__m512 l, __m512 h, __m512 *first, __m512 *second) {
  *first = _mm512_permutex2var_ps(l, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), h);
  *second = _mm512_permutex2var_ps(l, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), h);
}
#define ISA_HAS_PV_SLICE 1
/* o[g] = bf16(inv[g] * sum_p w[g][p] V[p]) for the G heads of a group (o[g] at o + g * D), over NC chunks
 * of 32 values of the V rows at v + offset[p]. Two positions at a time: their rows interleaved by
 * vpunpck{l,h}wd are vdpbf16ps operands against the broadcast bf16 pair (w[g][p], w[g][p + 1]) (wb[g]:
 * the weights in bf16, as 32-bit pairs), so one instruction takes 32 multiply-adds where widening V to
 * float32 took 16 and two conversions; each V row is loaded once for all G heads. Lane i of the "lo" sums
 * holds value 8 (i / 4) + i % 4 of its chunk, of the "hi" sums 4 more: the final permutes put them in
 * order. G and NC are constants at each call (the loops unroll, the 2 x NC x G sums stay in registers). */
static inline __attribute__((always_inline)) void pv_slice(const uint16_t *v, const int64_t *offset,
                                                           const uint32_t *wb, int64_t npairs, int64_t ctx,
                                                           const int G, const int NC, const float *inv, uint16_t *o,
                                                           int64_t D) {
  __m512 lo[16], hi[16];
  for (int i = 0; i < G * NC; i++) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < npairs; j++) {
    const uint16_t *ra = v + offset[2 * j], *rb = 2 * j + 1 < ctx ? v + offset[2 * j + 1] : ra; /* (weight 0) */
    if (2 * j + 8 < ctx) {
      _mm_prefetch((const char *)(v + offset[2 * j + 8]), _MM_HINT_T0);
      if (NC > 1) _mm_prefetch((const char *)(v + offset[2 * j + 8] + 32), _MM_HINT_T0);
    }
    __m512i il[4], ih[4];
    for (int c = 0; c < NC; c++) {
      const __m512i a = _mm512_loadu_si512(ra + 32 * c), b = _mm512_loadu_si512(rb + 32 * c);
      il[c] = _mm512_unpacklo_epi16(a, b);
      ih[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; g++) {
      const __m512i w = _mm512_set1_epi32((int)wb[g * npairs + j]);
      for (int c = 0; c < NC; c++) {
        lo[g * NC + c] = dot_bf16_pairs(lo[g * NC + c], il[c], w);
        hi[g * NC + c] = dot_bf16_pairs(hi[g * NC + c], ih[c], w);
      }
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) {
      const __m512 scale = _mm512_set1_ps(inv[g]);
      __m512 first, second;
      pair_order(lo[g * NC + c], hi[g * NC + c], &first, &second);
      vf_store_bf16(o + g * D + 32 * c, _mm512_mul_ps(first, scale));
      vf_store_bf16(o + g * D + 32 * c + 16, _mm512_mul_ps(second, scale));
    }
}

/* the first n (<= 16 of) lanes' low 16 bits at p */
static inline void vi_store_i16_n(int16_t *p, vi a, int64_t n) {
  _mm256_mask_storeu_epi16(p, n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1), _mm512_cvtepi32_epi16(a));
}

#define ISA_HAS_ARGMAX 1
/* The first index of the largest of the n bf16 values at row (torch's argmax: the first NaN counts as the
 * largest). Each lane keeps its first maximum; then the lanes' maxima and the smallest index among them. */
static inline int64_t argmax_row(const uint16_t *row, int64_t N) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_i = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < N; i += 16) {
    const __mmask16 m = N - i >= 16 ? 0xffff : (__mmask16)((1u << (N - i)) - 1);
    const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m,
                                        _mm512_castsi512_ps(_mm512_slli_epi32(
                                            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + i)), 16)));
    /* greater, or NaN: lanes already at NaN stay */
    const __mmask16 settled = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask((__mmask16)~settled, v, best, _CMP_NLE_UQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  const __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = nan ? nan : _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_i);
}

/* One constant hint per call: GCC 12 dropped the whole prefetch, without a word, where the hint was
 * `far ? _MM_HINT_T1 : _MM_HINT_T0` and this was inlined into always_inline kernels (the linear micro-kernels'
 * prefetches never reached the library; benchmarks/NOTES.md, step 13). */
static inline __attribute__((always_inline)) void prefetch(const void *p, int far) {
  if (far) __builtin_prefetch(p, 0, 2); /* prefetcht1 */
  else __builtin_prefetch(p, 0, 3);     /* prefetcht0 */
}
