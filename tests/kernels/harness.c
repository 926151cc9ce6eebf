/* Every exported kernel of mili/kernels/cpu/kernels.c against a plain scalar C reference, on deterministic
 * pseudo-random inputs, linked against one ISA's build of the kernels (tests/unit/test_kernel_harness.py links and
 * runs it once per ISA: natively on x86-64 against the very library mili.kernels.cpu builds and loads, under
 * qemu-aarch64 against an object of kernels.c cross-compiled with the library's flags for NEON).
 *
 *   cc -O1 -fopenmp -DEXPECT_ISA='"avx2"' tests/kernels/harness.c <the library: kernels_*.so> -o harness -lm
 *   (-DHARNESS_AMX: the linear layers on AMX tiles, mili_use_amx(1); EXPECT_ISA "avx512"; -DINT_KERNELS=0: an
 *   AVX-512 build without VNNI, whose int8 / int4 / int8g kernels are never called)
 *
 * It sees the kernels through their ABI alone (mili_kernels.h), as the engine does, and is compiled apart from them,
 * without the ISA's flags. The references are straightforward loops in double precision (no intrinsics) that
 * follow each kernel's documented numerics: outputs rounded to bf16 to nearest even, and the intermediate bf16
 * roundings the kernels document (RMSNorm's normed value, SwiGLU's silu, attention's softmax weights, the GDN's
 * bf16 io); int8 / int4 / int8g layers quantize x to int8 per row (per row and group of K) symmetrically, scale =
 * amax / 127 and q = x * (1 / scale) rounded to nearest even (as quantize_int8 computes it; its comment says
 * x / scale, which can differ by one at a tie), and the reference takes the exact integer product of those q,
 * scaled. Tolerances are in bf16 ulps: half an ulp of the exact value (the final rounding), plus a bound on the
 * kernel's float32 error before it rounds, plus one ulp of an intermediate bf16 value only where its exact value
 * lies within float32's error of a rounding boundary (see flip). A wrong index, a dropped term or a missed
 * rounding is beyond them (the harness was checked against such deliberate mutations of kernels.c).
 *
 * Prints one line per check ("ok ..." or "FAIL ..."), then "N passed, M failed"; exits 1 on any failure. */
#include "../../mili/kernels/cpu/mili_kernels.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef EXPECT_ISA
#error "compile with -DEXPECT_ISA='\"avx2\"' (the name mili_isa() must return)"
#endif

#define NT 2 /* OpenMP threads given to every kernel */

/* AVX-512 without VNNI (Skylake-X): the library never calls its int8 / int4 / int8g kernels (their vpdpbusd would fault;
 * aten's run instead, see mili.kernels.cpu.int8_available), so neither does the harness: built with -DINT_KERNELS=0. */
#ifndef INT_KERNELS
#define INT_KERNELS 1
#endif

static int n_passed, n_failed, n_skipped;

/* -- utilities ----------------------------------------------------------------------------------------------- */
static void *xalloc(size_t bytes) {
  void *p = calloc(bytes ? bytes : 1, 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

static uint64_t rng_state;
#ifndef HARNESS_SEED
#define HARNESS_SEED 0 /* (-DHARNESS_SEED=n: other inputs, the same checks) */
#endif
static void rng_seed(uint64_t seed) { rng_state = (seed + HARNESS_SEED * 0x2545F4914F6CDD1Dull) * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull; }
static uint32_t rng_u32(void) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng_state >> 32);
}
static float rng_uniform(float lo, float hi) { return lo + (hi - lo) * (float)((rng_u32() >> 8) * (1.0 / 16777216.0)); }
static int rng_int(int lo, int hi) { return lo + (int)(rng_u32() % (uint32_t)(hi - lo + 1)); } /* inclusive */

static float h_bf2f(bf16 v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static bf16 h_f2bf(float f) { /* nearest even; NaN stays NaN (quiet) */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}
static float h_round_bf(float f) { return h_bf2f(h_f2bf(f)); }
static uint32_t h_fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float h_h2f(uint16_t h) { /* IEEE half to float */
  const int e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m + 1024), e - 25);
  return (h >> 15) ? -v : v;
}
static uint16_t h_f2h(float f) { /* float to half, nearest even, for values in half's normal range (or 0) */
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  if (f == 0.0f) return sign;
  int e = (int)((u >> 23) & 255) - 127 + 15;
  uint32_t m = u & 0x7fffffu, r = m >> 13, rem = m & 0x1fffu;
  if (e < 1 || e > 30) {
    fprintf(stderr, "h_f2h: %g is outside half's normal range (harness bug)\n", f);
    exit(2);
  }
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  if (r == 1024) r = 0, e++;
  return (uint16_t)(sign | (uint16_t)(e << 10) | (uint16_t)r);
}
static uint16_t h_f2h_any(float f) { /* float to half, subnormals too (GGUF's small d's are): nearest even */
  if (fabsf(f) >= 0x1p-14f) return h_f2h(f);
  const uint16_t m = (uint16_t)nearbyintf(fabsf(f) * 0x1p24f); /* (m x 2^-24; 1024 is the smallest normal) */
  return (uint16_t)((f < 0 ? 0x8000u : 0u) | m);
}
static void fill_bf(bf16 *p, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++) p[i] = h_f2bf(rng_uniform(lo, hi));
}
static void fill_u16(uint16_t *p, int64_t n, uint16_t v) {
  for (int64_t i = 0; i < n; i++) p[i] = v;
}

/* Half a bf16 ulp at |v|: the most that rounding to nearest moves a value of that size. */
static double half_ulp(double v) {
  v = fabs(v);
  if (!(v > 0) || isinf(v)) return 0;
  int e;
  frexp(v, &e); /* v in [2^(e-1), 2^e): bf16 steps of 2^(e-8) there */
  return ldexp(1.0, e - 9);
}
/* The tolerance of a bf16 result whose exact value is want and which the kernel had to within err before it
 * rounded: half an ulp (the rounding) plus err. (1e-30: the values bf16 holds only as subnormals.) */
static double tol_bf16(double want, double err) { return half_ulp(fabs(want) + err) + err + 1e-30; }
/* A value the kernel rounds to bf16 from a float32 within rel of v: one bf16 ulp where v is that close to a
 * rounding boundary (the kernel's value and the reference's may then round either way), else 0. */
static double flip(double v, double rel) {
  const double h = half_ulp(v);
  if (h == 0) return 0;
  const double m = fabs(v) / h, odd = 2.0 * floor(m / 2.0) + 1.0; /* boundaries: odd multiples of h */
  return fabs(m - odd) * h <= rel * fabs(v) ? 2.0 * h : 0.0;
}

/* -- checks: the worst element's error against its tolerance ----------------------------------------------- */
typedef struct {
  int64_t n, bad, at;
  double max_err, worst; /* largest |got - want|; largest |got - want| / tolerance */
  double got, want, tol; /* at the worst element */
} Acc;

static void acc_init(Acc *a) {
  memset(a, 0, sizeof *a);
  a->at = -1;
}
/* one element: |got - want| <= tol (tol 0: equal) */
static void acc_add(Acc *a, int64_t i, double got, double want, double tol) {
  const double err = fabs(got - want);
  double ratio = err <= tol ? (tol > 0 ? err / tol : 0.0) : (tol > 0 && err == err ? err / tol : INFINITY);
  a->n++;
  if (!(err <= tol)) a->bad++;
  if (err > a->max_err || err != err) a->max_err = err;
  if (a->at < 0 || ratio > a->worst) a->worst = ratio, a->at = i, a->got = got, a->want = want, a->tol = tol;
}
static void acc_bits(Acc *a, int64_t i, uint32_t got, uint32_t want) { acc_add(a, i, (double)got, (double)want, 0.0); }
static void acc_bf16_exact(Acc *a, const bf16 *got, const bf16 *want, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc_bits(a, i, got[i], want[i]);
}
/* got (bf16) against want within tol, elementwise */
static void acc_bf16(Acc *a, const bf16 *got, const double *want, const double *tol, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc_add(a, i, h_bf2f(got[i]), want[i], tol[i]);
}

static void verdict(const Acc *a, const char *fmt, ...) {
  char name[300];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  if (a->n > 0 && a->bad == 0) {
    n_passed++;
    printf("ok %s (%lld values, max err %.3g, %.3f of tolerance)\n", name, (long long)a->n, a->max_err, a->worst);
  } else {
    n_failed++;
    printf("FAIL %s: %lld of %lld values off, max err %.6g; worst at [%lld]: got %.9g, want %.9g (tolerance %.3g)\n",
           name, (long long)a->bad, (long long)a->n, a->max_err, (long long)a->at, a->got, a->want, a->tol);
  }
  fflush(stdout);
}
static void check_true(int ok, const char *fmt, ...) {
  char name[300];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(name, sizeof name, fmt, ap);
  va_end(ap);
  if (ok) n_passed++;
  else n_failed++;
  printf("%s %s\n", ok ? "ok" : "FAIL", name);
  fflush(stdout);
}

/* ============================================================================================================
 * References
 * ============================================================================================================ */

/* x (n bf16) to int8 as quantize_int8 computes it: scale = amax / 127 (1 where amax is 0), q = x * (1 / scale)
 * rounded to nearest even; returns the scale, *sum = sum of q. A q beyond int8 would be a kernel bug (the
 * kernel stores it in 8 bits): flagged by *overflow. */
static float ref_quantize(const bf16 *x, int64_t n, int32_t *q, int64_t *sum, int *overflow) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float v = fabsf(h_bf2f(x[i]));
    if (v > amax) amax = v;
  }
  const float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
  int64_t s = 0;
  for (int64_t i = 0; i < n; i++) {
    const float p = h_bf2f(x[i]) * inv;
    q[i] = (int32_t)nearbyintf(p);
    if (q[i] > 127 || q[i] < -127) *overflow = 1;
    s += q[i];
  }
  *sum = s;
  return scale;
}

/* -- linear layers ------------------------------------------------------------------------------------------- */
/* LIN_INT4_H1, _H2: int4 with 1 or 2 bits above the nibble (GGUF's Q5_K, Q6_K as the kernel reads them) */
enum { LIN_BF16, LIN_INT8, LIN_INT4, LIN_INT8G, LIN_INT4_H1, LIN_INT4_H2 };
static const char *const LIN_NAME[] = {"linear", "linear_int8", "linear_int4", "linear_int8g", "linear_int4 +1 bit",
                                       "linear_int4 +2 bits"};
static int is_int4(int kind) { return kind == LIN_INT4 || kind == LIN_INT4_H1 || kind == LIN_INT4_H2; }
static int high_bits_of(int kind) { return kind == LIN_INT4_H1 ? 1 : kind == LIN_INT4_H2 ? 2 : 0; }

typedef struct {
  int kind, sym;          /* sym: without offsets (int8g: w = s (u - 128); int4: s (q - 8 << high bits)) */
  int64_t n, k, group, mode, sub; /* int4, int8g: mode SCALES_F16, _F32 or _K (sub groups a super-block) */
  float *wf;            /* bf16: W [n][k] (the bf16 values) */
  int8_t *w8;           /* int8: W [n][k] */
  float *sw;            /* int8: each column's scale [n] */
  int32_t *colsum;      /* int8: each column's sum of W [n] */
  uint8_t *q4;          /* int4: q [n][k], 0..15 (with high bits 0..31, 0..63); int8g: u [n][k], 0..255 */
  float *s4, *b4;       /* int4, int8g: scale and offset [n][G] (the values the kernel forms; sym: b = -128 s) */
  void *packed, *scales, *aux; /* the kernel's operands */
} Lin;

/* int4's and int8g's scales (or offsets) in the kernel's form `mode`: SCALES_F16 / _F32 [N/16][G][16] values;
 * SCALES_K two levels, [N/16][G / sub][32 + 16 sub] bytes: per row and super-block an fp16 d (subnormal where small,
 * as GGUF's can be), per group an int8 sc, the value d sc. scale_buffer allocates one, scale_put stores row r's group g (dh: its super-block's d, as fp16
 * bits; one level: the value v) and returns the value the kernel forms (exact in float32). */
static int64_t scale_sub(int64_t K, int64_t group) { /* GGUF's super-blocks of 256 where K holds them, else one a row */
  return K % 256 == 0 && 256 % group == 0 ? 256 / group : K / group;
}
static void *scale_buffer(int mode, int64_t n, int64_t G, int64_t sub) {
  return xalloc(mode == SCALES_K ? (size_t)(n * G / sub * 2 + n * G) : (size_t)((mode == SCALES_F32 ? 4 : 2) * n * G));
}
static float scale_put(void *buf, int mode, int64_t G, int64_t sub, int64_t r, int64_t g, float v, uint16_t dh, int8_t sc) {
  if (mode == SCALES_K) {
    uint8_t *at = (uint8_t *)buf + (r / 16) * (G / sub) * (32 + 16 * sub) + (g / sub) * (32 + 16 * sub);
    memcpy(at + 2 * (r % 16), &dh, 2);
    at[32 + 16 * (g % sub) + r % 16] = (uint8_t)sc;
    return h_h2f(dh) * (float)sc;
  }
  const int64_t at = (r / 16) * G * 16 + g * 16 + r % 16;
  if (mode == SCALES_F32) {
    ((float *)buf)[at] = v;
    return v;
  }
  ((uint16_t *)buf)[at] = h_f2h(v);
  return h_h2f(h_f2h(v));
}

