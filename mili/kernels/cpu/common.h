#include "mili_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <sys/syscall.h>
#endif

static inline float bf16_to_float(bf16 v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "isa_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "isa_avx2.h"
#elif defined(__aarch64__)
#include "isa_neon.h"
#else
#error "MILI's CPU kernels need AVX2 + FMA + F16C, AVX-512 (F/BW/VL) or aarch64 (mili/kernels/cpu picks the flags)"
#endif

#define NB_CAP (NB_MAX > NB_ONE ? NB_MAX : NB_ONE)
#define I4_NB_CAP (I4_NB > I4_NB_ONE ? I4_NB : I4_NB_ONE)
#define I8G_NB_CAP (I8G_NB > I8G_NB_ONE ? I8G_NB : I8G_NB_ONE)
/* The linear kernels issue no prefetches: the hardware's prefetchers follow their weight streams, and prefetching
 * 512-16,384 bytes ahead in each stream made a 4-bit decode step's layers ~10% slower on a Zen 4 (benchmarks/NOTES.md,
 * step 13). The attention kernels prefetch their K/V rows, which lie scattered over pages. */

const char *mili_isa(void) { return ISA_NAME; }

/* -- generic helpers over the ISA layer ------------------------------------------------------------------ */
static inline float round_to_bf16(float f) { /* nearest even, as torch rounds */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
}

/* The first n (< 16 allowed) values; the other lanes `fill` (loads) or untouched (stores). */
static inline vf vf_load_n(const float *p, int64_t n, float fill) {
  if (n >= 16) return vf_load(p);
  float t[16];
  for (int i = 0; i < 16; i++) t[i] = i < n ? p[i] : fill;
  return vf_load(t);
}
static inline void vf_store_n(float *p, vf v, int64_t n) {
  if (n >= 16) {
    vf_store(p, v);
    return;
  }
  float t[16];
  vf_store(t, v);
  memcpy(p, t, sizeof(float) * n);
}
static inline vf vf_load_bf16_n(const bf16 *p, int64_t n) {
  if (n >= 16) return vf_load_bf16(p);
  bf16 t[16] = {0};
  memcpy(t, p, sizeof(bf16) * n);
  return vf_load_bf16(t);
}
static inline void vf_store_bf16_n(bf16 *p, vf v, int64_t n) {
  if (n >= 16) {
    vf_store_bf16(p, v);
    return;
  }
  bf16 t[16];
  vf_store_bf16(t, v);
  memcpy(p, t, sizeof(bf16) * n);
}
static inline vf vf_round_bf16(vf v) { /* rounded to bf16 and back */
  bf16 t[16];
  vf_store_bf16(t, v);
  return vf_load_bf16(t);
}

/* exp(x): x = n ln2 + r, 2^n exactly, e^r by its Taylor series to r^6 (|r| <= ln2/2: relative error ~1e-7);
 * x is clamped to [-87, 88.3] (below, ~0; above, ~2e38: 2^n stays finite, n <= 127). */
static inline vf vf_exp(vf x) {
  x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.3f));
  const vf n = vf_round(vf_mul(x, vf_set1(1.44269504f)));
  vf r = vf_fnmadd(n, vf_set1(0.693145752f), x);
  r = vf_fnmadd(n, vf_set1(1.42860677e-6f), r);
  vf p = vf_set1(1.0f / 720);
  p = vf_fmadd(p, r, vf_set1(1.0f / 120));
  p = vf_fmadd(p, r, vf_set1(1.0f / 24));
  p = vf_fmadd(p, r, vf_set1(1.0f / 6));
  p = vf_fmadd(p, r, vf_set1(0.5f));
  p = vf_fmadd(p, r, vf_set1(1.0f));
  p = vf_fmadd(p, r, vf_set1(1.0f));
  return vf_scale2(p, n);
}