/* random weights of about wscale, packed as ops.py packs them */
static void lin_make(Lin *l, int kind, int64_t n, int64_t k, int64_t group, int mode, int sym, float wscale) {
  memset(l, 0, sizeof *l);
  l->kind = kind, l->n = n, l->k = k, l->group = group, l->mode = mode, l->sym = sym;
  l->sub = group ? scale_sub(k, group) : 0;
  if (kind == LIN_BF16) { /* [N/16][K/2][16][2] */
    l->wf = xalloc(sizeof(float) * n * k);
    bf16 *p = xalloc(sizeof(bf16) * n * k);
    for (int64_t r = 0; r < n; r++)
      for (int64_t c = 0; c < k; c++) {
        const bf16 v = h_f2bf(rng_uniform(-wscale, wscale));
        l->wf[r * k + c] = h_bf2f(v);
        p[((r / 16) * (k / 2) + c / 2) * 32 + (r % 16) * 2 + c % 2] = v;
      }
    l->packed = p;
  } else if (kind == LIN_INT8) { /* [N/16][K/4][16][4], |w| <= 127 (symmetric, as the AVX2 layer requires) */
    l->w8 = xalloc(n * k);
    l->sw = xalloc(sizeof(float) * n);
    l->colsum = xalloc(sizeof(int32_t) * n);
    int8_t *p = xalloc(n * k);
    for (int64_t r = 0; r < n; r++) {
      l->sw[r] = rng_uniform(0.5f, 1.5f) * wscale / 127.0f;
      for (int64_t c = 0; c < k; c++) {
        const int8_t v = (int8_t)rng_int(-127, 127);
        l->w8[r * k + c] = v;
        l->colsum[r] += v;
        p[((r / 16) * (k / 4) + c / 4) * 64 + (r % 16) * 4 + c % 4] = v;
      }
    }
    l->packed = p, l->scales = l->sw, l->aux = l->colsum;
  } else if (kind == LIN_INT8G) { /* u [N/16][K/4][16][4]; s, b [N/16][G][16] (sym: no b) */
    const int64_t G = k / group;
    l->q4 = xalloc(n * k);
    l->s4 = xalloc(sizeof(float) * n * G);
    l->b4 = xalloc(sizeof(float) * n * G);
    uint8_t *p = xalloc(n * k);
    for (int64_t r = 0; r < n; r++)
      for (int64_t c = 0; c < k; c++) {
        const uint8_t v = (uint8_t)rng_int(0, 255);
        l->q4[r * k + c] = v;
        p[((r / 16) * (k / 4) + c / 4) * 64 + (r % 16) * 4 + c % 4] = v;
      }
    const int64_t sub = l->sub;
    void *s = scale_buffer(mode, n, G, sub), *b = sym ? NULL : scale_buffer(mode, n, G, sub);
    uint16_t dh = 0, mh = 0;
    for (int64_t r = 0; r < n; r++)
      for (int64_t g = 0; g < G; g++) { /* w = s (u - z): z in 100..156 (sym: 128) */
        float sv = rng_uniform(0.5f, 1.5f) * wscale / 128.0f, bv = sym ? 0.0f : -sv * rng_uniform(100.0f, 156.0f);
        if (rng_int(0, 15) == 0) sv = -sv; /* (Q6_K's sub-block scales take either sign) */
        if (mode == SCALES_K && g % sub == 0) /* a super-block's d (s = d sc, sc ~ 32) and -dmin (b = -dmin m, m ~ 48) */
          dh = h_f2h_any(rng_uniform(0.5f, 1.5f) * wscale / 128.0f / 32.0f), mh = h_f2h_any(-rng_uniform(0.8f, 1.2f) * wscale / 48.0f);
        const int8_t sc = (int8_t)((sv < 0 ? -1 : 1) * rng_int(16, 48)), m = (int8_t)rng_int(32, 63);
        sv = scale_put(s, mode, G, sub, r, g, sv, dh, sc);
        if (b) bv = scale_put(b, mode, G, sub, r, g, bv, mh, m);
        l->s4[r * G + g] = sv, l->b4[r * G + g] = sym ? -128.0f * sv : bv;
      }
    l->packed = p, l->scales = s, l->aux = b;
  } else { /* q [N/16][K/8][64]: byte 4c + j, column c: k0 + j low nibble, k0 + 4 + j high; s, b [N/16][G][16].
            * With hb high bits each row of nibbles is followed by its high bits, [K/8][64 + 16 hb]: byte b of a
            * row's low (o = 0) or high (o = 1) nibbles has its bits above the nibble in byte 64 + b % (16 hb) of the
            * row, at bit 4 o + hb (b / (16 hb)) */
    const int64_t G = k / group;
    const int hb = high_bits_of(kind), top = (16 << hb) - 1;
    const int64_t wblock = k * (8 + 2 * hb);
    l->q4 = xalloc(n * k);
    l->s4 = xalloc(sizeof(float) * n * G);
    l->b4 = xalloc(sizeof(float) * n * G);
    uint8_t *p = xalloc(n / 16 * wblock);
    for (int64_t r = 0; r < n; r++)
      for (int64_t c = 0; c < k; c++) {
        const uint8_t v = (uint8_t)rng_int(0, top);
        const int64_t o = (c % 8) / 4, b = (r % 16) * 4 + c % 4;
        l->q4[r * k + c] = v;
        uint8_t *row = p + (r / 16) * wblock + (c / 8) * (64 + 16 * hb);
        row[b] |= (uint8_t)(o ? (v & 15) << 4 : v & 15);
        if (hb) row[64 + b % (16 * hb)] |= (uint8_t)((v >> 4) << (4 * o + hb * (b / (16 * hb))));
      }
    const int64_t sub = l->sub;
    void *s = scale_buffer(mode, n, G, sub), *b = sym ? NULL : scale_buffer(mode, n, G, sub);
    uint16_t dh = 0, mh = 0;
    const float span = (float)(1 << hb); /* (q's range over 0..15) */
    for (int64_t r = 0; r < n; r++)
      for (int64_t g = 0; g < G; g++) { /* w = s q + b = s (q - z): centred on a zero point z in (6..9) << hb */
        float sv = rng_uniform(0.5f, 1.5f) * wscale * 2.0f / 15.0f / span, bv = -sv * span * rng_uniform(6.0f, 9.0f);
        const int zero = rng_int(0, 15) == 0;
        if (zero) bv = 0.0f;
        if (sym && rng_int(0, 15) == 0) sv = -sv; /* (Q6_K's sub-block scales take either sign) */
        if (mode == SCALES_K && g % sub == 0) /* Q4_K's d (s = d sc, sc in 16..48) and -dmin (b = -dmin m) */
          dh = h_f2h_any(rng_uniform(0.5f, 1.5f) * wscale * 2.0f / 15.0f / span / 32.0f), mh = h_f2h_any(-rng_uniform(4.0f, 6.0f) * span * h_h2f(dh));
        sv = scale_put(s, mode, G, sub, r, g, sv, dh, (int8_t)((sv < 0 ? -1 : 1) * rng_int(16, 48)));
        if (b) bv = scale_put(b, mode, G, sub, r, g, bv, mh, (int8_t)(zero ? 0 : rng_int(32, 63)));
        l->s4[r * G + g] = sv, l->b4[r * G + g] = sym ? -(float)(8 << hb) * sv : bv;
      }
    l->packed = p, l->scales = s, l->aux = b;
  }
}
static void lin_free(Lin *l) {
  free(l->wf), free(l->w8), free(l->sw), free(l->colsum), free(l->q4), free(l->s4), free(l->b4), free(l->packed);
  if (is_int4(l->kind) || l->kind == LIN_INT8G) free(l->scales), free(l->aux);
}
/* The layer as the kernels' descriptor: the int8, int4 and int8g kernels' operand, a fused decode layer's linear */
static mili_linear_desc lin_desc(const Lin *l) {
  mili_linear_desc d;
  memset(&d, 0, sizeof d);
  d.w = l->packed, d.n = l->n, d.k = l->k;
  if (l->kind != LIN_BF16) d.scales = l->scales, d.aux = l->aux;
  if (is_int4(l->kind) || l->kind == LIN_INT8G) d.group = l->group, d.scale_mode = l->mode, d.sub = l->sub;
  d.int8g = l->kind == LIN_INT8G;
  d.high_bits = high_bits_of(l->kind);
  return d;
}
/* y rows ldy apart (int4, int8g: a column range of a wider output; the others ldy = n) */
static void lin_run_ld(const Lin *l, const bf16 *x, bf16 *y, int64_t ldy, int64_t M) {
  const mili_linear_desc d = lin_desc(l);
  if (l->kind == LIN_BF16) mili_linear(l->packed, x, y, M, l->n, l->k, NT);
  else if (l->kind == LIN_INT8) mili_linear_int8(&d, x, y, M, NT);
  else if (is_int4(l->kind)) mili_linear_int4(&d, x, y, M, ldy, NT);
  else mili_linear_int8g(&d, x, y, M, ldy, NT);
}
static void lin_run(const Lin *l, const bf16 *x, bf16 *y, int64_t M) { lin_run_ld(l, x, y, l->n, M); }

/* want[M][N] (unrounded) and each value's tolerance: bf16's rounding of the result plus float32 accumulation
 * over the terms' magnitudes (int8: none, the sums are exact integers). *overflow: a quantized x beyond int8. */
static void lin_ref(const Lin *l, const bf16 *x, int64_t M, double *want, double *tol, int *overflow) {
  const int64_t N = l->n, K = l->k;
  int32_t *q = xalloc(sizeof(int32_t) * K);
  for (int64_t m = 0; m < M; m++) {
    const bf16 *xr = x + m * K;
    if (l->kind == LIN_BF16) {
      for (int64_t n = 0; n < N; n++) {
        double s = 0, mag = 0;
        for (int64_t k = 0; k < K; k++) {
          const double p = (double)h_bf2f(xr[k]) * l->wf[n * K + k];
          s += p, mag += fabs(p);
        }
        want[m * N + n] = s, tol[m * N + n] = tol_bf16(s, 4e-6 * mag); /* float32 sums of K terms */
      }
    } else if (l->kind == LIN_INT8) {
      int64_t unused;
      const float sx = ref_quantize(xr, K, q, &unused, overflow);
      for (int64_t n = 0; n < N; n++) {
        int64_t acc = 0;
        for (int64_t k = 0; k < K; k++) acc += (int64_t)q[k] * l->w8[n * K + k];
        const double s = (double)acc * sx * l->sw[n];
        want[m * N + n] = s, tol[m * N + n] = tol_bf16(s, 3e-7 * fabs(s)); /* (float(sum) sx sw) */
      }
    } else if (is_int4(l->kind)) {
      const int64_t G = K / l->group;
      float sx[1024];
      int64_t xsum[1024];
      for (int64_t g = 0; g < G; g++) sx[g] = ref_quantize(xr + g * l->group, l->group, q + g * l->group, &xsum[g], overflow);
      for (int64_t n = 0; n < N; n++) {
        double s = 0, mag = 0;
        for (int64_t g = 0; g < G; g++) {
          int64_t acc = 0;
          for (int64_t k = g * l->group; k < (g + 1) * l->group; k++) acc += (int64_t)q[k] * l->q4[n * K + k];
          if (l->sym) acc -= (int64_t)(8 << high_bits_of(l->kind)) * xsum[g]; /* (sx s (S_q - zero xsum)) */
          const double t1 = (double)sx[g] * l->s4[n * G + g] * (double)acc;
          const double t2 = l->sym ? 0.0 : (double)sx[g] * l->b4[n * G + g] * (double)xsum[g];
          s += t1 + t2, mag += fabs(t1) + fabs(t2);
        }
        want[m * N + n] = s, tol[m * N + n] = tol_bf16(s, 2e-6 * mag); /* two float32 fmadds a group */
      }
    } else { /* int8g: sx (s S_u + b xsum), or (sym) sx s S_v, S_v = S_u - 128 xsum */
      const int64_t G = K / l->group;
      float sx[1024];
      int64_t xsum[1024];
      for (int64_t g = 0; g < G; g++) sx[g] = ref_quantize(xr + g * l->group, l->group, q + g * l->group, &xsum[g], overflow);
      for (int64_t n = 0; n < N; n++) {
        double s = 0, mag = 0;
        for (int64_t g = 0; g < G; g++) {
          int64_t acc = 0;
          for (int64_t k = g * l->group; k < (g + 1) * l->group; k++) acc += (int64_t)q[k] * l->q4[n * K + k];
          const double sw = l->s4[n * G + g], t1 = (double)sx[g] * sw * (double)(l->sym ? acc - 128 * xsum[g] : acc);
          const double t2 = l->sym ? 0.0 : (double)sx[g] * l->b4[n * G + g] * (double)xsum[g];
          s += t1 + t2, mag += fabs(t1) + fabs(t2);
        }
        want[m * N + n] = s, tol[m * N + n] = tol_bf16(s, 2e-6 * mag); /* one or two float32 fmadds a group */
      }
    }
  }
  free(q);
}
/* the reference rounded to bf16, as the kernel stores it (for composing references) */
static void lin_ref_bf(const Lin *l, const bf16 *x, int64_t M, bf16 *y) {
  double *want = xalloc(sizeof(double) * M * l->n), *tol = xalloc(sizeof(double) * M * l->n);
  int overflow = 0;
  lin_ref(l, x, M, want, tol, &overflow);
  for (int64_t i = 0; i < M * l->n; i++) y[i] = h_f2bf((float)want[i]);
  free(want), free(tol);
}

/* -- RMSNorm: out = bf16(w * bf16(s / sqrt(mean(s^2) + eps))), s = x or bf16(x + residual) --------------------- */
static void ref_rms_row(const float *s, const bf16 *w, int64_t D, float eps, double *want, double *tol,
                        double *flips) {
  double ss = 0;
  for (int64_t i = 0; i < D; i++) ss += (double)s[i] * s[i];
  const double inv = 1.0 / sqrt(ss / (double)D + eps);
  for (int64_t i = 0; i < D; i++) {
    const double pre = s[i] * inv, w_i = h_bf2f(w[i]), v = w_i * h_round_bf((float)pre);
    want[i] = v; /* (w times a bf16 is exact in float32: the outer rounding is the only one) */
    if (tol) tol[i] = tol_bf16(v, fabs(w_i) * flip(pre, 1e-5)); /* the inner one: float32's 1/sqrt */
    if (flips) flips[i] = fabs(w_i) * flip(pre, 1e-5);
  }
}
/* res_want: bf16(x + residual) (exact: one float32 addition rounded to bf16, as the kernel does) */
static void ref_rms_norm(const bf16 *x, int64_t ldx, const bf16 *residual, const bf16 *w, int64_t T, int64_t D,
                         float eps, double *want, double *tol, bf16 *res_want) {
  float *s = xalloc(sizeof(float) * D);
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < D; i++) {
      if (residual) {
        res_want[t * D + i] = h_f2bf(h_bf2f(x[t * ldx + i]) + h_bf2f(residual[t * D + i]));
        s[i] = h_bf2f(res_want[t * D + i]);
      } else {
        s[i] = h_bf2f(x[t * ldx + i]);
      }
    }
    ref_rms_row(s, w, D, eps, want + t * D, tol ? tol + t * D : NULL, NULL);
  }
  free(s);
}

/* -- q/k RMSNorm + rotate-half RoPE, in place on the fused rows; want/tol [T][Hq + Hkv][D] -------------------- */
static void ref_qk_norm_rope(const bf16 *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const bf16 *qw,
                             const bf16 *kw, float eps, const float *cos_t, const float *sin_t, double *want, double *tol) {
  const int64_t half = D / 2, H = Hq + Hkv;
  float *s = xalloc(sizeof(float) * D);
  double *nd = xalloc(sizeof(double) * D), *nf = xalloc(sizeof(double) * D);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      for (int64_t i = 0; i < D; i++) s[i] = h_bf2f(qkv[t * ld + h * D + i]);
      ref_rms_row(s, h < Hq ? qw : kw, D, eps, nd, NULL, nf);
      const float *c = cos_t + t * D, *sn = sin_t + t * D;
      double *o = want + (t * H + h) * D, *e = tol + (t * H + h) * D;
      for (int64_t i = 0; i < half; i++) { /* nd: w x the normed value, exact until rounded; nf: its flips */
        const double lo = h_round_bf((float)nd[i]), hi = h_round_bf((float)nd[half + i]);
        const double flo = nf[i] ? nf[i] + 2 * half_ulp(nd[i]) : 0, fhi = nf[half + i] ? nf[half + i] + 2 * half_ulp(nd[half + i]) : 0;
        o[i] = lo * c[i] - hi * sn[i];
        o[half + i] = hi * c[half + i] + lo * sn[half + i];
        e[i] = tol_bf16(o[i], flo * fabs(c[i]) + fhi * fabs(sn[i]) + 2.4e-7 * (fabs(lo * c[i]) + fabs(hi * sn[i])));
        e[half + i] = tol_bf16(o[half + i], fhi * fabs(c[half + i]) + flo * fabs(sn[half + i]) +
                                                2.4e-7 * (fabs(hi * c[half + i]) + fabs(lo * sn[half + i])));
      }
    }
  free(s), free(nd), free(nf);
}

/* -- SwiGLU: out = bf16(silu(gate)) * up ------------------------------------------------------------------- */
static void ref_silu_and_mul(const bf16 *gate_up, int64_t T, int64_t I, double *want, double *tol) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < I; i++) {
      const double g = h_bf2f(gate_up[t * 2 * I + i]), u = h_bf2f(gate_up[t * 2 * I + I + i]);
      const double silu = g / (1.0 + exp(-g)), v = (double)h_round_bf((float)silu) * u; /* (bf16 x bf16: exact) */
      want[t * I + i] = v;
      if (tol) tol[t * I + i] = tol_bf16(v, fabs(u) * flip(silu, 1e-5)); /* (exp's clamp at -87: ~1e-37) */
    }
}

/* -- paged KV ------------------------------------------------------------------------------------------------ */
/* where position p of sequence b, kv head h, starts in a head-major cache [pages][Hkv][page_size][D] */
static int64_t kv_at(const int64_t *page_table, int64_t ldp, int64_t b, int64_t p, int64_t h, int64_t Hkv, int64_t ps,
                     int64_t D) {
  return ((page_table[b * ldp + p / ps] * Hkv + h) * ps + p % ps) * D;
}
static void ref_store_kv(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, bf16 *kc, bf16 *vc, const int64_t *slots,
                         int64_t T, int64_t Hkv, int64_t D, int64_t ps) {
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    const int64_t page = slots[t] / ps, off = slots[t] % ps;
    for (int64_t h = 0; h < Hkv; h++)
      for (int64_t d = 0; d < D; d++) {
        kc[((page * Hkv + h) * ps + off) * D + d] = k[t * ldk + h * D + d];
        vc[((page * Hkv + h) * ps + off) * D + d] = v[t * ldv + h * D + d];
      }
  }
}

/* Decode attention, want/tol [B][Hq][D]: softmax(scale q.k) over each sequence's positions, the unnormalized
 * weights exp(s - max) rounded to bf16 before they multiply V, divided by their (unrounded) sum. */
static void ref_decode_attention(const bf16 *q, int64_t ldq, const bf16 *kc, const bf16 *vc, const int64_t *page_table,
                                 int64_t ldp, const int64_t *lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                 int64_t ps, float scale, double *want, double *tol) {
  const int64_t G = Hq / Hkv;
  for (int64_t b = 0; b < B; b++) {
    const int64_t ctx = lens[b];
    double *s = xalloc(sizeof(double) * ctx), *wr = xalloc(sizeof(double) * ctx), *wf = xalloc(sizeof(double) * ctx);
    for (int64_t hq = 0; hq < Hq; hq++) {
      const int64_t h = hq / G;
      double mx = -INFINITY, sum = 0;
      for (int64_t p = 0; p < ctx; p++) {
        const bf16 *kr = kc + kv_at(page_table, ldp, b, p, h, Hkv, ps, D);
        double dot = 0;
        for (int64_t d = 0; d < D; d++) dot += (double)h_bf2f(q[b * ldq + hq * D + d]) * h_bf2f(kr[d]);
        s[p] = dot * scale;
        if (s[p] > mx) mx = s[p];
      }
      for (int64_t p = 0; p < ctx; p++) {
        const double e = exp(s[p] - mx);
        sum += e;
        wr[p] = h_round_bf((float)e);
        wf[p] = flip(e, 1e-4); /* (float32 scores and exp) */
      }
      for (int64_t d = 0; d < D; d++) {
        double acc = 0, mag = 0, flips = 0;
        for (int64_t p = 0; p < ctx; p++) {
          const double vv = h_bf2f(vc[kv_at(page_table, ldp, b, p, h, Hkv, ps, D) + d]);
          acc += wr[p] * vv, mag += wr[p] * fabs(vv), flips += wf[p] * fabs(vv);
        }
        const double o = acc / sum;
        want[(b * Hq + hq) * D + d] = o;
        if (tol) tol[(b * Hq + hq) * D + d] = tol_bf16(o, (flips + (2e-6 + 6e-8 * ctx) * mag) / sum);
      }
    }
    free(s), free(wr), free(wf);
  }
}

/* int8 pages (--kv-cache-dtype int8): values [pages][Hkv][page_size x D] int8 beside scales [pages][Hkv][page_size]
 * float32. A row: scale = amax / 127 (0 where amax is 0), q = x * (1 / scale) rounded to nearest even. The scale of
 * position p (kv head h) is at kv_at(...) / D; its value d at kv8_at: within the (page, head)'s run of page_size x D
 * bytes, K's rows in blocks of 16 (the last of page_size % 16) as [D / 2][m][2], V's rows two by two as [D][2], an
 * odd page's last V row alone. */
static int64_t kv8_at(const int64_t *page_table, int64_t ldp, int64_t b, int64_t p, int64_t h, int64_t Hkv, int64_t ps,
                      int64_t D, int v, int64_t d) {
  const int64_t run = kv_at(page_table, ldp, b, p - p % ps, h, Hkv, ps, D), r = p % ps;
  if (v) return run + (r % 2 == 0 && r + 1 == ps ? r * D + d : (r / 2) * 2 * D + 2 * d + r % 2);
  const int64_t b0 = r - r % 16, m = ps - b0 < 16 ? ps - b0 : 16;
  return run + b0 * D + (d / 2) * 2 * m + 2 * (r - b0) + d % 2;
}
static float ref_quantize_kv_row(const bf16 *x, int64_t D, int8_t *q) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; d++)
    if (fabsf(h_bf2f(x[d])) > amax) amax = fabsf(h_bf2f(x[d]));
  const float scale = amax / 127.0f, inv = amax > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t d = 0; d < D; d++) q[d] = (int8_t)nearbyintf(h_bf2f(x[d]) * inv);
  return scale;
}
/* the row (its scale's index) whose value byte i of the int8 pages is: kv8_at undone */
static int64_t kv8_row(int64_t i, int64_t ps, int64_t D, int v) {
  const int64_t first = i / (ps * D) * ps, o = i % (ps * D);
  if (v) return first + (ps % 2 && o >= (ps - 1) * D ? ps - 1 : o / (2 * D) * 2 + o % 2);
  const int64_t b0 = o / (16 * D) * 16, m = ps - b0 < 16 ? ps - b0 : 16;
  return first + b0 + (o - b0 * D) % (2 * m) / 2;
}
static void ref_store_kv_int8(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, int8_t *kc, float *ks, int8_t *vc,
                              float *vs, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t ps) {
  int8_t *q = xalloc(D);
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    const int64_t page = slots[t] / ps; /* (as a one-page table) */
    for (int64_t h = 0; h < Hkv; h++) {
      const int64_t r = (page * Hkv + h) * ps + slots[t] % ps;
      ks[r] = ref_quantize_kv_row(k + t * ldk + h * D, D, q);
      for (int64_t d = 0; d < D; d++) kc[kv8_at(&page, 1, 0, slots[t] % ps, h, Hkv, ps, D, 0, d)] = q[d];
      vs[r] = ref_quantize_kv_row(v + t * ldv + h * D, D, q);
      for (int64_t d = 0; d < D; d++) vc[kv8_at(&page, 1, 0, slots[t] % ps, h, Hkv, ps, D, 1, d)] = q[d];
    }
  }
  free(q);
}

/* Decode attention over int8 pages, want/tol [B][Hq][D]: softmax(scale q.k) over the dequantized values (q x scale),
 * the weights unrounded. The kernel's error: the scores' (q as int16, at most half a step of amax / 32767 an element,
 * times sum |k|; a few float32 ulps of sum |q k|), the sums' (2e-6 + 6e-8 ctx of sum |w v|) and the weights' (V is
 * multiplied in int16: the weights times the row's V scale, as int16: at most half a step of
 * their largest / 32767 each, times |v|). */
static void ref_decode_attention_int8(const bf16 *q, int64_t ldq, const int8_t *kc, const float *ks, const int8_t *vc,
                                      const float *vs, const int64_t *page_table, int64_t ldp, const int64_t *lens,
                                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t ps, float scale,
                                      double *want, double *tol) {
  const int64_t G = Hq / Hkv;
  for (int64_t b = 0; b < B; b++) {
    const int64_t ctx = lens[b];
    double *s = xalloc(sizeof(double) * ctx), *w = xalloc(sizeof(double) * ctx), *ds = xalloc(sizeof(double) * ctx);
    for (int64_t hq = 0; hq < Hq; hq++) {
      const int64_t h = hq / G;
      double mx = -INFINITY, sum = 0, qmax = 0;
      for (int64_t d = 0; d < D; d++) { /* (an if: aarch64 GCC 12's vectorizer fails on fmax here) */
        const double a = fabs(h_bf2f(q[b * ldq + hq * D + d]));
        if (a > qmax) qmax = a;
      }
      for (int64_t p = 0; p < ctx; p++) {
        const int64_t at = kv_at(page_table, ldp, b, p, h, Hkv, ps, D);
        double dot = 0, mag = 0, kmag = 0;
        for (int64_t d = 0; d < D; d++) {
          const double kd = (double)kc[kv8_at(page_table, ldp, b, p, h, Hkv, ps, D, 0, d)] * ks[at / D];
          const double x = (double)h_bf2f(q[b * ldq + hq * D + d]) * kd;
          dot += x, mag += fabs(x), kmag += fabs(kd);
        }
        s[p] = dot * scale;
        ds[p] = (1e-6 * mag + qmax / 65534 * kmag) * scale + 1e-6; /* (q as int16; float32 scales and exp) */
        if (s[p] > mx) mx = s[p];
      }
      double wmax = 0; /* (the largest weight times its row's V scale: the int16 weights' step is wmax / 32767) */
      for (int64_t p = 0; p < ctx; p++) {
        sum += w[p] = exp(s[p] - mx);
        const double wv = w[p] * vs[kv_at(page_table, ldp, b, p, h, Hkv, ps, D) / D];
        if (wv > wmax) wmax = wv;
      }
      for (int64_t d = 0; d < D; d++) {
        double acc = 0, err = 0;
        for (int64_t p = 0; p < ctx; p++) {
          const int64_t at = kv_at(page_table, ldp, b, p, h, Hkv, ps, D);
          const int8_t vq = vc[kv8_at(page_table, ldp, b, p, h, Hkv, ps, D, 1, d)];
          const double vv = (double)vq * vs[at / D];
          acc += w[p] * vv, err += w[p] * fabs(vv) * (2 * ds[p] + 2e-6 + 6e-8 * ctx) + wmax / 65534 * abs(vq);
        }
        want[(b * Hq + hq) * D + d] = acc / sum;
        if (tol) tol[(b * Hq + hq) * D + d] = tol_bf16(acc / sum, err / sum);
      }
    }
    free(s), free(w), free(ds);
  }
}

/* Causal prefill attention, want/tol [Lq][Hq][D]: query i is position Lk - Lq + i; the normalized weights are
 * rounded to bf16 before they multiply V. */
static void ref_prefill_attention(const bf16 *q, int64_t ldq, const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv,
                                  int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D, float scale, double *want,
                                  double *tol) {
  const int64_t G = Hq / Hkv;
  double *s = xalloc(sizeof(double) * Lk), *pr = xalloc(sizeof(double) * Lk), *pf = xalloc(sizeof(double) * Lk);
  for (int64_t i = 0; i < Lq; i++)
    for (int64_t hq = 0; hq < Hq; hq++) {
      const int64_t h = hq / G, valid = Lk - Lq + i + 1;
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < valid; j++) {
        double dot = 0;
        for (int64_t d = 0; d < D; d++) dot += (double)h_bf2f(q[i * ldq + hq * D + d]) * h_bf2f(k[j * ldk + h * D + d]);
        s[j] = dot * scale;
        if (s[j] > mx) mx = s[j];
      }
      for (int64_t j = 0; j < valid; j++) sum += (s[j] = exp(s[j] - mx));
      for (int64_t j = 0; j < valid; j++) pr[j] = h_round_bf((float)(s[j] / sum)), pf[j] = flip(s[j] / sum, 1e-4);
      for (int64_t d = 0; d < D; d++) {
        double acc = 0, mag = 0, flips = 0;
        for (int64_t j = 0; j < valid; j++) {
          const double vv = h_bf2f(v[j * ldv + h * D + d]);
          acc += pr[j] * vv, mag += pr[j] * fabs(vv), flips += pf[j] * fabs(vv);
        }
        want[(i * Hq + hq) * D + d] = acc;
        tol[(i * Hq + hq) * D + d] = tol_bf16(acc, flips + (2e-6 + 6e-8 * valid) * mag);
      }
    }
  free(s), free(pr), free(pf);
}

/* ============================================================================================================
 * Tests
 * ============================================================================================================ */

static void test_isa(void) {
  check_true(strcmp(mili_isa(), EXPECT_ISA) == 0, "mili_isa: \"%s\" (expected \"%s\")", mili_isa(), EXPECT_ISA);
}

/* extreme: every weight at its largest (int8 +-127, int4 q = 15 (31, 63 with high bits), int8g u = 0 or 255: v = u - 128 = -128 or 127)
 * and x rows of +-1 (q = +-127): the sums at their bounds (the int16 intermediate sums of the AVX2 layer without
 * VNNI) */
static const char *const SCALE_NAME[] = {"f16", "f32", "two-level"};

static void test_linear(int kind, int64_t M, int64_t N, int64_t K, int64_t group, int mode, int sym, int extreme) {
  if (kind != LIN_BF16 && !INT_KERNELS) {
    n_skipped++;
    return;
  }
  rng_seed((uint64_t)(kind * 1000003 + M * 10007 + N * 101 + K * 7 + group * 3 + mode + extreme * 5 + sym * 11));
  Lin l;
  lin_make(&l, kind, N, K, group, mode, sym, 1.0f);
  bf16 *x = xalloc(sizeof(bf16) * M * K), *y = xalloc(sizeof(bf16) * (M * N + 64));
  fill_bf(x, M * K, -1.0f, 1.0f);
  if (M >= 5 && !extreme) { /* a row of zeros (scale 1 where quantized) and one with an outlier (most q near 0) */
    memset(x + 1 * K, 0, sizeof(bf16) * K);
    x[2 * K + K / 3] = h_f2bf(-40.0f);
  }
  if (extreme) {
    for (int64_t m = 0; m < M; m++) /* row 0: all +1; then -1; then alternating; then random signs */
      for (int64_t k = 0; k < K; k++)
        x[m * K + k] = h_f2bf(m % 4 == 0 ? 1.0f : m % 4 == 1 ? -1.0f : m % 4 == 2 ? (k % 2 ? -1.0f : 1.0f) : (rng_u32() & 1 ? 1.0f : -1.0f));
    int8_t *p8 = l.packed;
    uint8_t *p4 = l.packed;
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < K; k++) {
        if (kind == LIN_INT8) { /* column n: all +127, all -127, or alternating (matching row 2's signs) */
          const int8_t v = (int8_t)(n % 3 == 0 ? 127 : n % 3 == 1 ? -127 : k % 2 ? -127 : 127);
          l.colsum[n] += v - l.w8[n * K + k];
          l.w8[n * K + k] = v;
          p8[((n / 16) * (K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = v;
        } else if (is_int4(kind)) { /* (and every high bit set: q = 31, 63) */
          const int hb = high_bits_of(kind);
          l.q4[n * K + k] = (uint8_t)((16 << hb) - 1);
          uint8_t *row = p4 + (n / 16) * K * (8 + 2 * hb) + (k / 8) * (64 + 16 * hb);
          row[(n % 16) * 4 + (k % 8) % 4] = 0xff;
          if (hb) row[64 + ((n % 16) * 4 + k % 4) % (16 * hb)] = 0xff;
        } else if (kind == LIN_INT8G) { /* column n: all 0, all 255, or alternating (matching row 2's signs) */
          const uint8_t v = (uint8_t)(n % 3 == 0 ? 0 : n % 3 == 1 ? 255 : k % 2 ? 0 : 255);
          l.q4[n * K + k] = v;
          p4[((n / 16) * (K / 4) + k / 4) * 64 + (n % 16) * 4 + k % 4] = v;
        }
      }
  }
  fill_u16(y, M * N + 64, 0x7fc1); /* (a NaN where nothing is written) */
  lin_run(&l, x, y, M);
  double *want = xalloc(sizeof(double) * M * N), *tol = xalloc(sizeof(double) * M * N);
  int overflow = 0;
  lin_ref(&l, x, M, want, tol, &overflow);
  Acc a;
  acc_init(&a);
  acc_bf16(&a, y, want, tol, M * N);
  for (int64_t i = 0; i < 64; i++) acc_bits(&a, M * N + i, y[M * N + i], 0x7fc1); /* nothing past y */
  if (overflow) a.bad++, printf("(a quantized x beyond int8)\n");
  if (is_int4(kind) || kind == LIN_INT8G)
    verdict(&a, "%s M=%lld N=%lld K=%lld group=%lld scales=%s%s%s", LIN_NAME[kind], (long long)M, (long long)N,
            (long long)K, (long long)group, SCALE_NAME[mode], sym ? " symmetric" : "", extreme ? " (extreme values)" : "");
  else
    verdict(&a, "%s M=%lld N=%lld K=%lld%s", LIN_NAME[kind], (long long)M, (long long)N, (long long)K,
            extreme ? " (extreme values)" : "");
  lin_free(&l);
  free(x), free(y), free(want), free(tol);
}

static void test_rms_norm(int64_t T, int64_t D, int64_t pad, int with_residual) {
  rng_seed((uint64_t)(T * 131 + D * 7 + pad + with_residual));
  const int64_t ldx = D + pad;
  bf16 *x = xalloc(sizeof(bf16) * T * ldx), *r = xalloc(sizeof(bf16) * T * D), *w = xalloc(sizeof(bf16) * D);
  bf16 *out = xalloc(sizeof(bf16) * T * D), *res_out = xalloc(sizeof(bf16) * T * D), *res_want = xalloc(sizeof(bf16) * T * D);
  fill_bf(x, T * ldx, -2.0f, 2.0f);
  fill_bf(r, T * D, -2.0f, 2.0f);
  fill_bf(w, D, 0.5f, 1.5f);
  if (T >= 3 && !with_residual) memset(x + 2 * ldx, 0, sizeof(bf16) * D); /* a row of zeros */
  const float eps = 1e-6f;
  const mili_norm_rows rows = {.x = x, .ldx = ldx, .residual = with_residual ? r : NULL,
                               .res_out = with_residual ? res_out : NULL, .out = out, .T = T, .D = D};
  mili_rms_norm(&rows, w, eps, NT);
  double *want = xalloc(sizeof(double) * T * D), *tol = xalloc(sizeof(double) * T * D);
  ref_rms_norm(x, ldx, with_residual ? r : NULL, w, T, D, eps, want, tol, res_want);
  Acc a;
  acc_init(&a);
  acc_bf16(&a, out, want, tol, T * D);
  verdict(&a, "rms_norm%s T=%lld D=%lld ldx=%lld", with_residual ? " +residual" : "", (long long)T, (long long)D,
          (long long)ldx);
  if (with_residual) {
    acc_init(&a);
    acc_bf16_exact(&a, res_out, res_want, T * D);
    verdict(&a, "rms_norm residual out = bf16(x + residual), exact, T=%lld D=%lld", (long long)T, (long long)D);
  }
  free(x), free(r), free(w), free(out), free(res_out), free(res_want), free(want), free(tol);
}

static void rope_tables(int64_t T, int64_t D, float *cos_t, float *sin_t) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < D / 2; i++) {
      const double pos = (double)(t * 7 + 3), angle = pos * pow(10000.0, -2.0 * (double)i / (double)D);
      cos_t[t * D + i] = cos_t[t * D + D / 2 + i] = (float)cos(angle);
      sin_t[t * D + i] = sin_t[t * D + D / 2 + i] = (float)sin(angle);
    }
}

static void test_qk_norm_rope(int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  rng_seed((uint64_t)(T * 17 + Hq * 5 + Hkv * 3 + D));
  const int64_t ld = (Hq + 2 * Hkv) * D + 16, H = Hq + Hkv; /* rows: q | k | v, then padding */
  bf16 *qkv = xalloc(sizeof(bf16) * T * ld), *before = xalloc(sizeof(bf16) * T * ld);
  bf16 *qw = xalloc(sizeof(bf16) * D), *kw = xalloc(sizeof(bf16) * D);
  float *cos_t = xalloc(sizeof(float) * T * D), *sin_t = xalloc(sizeof(float) * T * D);
  fill_bf(qkv, T * ld, -3.0f, 3.0f);
  fill_bf(qw, D, 0.5f, 1.5f);
  fill_bf(kw, D, 0.5f, 1.5f);
  rope_tables(T, D, cos_t, sin_t);
  memcpy(before, qkv, sizeof(bf16) * T * ld);
  double *want = xalloc(sizeof(double) * T * H * D), *tol = xalloc(sizeof(double) * T * H * D);
  const float eps = 1e-6f;
  ref_qk_norm_rope(before, ld, T, Hq, Hkv, D, qw, kw, eps, cos_t, sin_t, want, tol);
  const mili_qk_heads heads = {.qkv = qkv, .ld = ld, .T = T, .q_heads = Hq, .kv_heads = Hkv, .head_dim = D,
                               .cos = cos_t, .sin = sin_t};
  mili_qk_norm_rope(&heads, qw, kw, eps, NT);
  Acc a, u;
  acc_init(&a);
  acc_init(&u);
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < ld; i++) {
      if (i < H * D) acc_add(&a, t * H * D + i, h_bf2f(qkv[t * ld + i]), want[t * H * D + i], tol[t * H * D + i]);
      else acc_bits(&u, t * ld + i, qkv[t * ld + i], before[t * ld + i]); /* v and the padding: untouched */
    }
  verdict(&a, "qk_norm_rope T=%lld Hq=%lld Hkv=%lld D=%lld", (long long)T, (long long)Hq, (long long)Hkv, (long long)D);
  verdict(&u, "qk_norm_rope leaves v and the row padding alone, T=%lld D=%lld", (long long)T, (long long)D);
  free(qkv), free(before), free(qw), free(kw), free(cos_t), free(sin_t), free(want), free(tol);
}

static void test_silu_and_mul(int64_t T, int64_t I) {
  rng_seed((uint64_t)(T * 7 + I));
  bf16 *gu = xalloc(sizeof(bf16) * T * 2 * I), *out = xalloc(sizeof(bf16) * (T * I + 16));
  fill_bf(gu, T * 2 * I, -8.0f, 8.0f);
  const float extremes[] = {-100.0f, -88.0f, -20.0f, -0.0f, 0.0f, 20.0f, 88.0f, 100.0f};
  for (int i = 0; i < 8 && i < I; i++) gu[i] = h_f2bf(extremes[i]); /* gate values at exp's clamps */
  fill_u16(out, T * I + 16, 0x7fc1);
  mili_silu_and_mul(gu, out, T, I, NT);
  double *want = xalloc(sizeof(double) * T * I), *tol = xalloc(sizeof(double) * T * I);
  ref_silu_and_mul(gu, T, I, want, tol);
  Acc a;
  acc_init(&a);
  acc_bf16(&a, out, want, tol, T * I);
  for (int64_t i = 0; i < 16; i++) acc_bits(&a, T * I + i, out[T * I + i], 0x7fc1);
  verdict(&a, "silu_and_mul T=%lld I=%lld", (long long)T, (long long)I);
  free(gu), free(out), free(want), free(tol);
}

static void test_store_kv(int64_t T, int64_t Hkv, int64_t D, int64_t ps) {
  rng_seed((uint64_t)(T * 3 + Hkv * 5 + D + ps));
  const int64_t pages = T / ps + 3, ld = (2 + 2 * Hkv) * D + 8, n = pages * Hkv * ps * D;
  bf16 *rows = xalloc(sizeof(bf16) * T * ld), *kc = xalloc(sizeof(bf16) * n), *vc = xalloc(sizeof(bf16) * n);
  bf16 *kr = xalloc(sizeof(bf16) * n), *vr = xalloc(sizeof(bf16) * n);
  int64_t *slots = xalloc(sizeof(int64_t) * T);
  fill_bf(rows, T * ld, -1.0f, 1.0f);
  fill_bf(kc, n, -1.0f, 1.0f);
  fill_bf(vc, n, -1.0f, 1.0f);
  memcpy(kr, kc, sizeof(bf16) * n);
  memcpy(vr, vc, sizeof(bf16) * n);
  for (int64_t t = 0; t < T; t++) /* distinct slots, scattered over the pages; every fourth token padding (-1) */
    slots[t] = t % 4 == 3 ? -1 : t == 0 ? 0 : ((t * 7 + 3) % pages) * ps + (t * 5 + 1) % ps; /* (slot 0 too) */
  for (int64_t t = 0; t < T; t++)
    for (int64_t u = 0; u < t; u++)
      if (slots[t] >= 0 && slots[t] == slots[u]) slots[t] = -1;
  const bf16 *k = rows + 2 * D, *v = rows + (2 + Hkv) * D;
  const mili_kv_pages kv = {kc, vc, NULL, NULL, Hkv, D, ps};
  mili_store_kv(k, ld, v, ld, slots, T, &kv, NT);
  ref_store_kv(k, ld, v, ld, kr, vr, slots, T, Hkv, D, ps);
  Acc a;
  acc_init(&a);
  acc_bf16_exact(&a, kc, kr, n);
  acc_bf16_exact(&a, vc, vr, n);
  verdict(&a, "store_kv T=%lld Hkv=%lld D=%lld page_size=%lld (slots < 0 skipped)", (long long)T, (long long)Hkv,
          (long long)D, (long long)ps);
  free(rows), free(kc), free(vc), free(kr), free(vr), free(slots);
}

/* A pool of pages for B sequences of lens[b] positions, each sequence's pages scattered (a permutation of the
 * pool); the table's unused entries and every position past a sequence's length hold garbage (large values), so
 * a kernel reading beyond the context disagrees. Returns the table [B][ldp]. */
static int64_t *make_pages(int64_t B, const int64_t *lens, int64_t ps, int64_t *npages, int64_t *ldp) {
  int64_t total = 0, widest = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t n = (lens[b] + ps - 1) / ps;
    total += n;
    if (n > widest) widest = n;
  }
  *npages = total + 2, *ldp = widest + 2;
  int64_t *perm = xalloc(sizeof(int64_t) * total), *table = xalloc(sizeof(int64_t) * B * *ldp);
  for (int64_t i = 0; i < total; i++) perm[i] = i;
  for (int64_t i = total - 1; i > 0; i--) {
    const int64_t j = rng_u32() % (uint64_t)(i + 1), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  int64_t used = 0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < *ldp; i++)
      table[b * *ldp + i] = i < (lens[b] + ps - 1) / ps ? perm[used++] : total + 1; /* (the last page: garbage) */
  free(perm);
  return table;
}
static void fill_cache(bf16 *cache, int64_t npages, int64_t Hkv, int64_t ps, int64_t D, const int64_t *table,
                       int64_t ldp, int64_t B, const int64_t *lens) {
  fill_u16(cache, npages * Hkv * ps * D, h_f2bf(30.0f)); /* garbage wherever no valid position lives */
  for (int64_t b = 0; b < B; b++)
    for (int64_t p = 0; p < lens[b]; p++)
      for (int64_t h = 0; h < Hkv; h++) fill_bf(cache + kv_at(table, ldp, b, p, h, Hkv, ps, D), D, -1.0f, 1.0f);
}

static void test_decode_attention(int64_t B, const int64_t *lens, int64_t Hkv, int64_t G, int64_t D, int64_t ps) {
  rng_seed((uint64_t)(B * 3 + Hkv * 5 + G * 7 + D * 11 + ps * 13 + lens[0]));
  const int64_t Hq = Hkv * G, ldq = Hq * D + 32;
  int64_t npages, ldp;
  int64_t *table = make_pages(B, lens, ps, &npages, &ldp);
  const int64_t n = npages * Hkv * ps * D;
  bf16 *kc = xalloc(sizeof(bf16) * n), *vc = xalloc(sizeof(bf16) * n), *q = xalloc(sizeof(bf16) * B * ldq);
  bf16 *out = xalloc(sizeof(bf16) * (B * Hq * D + 32));
  fill_cache(kc, npages, Hkv, ps, D, table, ldp, B, lens);
  fill_cache(vc, npages, Hkv, ps, D, table, ldp, B, lens);
  fill_bf(q, B * ldq, -2.0f, 2.0f);
  fill_u16(out, B * Hq * D + 32, 0x7fc1);
  const float scale = 1.0f / sqrtf((float)D);
  const mili_kv_pages kv = {kc, vc, NULL, NULL, Hkv, D, ps};
  const mili_seq_pages seqs = {table, ldp, lens, B};
  mili_decode_attention(q, ldq, Hq, scale, &kv, &seqs, out, NT);
  double *want = xalloc(sizeof(double) * B * Hq * D), *tol = xalloc(sizeof(double) * B * Hq * D);
  ref_decode_attention(q, ldq, kc, vc, table, ldp, lens, B, Hq, Hkv, D, ps, scale, want, tol);
  Acc a;
  acc_init(&a);
  acc_bf16(&a, out, want, tol, B * Hq * D);
  for (int64_t i = 0; i < 32; i++) acc_bits(&a, B * Hq * D + i, out[B * Hq * D + i], 0x7fc1);
  char lens_s[128] = "";
  for (int64_t b = 0; b < B; b++)
    snprintf(lens_s + strlen(lens_s), sizeof lens_s - strlen(lens_s), "%s%lld", b ? "," : "", (long long)lens[b]);
  verdict(&a, "decode_attention B=%lld lens=%s Hq=%lld Hkv=%lld (group %lld) D=%lld page_size=%lld", (long long)B,
          lens_s, (long long)Hq, (long long)Hkv, (long long)G, (long long)D, (long long)ps);
  free(table), free(kc), free(vc), free(q), free(out), free(want), free(tol);
}

static void acc_bytes_exact(Acc *a, const void *got, const void *want, int64_t n) {
  for (int64_t i = 0; i < n; i++) acc_bits(a, i, ((const uint8_t *)got)[i], ((const uint8_t *)want)[i]);
}

static void test_store_kv_int8(int64_t T, int64_t Hkv, int64_t D, int64_t ps) {
  rng_seed((uint64_t)(T * 3 + Hkv * 5 + D + ps + 1000));
  const int64_t pages = T / ps + 3, ld = (2 + 2 * Hkv) * D + 8, rows = pages * Hkv * ps, n = rows * D;
  bf16 *x = xalloc(sizeof(bf16) * T * ld);
  int8_t *kc = xalloc(n), *vc = xalloc(n), *kr = xalloc(n), *vr = xalloc(n);
  float *ks = xalloc(sizeof(float) * rows), *vs = xalloc(sizeof(float) * rows), *ksr = xalloc(sizeof(float) * rows);
  float *vsr = xalloc(sizeof(float) * rows);
  int64_t *slots = xalloc(sizeof(int64_t) * T);
  for (int64_t t = 0; t < T; t++) fill_bf(x + t * ld, ld, -rng_uniform(0.01f, 8.0f), rng_uniform(0.01f, 8.0f));
  const bf16 *k = x + 2 * D, *v = x + (2 + Hkv) * D;
  memset(x + 2 * D, 0, sizeof(bf16) * D); /* token 0's first K row: zeros (scale 0) */
  for (int64_t i = 0; i < n; i++) kc[i] = vc[i] = kr[i] = vr[i] = (int8_t)(i % 7 - 3); /* (untouched rows: kept) */
  for (int64_t i = 0; i < rows; i++) ks[i] = vs[i] = ksr[i] = vsr[i] = 0.5f;
  for (int64_t t = 0; t < T; t++)
    slots[t] = t % 4 == 3 ? -1 : t == 0 ? 0 : ((t * 7 + 3) % pages) * ps + (t * 5 + 1) % ps;
  for (int64_t t = 0; t < T; t++)
    for (int64_t u = 0; u < t; u++)
      if (slots[t] >= 0 && slots[t] == slots[u]) slots[t] = -1;
  const mili_kv_pages kv = {kc, vc, ks, vs, Hkv, D, ps};
  mili_store_kv(k, ld, v, ld, slots, T, &kv, NT);
  ref_store_kv_int8(k, ld, v, ld, kr, ksr, vr, vsr, slots, T, Hkv, D, ps);
  Acc a;
  acc_init(&a);
  acc_bytes_exact(&a, kc, kr, n);
  acc_bytes_exact(&a, vc, vr, n);
  acc_bytes_exact(&a, ks, ksr, sizeof(float) * rows);
  acc_bytes_exact(&a, vs, vsr, sizeof(float) * rows);
  verdict(&a, "store_kv_int8 T=%lld Hkv=%lld D=%lld page_size=%lld: values and scales exact (slots < 0 skipped)",
          (long long)T, (long long)Hkv, (long long)D, (long long)ps);
  acc_init(&a); /* the layout's two directions agree: each value's place names its row */
  for (int64_t page = 0; page < pages; page++)
    for (int64_t r = 0; r < ps; r++)
      for (int64_t h = 0; h < Hkv; h++)
        for (int64_t d = 0; d < D; d++)
          for (int v8 = 0; v8 < 2; v8++)
            acc_bits(&a, 0, (uint16_t)kv8_row(kv8_at(&page, 1, 0, r, h, Hkv, ps, D, v8, d), ps, D, v8),
                     (uint16_t)((page * Hkv + h) * ps + r));
  verdict(&a, "int8 pages' layout, page_size=%lld D=%lld: kv8_row undoes kv8_at", (long long)ps, (long long)D);
  /* the gather: every token of two sequences over the same pages, dequantized bf16(q x scale) exactly */
  const int64_t lens[2] = {T, T / 2 + 1};
  int64_t npages, ldp;
  int64_t *table = make_pages(2, lens, ps, &npages, &ldp);
  for (int64_t i = 0; i < 2 * ldp; i++) table[i] %= pages;
  bf16 *out = xalloc(sizeof(bf16) * 2 * T * Hkv * D), *want = xalloc(sizeof(bf16) * 2 * T * Hkv * D);
  const mili_seq_pages seqs = {table, ldp, lens, 2};
  for (int which = 0; which < 2; which++) {
    mili_gather_kv_int8(&kv, which, &seqs, T, out, NT);
    const int8_t *c = which ? vc : kc;
    const float *sc = which ? vs : ks;
    for (int64_t b = 0; b < 2; b++)
      for (int64_t p = 0; p < T; p++)
        for (int64_t h = 0; h < Hkv; h++) {
          const int64_t at = kv_at(table, ldp, b, p, h, Hkv, ps, D);
          for (int64_t d = 0; d < D; d++)
            want[((b * T + p) * Hkv + h) * D + d] = h_f2bf((float)c[kv8_at(table, ldp, b, p, h, Hkv, ps, D, which, d)] * sc[at / D]);
        }
    acc_init(&a);
    acc_bf16_exact(&a, out, want, 2 * T * Hkv * D);
    verdict(&a, "gather_kv_int8 (%s) T=%lld Hkv=%lld D=%lld page_size=%lld: dequantized exactly", which ? "V" : "K",
            (long long)T, (long long)Hkv, (long long)D, (long long)ps);
  }
  free(x), free(kc), free(vc), free(kr), free(vr), free(ks), free(vs), free(ksr), free(vsr), free(slots);
  free(table), free(out), free(want);
}

/* int8 pages of B sequences (make_pages' table): random rows (values, scales of 2^-7..2^-5) at each sequence's
 * positions, garbage (127, scale 30) everywhere else, so a kernel reading beyond a context disagrees. */
static void fill_cache_int8(int8_t *cache, float *scales, int v, int64_t npages, int64_t Hkv, int64_t ps, int64_t D,
                            const int64_t *table, int64_t ldp, int64_t B, const int64_t *lens) {
  memset(cache, 127, npages * Hkv * ps * D);
  for (int64_t i = 0; i < npages * Hkv * ps; i++) scales[i] = 30.0f;
  for (int64_t b = 0; b < B; b++)
    for (int64_t p = 0; p < lens[b]; p++)
      for (int64_t h = 0; h < Hkv; h++) {
        const int64_t at = kv_at(table, ldp, b, p, h, Hkv, ps, D);
        for (int64_t d = 0; d < D; d++) cache[kv8_at(table, ldp, b, p, h, Hkv, ps, D, v, d)] = (int8_t)rng_int(-127, 127);
        scales[at / D] = rng_uniform(1.0f / 128, 1.0f / 32);
      }
}

static void test_decode_attention_int8(int64_t B, const int64_t *lens, int64_t Hkv, int64_t G, int64_t D, int64_t ps) {
  rng_seed((uint64_t)(B * 3 + Hkv * 5 + G * 7 + D * 11 + ps * 13 + lens[0] + 2000));
  const int64_t Hq = Hkv * G, ldq = Hq * D + 32;
  int64_t npages, ldp;
  int64_t *table = make_pages(B, lens, ps, &npages, &ldp);
  const int64_t rows = npages * Hkv * ps;
  int8_t *kc = xalloc(rows * D), *vc = xalloc(rows * D);
  float *ks = xalloc(sizeof(float) * rows), *vs = xalloc(sizeof(float) * rows);
  bf16 *q = xalloc(sizeof(bf16) * B * ldq), *out = xalloc(sizeof(bf16) * (B * Hq * D + 32));
  fill_cache_int8(kc, ks, 0, npages, Hkv, ps, D, table, ldp, B, lens);
  fill_cache_int8(vc, vs, 1, npages, Hkv, ps, D, table, ldp, B, lens);
  fill_bf(q, B * ldq, -2.0f, 2.0f);
  fill_u16(out, B * Hq * D + 32, 0x7fc1);
  const float scale = 1.0f / sqrtf((float)D);
  const mili_kv_pages kv = {kc, vc, ks, vs, Hkv, D, ps};
  const mili_seq_pages seqs = {table, ldp, lens, B};
  mili_decode_attention(q, ldq, Hq, scale, &kv, &seqs, out, NT);
  double *want = xalloc(sizeof(double) * B * Hq * D), *tol = xalloc(sizeof(double) * B * Hq * D);
  ref_decode_attention_int8(q, ldq, kc, ks, vc, vs, table, ldp, lens, B, Hq, Hkv, D, ps, scale, want, tol);
  Acc a;
  acc_init(&a);
  acc_bf16(&a, out, want, tol, B * Hq * D);
  for (int64_t i = 0; i < 32; i++) acc_bits(&a, B * Hq * D + i, out[B * Hq * D + i], 0x7fc1);
  char lens_s[128] = "";
  for (int64_t b = 0; b < B; b++)
    snprintf(lens_s + strlen(lens_s), sizeof lens_s - strlen(lens_s), "%s%lld", b ? "," : "", (long long)lens[b]);
  verdict(&a, "decode_attention_int8 B=%lld lens=%s Hq=%lld Hkv=%lld (group %lld) D=%lld page_size=%lld", (long long)B,
          lens_s, (long long)Hq, (long long)Hkv, (long long)G, (long long)D, (long long)ps);
  free(table), free(kc), free(vc), free(ks), free(vs), free(q), free(out), free(want), free(tol);
}

static void test_prefill_attention(int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D) {
  rng_seed((uint64_t)(Lq * 3 + Lk * 5 + Hq * 7 + Hkv * 11 + D));
  const int64_t ld = (Hq + 2 * Hkv) * D, ldo = Hq * D + 16; /* fused rows q | k | v; out rows padded */
  bf16 *rows = xalloc(sizeof(bf16) * Lk * ld), *out = xalloc(sizeof(bf16) * Lq * ldo);
  fill_bf(rows, Lk * ld, -2.0f, 2.0f);
  fill_u16(out, Lq * ldo, 0x7fc1);
  const bf16 *q = rows + (Lk - Lq) * ld, *k = rows + Hq * D, *v = rows + (Hq + Hkv) * D;
  const float scale = 1.0f / sqrtf((float)D);
  const mili_prefill_chunk chunk = {.q = q, .k = k, .v = v, .ldq = ld, .ldk = ld, .ldv = ld, .Lq = Lq, .Lk = Lk,
                                    .q_heads = Hq, .kv_heads = Hkv, .head_dim = D};
  mili_prefill_attention(&chunk, scale, out, ldo, NT);
  double *want = xalloc(sizeof(double) * Lq * Hq * D), *tol = xalloc(sizeof(double) * Lq * Hq * D);
  ref_prefill_attention(q, ld, k, ld, v, ld, Lq, Lk, Hq, Hkv, D, scale, want, tol);
  Acc a;
  acc_init(&a);
  for (int64_t i = 0; i < Lq; i++)
    for (int64_t j = 0; j < ldo; j++) {
      if (j < Hq * D) acc_add(&a, i * Hq * D + j, h_bf2f(out[i * ldo + j]), want[i * Hq * D + j], tol[i * Hq * D + j]);
      else acc_bits(&a, i * ldo + j, out[i * ldo + j], 0x7fc1); /* the padding: untouched */
    }
  verdict(&a, "prefill_attention Lq=%lld Lk=%lld Hq=%lld Hkv=%lld D=%lld", (long long)Lq, (long long)Lk, (long long)Hq,
          (long long)Hkv, (long long)D);
  free(rows), free(out), free(want), free(tol);
}

/* -- one decoder layer: (1) against the same kernels called one by one as documented (bit for bit), (2) against
 * the composition of the references above, each stage rounded to bf16 as the kernels round it. ------------- */
/* split: the fused q|k|v in two parts (mili_linear_desc's next), the v rows int4 with two high bits, symmetric, in
 * groups of 16 (GGUF's Q4_K_M: Q4_K q and k beside a Q6_K v) */
/* kv8: the layer's pages int8 (values and scales; the bf16 caches unused) */
static void decode_layer_case(int kind, int64_t group, int mode, int sym, int first, int split, int kv8) {
  if (kind != LIN_BF16 && !INT_KERNELS) {
    n_skipped++;
    return;
  }
  rng_seed((uint64_t)(kind * 101 + group * 7 + mode * 3 + first + sym * 13 + (mode == SCALES_K) * 17 + split * 19));
  const int64_t H = 128, Hq = 4, Hkv = 2, D = 64, I = 128, T = 3, ps = 16, nqkv = (Hq + 2 * Hkv) * D;
  const int64_t nqk = split ? (Hq + Hkv) * D : nqkv; /* (the first part's rows) */
  const float eps = 1e-6f, scale = 1.0f / sqrtf((float)D);
  Lin qkv, o, gu, down, v;
  lin_make(&qkv, kind, nqk, H, group, mode, sym, 2.0f / sqrtf((float)H));
  if (split) lin_make(&v, LIN_INT4_H2, nqkv - nqk, H, 16, SCALES_K, 1, 2.0f / sqrtf((float)H));
  lin_make(&o, kind, H, Hq * D, group, mode, sym, 1.0f / sqrtf((float)(Hq * D)));
  lin_make(&gu, kind, 2 * I, H, group, mode, sym, 2.0f / sqrtf((float)H));
  lin_make(&down, kind, H, I, group, mode, sym, 1.0f / sqrtf((float)I));
  bf16 *norms = xalloc(sizeof(bf16) * (2 * H + 2 * D));
  fill_bf(norms, 2 * H + 2 * D, 0.5f, 1.5f);
  mili_layer_desc L;
  memset(&L, 0, sizeof L);
  L.hidden = H, L.q_heads = Hq, L.kv_heads = Hkv, L.head_dim = D, L.inter = I, L.eps = eps, L.scale = scale;
  L.input_norm = norms, L.post_norm = norms + H, L.q_norm = norms + 2 * H, L.k_norm = norms + 2 * H + D;
  L.qkv = lin_desc(&qkv), L.o = lin_desc(&o), L.gate_up = lin_desc(&gu), L.down = lin_desc(&down);
  mili_linear_desc v_desc;
  if (split) v_desc = lin_desc(&v), L.qkv.next = &v_desc;

  const int64_t prev[3] = {4, 16, 30}, lens[3] = {5, 17, 31}; /* each sequence's cached positions, then this token */
  int64_t npages, ldp;
  int64_t *table = make_pages(T, lens, ps, &npages, &ldp), slots[3];
  for (int64_t b = 0; b < T; b++) slots[b] = table[b * ldp + prev[b] / ps] * ps + prev[b] % ps;
  const int64_t nc = npages * Hkv * ps * D;
  bf16 *kc[3], *vc[3]; /* the kernel's layer, the pieces, the reference */
  for (int i = 0; i < 3; i++) kc[i] = xalloc(sizeof(bf16) * nc), vc[i] = xalloc(sizeof(bf16) * nc);
  fill_cache(kc[0], npages, Hkv, ps, D, table, ldp, T, prev);
  fill_cache(vc[0], npages, Hkv, ps, D, table, ldp, T, prev);
  for (int i = 1; i < 3; i++) memcpy(kc[i], kc[0], sizeof(bf16) * nc), memcpy(vc[i], vc[0], sizeof(bf16) * nc);
  const int64_t nrows = npages * Hkv * ps;
  int8_t *kq[3], *vq[3]; /* kv8: the int8 pages, as kc / vc */
  float *ksc[3], *vsc[3];
  for (int i = 0; i < 3; i++) {
    kq[i] = xalloc(nc), vq[i] = xalloc(nc), ksc[i] = xalloc(sizeof(float) * nrows), vsc[i] = xalloc(sizeof(float) * nrows);
    if (i == 0) {
      fill_cache_int8(kq[0], ksc[0], 0, npages, Hkv, ps, D, table, ldp, T, prev);
      fill_cache_int8(vq[0], vsc[0], 1, npages, Hkv, ps, D, table, ldp, T, prev);
    } else {
      memcpy(kq[i], kq[0], nc), memcpy(vq[i], vq[0], nc);
      memcpy(ksc[i], ksc[0], sizeof(float) * nrows), memcpy(vsc[i], vsc[0], sizeof(float) * nrows);
    }
  }
  float *cos_t = xalloc(sizeof(float) * T * D), *sin_t = xalloc(sizeof(float) * T * D);
  rope_tables(T, D, cos_t, sin_t);
  bf16 *h[3], *res[3];
  for (int i = 0; i < 3; i++) h[i] = xalloc(sizeof(bf16) * T * H), res[i] = xalloc(sizeof(bf16) * T * H);
  fill_bf(h[0], T * H, -1.0f, 1.0f);
  fill_bf(res[0], T * H, -3.0f, 3.0f);
  for (int i = 1; i < 3; i++) memcpy(h[i], h[0], sizeof(bf16) * T * H), memcpy(res[i], res[0], sizeof(bf16) * T * H);
  const int64_t nwork = T * (H + nqkv + Hq * D + H + 2 * I + I);
  bf16 *work = xalloc(sizeof(bf16) * nwork);

  const mili_seq_pages seqs = {table, ldp, lens, T};
  const mili_kv_pages kv0 = kv8 ? (mili_kv_pages){kq[0], vq[0], ksc[0], vsc[0], Hkv, D, ps}
                                : (mili_kv_pages){kc[0], vc[0], NULL, NULL, Hkv, D, ps};
  const mili_kv_pages kv1 = kv8 ? (mili_kv_pages){kq[1], vq[1], ksc[1], vsc[1], Hkv, D, ps}
                                : (mili_kv_pages){kc[1], vc[1], NULL, NULL, Hkv, D, ps};
  const mili_decode_step step = {h[0], res[0], slots, cos_t, sin_t, work, NULL, T};
  mili_decode_layer(&L, first, &kv0, &seqs, &step, NT);

  { /* (1) the pieces, as the layer documents them */
    bf16 *normed = xalloc(sizeof(bf16) * T * H), *x = xalloc(sizeof(bf16) * T * nqkv), *attn = xalloc(sizeof(bf16) * T * Hq * D);
    bf16 *ob = xalloc(sizeof(bf16) * T * H), *g = xalloc(sizeof(bf16) * T * 2 * I), *act = xalloc(sizeof(bf16) * T * I);
    if (first) memcpy(res[1], h[1], sizeof(bf16) * T * H);
    const mili_norm_rows in_rows = {.x = h[1], .ldx = H, .residual = first ? NULL : res[1],
                                    .res_out = first ? NULL : res[1], .out = normed, .T = T, .D = H};
    mili_rms_norm(&in_rows, L.input_norm, eps, NT);
    lin_run_ld(&qkv, normed, x, nqkv, T);
    if (split) lin_run_ld(&v, normed, x + nqk, nqkv, T);
    const mili_qk_heads heads = {.qkv = x, .ld = nqkv, .T = T, .q_heads = Hq, .kv_heads = Hkv, .head_dim = D,
                                 .cos = cos_t, .sin = sin_t};
    mili_qk_norm_rope(&heads, L.q_norm, L.k_norm, eps, NT);
    mili_store_kv(x + Hq * D, nqkv, x + (Hq + Hkv) * D, nqkv, slots, T, &kv1, NT);
    mili_decode_attention(x, nqkv, Hq, scale, &kv1, &seqs, attn, NT);
    lin_run(&o, attn, ob, T);
    const mili_norm_rows post_rows = {.x = ob, .ldx = H, .residual = res[1], .res_out = res[1], .out = normed,
                                      .T = T, .D = H};
    mili_rms_norm(&post_rows, L.post_norm, eps, NT);
    lin_run(&gu, normed, g, T);
    mili_silu_and_mul(g, act, T, I, NT);
    lin_run(&down, act, h[1], T);
    free(normed), free(x), free(attn), free(ob), free(g), free(act);
  }
  { /* (2) the references composed */
    bf16 *normed = xalloc(sizeof(bf16) * T * H), *x = xalloc(sizeof(bf16) * T * nqkv), *attn = xalloc(sizeof(bf16) * T * Hq * D);
    bf16 *ob = xalloc(sizeof(bf16) * T * H), *g = xalloc(sizeof(bf16) * T * 2 * I), *act = xalloc(sizeof(bf16) * T * I);
    const int64_t nmax = T * (nqkv > 2 * I ? nqkv : 2 * I);
    double *want = xalloc(sizeof(double) * nmax), *tol = xalloc(sizeof(double) * nmax);
    if (first) {
      memcpy(res[2], h[2], sizeof(bf16) * T * H);
      ref_rms_norm(h[2], H, NULL, L.input_norm, T, H, eps, want, NULL, NULL);
    } else {
      ref_rms_norm(h[2], H, res[2], L.input_norm, T, H, eps, want, NULL, res[2]);
    }
    for (int64_t i = 0; i < T * H; i++) normed[i] = h_f2bf((float)want[i]);
    if (split) { /* each part's reference into its columns */
      bf16 *part = xalloc(sizeof(bf16) * T * nqkv);
      lin_ref_bf(&qkv, normed, T, part);
      for (int64_t t = 0; t < T; t++) memcpy(x + t * nqkv, part + t * nqk, sizeof(bf16) * nqk);
      lin_ref_bf(&v, normed, T, part);
      for (int64_t t = 0; t < T; t++) memcpy(x + t * nqkv + nqk, part + t * (nqkv - nqk), sizeof(bf16) * (nqkv - nqk));
      free(part);
    } else {
      lin_ref_bf(&qkv, normed, T, x);
    }
    ref_qk_norm_rope(x, nqkv, T, Hq, Hkv, D, L.q_norm, L.k_norm, eps, cos_t, sin_t, want, tol);
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < (Hq + Hkv) * D; i++) x[t * nqkv + i] = h_f2bf((float)want[t * (Hq + Hkv) * D + i]);
    if (kv8) {
      ref_store_kv_int8(x + Hq * D, nqkv, x + (Hq + Hkv) * D, nqkv, kq[2], ksc[2], vq[2], vsc[2], slots, T, Hkv, D, ps);
      ref_decode_attention_int8(x, nqkv, kq[2], ksc[2], vq[2], vsc[2], table, ldp, lens, T, Hq, Hkv, D, ps, scale, want,
                                NULL);
    } else {
      ref_store_kv(x + Hq * D, nqkv, x + (Hq + Hkv) * D, nqkv, kc[2], vc[2], slots, T, Hkv, D, ps);
      ref_decode_attention(x, nqkv, kc[2], vc[2], table, ldp, lens, T, Hq, Hkv, D, ps, scale, want, NULL);
    }
    for (int64_t i = 0; i < T * Hq * D; i++) attn[i] = h_f2bf((float)want[i]);
    lin_ref_bf(&o, attn, T, ob);
    ref_rms_norm(ob, H, res[2], L.post_norm, T, H, eps, want, NULL, res[2]);
    for (int64_t i = 0; i < T * H; i++) normed[i] = h_f2bf((float)want[i]);
    lin_ref_bf(&gu, normed, T, g);
    ref_silu_and_mul(g, T, I, want, NULL);
    for (int64_t i = 0; i < T * I; i++) act[i] = h_f2bf((float)want[i]);
    lin_ref_bf(&down, act, T, h[2]);
    free(normed), free(x), free(attn), free(ob), free(g), free(act), free(want), free(tol);
  }
  char what[96];
  if (is_int4(kind) || kind == LIN_INT8G)
    snprintf(what, sizeof what, "%s group=%lld scales=%s%s%s", LIN_NAME[kind] + 7, (long long)group,
             SCALE_NAME[mode], sym ? " symmetric" : "", split ? " (q|k, then v: int4 +2 bits)" : "");
  else
    snprintf(what, sizeof what, "%s", kind == LIN_INT8 ? "int8" : "bf16");
  if (kv8) snprintf(what + strlen(what), sizeof what - strlen(what), ", int8 pages");
  Acc a;
  acc_init(&a);
  acc_bf16_exact(&a, h[0], h[1], T * H);
  acc_bf16_exact(&a, res[0], res[1], T * H);
  acc_bf16_exact(&a, kc[0], kc[1], nc);
  acc_bf16_exact(&a, vc[0], vc[1], nc);
  acc_bytes_exact(&a, kq[0], kq[1], nc);
  acc_bytes_exact(&a, vq[0], vq[1], nc);
  acc_bytes_exact(&a, ksc[0], ksc[1], sizeof(float) * nrows);
  acc_bytes_exact(&a, vsc[0], vsc[1], sizeof(float) * nrows);
  verdict(&a, "decode_layer %s first=%d: output, residual and caches = the kernels called one by one (bit for bit)",
          what, first);
  /* against the references: each stage's one-ulp differences carry on through the layer, so the bound is a
   * fraction of each output's largest magnitude */
  acc_init(&a);
  double hmax = 0, rmax = 0;
  for (int64_t i = 0; i < T * H; i++) {
    if (fabs(h_bf2f(h[2][i])) > hmax) hmax = fabs(h_bf2f(h[2][i]));
    if (fabs(h_bf2f(res[2][i])) > rmax) rmax = fabs(h_bf2f(res[2][i]));
  }
  for (int64_t i = 0; i < T * H; i++) {
    acc_add(&a, i, h_bf2f(h[0][i]), h_bf2f(h[2][i]), 0.02 * hmax + fabs(h_bf2f(h[2][i])) / 64);
    acc_add(&a, T * H + i, h_bf2f(res[0][i]), h_bf2f(res[2][i]), 0.02 * rmax + fabs(h_bf2f(res[2][i])) / 64);
  }
  verdict(&a, "decode_layer %s first=%d: output and residual = the references composed", what, first);
  Acc c;
  acc_init(&c);
  for (int64_t i = 0; i < nc; i++) { /* the new K/V rows: rounded differences only (int8: dequantized) */
    const int64_t kr = kv8_row(i, ps, D, 0), vr = kv8_row(i, ps, D, 1); /* (the rows byte i is of) */
    const double kg = kv8 ? kq[0][i] * (double)ksc[0][kr] : h_bf2f(kc[0][i]);
    const double kw = kv8 ? kq[2][i] * (double)ksc[2][kr] : h_bf2f(kc[2][i]);
    const double vg = kv8 ? vq[0][i] * (double)vsc[0][vr] : h_bf2f(vc[0][i]);
    const double vw = kv8 ? vq[2][i] * (double)vsc[2][vr] : h_bf2f(vc[2][i]);
    acc_add(&c, i, kg, kw, fabs(kw) / 32 + 0.02);
    acc_add(&c, nc + i, vg, vw, fabs(vw) / 32 + 0.02);
  }
  verdict(&c, "decode_layer %s first=%d: caches = the references composed", what, first);
  lin_free(&qkv), lin_free(&o), lin_free(&gu), lin_free(&down);
  if (split) lin_free(&v);
  free(norms), free(table), free(cos_t), free(sin_t), free(work);
  for (int i = 0; i < 3; i++) free(kc[i]), free(vc[i]), free(h[i]), free(res[i]);
  for (int i = 0; i < 3; i++) free(kq[i]), free(vq[i]), free(ksc[i]), free(vsc[i]);
}
static void test_decode_layer(int kind, int64_t group, int mode, int sym, int first, int split) {
  decode_layer_case(kind, group, mode, sym, first, split, 0);
}

/* -- argmax: the first index of the largest value, the first NaN counting as the largest -------------------- */
static int64_t ref_argmax(const bf16 *row, int64_t N) {
  int64_t best = 0;
  double top = -INFINITY;
  for (int64_t i = 0; i < N; i++) {
    const float v = h_bf2f(row[i]);
    if (isnan(v)) return i;
    if (v > top) top = v, best = i;
  }
  return best;
}

static void test_argmax(int64_t N) {
  rng_seed((uint64_t)N * 977);
  enum { R = 8 };
  const int64_t ld = N + 3;
  bf16 *x = xalloc(sizeof(bf16) * R * ld);
  int64_t out[R], want[R];
  fill_bf(x, R * ld, -10.0f, 10.0f);
  for (int64_t r = 0; r < R; r++) {
    bf16 *row = x + r * ld;
    const int64_t i = rng_u32() % (uint64_t)N, j = rng_u32() % (uint64_t)N, k = rng_u32() % (uint64_t)N;
    switch (r) {
      case 0: break; /* random values */
      case 1: row[i] = row[j] = row[k] = h_f2bf(64.0f); break; /* ties: the first */
      case 2: row[i] = h_f2bf(INFINITY), row[j] = 0x7fc0, row[k] = 0xffc1; break; /* NaNs: the first (+ or - sign) */
      case 3: fill_u16(row, N, h_f2bf(-INFINITY)); break; /* all -inf: 0 */
      case 4: /* all <= 0, the largest 0 as -0 and +0: the first of either */
        for (int64_t c = 0; c < N; c++) row[c] = h_f2bf(-fabsf(h_bf2f(row[c])) - 1.0f);
        row[i] = 0x8000, row[j] = 0x0000;
        break;
      case 5: row[N - 1] = 0x7f81; break; /* a signalling NaN at the end */
      case 6: row[0] = h_f2bf(100.0f), row[N - 1] = h_f2bf(100.0f); break; /* ties at both ends */
      case 7: fill_u16(row, N, h_f2bf(-3.0f)); row[N - 1] = h_f2bf(-2.0f); break; /* the last, all else equal */
    }
  }
  for (int64_t r = 0; r < R; r++) out[r] = -7, want[r] = ref_argmax(x + r * ld, N);
  mili_argmax_rows(x, ld, R, N, out, NT);
  Acc a;
  acc_init(&a);
  for (int64_t r = 0; r < R; r++) acc_add(&a, r, (double)out[r], (double)want[r], 0.0);
  verdict(&a, "argmax_rows N=%lld (%d rows: random, ties, NaNs, -inf, +-0, sNaN, end ties, last)", (long long)N, R);
  free(x);
}

static void test_bitmask(int64_t V) {
  rng_seed((uint64_t)V * 31 + 1);
  const int64_t B = 4, ld = V + 7, words = (V + 31) / 32, ldm = words + 2, mrows = 5;
  const int64_t rows[3] = {2, 0, 3}; /* (row 1 is not listed: untouched) */
  float *lg = xalloc(sizeof(float) * B * ld), *want = xalloc(sizeof(float) * B * ld);
  int32_t *mask = xalloc(sizeof(int32_t) * mrows * ldm);
  for (int64_t i = 0; i < B * ld; i++) lg[i] = rng_uniform(-5.0f, 5.0f);
  for (int64_t i = 0; i < mrows * ldm; i++) {
    const int kind = rng_int(0, 3);
    mask[i] = kind == 0 ? -1 : kind == 1 ? 0 : (int32_t)rng_u32();
  }
  memcpy(want, lg, sizeof(float) * B * ld);
  for (int j = 0; j < 3; j++)
    for (int64_t t = 0; t < V; t++)
      if (!(((uint32_t)mask[rows[j] * ldm + t / 32] >> (t % 32)) & 1u)) want[rows[j] * ld + t] = -INFINITY;
  mili_apply_bitmask(lg, ld, mask, ldm, rows, 3, V, NT);
  Acc a;
  acc_init(&a);
  for (int64_t i = 0; i < B * ld; i++) acc_bits(&a, i, h_fbits(lg[i]), h_fbits(want[i]));
  verdict(&a, "apply_bitmask V=%lld (rows 2,0,3 of 5; bits past V and unlisted rows ignored)", (long long)V);
  free(lg), free(want), free(mask);
}

/* -- Gated DeltaNet decode ------------------------------------------------------------------------------------
 * The reference follows the math in kernels.c's comment in double precision. With bf16 io the conv output, its
 * SiLU and beta are rounded to bf16: there the inputs are small dyadic numbers (x, the conv state: k / 64;
 * conv weights: k / 16), so the conv sums are exact in float32 and double alike, and SiLU and sigmoid are
 * evaluated in float32 as a bf16 op evaluates them (expf), so that the rounding boundaries fall alike. */
static void test_gdn(int bf16_io, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K, int with_fresh) {
  rng_seed((uint64_t)(bf16_io * 7 + Hk * 11 + Hv * 13 + Dk * 17 + Dv * 19 + K * 23 + with_fresh));
  enum { B = 3, ROWS = 6 };
  const int64_t C = 2 * Hk * Dk + Hv * Dv, W = K - 1, rep = Hv / Hk, ldq = C + 8, ldba = 2 * Hv + 3, es = bf16_io ? 2 : 4;
  const int64_t slots[B] = {4, 0, 2};
  const uint8_t fresh[B] = {0, 1, 0};
  void *qkv = xalloc(es * B * ldq), *ba = xalloc(es * B * ldba);
  void *conv = xalloc(es * ROWS * C * (W ? W : 1)), *conv_ref = xalloc(es * ROWS * C * (W ? W : 1));
  float *S = xalloc(sizeof(float) * ROWS * Hv * Dk * Dv), *S0 = xalloc(sizeof(float) * ROWS * Hv * Dk * Dv);
  float *conv_w = xalloc(sizeof(float) * C * K), *A_log = xalloc(sizeof(float) * Hv), *dt_bias = xalloc(sizeof(float) * Hv);
  float *out = xalloc(sizeof(float) * (B * Hv * Dv + 16));
#define PUT(p, i, v) (bf16_io ? (void)(((bf16 *)(p))[i] = h_f2bf(v)) : (void)(((float *)(p))[i] = (v)))
#define GET(p, i) (bf16_io ? h_bf2f(((const bf16 *)(p))[i]) : ((const float *)(p))[i])
  for (int64_t i = 0; i < B * ldq; i++) PUT(qkv, i, bf16_io ? (float)rng_int(-64, 64) / 64.0f : rng_uniform(-1.0f, 1.0f));
  for (int64_t i = 0; i < ROWS * C * W; i++) PUT(conv, i, bf16_io ? (float)rng_int(-64, 64) / 64.0f : rng_uniform(-1.0f, 1.0f));
  for (int64_t i = 0; i < C * K; i++) conv_w[i] = bf16_io ? (float)rng_int(-16, 16) / 16.0f : rng_uniform(-1.0f, 1.0f);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < ldba; i++) PUT(ba, b * ldba + i, rng_uniform(-3.0f, 3.0f));
  PUT(ba, 0 * ldba + Hv + 1, 25.0f); /* a + dt_bias > 20: softplus(a) = a */
  for (int64_t h = 0; h < Hv; h++) A_log[h] = rng_uniform(-2.0f, 1.0f), dt_bias[h] = rng_uniform(-1.0f, 1.0f);
  for (int64_t i = 0; i < ROWS * Hv * Dk * Dv; i++) S[i] = rng_uniform(-0.5f, 0.5f);
  memcpy(S0, S, sizeof(float) * ROWS * Hv * Dk * Dv);
  memcpy(conv_ref, conv, es * ROWS * C * W);
  fill_u16((uint16_t *)(out + B * Hv * Dv), 32, 0x7fc1);

  const mili_gdn_layer layer = {.conv_w = conv_w, .A_log = A_log, .dt_bias = dt_bias, .conv_states = conv,
                                .ssm_states = S, .k_heads = Hk, .v_heads = Hv, .k_dim = Dk, .v_dim = Dv,
                                .conv_width = K, .bf16_io = bf16_io};
  const mili_gdn_step step = {.qkv = qkv, .ba = ba, .ldq = ldq, .ldba = ldba, .slots = slots,
                              .fresh = with_fresh ? fresh : NULL, .B = B};
  mili_gdn_decode(&layer, &step, out, NT);

  /* the reference */
  double *xs = xalloc(sizeof(double) * B * C), *Sr = xalloc(sizeof(double) * ROWS * Hv * Dk * Dv);
  double *Stol = xalloc(sizeof(double) * ROWS * Hv * Dk * Dv), *want = xalloc(sizeof(double) * B * Hv * Dv);
  double *otol = xalloc(sizeof(double) * B * Hv * Dv), *kn = xalloc(sizeof(double) * Dk), *qn = xalloc(sizeof(double) * Dk);
  double *cmag = xalloc(sizeof(double) * B * C); /* each conv output's terms' magnitude (float32 io: its error) */
  double *qnm = xalloc(sizeof(double) * Dk), *knm = xalloc(sizeof(double) * Dk);
  int inexact = 0;
  for (int64_t i = 0; i < ROWS * Hv * Dk * Dv; i++) Sr[i] = S0[i];
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = 0; c < C; c++) {
      const int zero = with_fresh && fresh[b];
      const int64_t at = (slots[b] * C + c) * W;
      const double x = GET(qkv, b * ldq + c);
      double y = (double)conv_w[c * K + W] * x, ym = fabs(y);
      for (int64_t j = 0; j < W; j++) {
        const double t = (double)conv_w[c * K + j] * (zero ? 0.0 : (double)GET(conv_ref, at + j));
        y += t, ym += fabs(t);
      }
      cmag[b * C + c] = bf16_io ? 0.0 : ym;
      for (int64_t j = 0; j < W; j++) { /* the state: its last W - 1 inputs (zeros when fresh), then x */
        if (bf16_io)
          ((bf16 *)conv_ref)[at + j] = j == W - 1 ? ((const bf16 *)qkv)[b * ldq + c] : zero ? 0 : ((bf16 *)conv_ref)[at + j + 1];
        else
          ((float *)conv_ref)[at + j] = j == W - 1 ? (float)x : zero ? 0.0f : ((float *)conv_ref)[at + j + 1];
      }
      if (bf16_io) {
        float yf = (float)y;
        if ((double)yf != y) inexact = 1;
        yf = h_round_bf(yf);
        xs[b * C + c] = h_round_bf(yf / (1.0f + expf(-yf)));
      } else {
        xs[b * C + c] = y / (1.0 + exp(-y));
      }
    }
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hv; h++) {
      const int64_t kh = h / rep;
      const double *q = xs + b * C + kh * Dk, *k = xs + b * C + Hk * Dk + kh * Dk, *v = xs + b * C + 2 * Hk * Dk + h * Dv;
      const double *qm = cmag + b * C + kh * Dk, *km = cmag + b * C + Hk * Dk + kh * Dk, *vm = cmag + b * C + 2 * Hk * Dk + h * Dv;
      double qq = 0, kk = 0;
      for (int64_t i = 0; i < Dk; i++) qq += q[i] * q[i], kk += k[i] * k[i];
      const double qs = 1.0 / sqrt(qq + 1e-6) / sqrt((double)Dk), ks = 1.0 / sqrt(kk + 1e-6);
      for (int64_t i = 0; i < Dk; i++) { /* and their magnitudes for the tolerances, the conv's error included */
        qn[i] = q[i] * qs, kn[i] = k[i] * ks;
        qnm[i] = fabs(qn[i]) + qs * qm[i], knm[i] = fabs(kn[i]) + ks * km[i];
      }
      const double a = (double)GET(ba, b * ldba + Hv + h) + dt_bias[h];
      const double softplus = a > 20.0 ? a : log1p(exp(a)), decay = exp(-exp((double)A_log[h]) * softplus);
      double beta;
      if (bf16_io) {
        const float bv = GET(ba, b * ldba + h);
        beta = h_round_bf(1.0f / (1.0f + expf(-bv)));
      } else {
        beta = 1.0 / (1.0 + exp(-(double)GET(ba, b * ldba + h)));
      }
      double *Sh = Sr + (slots[b] * Hv + h) * Dk * Dv, *Th = Stol + (slots[b] * Hv + h) * Dk * Dv;
      if (with_fresh && fresh[b])
        for (int64_t i = 0; i < Dk * Dv; i++) Sh[i] = 0;
      for (int64_t j = 0; j < Dv; j++) {
        double mem = 0, memmag = 0;
        for (int64_t i = 0; i < Dk; i++) {
          Sh[i * Dv + j] *= decay; /* S = exp(g) S */
          mem += Sh[i * Dv + j] * kn[i], memmag += fabs(Sh[i * Dv + j]) * knm[i];
        }
        const double delta = beta * (v[j] - mem); /* S += k (beta (v - S^T k))^T */
        double o = 0, omag = 0;
        for (int64_t i = 0; i < Dk; i++) {
          const double mag = fabs(Sh[i * Dv + j]) + knm[i] * beta * (fabs(v[j]) + vm[j] + memmag);
          Sh[i * Dv + j] += kn[i] * delta;
          Th[i * Dv + j] = 1e-5 * mag + 1e-30;
          o += Sh[i * Dv + j] * qn[i], omag += qnm[i] * mag;
        }
        want[(b * Hv + h) * Dv + j] = o, otol[(b * Hv + h) * Dv + j] = 1e-5 * omag + 1e-30;
      }
    }
  Acc a;
  acc_init(&a);
  for (int64_t i = 0; i < B * Hv * Dv; i++) acc_add(&a, i, out[i], want[i], otol[i]);
  for (int64_t i = 0; i < 32; i++) acc_bits(&a, B * Hv * Dv + i, ((uint16_t *)(out + B * Hv * Dv))[i], 0x7fc1);
  if (inexact) a.bad++, printf("(harness: a bf16 conv sum was not exact in float32)\n");
  verdict(&a, "gdn_decode %s Hk=%lld Hv=%lld Dk=%lld Dv=%lld K=%lld fresh=%s: out", bf16_io ? "bf16" : "f32",
          (long long)Hk, (long long)Hv, (long long)Dk, (long long)Dv, (long long)K, with_fresh ? "0,1,0" : "NULL");
  acc_init(&a);
  for (int64_t r = 0; r < ROWS; r++) {
    int touched = 0;
    for (int b = 0; b < B; b++) touched |= slots[b] == r;
    for (int64_t i = r * Hv * Dk * Dv; i < (r + 1) * Hv * Dk * Dv; i++) {
      if (touched) acc_add(&a, i, S[i], Sr[i], Stol[i]);
      else acc_bits(&a, i, h_fbits(S[i]), h_fbits(S0[i])); /* other slots: untouched */
    }
  }
  verdict(&a, "gdn_decode %s Dk=%lld Dv=%lld K=%lld fresh=%s: SSM states", bf16_io ? "bf16" : "f32", (long long)Dk,
          (long long)Dv, (long long)K, with_fresh ? "0,1,0" : "NULL");
  acc_init(&a);
  for (int64_t i = 0; i < ROWS * C * W; i++)
    acc_bits(&a, i, bf16_io ? ((bf16 *)conv)[i] : h_fbits(((float *)conv)[i]),
             bf16_io ? ((bf16 *)conv_ref)[i] : h_fbits(((float *)conv_ref)[i]));
  verdict(&a, "gdn_decode %s Dk=%lld Dv=%lld K=%lld fresh=%s: conv states shifted (exact)", bf16_io ? "bf16" : "f32",
          (long long)Dk, (long long)Dv, (long long)K, with_fresh ? "0,1,0" : "NULL");
#undef PUT
#undef GET
  free(qkv), free(ba), free(conv), free(conv_ref), free(S), free(S0), free(conv_w), free(A_log), free(dt_bias), free(out);
  free(xs), free(Sr), free(Stol), free(want), free(otol), free(kn), free(qn), free(cmag), free(qnm), free(knm);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  test_isa();
#ifdef HARNESS_AMX
  check_true(mili_amx_init() == 0, "mili_amx_init: Linux grants the AMX tile state");
  if (n_failed) { /* (the tiles would fault) */
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return 1;
  }
  mili_use_amx(1);
  check_true(mili_uses_amx() == 1, "mili_use_amx(1): the linear layers on AMX tiles");
#else
  check_true(mili_uses_amx() == 0, "mili_uses_amx: off unless asked");
#endif

  const int64_t Ms[] = {1, 2, 5, 7, 17}, Ns[] = {16, 48, 80}, Ks[] = {64, 128, 1024};
  for (int kind = LIN_BF16; kind <= LIN_INT8; kind++)
    for (int i = 0; i < 5; i++)
      for (int j = 0; j < 3; j++)
        for (int k = 0; k < 3; k++) test_linear(kind, Ms[i], Ns[j], Ks[k], 0, 0, 0, 0);
  test_linear(LIN_BF16, 64, 48, 1024, 0, 0, 0, 0); /* (several row tiles; the quantization's parallel loop) */
  test_linear(LIN_INT8, 64, 48, 1024, 0, 0, 0, 0);
  test_linear(LIN_INT8, 1, 48, 1024, 0, 0, 0, 1);
  test_linear(LIN_INT8, 7, 48, 1024, 0, 0, 0, 1);
  const int64_t groups[] = {32, 64, 128}, i4_K[] = {128, 1024}, i4_MN[][2] = {{1, 16}, {1, 80}, {2, 48}, {5, 80}, {17, 48}};
  for (int g = 0; g < 3; g++)
    for (int k = 0; k < 2; k++)
      for (int mode = SCALES_F16; mode <= SCALES_K; mode++)
        for (int s = 0; s < 5; s++) test_linear(LIN_INT4, i4_MN[s][0], i4_MN[s][1], i4_K[k], groups[g], mode, 0, 0);
  test_linear(LIN_INT4, 64, 48, 1024, 64, 0, 0, 0);
  test_linear(LIN_INT4, 64, 48, 1024, 128, 1, 0, 0);
  test_linear(LIN_INT4, 64, 48, 1024, 32, SCALES_K, 0, 0);
  /* groups of 1, 2, 3, 5 steps of 8 (group % 8 == 0 is all the kernel asks; two-level: one super-block a row) */
  const int64_t odd_groups[][2] = {{8, 64}, {16, 128}, {24, 96}, {40, 320}};
  for (int g = 0; g < 4; g++)
    for (int s = 0; s < 5; s++) test_linear(LIN_INT4, i4_MN[s][0], i4_MN[s][1], odd_groups[g][1], odd_groups[g][0], s % 3, 0, 0);
  for (int g = 0; g < 3; g++) {
    test_linear(LIN_INT4, 1, 48, 1024, groups[g], 1, 0, 1);
    test_linear(LIN_INT4, 7, 48, 1024, groups[g], 0, 0, 1);
    test_linear(LIN_INT4, 2, 48, 1024, groups[g], SCALES_K, 0, 1);
  }
  /* int4 with high bits (GGUF's Q5_K: 1, offsets, groups of 32; Q6_K: 2, symmetric, groups of 16; and the other
   * forms), one row (the direct kernel), pairs of rows, and past EXPAND_ROWS (expanded to int8g's layout) */
  const int64_t hb_MN[][2] = {{1, 16}, {1, 80}, {2, 48}, {5, 80}, {8, 48}, {9, 48}, {17, 48}, {64, 48}};
  for (int kind = LIN_INT4_H1; kind <= LIN_INT4_H2; kind++)
    for (int sym = 0; sym <= 1; sym++)
      for (int mode = SCALES_F16; mode <= SCALES_K; mode++)
        for (int s = 0; s < 8; s++) test_linear(kind, hb_MN[s][0], hb_MN[s][1], s % 2 ? 256 : 1024, s % 3 ? 32 : 16, mode, sym, 0);
  for (int kind = LIN_INT4_H1; kind <= LIN_INT4_H2; kind++)
    for (int sym = 0; sym <= 1; sym++) {
      test_linear(kind, 1, 48, 1024, 32, SCALES_K, sym, 1);
      test_linear(kind, 2, 48, 1024, 16, SCALES_K, sym, 1);
      test_linear(kind, 7, 48, 1024, 32, 1, sym, 1);
      test_linear(kind, 12, 48, 1024, 16, 0, sym, 1);
    }
  /* int8g: GGUF's groups (Q6_K 16, Q8_0 and Q5_K 32) and more, with and without offsets, fp16, f32 and two-level
   * scales */
  const int64_t i8g_groups[] = {16, 32, 64}, i8g_MN[][2] = {{1, 16}, {1, 80}, {2, 48}, {3, 16}, {5, 80}, {17, 48}};
  for (int g = 0; g < 3; g++)
    for (int k = 0; k < 2; k++)
      for (int mode = SCALES_F16; mode <= SCALES_K; mode++)
        for (int sym = 0; sym <= 1; sym++)
          for (int s = 0; s < 6; s++) test_linear(LIN_INT8G, i8g_MN[s][0], i8g_MN[s][1], i4_K[k], i8g_groups[g], mode, sym, 0);
  test_linear(LIN_INT8G, 64, 48, 1024, 32, 0, 1, 0);
  test_linear(LIN_INT8G, 64, 48, 1024, 16, 1, 0, 0);
  test_linear(LIN_INT8G, 64, 48, 1024, 16, SCALES_K, 1, 0);
  for (int s = 0; s < 6; s++) test_linear(LIN_INT8G, i8g_MN[s][0], i8g_MN[s][1], 120, 24, s % 3, s / 3, 0);
  /* few rows over many blocks (grouped_streams: each thread's blocks in S runs stepped through together): 37 and 9
   * blocks give runs of unequal length, 3 fewer blocks than S runs a thread */
  const int64_t run_MN[][2] = {{1, 592}, {3, 592}, {8, 144}, {1, 96}};
  for (int s = 0; s < 4; s++) {
    test_linear(LIN_INT4, run_MN[s][0], run_MN[s][1], 256, 32, s % 3, s % 2, 0);
    test_linear(LIN_INT4_H2, run_MN[s][0], run_MN[s][1], 256, 16, SCALES_K, 1, 0);
    test_linear(LIN_INT4_H1, run_MN[s][0], run_MN[s][1], 256, 32, SCALES_K, 0, 0);
    test_linear(LIN_INT8G, run_MN[s][0], run_MN[s][1], 256, 32, s % 3, s % 2, 0);
  }
  for (int g = 0; g < 2; g++)
    for (int sym = 0; sym <= 1; sym++) {
      test_linear(LIN_INT8G, 1, 48, 1024, i8g_groups[g], 1, sym, 1);
      test_linear(LIN_INT8G, 7, 48, 1024, i8g_groups[g], 0, sym, 1);
      test_linear(LIN_INT8G, 2, 48, 1024, i8g_groups[g], SCALES_K, sym, 1);
    }

  for (int res = 0; res <= 1; res++) {
    test_rms_norm(1, 16, 0, res);
    test_rms_norm(3, 48, 16, res);
    test_rms_norm(5, 1024, 8, res);
    test_rms_norm(40, 2048, 0, res); /* (the parallel loop) */
  }
  test_qk_norm_rope(1, 4, 2, 64);
  test_qk_norm_rope(3, 2, 1, 128);
  test_qk_norm_rope(17, 5, 1, 64); /* (the parallel loop) */
  test_qk_norm_rope(2, 1, 1, 32);
  test_qk_norm_rope(1, 1, 1, 1024);
  test_silu_and_mul(1, 16);
  test_silu_and_mul(3, 48);
  test_silu_and_mul(5, 1024);
  test_silu_and_mul(32, 2048); /* (the parallel loop) */

  test_store_kv(9, 2, 64, 16);
  test_store_kv(13, 1, 128, 5);
  const int64_t Gs[] = {1, 2, 4, 5, 8}, lens_a[] = {1, 17, 40}, lens_b[] = {7, 33, 2}, lens_c[] = {64};
  for (int d = 0; d < 2; d++)
    for (int g = 0; g < 5; g++) test_decode_attention(3, lens_a, 2, Gs[g], d ? 128 : 64, 16);
  for (int g = 0; g < 5; g++) test_decode_attention(3, lens_b, 1, Gs[g], g % 2 ? 96 : 32, 5);
  test_decode_attention(1, lens_c, 1, 8, 128, 16);
  test_store_kv_int8(9, 2, 64, 16);
  test_store_kv_int8(13, 1, 128, 5);
  test_store_kv_int8(40, 2, 24, 16); /* (D 24: shorter than a vector; T x Hkv >= 64: the parallel loop) */
  for (int d = 0; d < 2; d++)
    for (int g = 0; g < 5; g++) test_decode_attention_int8(3, lens_a, 2, Gs[g], d ? 128 : 64, 16);
  for (int g = 0; g < 5; g++) test_decode_attention_int8(3, lens_b, 1, Gs[g], g % 2 ? 96 : 32, 5);
  test_decode_attention_int8(1, lens_c, 1, 8, 128, 16);
  const int64_t lens_d[] = {300, 1, 45}; /* (many tiles, one position, a partial tile) */
  test_decode_attention_int8(3, lens_d, 2, 3, 128, 16);
  const int64_t lens_e[] = {700, 257, 5}; /* (tasks of 256 positions: chunks that end inside a page of 5 or 100) */
  test_decode_attention_int8(3, lens_e, 2, 2, 128, 5);
  test_decode_attention_int8(3, lens_e, 1, 3, 96, 100);
  test_decode_attention_int8(3, lens_e, 3, 1, 64, 16);

  const int64_t LqLk[][2] = {{1, 1}, {7, 7}, {17, 17}, {3, 40}, {16, 33}, {20, 50}, {33, 33}};
  const int64_t heads[][2] = {{2, 2}, {4, 2}, {5, 1}, {8, 1}};
  for (int s = 0; s < 7; s++)
    for (int h = 0; h < 4; h++) test_prefill_attention(LqLk[s][0], LqLk[s][1], heads[h][0], heads[h][1], (s + h) % 2 ? 128 : 64);

  test_decode_layer(LIN_BF16, 0, 0, 0, 1, 0);
  decode_layer_case(LIN_BF16, 0, 0, 0, 1, 0, 1); /* (int8 pages) */
  decode_layer_case(LIN_INT8, 0, 0, 0, 0, 0, 1);
  test_decode_layer(LIN_BF16, 0, 0, 0, 0, 0);
  test_decode_layer(LIN_INT8, 0, 0, 0, 0, 0);
  test_decode_layer(LIN_INT4, 64, 0, 0, 0, 0);
  test_decode_layer(LIN_INT4, 32, 1, 0, 1, 0);
  test_decode_layer(LIN_INT8G, 32, 0, 1, 0, 0);
  test_decode_layer(LIN_INT8G, 16, 1, 0, 1, 0);
  test_decode_layer(LIN_INT4, 32, SCALES_K, 0, 0, 0); /* (GGUF's K-quants as stored: Q4_K, Q6_K, Q5_K) */
  test_decode_layer(LIN_INT8G, 16, SCALES_K, 1, 1, 0);
  test_decode_layer(LIN_INT8G, 32, SCALES_K, 0, 0, 0);
  test_decode_layer(LIN_INT4_H2, 16, SCALES_K, 1, 0, 0); /* (Q6_K, Q5_K on the int4 kernel with their high bits) */
  test_decode_layer(LIN_INT4_H1, 32, SCALES_K, 0, 1, 0);
  test_decode_layer(LIN_INT4, 32, SCALES_K, 0, 0, 1); /* (Q4_K_M's q|k|v: Q4_K, Q4_K, Q6_K) */
  test_decode_layer(LIN_INT4, 32, SCALES_K, 0, 1, 1);

  const int64_t argN[] = {1, 2, 3, 15, 16, 17, 31, 33, 100, 1001};
  for (int i = 0; i < 10; i++) test_argmax(argN[i]);
  const int64_t Vs[] = {1, 31, 32, 33, 100, 1000};
  for (int i = 0; i < 6; i++) test_bitmask(Vs[i]);

  for (int io = 0; io <= 1; io++) {
    test_gdn(io, 2, 4, 32, 16, 4, 1);
    test_gdn(io, 2, 4, 64, 32, 4, 0);
    test_gdn(io, 2, 2, 128, 64, 2, 1);
    test_gdn(io, 1, 3, 64, 48, 3, 1);
  }

  if (n_skipped) printf("skipped %d int8 / int4 / int8g checks: AVX-512 without VNNI, where the library never runs them\n", n_skipped);
  printf("%d passed, %d failed\n", n_passed, n_failed);
  return n_failed ? 1 : 0;
}
