/* MILI's CPU kernels: one source over a thin per-ISA layer.
 *
 * Built on first use by mili/kernels/cpu/__init__.py, once per ISA, with that ISA's flags alone
 * (AVX-512: -mavx512f -mavx512bw -mavx512vl [-mavx512bf16 -mavx512vnni]; AVX2: -mavx2 -mfma -mf16c
 * [-mavxvnni]; aarch64: -march=armv8-a or armv8.2-a+dotprod), and called through ctypes. The library links
 * libgomp by its soname, so it shares the OpenMP runtime torch already loaded (one thread pool). Every
 * function takes the thread count to use.
 *
 * The per-ISA layer (isa_avx512.h, isa_avx2.h, isa_neon.h) gives every kernel the same vocabulary:
 *  - vf / vi: 16 float32 / int32 lanes (one zmm, two ymm, four NEON q registers), with loads, stores,
 *    arithmetic, reductions, bf16 and fp16 conversions (bf16 rounded to nearest even, as torch rounds);
 *  - the linear layers' operands over one 64-byte row of a packed weight block: dot_bf16 (16 columns x a pair
 *    of k), dot_int8 (x 4 k), dot_int4 (x 4 k of nibbles), dot_int8g (x 4 k of unsigned bytes), and the tile
 *    shapes (MR_MAX rows x NB_MAX blocks of sums) that fit that ISA's registers;
 *  - optional specializations (ISA_HAS_PV_SLICE, ISA_HAS_ARGMAX, ISA_HAS_AMX) where AVX-512 does better than
 *    the generic code below.
 * Everything else is written once, here.
 *
 * Layouts: bf16 values are uint16_t. A linear layer's weight [N, K] is packed once as [N/16][K/2][16][2]:
 * for each block of 16 output rows, K/2 rows of 64 bytes, each holding 16 pairs of consecutive k (int8:
 * [N/16][K/4][16][4]). That is exactly AMX's "B" tile layout (16 pair-rows x 16 columns x 2), so a block's
 * weights stream from memory in one sequential run, and the same bytes serve every ISA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <sys/syscall.h>
#endif

typedef uint16_t bf16;

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

/* -- AMX (Sapphire Rapids and later) ----------------------------------------------------------------------
 * Linux hands AMX tile state to a process only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
 * mili_amx_init returns 0 when granted; the linear layers then run on AMX (mili_use_amx), else on the ISA's
 * micro-kernel. Builds without AMX answer -1. */
static int use_amx = 0;
#if defined(__x86_64__) && defined(ISA_HAS_AMX)
int mili_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
#else
int mili_amx_init(void) { return -1; }
#endif
void mili_use_amx(int on) { use_amx = on; }
int mili_uses_amx(void) { return use_amx; }

#ifdef ISA_HAS_AMX
#define AMX __attribute__((target("amx-tile,amx-bf16,amx-int8")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Tiles 0-3: C (2 row chunks x 2 column blocks, fp32), 4-5: A (x rows), 6-7: B (weights). */
AMX static void configure_tiles(int rows) {
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) {
    c.colsb[t] = 64;
    c.rows[t] = t >= 6 ? 16 : rows;
  }
  _tile_loadconfig(&c);
}

/* The 16 x 16 result tile t of rows `rows` into y (stride N) as bf16: float32 as is (bf16 inputs), or
 * int32 times the row's and the column's scales (int8 inputs). */
static inline void store_tile(int rows, const void *c, bf16 *y, int64_t N, const float *sx, const float *sw) {
  for (int r = 0; r < rows; r++) {
    vf v;
    if (sx) /* int8: scale by the activation row's and the weight columns' scales */
      v = vf_mul(vi_to_vf(vi_load((const int32_t *)c + r * 16)), vf_mul(vf_set1(sx[r]), vf_load(sw)));
    else
      v = vf_load((const float *)c + r * 16);
    vf_store_bf16(y + r * N, v);
  }
}

#define TILE_STORE(t, rows, y, sx, sw)         \
  do {                                         \
    _tile_stored(t, cbuf, 64);                 \
    store_tile(rows, cbuf, y, N, sx, sw);      \
  } while (0)

/* y[M, N] = x[M, K] @ W^T over AMX tiles, for bf16 (xsize 2, tdpbf16ps) or int8 (xsize 1, tdpbssd, then
 * scaled by sx[M] and sw[N]). W packed as 16-row blocks of 64-byte rows (see the top; int8: [N/16][K/4]
 * [16][4]); x rows are read 16 at a time, so x must hold whole 16-row chunks when M > 16. Each thread
 * takes whole 16-column blocks (two at a time) and all rows (two chunks at a time): each weight tile is
 * used for up to 32 rows, and for M <= 16 the weights are streamed exactly once. */
AMX static void amx_matmul(const uint8_t *w, const uint8_t *x, bf16 *y, int64_t M, int64_t N, int64_t K,
                           int xsize, const float *sx, const float *sw, int nthreads) {
  const int64_t nblocks = N / 16, nchunks = (M + 15) / 16, ldx = K * xsize, kstep = 64 / xsize;
  const int rows = M < 16 ? (int)M : 16, tail = M > 16 && M % 16 ? (int)(M % 16) : 16;
#pragma omp parallel num_threads(nthreads)
  {
    configure_tiles(rows);
    int32_t cbuf[256];
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb += 2) {
      const int two_n = nb + 1 < nblocks;
      const uint8_t *w0 = w + nb * 16 * ldx, *w1 = w0 + 16 * ldx;
      for (int64_t mc = 0; mc < nchunks; mc += 2) {
        const int two_m = mc + 1 < nchunks;
        const uint8_t *x0 = x + mc * 16 * ldx, *x1 = x0 + 16 * ldx;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += kstep) {
          const int64_t wk = k * 16 * xsize;
          if (mc == 0) /* first pass over these weights: fetch ahead of the tile loads */
            for (int j = 0; j < 1024; j += 64) {
              _mm_prefetch((const char *)(w0 + wk) + 2048 + j, _MM_HINT_T0);
              if (two_n) _mm_prefetch((const char *)(w1 + wk) + 2048 + j, _MM_HINT_T0);
            }
          _tile_loadd(4, x0 + k * xsize, ldx);
          _tile_loadd(6, w0 + wk, 64);
          if (two_n) _tile_loadd(7, w1 + wk, 64);
          if (two_m) _tile_loadd(5, x1 + k * xsize, ldx);
          if (xsize == 2) {
            _tile_dpbf16ps(0, 4, 6);
            if (two_n) _tile_dpbf16ps(1, 4, 7);
            if (two_m) _tile_dpbf16ps(2, 5, 6);
            if (two_m && two_n) _tile_dpbf16ps(3, 5, 7);
          } else {
            _tile_dpbssd(0, 4, 6);
            if (two_n) _tile_dpbssd(1, 4, 7);
            if (two_m) _tile_dpbssd(2, 5, 6);
            if (two_m && two_n) _tile_dpbssd(3, 5, 7);
          }
        }
        const int r0 = mc == nchunks - 1 ? tail : 16, r1 = mc + 1 == nchunks - 1 ? tail : 16;
        const float *sx0 = sx ? sx + mc * 16 : NULL, *sx1 = sx ? sx0 + 16 : NULL;
        const float *sw0 = sw ? sw + nb * 16 : NULL, *sw1 = sw ? sw0 + 16 : NULL;
        bf16 *y0 = y + mc * 16 * N + nb * 16, *y1 = y0 + 16 * N;
        TILE_STORE(0, M < 16 ? rows : r0, y0, sx0, sw0);
        if (two_n) TILE_STORE(1, M < 16 ? rows : r0, y0 + 16, sx0, sw1);
        if (two_m) {
          TILE_STORE(2, r1, y1, sx1, sw0);
          if (two_n) TILE_STORE(3, r1, y1 + 16, sx1, sw1);
        }
      }
    }
    _tile_release();
  }
}
#endif /* ISA_HAS_AMX */

/* -- the linear layers' micro-kernel ---------------------------------------------------------------------
 * One 64-byte row of a block holds the 16 columns' weights for 2 consecutive k (bf16) or 4 (int8): the
 * operand of the ISA's dot product against one 32-bit word of x (bf16: where the ISA has no bf16 dot product,
 * ISA_X_F32, x is widened to float32 once by x_operand and each pair read as two floats). The micro-kernel keeps MR rows x NB blocks
 * of sums in registers over the whole of K, so each weight row loaded serves MR rows and each x word NB
 * blocks. int8: x holds q + INT8_X_OFFSET (128 where the dot product takes x unsigned: the sums then carry
 * 128 * colsum(W), taken off with `colsum` before scaling). */
INT8_TARGET static inline __attribute__((always_inline)) void micro(
    const uint8_t *w, int64_t wblock, const uint8_t *x, int64_t ldx, bf16 *y, float *yf, int64_t N, int64_t kwords,
    const int MR, const int NB, const int int8, const float *sx, const float *sw, const int32_t *colsum) {
  if (int8) {
    vi acc[MR_MAX][NB_CAP];
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = vi_zero();
    for (int64_t p = 0; p < kwords; p++) {
      wrow8 wv[NB_CAP];
      for (int j = 0; j < NB; j++) {
        wv[j] = w_int8(w + j * wblock + p * 64);
      }
      for (int i = 0; i < MR; i++) {
        const xq4 xb = x_int8((const int8_t *)(x + i * ldx + p * 4));
        for (int j = 0; j < NB; j++) acc[i][j] = dot_int8(acc[i][j], xb, wv[j]);
      }
    }
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NB; j++) {
        vi v = acc[i][j];
        if (INT8_X_OFFSET) v = vi_sub(v, vi_shl(vi_load(colsum + j * 16), 7));
        vf_store_bf16(y + i * N + j * 16, vf_mul(vi_to_vf(v), vf_mul(vf_set1(sx[i]), vf_load(sw + j * 16))));
      }
    return;
  }
  vf acc[MR_MAX][NB_CAP];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = vf_zero();
  for (int64_t p = 0; p < kwords; p++) {
    wrow wv[NB_CAP];
    for (int j = 0; j < NB; j++) {
      wv[j] = w_bf16(w + j * wblock + p * 64);
    }
    for (int i = 0; i < MR; i++) {
#if ISA_X_F32
      const xpair xb = x_f32((const float *)(x + i * ldx + p * 8));
#else
      const xpair xb = x_bf16((const bf16 *)(x + i * ldx + p * 4));
#endif
      for (int j = 0; j < NB; j++) acc[i][j] = dot_bf16(acc[i][j], xb, wv[j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) {
      if (yf) vf_store(yf + i * N + j * 16, acc[i][j]);
      else vf_store_bf16(y + i * N + j * 16, acc[i][j]);
    }
}

/* Instantiates micro for every (rows, blocks) the ISA's tiles allow, with constants, so its arrays live in
 * registers. */
#define MICRO(MR, NB) micro(w, wblock, x, ldx, y, yf, N, kwords, MR, NB, int8, sx, sw, colsum)
#define MICRO_NB(MR)                                \
  switch (nb) {                                     \
    case 1: MICRO(MR, 1); break;                    \
    case 2: if (NB_CAP >= 2) MICRO(MR, 2); break;   \
    case 3: if (NB_CAP >= 3) MICRO(MR, 3); break;   \
    default: if (NB_CAP >= 4) MICRO(MR, 4); break;  \
  }
INT8_TARGET static void micro_any(const uint8_t *w, int64_t wblock, const uint8_t *x, int64_t ldx, bf16 *y, float *yf,
                                  int64_t N, int64_t kwords, int mr, int nb, int int8, const float *sx, const float *sw,
                                  const int32_t *colsum) {
  switch (mr) {
    case 1: MICRO_NB(1); break;
#if MR_MAX >= 2
    case 2: MICRO_NB(2); break;
#endif
#if MR_MAX >= 3
    case 3: MICRO_NB(3); break;
#endif
#if MR_MAX >= 4
    case 4: MICRO_NB(4); break;
#endif
#if MR_MAX >= 5
    case 5: MICRO_NB(5); break;
#endif
#if MR_MAX >= 6
    case 6: MICRO_NB(6); break;
#endif
  }
}

#if ISA_X_F32
/* Many rows of bf16 on an ISA without a bf16 dot product: a block's weights are widened once into a float32
 * panel [K][16] and F32_MR rows at a time run the plain float32 kernel over it (per k: one weight vector, a
 * broadcast of each row's x, F32_MR FMAs on independent sums), where the direct kernel spent an ALU op per FMA
 * widening each weight row again for every few rows. x is float32 (x_operand). The sums are added in the direct
 * kernel's order (a pair's odd k, then its even k), so a row's result does not depend on how many rows share the
 * call (a speculative verification's rows equal the decode steps': cpu_decode.py). */
#define PANEL_MIN_ROWS 8
static inline __attribute__((always_inline)) void micro_f32(const float *panel, int64_t kwords, const uint8_t *x,
                                                            int64_t ldx, bf16 *y, float *yf, int64_t ldy, const int MR) {
  vf acc[F32_MR];
  for (int i = 0; i < MR; i++) acc[i] = vf_zero();
  for (int64_t p = 0; p < kwords; p++) { /* each pair odd k first, then even, as dot_bf16 adds them: the same bits */
    const vf even = vf_load(panel + 32 * p), odd = vf_load(panel + 32 * p + 16);
    for (int i = 0; i < MR; i++) {
      const float *xr = (const float *)(x + i * ldx) + 2 * p;
      acc[i] = vf_fmadd(vf_set1(xr[0]), even, vf_fmadd(vf_set1(xr[1]), odd, acc[i]));
    }
  }
  for (int i = 0; i < MR; i++) {
    if (yf) vf_store(yf + i * ldy, acc[i]);
    else vf_store_bf16(y + i * ldy, acc[i]);
  }
}

static void panel_blocks(const uint8_t *w, int64_t wblock, int64_t nb0, int nb, const uint8_t *x, int64_t ldx, int64_t M,
                         int64_t kwords, bf16 *y, float *yf, int64_t ldy) {
  float *panel = malloc(sizeof(float) * kwords * 32);
  for (int b = 0; b < nb; b++) {
    const uint8_t *wb = w + (nb0 + b) * wblock;
    for (int64_t p = 0; p < kwords; p++) w_bf16_widen(wb + p * 64, panel + 32 * p, panel + 32 * p + 16);
    for (int64_t m0 = 0; m0 < M; m0 += F32_MR) {
      const int mr = M - m0 < F32_MR ? (int)(M - m0) : F32_MR;
      const uint8_t *xm = x + m0 * ldx;
      bf16 *ym = y ? y + m0 * ldy + (nb0 + b) * 16 : NULL;
      float *yfm = yf ? yf + m0 * ldy + (nb0 + b) * 16 : NULL;
      switch (mr) {
        case 1: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, 1); break;
        case 2: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, 2); break;
        case 3: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, 3); break;
        case 4: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, 4); break;
        case 5: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, 5); break;
        default: micro_f32(panel, kwords, xm, ldx, ym, yfm, ldy, F32_MR); break;
      }
    }
  }
  free(panel);
}
#endif

/* All M rows of the nb column blocks from block nb0 on, MR_MAX rows at a time (a single row: nb up to NB_ONE,
 * else NB_MAX): y (bf16) or yf (float32) [M, .] with row stride ldy; sx, sw, colsum: int8's scales and
 * column sums (else NULL). */
static void blocks(const uint8_t *w, int64_t wblock, int64_t nb0, int nb, const uint8_t *x, int64_t ldx, int64_t M,
                   int64_t kwords, bf16 *y, float *yf, int64_t ldy, int int8, const float *sx, const float *sw,
                   const int32_t *colsum) {
#if ISA_X_F32
  if (!int8 && M >= PANEL_MIN_ROWS) {
    panel_blocks(w, wblock, nb0, nb, x, ldx, M, kwords, y, yf, ldy);
    return;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
    const int mr = M - m0 < MR_MAX ? (int)(M - m0) : MR_MAX;
    for (int b = 0; b < nb;) { /* (M > 1 takes NB_MAX blocks at a time; a single row up to NB_ONE) */
      const int cap = mr == 1 ? NB_ONE : NB_MAX, n = nb - b < cap ? nb - b : cap;
      micro_any(w + (nb0 + b) * wblock, wblock, x + m0 * ldx, ldx, y ? y + m0 * ldy + (nb0 + b) * 16 : NULL,
                yf ? yf + m0 * ldy + (nb0 + b) * 16 : NULL, ldy, kwords, mr, n, int8, sx ? sx + m0 : NULL,
                sw ? sw + (nb0 + b) * 16 : NULL, colsum ? colsum + (nb0 + b) * 16 : NULL);
      b += n;
    }
  }
}

/* x [M, K] bf16 (rows ld elements apart) as the bf16 micro-kernel reads it: as it is, or (ISA_X_F32) widened to
 * float32 into a buffer the caller frees (*tmp); *ldx: the row stride in bytes. */
static const uint8_t *x_operand(const bf16 *x, int64_t M, int64_t K, int64_t ld, float **tmp, int64_t *ldx) {
#if ISA_X_F32
  float *xf = malloc(sizeof(float) * M * K);
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k += 16) vf_store_n(xf + m * K + k, vf_load_bf16_n(x + m * ld + k, K - k), K - k);
  *tmp = xf;
  *ldx = K * 4;
  return (const uint8_t *)xf;
#else
  (void)M, (void)K;
  *tmp = NULL;
  *ldx = ld * 2;
  return (const uint8_t *)x;
#endif
}

/* Each thread takes a contiguous run of column groups (NB_CAP blocks: its share of the weights, streamed once
 * when M <= MR_MAX) and all rows, MR_MAX at a time, while the group's weights sit in its L2. x rows are ldx bytes
 * apart; a weight row (kwords of them a block) is 64 bytes; int8 (else bf16) says which product. */
static void vec_matmul(const uint8_t *w, const uint8_t *x, int64_t ldx, bf16 *y, int64_t M, int64_t N, int64_t kwords,
                       int int8, const float *sx, const float *sw, const int32_t *colsum, int nthreads) {
  const int64_t nblocks = N / 16, per = M == 1 ? NB_ONE : NB_CAP, ngroups = (nblocks + per - 1) / per;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (ngroups > 1)
  for (int64_t g = 0; g < ngroups; g++) {
    const int64_t nb0 = g * per;
    blocks(w, 64 * kwords, nb0, nblocks - nb0 < per ? (int)(nblocks - nb0) : (int)per, x, ldx, M, kwords, y, NULL, N,
           int8, sx, sw, colsum);
  }
}

/* One thread's bf16 product: [M, nblocks x 16] (row stride ldy; bf16 into y, or float32 into yf) = x[M, 2 kwords]
 * (bf16, rows ld elements apart) @ W^T, W packed as 16-column blocks of kwords 64-byte rows, wblock bytes apart. */
static void gemm_serial(const uint8_t *w, int64_t wblock, int64_t nblocks, const bf16 *x, int64_t ld, int64_t M,
                        int64_t kwords, bf16 *y, float *yf, int64_t ldy) {
  float *tmp;
  int64_t ldx;
  const uint8_t *xs = x_operand(x, M, 2 * kwords, ld, &tmp, &ldx);
  blocks(w, wblock, 0, (int)nblocks, xs, ldx, M, kwords, y, yf, ldy, 0, NULL, NULL, NULL);
  free(tmp);
}

/* bf16: y[M, N] = x[M, K] @ W^T, W packed [N/16][K/2][16][2]. K % 32 == 0, N % 16 == 0. */
void mili_linear(const bf16 *w, const bf16 *x, bf16 *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#ifdef ISA_HAS_AMX
  if (use_amx) {
    const uint8_t *xs = (const uint8_t *)x;
    uint8_t *whole = NULL; /* x in whole 16-row chunks (zero padded) when M > 16 is not a multiple of 16 */
    if (M > 16 && M % 16) {
      const int64_t mp = (M + 15) / 16 * 16;
      whole = calloc(mp * K, sizeof(bf16));
      memcpy(whole, x, M * K * sizeof(bf16));
      xs = whole;
    }
    amx_matmul((const uint8_t *)w, xs, y, M, N, K, 2, NULL, NULL, nthreads);
    free(whole);
    return;
  }
#endif
  float *tmp;
  int64_t ldx;
  const uint8_t *xs = x_operand(x, M, K, K, &tmp, &ldx);
  vec_matmul((const uint8_t *)w, xs, ldx, y, M, N, K / 2, 0, NULL, NULL, NULL, nthreads);
  free(tmp);
}

/* n bf16 values to int8 with one symmetric scale, returned (amax / 127; q = x times 1 / scale rounded to nearest
 * even, as lrintf does in the default rounding mode): stores q + offset (128: unsigned, for vpdpbusd's first
 * operand) and the sum of q (without the offset) in *sum. Any n. Vectorized because the scalar loop it
 * replaced (lrintf is a libm call under -O3) cost ~4.3 ns a value against ~0.4 here, run by one thread while
 * the others waited: ~0.8 ms of a 0.6B decode step (200k values over its 112 linears). */
static inline float quantize_int8(const bf16 *x, int64_t n, int8_t *q, int offset, int32_t *sum) {
  vf amax = vf_zero();
  for (int64_t k = 0; k < n; k += 16) amax = vf_max(amax, vf_abs(vf_load_bf16_n(x + k, n - k)));
  const float a = vf_reduce_max(amax), scale = a > 0.f ? a / 127.f : 1.f;
  const vf inv = vf_set1(1.f / scale);
  vi s = vi_zero();
  for (int64_t k = 0; k < n; k += 16) {
    const vi r = vf_to_vi(vf_mul(vf_load_bf16_n(x + k, n - k), inv)); /* (the tail's zeros give 0) */
    s = vi_add(s, r);
    if (n - k >= 16) {
      vi_store_i8(q + k, vi_add(r, vi_set1(offset)));
    } else {
      int8_t t[16];
      vi_store_i8(t, vi_add(r, vi_set1(offset)));
      memcpy(q + k, t, n - k);
    }
  }
  *sum = vi_reduce_add(s);
  return scale;
}

/* int8 weights with one float scale per output row (sw[N]) and their column sums (colsum[N], for the ISAs
 * whose dot product takes x unsigned), W packed [N/16][K/4][16][4]; x is quantized here to int8 with one
 * scale per row (symmetric, round to nearest). K % 64 == 0. */
void mili_linear_int8(const int8_t *w, const float *sw, const int32_t *colsum, const bf16 *x, bf16 *y, int64_t M,
                      int64_t N, int64_t K, int nthreads) {
  const int64_t mp = M <= 16 ? M : (M + 15) / 16 * 16;
  const int offset = use_amx ? 0 : INT8_X_OFFSET;
  int8_t *xq = calloc(mp * K, 1);
  float *sx = calloc(mp, sizeof(float));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
  for (int64_t m = 0; m < M; m++) {
    int32_t unused;
    sx[m] = quantize_int8(x + m * K, K, xq + m * K, offset, &unused);
  }
#ifdef ISA_HAS_AMX
  if (use_amx)
    amx_matmul((const uint8_t *)w, (const uint8_t *)xq, y, M, N, K, 1, sx, sw, nthreads);
  else
#endif
    vec_matmul((const uint8_t *)w, (const uint8_t *)xq, K, y, M, N, K / 4, 1, sx, sw, colsum, nthreads);
  free(xq);
  free(sx);
}

/* x [M, K] quantized to int8 per row and group of K, for the int4 and int8g kernels: the quants xq, each group's
 * scale sx and its sum of quants xsum ([M][K / group] each). */
typedef struct {
  int8_t *xq;
  float *sx;
  int32_t *xsum;
} grouped_x;

static grouped_x quantize_groups(const bf16 *x, int64_t M, int64_t K, int64_t group, int nthreads) {
  const int64_t G = K / group;
  const grouped_x gx = {malloc(M * K), malloc(M * G * sizeof(float)), malloc(M * G * sizeof(int32_t))};
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
  for (int64_t r = 0; r < M * G; r++) { /* one group of one row */
    const int64_t at = (r / G) * K + (r % G) * group;
    gx.sx[r] = quantize_int8(x + at, group, gx.xq + at, 0, gx.xsum + r);
  }
  return gx;
}

static void free_groups(grouped_x gx) {
  free(gx.xq);
  free(gx.sx);
  free(gx.xsum);
}

/* -- int4 weights: w = s q + b, a scale and an offset per group of input channels ----------------------------
 * q in 0..15. AWQ's (q - z) s is s q + (-z s); GGUF's Q4_0 d (q - 8) is d q + (-8 d); its Q4_K sub-blocks
 * d sc q - dmin m are (d sc) q + (-dmin m): each maps onto this exactly with float32 scales and offsets (fp16
 * where those are exact). q packed [N/16][K/8][64 bytes]: byte 4c + j of a row holds column c's q at k0 + j in
 * its low nibble and at k0 + 4 + j in its high one, so masking and shifting a 64-byte load gives two of the
 * int8 kernel's [16 columns][4 k] operands. Scales and offsets are per block of 16 columns and group, in one of the
 * forms below (scale_mode). x is quantized to int8 per row and group (sx), and each group's sum of q (xsum) carries
 * the offsets: sum_k x w = sx (s sum_k xq q + b sum_k xq). Without offsets (wb NULL) w = s (q - 8), none stored:
 * GGUF's Q4_0 d (q - 8) as it is (its bits, a zero's sign too), sx s (sum_k xq q - 8 sum_k xq).
 *
 * With high bits (hb = 1 or 2: q in 0..31 or 0..63) the same kernel reads GGUF's Q5_K (d sc q - dmin m) and Q6_K
 * (d sc (q - 32): without offsets w = s (q - 8 << hb)) at about the file's bytes (0.69 and 0.82 a weight, where the
 * int8g kernel's bytes took 1.07): each row of a block of 16 columns is its 64 bytes of nibbles as above followed
 * by their 16 hb bytes of high bits (the row's 128 values' bits above the nibble, in the ISA layer's lanes:
 * isa_avx512.h, w_int4_high), [K/8][64 + 16 hb], ORed in after the nibbles are unpacked. A block is one stream:
 * with the high bits after all the nibbles ([K/8][64], then [K/8][16 hb]) each block was two, and a decode's S long
 * runs (grouped_streams) 2 S streams a thread, which measured 0.83-0.92x the interleaved rows on Q6_K and Q5_K.
 * The sums are the same integers as int8g's over u = q (+ 128 - 32 without offsets), and the float32 steps after
 * them the same, so the results are int8g's bits. Many rows (prefill) expand each thread's blocks to int8g's layout
 * once and run its kernel: there the unpacking, paid for every pair of rows, would cost more than the bytes it
 * saves. */

/* The int4 and int8g kernels' scales (and offsets: the same form), one array each, per block of 16 output columns:
 *  SCALES_F16, SCALES_F32: [N/16][G][16] fp16 or float32 values;
 *  SCALES_K: two levels, as GGUF's K-quants store them: per super-block of `sub` groups 16 fp16 d, then sub x 16
 *    int8 sub-scales sc, [N/16][G / sub][32 + 16 sub] bytes. A group's value is d sc, formed here in float32: the
 *    product is exact (an 11-bit mantissa times at most 8 bits), so these are the values, and the results the bits,
 *    of the SCALES_F32 form of d sc, at ~1 + 2 / sub bytes a group instead of 4. Q4_K's and Q5_K's scales are
 *    (d, sc) and their offsets (-dmin, m): -dmin m = -(dmin m) exactly; Q6_K's scales (d, sc) with sc signed. */
enum { SCALES_F16 = 0, SCALES_F32 = 1, SCALES_K = 2 };
typedef struct {
  int mode;       /* SCALES_F16, SCALES_F32 or SCALES_K */
  int64_t sub;    /* SCALES_K: groups per super-block */
  int64_t stride; /* bytes from one block of 16 columns to the next */
} scale_form;

static inline scale_form scale_form_of(int mode, int64_t G, int64_t sub) {
  const int64_t stride = mode == SCALES_K ? G / sub * (32 + 16 * sub) : G * 16 * (mode == SCALES_F32 ? 4 : 2);
  return (scale_form){mode, mode == SCALES_K ? sub : 1, stride};
}

/* Where group g's values lie in a block: at (its values, or SCALES_K its sub-scales) and d_at (SCALES_K: its
 * super-block's d), in bytes, and whether g starts a super-block. Worked out once a group, for every block. */
typedef struct {
  int64_t at, d_at;
  int first;
} scale_at;

static inline scale_at scale_place(scale_form f, int64_t g) {
  if (f.mode != SCALES_K) return (scale_at){g * 16 * (f.mode == SCALES_F32 ? 4 : 2), 0, 0};
  const int64_t s = g / f.sub, d_at = s * (32 + 16 * f.sub);
  return (scale_at){d_at + 32 + 16 * (g - s * f.sub), d_at, g == s * f.sub};
}

/* The 16 columns' values of a group (block: the block's scales or offsets). SCALES_K: *d holds the block's d as
 * float32, converted once a super-block (at its first group) and kept for the others. */
static inline __attribute__((always_inline)) vf load_scales(const uint8_t *block, scale_at a, int mode, vf *d) {
  if (mode == SCALES_F32) return vf_load((const float *)(block + a.at));
  if (mode == SCALES_F16) return vf_load_f16((const uint16_t *)(block + a.at));
  if (a.first) *d = vf_load_f16((const uint16_t *)(block + a.d_at));
  return vf_mul(*d, vi_to_vf(vi_load_i8((const int8_t *)(block + a.at))));
}

/* One thread's run of nbs column blocks (from block nb0) of a layer's scales and offsets (b NULL: none), as its
 * micro-kernel calls read them over many rows (prefill). SCALES_K values are formed once into float32
 * (buf, freed by the caller), the SCALES_F32 form of the same values: each pair of rows then reads them as that form
 * does, where forming them again for every pair cost ~13% of the int4 and int8g kernels' time at 64 rows. A row's
 * results are the same bits either way. */
typedef struct {
  const uint8_t *s, *b;
  scale_form f;
  float *buf;
} run_scales;

static run_scales scales_of_run(const void *ws, const void *wb, scale_form sf, int64_t nb0, int64_t nbs, int64_t G) {
  run_scales r = {(const uint8_t *)ws + nb0 * sf.stride, wb ? (const uint8_t *)wb + nb0 * sf.stride : NULL, sf, NULL};
  if (sf.mode != SCALES_K) return r;
  r.buf = malloc(sizeof(float) * (wb ? 2 : 1) * nbs * G * 16);
  for (int half = 0; half < (wb ? 2 : 1); half++) {
    const uint8_t *src = half ? r.b : r.s;
    float *out = r.buf + half * nbs * G * 16;
    for (int64_t j = 0; j < nbs; j++) {
      vf d = vf_zero();
      for (int64_t g = 0; g < G; g++)
        vf_store(out + (j * G + g) * 16, load_scales(src + j * sf.stride, scale_place(sf, g), SCALES_K, &d));
    }
  }
  r.f = scale_form_of(SCALES_F32, G, 1);
  r.s = (const uint8_t *)r.buf;
  r.b = wb ? (const uint8_t *)(r.buf + nbs * G * 16) : NULL;
  return r;
}
#define EXPAND_ROWS 8 /* more rows than this: SCALES_K expanded (scales_of_run) */

INT8_TARGET static inline __attribute__((always_inline)) void int4_micro(
    const uint8_t *w, int64_t wblock, const uint8_t *ws, const uint8_t *wb, scale_form sf, int64_t G,
    int64_t k8_per_group, const int8_t *xq, int64_t K, const float *sx, const int32_t *xsum, bf16 *y, int64_t ldy,
    int64_t ystep, const int MR, const int NB, const int sym, const int two, const int hb) {
  const int mode = two ? SCALES_K : sf.mode == SCALES_F32 ? SCALES_F32 : SCALES_F16; /* (two: SCALES_K, a constant) */
  vf f[I4_MR][I4_NB_CAP], ds[I4_NB_CAP], db[I4_NB_CAP]; /* (ds, db: SCALES_K's d of the scales and offsets) */
  for (int j = 0; j < NB; j++) {
    ds[j] = db[j] = vf_zero();
    for (int i = 0; i < MR; i++) f[i][j] = vf_zero();
  }
  for (int64_t g = 0; g < G; g++) {
    /* One row (decode) where the ISA allows (INT4_APART: vpdpbusd on AVX-512), the high nibbles' products are
     * summed apart, which gives each sum two independent chains; without high bits they are used in place (masked,
     * not shifted: one instruction less a load), 16 times too large (with them 16 q would pass a byte). Otherwise
     * each step's products go to running sums (i4acc: int16 lanes on AVX2's vpmaddubsw, widened every
     * I4_STEPS >> hb steps) flushed into acc. Two rows keep one sum each: twice the sums would not fit the
     * registers (measured slower at M = 64). */
    const int apart = MR == 1 && INT4_APART;
    const int64_t steps = I4_STEPS >> hb;
    vi acc[I4_MR][I4_NB_CAP], acc16[I4_MR][I4_NB_CAP];
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = acc16[i][j] = vi_zero();
    const int64_t p_end = (g + 1) * k8_per_group;
    for (int64_t p0 = g * k8_per_group; p0 < p_end; p0 += steps) {
      i4acc t[I4_MR][I4_NB_CAP];
      for (int i = 0; i < MR; i++)
        for (int j = 0; j < NB; j++) t[i][j] = i4_zero();
      for (int64_t p = p0; p < p_end && p < p0 + steps; p++) {
        wrow8 lo[I4_NB_CAP], hi[I4_NB_CAP];
        for (int j = 0; j < NB; j++) {
          w_int4(w + j * wblock + p * (64 + 16 * hb), &lo[j], &hi[j], apart && !hb);
          if (hb) w_int4_high(w + j * wblock + p * (64 + 16 * hb) + 64, &lo[j], &hi[j], hb);
        }
        for (int i = 0; i < MR; i++) {
          const xq4 x0 = x_int8(xq + i * K + p * 8), x1 = x_int8(xq + i * K + p * 8 + 4);
          for (int j = 0; j < NB; j++) {
            if (apart) { /* two chains: the high nibbles' products (16 x where in place) apart */
              acc[i][j] = dot_int4(acc[i][j], x0, lo[j]);
              acc16[i][j] = dot_int4(acc16[i][j], x1, hi[j]);
            } else {
              t[i][j] = i4_dot(t[i][j], x0, lo[j], x1, hi[j]);
            }
          }
        }
      }
      if (!apart)
        for (int i = 0; i < MR; i++)
          for (int j = 0; j < NB; j++) acc[i][j] = i4_flush(acc[i][j], t[i][j]);
    }
    const scale_at at = scale_place(sf, g);
    for (int j = 0; j < NB; j++) {
      const vf s = load_scales(ws + j * sf.stride, at, mode, &ds[j]);
      const vf b = sym ? s : load_scales(wb + j * sf.stride, at, mode, &db[j]);
      for (int i = 0; i < MR; i++) {
        vi sum = apart ? vi_add(acc[i][j], hb ? acc16[i][j] : vi_sra(acc16[i][j], 4)) : acc[i][j];
        const float scale = sx[i * G + g];
        if (sym) sum = vi_sub(sum, vi_set1((8 << hb) * xsum[i * G + g]));
        f[i][j] = vf_fmadd(vi_to_vf(sum), vf_mul(s, vf_set1(scale)), f[i][j]);
        if (!sym) f[i][j] = vf_fmadd(b, vf_set1(scale * (float)xsum[i * G + g]), f[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) vf_store_bf16(y + i * ldy + j * ystep, f[i][j]);
}

#define I4(MR, NB) int4_micro(w, wblock, ws, wb, sf, G, k8g, xq, K, sx, xsum, y, ldy, ystep, MR, NB, sym, two, hb)
#define I4_NB_CASE(MR)                                  \
  switch (nb) {                                         \
    case 1: I4(MR, 1); break;                           \
    case 2: if (I4_NB_CAP >= 2) I4(MR, 2); break;       \
    case 3: if (I4_NB_CAP >= 3) I4(MR, 3); break;       \
    default: if (I4_NB_CAP >= 4) I4(MR, 4); break;      \
  }
#define I4_MR_CASE \
  if (mr == 1) {   \
    I4_NB_CASE(1); \
  } else {         \
    I4_NB_CASE(2); \
  }
#define I4_SYM_CASE    \
  if (wb) {            \
    const int sym = 0; \
    I4_MR_CASE         \
  } else {             \
    const int sym = 1; \
    I4_MR_CASE         \
  }
#define I4_HB_CASE                 \
  if (high_bits == 2) {            \
    const int hb = 2;              \
    I4_SYM_CASE                    \
  } else if (high_bits == 1) {     \
    const int hb = 1;              \
    I4_SYM_CASE                    \
  } else {                         \
    const int hb = 0;              \
    I4_SYM_CASE                    \
  }
INT8_TARGET static void int4_micro_any(const uint8_t *w, int64_t wblock, const uint8_t *ws,
                                       const uint8_t *wb, scale_form sf, int64_t G, int64_t k8g, const int8_t *xq,
                                       int64_t K, const float *sx, const int32_t *xsum, bf16 *y, int64_t ldy,
                                       int64_t ystep, int mr, int nb, int high_bits) {
  if (sf.mode == SCALES_K) { /* (sym, hb and two constants in each instance: their branches fold away) */
    const int two = 1;
    I4_HB_CASE
  } else {
    const int two = 0;
    I4_HB_CASE
  }
}

/* -- int8g: 8-bit weights w = s u + b, a scale and an offset per group of input channels ----------------------
 * u in 0..255 (the int4 kernel's form with 8-bit values). GGUF's blocks map onto it exactly: Q5_K's sub-blocks
 * d sc q - dmin m are s = d sc, u = q, b = -dmin m; without offsets (wb NULL) b is -128 s, which stores none and
 * takes one multiply-add a group less: Q8_0's d q is s = d, u = q + 128, and Q6_K's d sc (q - 32) is s = d sc,
 * u = q + 96. Each s u there is exact in float32 (an 11-bit fp16 mantissa times at most 8 + 8 bits), so s u + b,
 * or s (u - 128), rounds as gguf's dequantize rounds d q - dm, or d q. u is packed as the int8 kernel's weights,
 * [N/16][K/4][16][4]; scales and offsets in the int4 kernel's forms (scale_form: Q6_K and Q5_K two-level as the file
 * stores them, SCALES_K).
 * x is quantized to int8 per row and group (sx, with each group's sum of q, xsum). The ISA's dot product gives a
 * group's S_u = sum xq u (vpdpbusd: u unsigned, x signed), or where it is signed x signed (I8G_SIGNED: AVX2
 * without VNNI, NEON) S_v over v = u - 128; S_u = S_v + 128 xsum. Both exact integers, so every ISA has the
 * same sums and the same float32 steps after them: sum_k x w = sx (s S_u + b xsum), or symmetric sx s S_v.
 * Signed with offsets (sgn and wb: w = s (u - 128) + b) is the two at once, sx (s S_v + b xsum): the rows of one
 * fused layer whose parts mix symmetric blocks (Q6_K, Q8_0) with blocks that have offsets (Q4_K, Q5_K) keep
 * each part's exact form (a symmetric part's b is 0, an offset part's u is q + 128). */
INT8_TARGET static inline __attribute__((always_inline)) void int8g_micro(
    const uint8_t *w, int64_t wblock, const uint8_t *ws, const uint8_t *wb, scale_form sf, int64_t G, int64_t k4_per_group,
    const int8_t *xq, int64_t K, const float *sx, const int32_t *xsum, bf16 *y, int64_t ldy, int64_t ystep,
    const int MR, const int NB, const int sgn, const int offs, const int two) {
  const int mode = two ? SCALES_K : sf.mode == SCALES_F32 ? SCALES_F32 : SCALES_F16; /* (two: SCALES_K, a constant) */
  vf f[I8G_MR][I8G_NB_CAP], ds[I8G_NB_CAP], db[I8G_NB_CAP]; /* (ds, db: SCALES_K's d of the scales and offsets) */
  for (int j = 0; j < NB; j++) {
    ds[j] = db[j] = vf_zero();
    for (int i = 0; i < MR; i++) f[i][j] = vf_zero();
  }
  for (int64_t g = 0; g < G; g++) {
    vi acc[I8G_MR][I8G_NB_CAP];
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = vi_zero();
    for (int64_t p = g * k4_per_group; p < (g + 1) * k4_per_group; p++) {
      wrowg wv[I8G_NB_CAP];
      for (int j = 0; j < NB; j++) {
        wv[j] = w_int8g(w + j * wblock + p * 64);
      }
      for (int i = 0; i < MR; i++) {
        const xq4 xb = x_int8(xq + i * K + p * 4);
        for (int j = 0; j < NB; j++) acc[i][j] = dot_int8g(acc[i][j], xb, wv[j]);
      }
    }
    const scale_at at = scale_place(sf, g);
    for (int j = 0; j < NB; j++) {
      const vf s = load_scales(ws + j * sf.stride, at, mode, &ds[j]);
      const vf b = offs ? load_scales(wb + j * sf.stride, at, mode, &db[j]) : s;
      for (int i = 0; i < MR; i++) {
        const float scale = sx[i * G + g];
        vi sum = acc[i][j]; /* to S_v (signed) or S_u */
        if (sgn && !I8G_SIGNED) sum = vi_sub(sum, vi_set1(128 * xsum[i * G + g]));
        if (!sgn && I8G_SIGNED) sum = vi_add(sum, vi_set1(128 * xsum[i * G + g]));
        f[i][j] = vf_fmadd(vi_to_vf(sum), vf_mul(s, vf_set1(scale)), f[i][j]);
        if (offs) f[i][j] = vf_fmadd(b, vf_set1(scale * (float)xsum[i * G + g]), f[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) vf_store_bf16(y + i * ldy + j * ystep, f[i][j]);
}

#define I8G(MR, NB) int8g_micro(w, wblock, ws, wb, sf, G, k4g, xq, K, sx, xsum, y, ldy, ystep, MR, NB, sgn, offs, two)
#define I8G_NB_CASE(MR)                                 \
  switch (nb) {                                         \
    case 1: I8G(MR, 1); break;                          \
    case 2: if (I8G_NB_CAP >= 2) I8G(MR, 2); break;     \
    case 3: if (I8G_NB_CAP >= 3) I8G(MR, 3); break;     \
    default: if (I8G_NB_CAP >= 4) I8G(MR, 4); break;    \
  }
#define I8G_MR_CASE          \
  if (mr == 1) {             \
    I8G_NB_CASE(1);          \
  } else {                   \
    I8G_NB_CASE(2);          \
  }
INT8_TARGET static void int8g_micro_any(const uint8_t *w, int64_t wblock, const uint8_t *ws, const uint8_t *wb, scale_form sf,
                                        int64_t G, int64_t k4g, const int8_t *xq, int64_t K, const float *sx,
                                        const int32_t *xsum, bf16 *y, int64_t ldy, int64_t ystep, int mr, int nb,
                                        int signed_q) {
#define I8G_FORM_CASE                \
  if (wb && !signed_q) {             \
    const int sgn = 0, offs = 1;     \
    I8G_MR_CASE                      \
  } else if (wb) {                   \
    const int sgn = 1, offs = 1;     \
    I8G_MR_CASE                      \
  } else {                           \
    const int sgn = 1, offs = 0;     \
    I8G_MR_CASE                      \
  }
  if (sf.mode == SCALES_K) { /* (sgn, offs and two constants in each instance: their branches fold away) */
    const int two = 1;
    I8G_FORM_CASE
  } else {
    const int two = 0;
    I8G_FORM_CASE
  }
}

/* nbs blocks of int4 with high bits (hb 1 or 2; w: the first, wblock bytes apart) in int8g's layout at out, each
 * value plus add: a row's lo and hi (k0..3, k0 + 4..7) are int8g's rows 2p and 2p + 1. */
static void int4_to_int8g(const uint8_t *w, int64_t wblock, int64_t nbs, int64_t K, int hb, int add, uint8_t *out) {
  for (int64_t j = 0; j < nbs; j++)
    for (int64_t p = 0; p < K / 8; p++) {
      wrow8 lo, hi;
      const uint8_t *row = w + j * wblock + p * (64 + 16 * hb), *hp = row + 64;
      w_int4(row, &lo, &hi, 0);
      if (hb == 2) w_int4_high(hp, &lo, &hi, 2); /* (constants: the ISA layer's branches fold) */
      else w_int4_high(hp, &lo, &hi, 1);
      w_store8(out + (j * K / 8 + p) * 128, lo, add);
      w_store8(out + (j * K / 8 + p) * 128 + 64, hi, add);
    }
}

/* Few rows (decode, M <= EXPAND_ROWS): each thread's contiguous share of the blocks is cut into S runs of R
 * blocks (S: the blocks the micro-kernel takes at once, 4 on AVX-512), and the micro-kernel steps through them
 * together, block i of every run in one call (the blocks R wblock bytes apart, their outputs R x 16 columns apart).
 * So a thread reads S long streams at once (the weights, and as many of scales), each continuing from one call
 * to the next. One stream (one block a call) or S short ones (S neighbouring blocks: a block is K / 2 x 16 bytes
 * of int4, 8 KB at K = 1024) kept the hardware prefetchers from running far enough ahead: S long streams measured
 * 1.17-1.28x one or S short ones on the Q4_0, Q4_K and Q8_0 layers of the 0.6B and 4B:8 shapes (benchmarks/NOTES.md,
 * step 15). Each column's sums are the same: the results are the same bits. */
static void grouped_streams(const uint8_t *w, int64_t wblock, const void *ws, const void *wb, scale_form sf,
                            const grouped_x gx, bf16 *y, int64_t ldy, int64_t M, int64_t nblocks, int64_t K,
                            int64_t group, int int8g, int high_bits, int nthreads) {
  const int64_t G = K / group, parts = nblocks < nthreads ? nblocks : nthreads;
  const int mr_max = int8g ? I8G_MR : I4_MR;
  const int S = M == 1 ? (int8g ? I8G_NB_ONE : I4_NB_ONE) : (int8g ? I8G_NB : I4_NB);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parts > 1)
  for (int64_t t = 0; t < parts; t++) { /* one a thread */
    const int64_t b0 = nblocks * t / parts, len = nblocks * (t + 1) / parts - b0, R = (len + S - 1) / S;
    scale_form sfr = sf; /* (one block to the next in a call: R blocks) */
    sfr.stride = sf.stride * R;
    for (int64_t i = 0; i < R; i++) {
      int n = 1; /* the runs that still have an i-th block (only the last can be short) */
      while (n < S && n * R + i < len) n++;
      const int64_t b = b0 + i;
      const uint8_t *s = (const uint8_t *)ws + b * sf.stride, *o = wb ? (const uint8_t *)wb + b * sf.stride : NULL;
      for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
        const int mr = M - m0 < mr_max ? (int)(M - m0) : mr_max;
        bf16 *yb = y + m0 * ldy + b * 16;
        if (int8g)
          int8g_micro_any(w + b * wblock, R * wblock, s, o, sfr, G, group / 4, gx.xq + m0 * K, K, gx.sx + m0 * G,
                          gx.xsum + m0 * G, yb, ldy, R * 16, mr, n, int8g == 2);
        else
          int4_micro_any(w + b * wblock, R * wblock, s, o, sfr, G, group / 8, gx.xq + m0 * K, K,
                         gx.sx + m0 * G, gx.xsum + m0 * G, yb, ldy, R * 16, mr, n, high_bits);
      }
    }
  }
}

/* The int4 and int8g kernels' one driver: y[M, N] (rows ldy apart) = x[M, K] @ W^T, W int8g (int8g 1; 2: signed with
 * offsets) or int4 with high_bits (0, 1 or 2), scales and offsets (wb NULL: none) in the form scale_mode (SCALES_K:
 * sub groups a super-block). x is quantized per row and group once; few rows go to grouped_streams. */
static void grouped_linear(const uint8_t *w, const void *ws, const void *wb, const bf16 *x, bf16 *y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K, int64_t group, int scale_mode, int64_t sub, int int8g,
                           int high_bits, int nthreads) {
  const int expand = !int8g && high_bits && M > EXPAND_ROWS; /* many rows: int8g's kernel over expanded blocks */
  const int eight = int8g || expand;                         /* (which micro-kernel runs) */
  const int64_t G = K / group, nblocks = N / 16, per = eight ? I8G_NB : I4_NB; /* (a group: one call's blocks) */
  const int64_t ngroups = (nblocks + per - 1) / per, wblock = int8g ? K * 16 : K * (8 + 2 * high_bits);
  const int mr_max = eight ? I8G_MR : I4_MR;
  const scale_form sf = scale_form_of(scale_mode, G, sub);
  const grouped_x gx = quantize_groups(x, M, K, group, nthreads);
  if (M <= EXPAND_ROWS) {
    grouped_streams(w, wblock, ws, wb, sf, gx, y, ldy, M, nblocks, K, group, int8g, high_bits, nthreads);
    free_groups(gx);
    return;
  }
  /* Many rows (prefill): each thread takes groups of neighbouring blocks and every row over each group while its
   * weights sit in L2; SCALES_K scales formed once a group (scales_of_run), int4 with high bits expanded. */
#pragma omp parallel num_threads(nthreads) if (ngroups > 1)
  {
    /* one a thread, reused by its runs; 64-byte aligned as the packed weights are (a misaligned one made every row's
     * load straddle two lines: ~20% of the kernel's time at 512 rows) */
    uint8_t *expanded = expand ? aligned_alloc(64, per * K * 16) : NULL;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < ngroups; c++) {
      const int64_t nb0 = c * per, nbs = nblocks - nb0 < per ? nblocks - nb0 : per;
      const run_scales rs = scales_of_run(ws, wb, sf, nb0, nbs, G);
      const uint8_t *wc = w + nb0 * wblock;
      int64_t wbl = wblock;
      if (expand) { /* u = q, or without offsets q + 128 - (8 << hb): int8g's s (u - 128) is then s (q - 8 << hb) */
        int4_to_int8g(wc, wblock, nbs, K, high_bits, wb ? 0 : 128 - (8 << high_bits), expanded);
        wc = expanded;
        wbl = K * 16;
      }
      for (int64_t m0 = 0; m0 < M; m0 += mr_max) {
        const int mr = M - m0 < mr_max ? (int)(M - m0) : mr_max;
        bf16 *yb = y + m0 * ldy + nb0 * 16;
        if (eight)
          int8g_micro_any(wc, wbl, rs.s, rs.b, rs.f, G, group / 4, gx.xq + m0 * K, K, gx.sx + m0 * G,
                          gx.xsum + m0 * G, yb, ldy, 16, mr, (int)nbs, int8g == 2);
        else
          int4_micro_any(wc, wbl, rs.s, rs.b, rs.f, G, group / 8, gx.xq + m0 * K, K, gx.sx + m0 * G,
                         gx.xsum + m0 * G, yb, ldy, 16, mr, (int)nbs, high_bits);
      }
      free(rs.buf);
    }
    free(expanded);
  }
  free_groups(gx);
}

/* y[M, N] (rows ldy apart) = x[M, K] @ W^T for int4 W (layout above; high_bits 0, 1 or 2; wb NULL: symmetric,
 * w = s (q - 8 << high_bits)), scales and offsets in the form scale_mode (SCALES_K: sub groups a super-block).
 * N % 16 == 0, K % group == 0, group % 8 == 0 (with high bits K % 32 == 0); SCALES_K: (K / group) % sub == 0. */
void mili_linear_int4(const uint8_t *w, const void *ws, const void *wb, const bf16 *x, bf16 *y, int64_t M, int64_t N,
                      int64_t K, int64_t group, int scale_mode, int64_t sub, int high_bits, int64_t ldy, int nthreads) {
  grouped_linear(w, ws, wb, x, y, ldy, M, N, K, group, scale_mode, sub, 0, high_bits, nthreads);
}

/* y[M, N] (rows ldy apart) = x[M, K] @ W^T for int8g W (layout above; wb NULL: symmetric, w = s (u - 128); signed_q
 * with wb: w = s (u - 128) + b), scales and offsets as mili_linear_int4's. N % 16 == 0, K % group == 0,
 * group % 8 == 0; SCALES_K: (K / group) % sub == 0. */
void mili_linear_int8g(const uint8_t *w, const void *ws, const void *wb, const bf16 *x, bf16 *y, int64_t M, int64_t N,
                       int64_t K, int64_t group, int scale_mode, int64_t sub, int signed_q, int64_t ldy, int nthreads) {
  grouped_linear(w, ws, wb, x, y, ldy, M, N, K, group, scale_mode, sub, signed_q ? 2 : 1, 0, nthreads);
}

/* -- norms, RoPE, SwiGLU --------------------------------------------------------------------------------- */

/* One row of RMSNorm as torch rounds it: out = bf16(w * bf16(s / sqrt(mean(s^2) + eps))). D % 16 == 0. */
static inline void rms_norm_row(const bf16 *s, const bf16 *w, bf16 *out, int64_t D, float eps) {
  vf sq = vf_zero();
  for (int64_t i = 0; i < D; i += 16) {
    const vf v = vf_load_bf16(s + i);
    sq = vf_fmadd(v, v, sq);
  }
  const vf inv = vf_set1(1.0f / sqrtf(vf_reduce_add(sq) / (float)D + eps));
  for (int64_t i = 0; i < D; i += 16) {
    const vf normed = vf_round_bf16(vf_mul(vf_load_bf16(s + i), inv));
    vf_store_bf16(out + i, vf_mul(vf_load_bf16(w + i), normed));
  }
}

/* RMSNorm over rows of length D (x rows at stride ldx); with a residual, s = bf16(x + residual) is
 * written to res_out and normalized. D % 16 == 0. */
void mili_rms_norm(const bf16 *x, int64_t ldx, const bf16 *residual, const bf16 *w, bf16 *out, bf16 *res_out,
                   int64_t T, int64_t D, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D >= 65536)
  for (int64_t t = 0; t < T; t++) {
    const bf16 *src = x + t * ldx;
    if (residual) {
      for (int64_t i = 0; i < D; i += 16)
        vf_store_bf16(res_out + t * D + i, vf_add(vf_load_bf16(src + i), vf_load_bf16(residual + t * D + i)));
      src = res_out + t * D;
    }
    rms_norm_row(src, w, out + t * D, D, eps);
  }
}

/* In place on the fused qkv output (rows of stride ld): per-head RMSNorm of the Hq query heads (weight
 * qw) and the Hkv key heads after them (weight kw), then rotate-half RoPE with float32 cos/sin [T, D].
 * D % 32 == 0, D <= 1024. */
void mili_qk_norm_rope(bf16 *qkv, int64_t ld, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const bf16 *qw,
                       const bf16 *kw, float eps, const float *cos_t, const float *sin_t, int nthreads) {
  const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 16)
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos_t + t * D, *s = sin_t + t * D;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
      bf16 *head = qkv + t * ld + h * D, normed[1024];
      rms_norm_row(head, h < Hq ? qw : kw, normed, D, eps);
      for (int64_t i = 0; i < half; i += 16) {
        const vf lo = vf_load_bf16(normed + i), hi = vf_load_bf16(normed + half + i);
        vf_store_bf16(head + i, vf_fnmadd(hi, vf_load(s + i), vf_mul(lo, vf_load(c + i))));
        vf_store_bf16(head + half + i, vf_fmadd(lo, vf_load(s + half + i), vf_mul(hi, vf_load(c + half + i))));
      }
    }
  }
}

/* out[t, i] = bf16(silu(gate[t, i])) * up[t, i] (rounded as torch's bf16 ops), rows = [gate (I) | up (I)].
 * I % 16 == 0. */
void mili_silu_and_mul(const bf16 *gate_up, bf16 *out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 65536)
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < I; i += 16) {
      const vf g = vf_load_bf16(gate_up + t * 2 * I + i), u = vf_load_bf16(gate_up + t * 2 * I + I + i);
      const vf e = vf_exp(vf_sub(vf_zero(), g));
      const vf silu = vf_div(g, vf_add(vf_set1(1.0f), e));
      vf_store_bf16(out + t * I + i, vf_mul(vf_round_bf16(silu), u));
    }
}

/* -- attention ------------------------------------------------------------------------------------------- */

/* dst[i] = bf16(src[i] * scale), i < n. */
static void to_bf16_row(const float *src, float scale, int64_t n, bf16 *dst) {
  const vf s = vf_set1(scale);
  for (int64_t i = 0; i < n; i += 16) vf_store_bf16_n(dst + i, vf_mul(vf_load_n(src + i, n - i, 0.0f), s), n - i);
}

/* Softmax numerator in place: s[i] = exp(s[i] - max); returns the sum (and the maximum at *max). */
static float exp_shifted_max(float *s, int64_t n, float *max) {
  vf mx = vf_set1(-INFINITY), sum = vf_zero();
  for (int64_t i = 0; i < n; i += 16) mx = vf_max(mx, vf_load_n(s + i, n - i, -INFINITY));
  *max = vf_reduce_max(mx);
  const vf top = vf_set1(*max);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vf e = vf_exp(vf_sub(vf_load(s + i), top));
    vf_store(s + i, e);
    sum = vf_add(sum, e);
  }
  float total = vf_reduce_add(sum);
  if (n - i) {
    vf_store_n(s + i, vf_exp(vf_sub(vf_load_n(s + i, n - i, 0.0f), top)), n - i);
    for (; i < n; i++) total += s[i];
  }
  return total;
}
static float exp_shifted(float *s, int64_t n) {
  float max;
  return exp_shifted_max(s, n, &max);
}

/* K/V rows are scattered over pages (one head's row, then the other heads' rows): fetch ahead. */
static inline void prefetch_row(const bf16 *row, int64_t n, int far) {
  for (int64_t c = 0; c < n; c += 32) prefetch(row + c, far);
}

#ifndef ISA_HAS_PV_SLICE
/* o[g] = bf16(inv[g] * sum_p w[g][p] V[p]) for the G heads of a group, over NC chunks of 16 values of the V
 * rows at v + offset[p]; wr: the weights already rounded to bf16 (as torch's CPU flash attention multiplies
 * P), as float32 [G][ctx]. One head at a time; NC is a constant at each call. */
static inline __attribute__((always_inline)) void pv_head(const bf16 *v, const int64_t *offset, const float *wr,
                                                          int64_t ctx, const int NC, float inv, bf16 *o) {
  vf acc[4];
  for (int c = 0; c < NC; c++) acc[c] = vf_zero();
  for (int64_t p = 0; p < ctx; p++) {
    const bf16 *row = v + offset[p];
    if (p + 8 < ctx) prefetch(v + offset[p + 8], 0);
    const vf wp = vf_set1(wr[p]);
    for (int c = 0; c < NC; c++) acc[c] = vf_fmadd(vf_load_bf16(row + 16 * c), wp, acc[c]);
  }
  for (int c = 0; c < NC; c++) vf_store_bf16(o + 16 * c, vf_mul(acc[c], vf_set1(inv)));
}
#endif

/* The weighted sums of V for the G heads of a group, w [G][ctx] float32 (unnormalized; inv[g] the
 * reciprocal of each head's sum), the weights rounded to bf16 once (as torch's CPU flash attention
 * multiplies P). D % 32 == 0. */
static void pv_all(const bf16 *v, const int64_t *offset, const float *w, int64_t ctx, int64_t G, int64_t D,
                   const float *inv, bf16 *o) {
#ifdef ISA_HAS_PV_SLICE /* bf16 pairs of positions, G x NC <= 8 slices of 32 values */
  const int64_t npairs = (ctx + 1) / 2;
  uint32_t *wb = malloc(sizeof(uint32_t) * G * npairs);
  for (int64_t g = 0; g < G; g++) {
    bf16 *dst = (bf16 *)(wb + g * npairs);
    to_bf16_row(w + g * ctx, 1.0f, ctx, dst);
    if (ctx % 2) dst[ctx] = 0;
  }
  for (int64_t d0 = 0; d0 < D;) {
    const int64_t left = (D - d0) / 32;
#define PV(g, nc) do { pv_slice(v + d0, offset, wb, npairs, ctx, g, nc, inv, o + d0, D); d0 += 32 * (nc); } while (0)
    if (G == 1 && left >= 4) PV(1, 4);
    else if (G == 2 && left >= 4) PV(2, 4);
    else if (G == 2 && left >= 2) PV(2, 2);
    else if (G == 4 && left >= 2) PV(4, 2);
    else if (G == 8) PV(8, 1);
    else if (G == 1 && left >= 2) PV(1, 2);
    else {
      for (int64_t g = 0; g < G; g++)
        pv_slice(v + d0, offset, wb + g * npairs, npairs, ctx, 1, 1, inv + g, o + g * D + d0, D);
      d0 += 32;
    }
#undef PV
  }
  free(wb);
#else
  float *wr = malloc(sizeof(float) * G * ctx);
  for (int64_t i = 0; i < G * ctx; i++) wr[i] = round_to_bf16(w[i]);
  for (int64_t g = 0; g < G; g++)
    for (int64_t d0 = 0; d0 < D;) {
      if (D - d0 >= 64) {
        pv_head(v + d0, offset, wr + g * ctx, ctx, 4, inv[g], o + g * D + d0);
        d0 += 64;
      } else {
        pv_head(v + d0, offset, wr + g * ctx, ctx, 2, inv[g], o + g * D + d0);
        d0 += 32;
      }
    }
  free(wr);
#endif
}

/* The CPU backend's pages are head-major, [pages, Hkv, page_size, D]: a (sequence, kv head) task reads
 * page_size x D contiguous values a page (4 KB for Qwen3's 16 x 128 bf16) where the token-major layout
 * [pages, page_size, Hkv, D] gave it D values every Hkv x D (256 B every 2 KB), which this machine's memory
 * serves at about a third of the streaming rate (benchmarks/NOTES.md, step 9). */

/* k, v [T, Hkv, D] (token strides ldk, ldv) into the caches at flat slots (page x page_size + offset);
 * slot < 0 is skipped (padding). */
void mili_store_kv(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, bf16 *k_cache, bf16 *v_cache,
                   const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t page_size) {
  for (int64_t t = 0; t < T; t++) {
    if (slots[t] < 0) continue;
    const int64_t base = (slots[t] / page_size * Hkv * page_size + slots[t] % page_size) * D;
    for (int64_t h = 0; h < Hkv; h++) {
      memcpy(k_cache + base + h * page_size * D, k + t * ldk + h * D, sizeof(bf16) * D);
      memcpy(v_cache + base + h * page_size * D, v + t * ldv + h * D, sizeof(bf16) * D);
    }
  }
}

/* Decode attention over the paged pool, reading each page in place: B sequences with one query token
 * each, q [B, Hq, D] (token stride ldq), head-major caches [pages, Hkv, page_size, D], page_table [B, ldp]
 * (int64), context_lens [B] (int64). One task per (sequence, kv head): its `group` query heads share each
 * K and V row loaded. Scores, softmax and the weighted sum of V are float32. D % 32 == 0. */
void mili_decode_attention(const bf16 *q, int64_t ldq, const bf16 *k_cache, const bf16 *v_cache,
                           const int64_t *page_table, int64_t ldp, const int64_t *context_lens, bf16 *out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                           int nthreads) {
  const int64_t group = Hq / Hkv;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
  for (int64_t task = 0; task < B * Hkv; task++) {
    const int64_t b = task / Hkv, h = task % Hkv, ctx = context_lens[b];
    float *scores = malloc(sizeof(float) * (group * ctx + group));
    float *inv = scores + group * ctx;
    int64_t *offset = malloc(sizeof(int64_t) * ctx); /* of each position's K/V row for this head */
    for (int64_t p = 0; p < ctx; p++)
      offset[p] = ((page_table[b * ldp + p / page_size] * Hkv + h) * page_size + p % page_size) * D;
    const bf16 *qh = q + b * ldq + h * group * D;
    for (int64_t p = 0; p < ctx; p++) {
      const bf16 *kr = k_cache + offset[p];
      if (p + 8 < ctx) {
        prefetch_row(k_cache + offset[p + 8], D, 0);
        prefetch_row(v_cache + offset[p + 8], D, 1);
      }
      for (int64_t g = 0; g < group; g++) {
        vf s = vf_zero();
        for (int64_t c = 0; c < D; c += 32) s = dot_bf16x32(s, qh + g * D + c, kr + c);
        scores[g * ctx + p] = vf_reduce_add(s) * scale;
      }
    }
    for (int64_t g = 0; g < group; g++) inv[g] = 1.0f / exp_shifted(scores + g * ctx, ctx);
    pv_all(v_cache, offset, scores, ctx, group, D, inv, out + (b * Hq + h * group) * D);
    free(scores);
    free(offset);
  }
}

/* -- int8 pages (--kv-cache-dtype int8) ---------------------------------------------------------------------
 * A layer's K (and V) pages as int8 values [pages, Hkv, page_size, D] (head-major, as the bf16 pages) beside
 * float32 scales [pages, Hkv, page_size]: one symmetric scale per (token, kv head) row, amax / 127, its values
 * round(x / scale) (x times 1 / scale, nearest even) in -127..127; a row of zeros has scale 0. A row is quantized
 * once, when stored: nothing is requantized as a page fills. A row of D values is D + 4 bytes (132 at D = 128, 0.52
 * of bf16's), so a decode step streams about half the bytes. Row r = (page x Hkv + head) x page_size + offset holds
 * its values at r x D and its scale at r. The decode kernel reads the rows as they are (q . k in int32 against int16
 * queries, V widened to float32 a tile of rows at a time); a prefill chunk's context is gathered dequantized to bf16
 * (mili_gather_kv_int8) for the prefill kernel. */

static inline int64_t kv_row(int64_t slot, int64_t h, int64_t Hkv, int64_t page_size) {
  return (slot / page_size * Hkv + h) * page_size + slot % page_size;
}

/* x [D] bf16 -> q [D] int8 and its scale (any D). */
static inline void quantize_kv_row(const bf16 *x, int64_t D, int8_t *q, float *scale) {
  vf amax = vf_zero();
  for (int64_t d = 0; d < D; d += 16) amax = vf_max(amax, vf_abs(vf_load_bf16_n(x + d, D - d)));
  const float a = vf_reduce_max(amax), s = a / 127.f;
  const vf inv = vf_set1(a > 0.f ? 1.f / s : 0.f);
  for (int64_t d = 0; d < D; d += 16) {
    const vi r = vf_to_vi(vf_mul(vf_load_bf16_n(x + d, D - d), inv));
    if (D - d >= 16) {
      vi_store_i8(q + d, r);
    } else {
      int8_t t[16];
      vi_store_i8(t, r);
      memcpy(q + d, t, D - d);
    }
  }
  *scale = s;
}

/* out [D] = bf16(q x scale) (any D). */
static inline void dequantize_kv_row(const int8_t *q, float scale, int64_t D, bf16 *out) {
  const vf s = vf_set1(scale);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) vf_store_bf16(out + d, vf_mul(vi_to_vf(vi_load_i8(q + d)), s));
  for (; d < D; d++) {
    const float f = round_to_bf16((float)q[d] * scale);
    uint32_t bits;
    memcpy(&bits, &f, 4);
    out[d] = (bf16)(bits >> 16);
  }
}

/* k, v [T, Hkv, D] (token strides ldk, ldv; bf16) quantized into the int8 pages at flat slots (page x page_size +
 * offset); slot < 0 is skipped (padding). */
void mili_store_kv_int8(const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv, int8_t *k_cache, float *k_scales,
                        int8_t *v_cache, float *v_scales, const int64_t *slots, int64_t T, int64_t Hkv, int64_t D,
                        int64_t page_size, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (T * Hkv >= 64)
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < Hkv; h++) {
      if (slots[t] < 0) continue;
      const int64_t r = kv_row(slots[t], h, Hkv, page_size);
      quantize_kv_row(k + t * ldk + h * D, D, k_cache + r * D, k_scales + r);
      quantize_kv_row(v + t * ldv + h * D, D, v_cache + r * D, v_scales + r);
    }
}

/* out [B, n, Hkv, D] bf16: the first n tokens of each of B sequences' int8 pages (page_table [B, ldp]),
 * dequantized (a prefill chunk's context, and the torch fallback's). Any D. */
void mili_gather_kv_int8(const int8_t *cache, const float *scales, const int64_t *page_table, int64_t ldp, int64_t B,
                         int64_t n, int64_t Hkv, int64_t D, int64_t page_size, bf16 *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * n * Hkv >= 256)
  for (int64_t b = 0; b < B; b++)
    for (int64_t p = 0; p < n; p++) {
      const int64_t page = page_table[b * ldp + p / page_size];
      for (int64_t h = 0; h < Hkv; h++) {
        const int64_t r = (page * Hkv + h) * page_size + p % page_size;
        dequantize_kv_row(cache + r * D, scales[r], D, out + ((b * n + p) * Hkv + h) * D);
      }
    }
}

/* A query head (bf16 [D]) as int16 with one scale, returned: amax / 32767, q16 = q / scale (times its reciprocal)
 * rounded to nearest even. Its error, at most half a step (amax / 65534), is below bf16's own rounding of q. */
static float quantize_q16(const bf16 *q, int64_t D, int16_t *q16) {
  vf amax = vf_zero();
  for (int64_t d = 0; d < D; d += 16) amax = vf_max(amax, vf_abs(vf_load_bf16(q + d)));
  const float a = vf_reduce_max(amax), scale = a / 32767.0f, inv = a > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t d = 0; d < D; d++) q16[d] = (int16_t)nearbyintf(bf16_to_float(q[d]) * inv);
  return scale;
}

#ifndef ISA_HAS_HSUM16
/* lane r of the result = the sum of acc[r]'s lanes (16 rows' dot products at once; the ISA layers that have
 * a transposing tree define their own) */
static inline vi vi_hsum16(const vi *acc) {
  int32_t t[16];
  for (int r = 0; r < 16; r++) t[r] = vi_reduce_add(acc[r]);
  return vi_load(t);
}
#endif

/* s[i] = q16 . (row i's int8 values), exactly in int32 (|dot| <= 127 x 32767 x D: D <= 512 stays within int32), for
 * the n <= 16 consecutive rows at k (row i at k + i D), as one vector (lane i: row i; lanes past n are 0). The 16
 * rows' sums stay in registers and are reduced together (vi_hsum16: a transposing tree, not one horizontal sum a
 * row). D % 32 == 0. */
static inline __attribute__((always_inline)) vi qk_int8_block(const int16_t *q16, int64_t D, const int8_t *k,
                                                              int64_t n) {
  vi acc[16];
  for (int i = 0; i < 16; i++) acc[i] = vi_zero();
  for (int64_t i = 0; i < n; i++)
    for (int64_t d = 0; d < D; d += 32) acc[i] = dot_i8_i16x32(acc[i], k + i * D + d, q16 + d);
  return vi_hsum16(acc);
}

#ifndef ISA_HAS_PV_I16
/* acc[g] [D] += sum_i w[g][i] V[i] for G heads (w[g] at w + 16 g), the n <= 16 consecutive rows at v (row i at
 * v + i D) widened to float32 in registers, 64 values at a time (each row's bytes widened once for the G heads, the
 * G x 4 sums held). D % 32 == 0. */
static inline __attribute__((always_inline)) void pv_int8_block(const int8_t *v, int64_t n, int64_t D, const float *w,
                                                                const int G, float *acc) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    vf a[4][4];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) a[g][c] = vf_load(acc + g * D + d + 16 * c);
    for (int64_t i = 0; i < n; i++) {
      const int8_t *r = v + i * D + d;
      vf x[4];
      for (int c = 0; c < 4; c++) x[c] = vi_to_vf(vi_load_i8(r + 16 * c));
      for (int g = 0; g < G; g++) {
        const vf wi = vf_set1(w[16 * g + i]);
        for (int c = 0; c < 4; c++) a[g][c] = vf_fmadd(x[c], wi, a[g][c]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 4; c++) vf_store(acc + g * D + d + 16 * c, a[g][c]);
  }
  for (; d < D; d += 32) {
    vf a[4][2];
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2; c++) a[g][c] = vf_load(acc + g * D + d + 16 * c);
    for (int64_t i = 0; i < n; i++) {
      const int8_t *r = v + i * D + d;
      const vf x0 = vi_to_vf(vi_load_i8(r)), x1 = vi_to_vf(vi_load_i8(r + 16));
      for (int g = 0; g < G; g++) {
        const vf wi = vf_set1(w[16 * g + i]);
        a[g][0] = vf_fmadd(x0, wi, a[g][0]);
        a[g][1] = vf_fmadd(x1, wi, a[g][1]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int c = 0; c < 2; c++) vf_store(acc + g * D + d + 16 * c, a[g][c]);
  }
}
#endif


/* A decode task's share of the int8 pages: positions p0 .. p0 + n of one sequence (its page table row at pages), all
 * heads. The rows of page j's head h are (pages[j] Hkv + h) page_size + i; a call walks them as blocks of up to 16
 * consecutive rows (within a page and the task's positions), body seeing h (the kv head), row (the block's first),
 * pos (its first position, from p0) and m (its rows). The hardware's prefetchers follow these runs (each page's
 * K, or V, is Hkv x page_size rows in one piece): software prefetches here made the kernel 1.4x slower. */
typedef struct {
  const int64_t *pages;
  int64_t p0, n, Hkv, page_size;
} kv_span;

#define FOR_EACH_BLOCK(sp, row, pos, m, body)                                                                   \
  for (int64_t j = (sp).p0 / (sp).page_size, end = (sp).p0 + (sp).n; j * (sp).page_size < end; j++) {           \
    const int64_t lo_ = j * (sp).page_size > (sp).p0 ? j * (sp).page_size : (sp).p0;                            \
    const int64_t hi_ = (j + 1) * (sp).page_size < end ? (j + 1) * (sp).page_size : end;                        \
    for (int64_t h = 0; h < (sp).Hkv; h++)                                                                      \
      for (int64_t pos = lo_ - (sp).p0; pos < hi_ - (sp).p0; pos += 16) {                                       \
        const int64_t m = hi_ - (sp).p0 - pos < 16 ? hi_ - (sp).p0 - pos : 16;                                  \
        const int64_t row = ((sp).pages[j] * (sp).Hkv + h) * (sp).page_size + ((sp).p0 + pos) % (sp).page_size; \
        body;                                                                                                   \
      }                                                                                                         \
  }

/* scores [Hq][L] (from the span's first position) = q . k x the row's scale x the query's (qscale, which holds the
 * softmax scale too), the queries q16 [Hq][D] int16. */
static void span_scores(const kv_span sp, const int16_t *q16, const float *qscale, const int8_t *k_cache,
                        const float *k_scales, int64_t G, int64_t D, int64_t L, float *scores) {
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf ks = vf_load_n(k_scales + row, m, 0.0f);
    for (int64_t g = 0; g < G; g++) {
      const int64_t hq = h * G + g;
      const vi dots = qk_int8_block(q16 + hq * D, D, k_cache + row * D, m);
      vf_store_n(scores + hq * L + pos, vf_mul(vi_to_vf(dots), vf_mul(ks, vf_set1(qscale[hq]))), m);
    }
  })
}

#ifdef ISA_HAS_PV_I16
/* acc [Hq][D] (float32) = sum over the span's rows of w V, w the softmax's numerators in scores [Hq][L] times each
 * row's V scale: quantized to int16 per head (its largest weight at 32767; the step is below bf16's rounding of the
 * largest) and multiplied with V's rows in int32, two rows a pair (pv_i16_block; |sum| <= L x 32767 x 127 stays
 * within int32 for L <= 512), then scaled back (pv_i16_finish). Scratch: wq int16 [Hq][L], acc32 [Hq][D],
 * wscale [Hq]. */
static void span_values(const kv_span sp, float *scores, const int8_t *v_cache, const float *v_scales, int64_t Hq,
                        int64_t G, int64_t D, int64_t L, int16_t *wq, int32_t *acc32, float *wscale, float *acc) {
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf vs = vf_load_n(v_scales + row, m, 0.0f);
    for (int64_t g = 0; g < G; g++) {
      float *w = scores + (h * G + g) * L + pos;
      vf_store_n(w, vf_mul(vf_load_n(w, m, 0.0f), vs), m);
    }
  })
  for (int64_t hq = 0; hq < Hq; hq++) {
    const float *w = scores + hq * L;
    vf mx = vf_zero();
    for (int64_t i = 0; i < sp.n; i += 16) mx = vf_max(mx, vf_load_n(w + i, sp.n - i, 0.0f));
    const float top = vf_reduce_max(mx), inv = top > 0.0f ? 32767.0f / top : 0.0f;
    for (int64_t i = 0; i < sp.n; i += 16) vi_store_i16_n(wq + hq * L + i, vf_to_vi(vf_mul(vf_load_n(w + i, sp.n - i, 0.0f), vf_set1(inv))), sp.n - i);
    wscale[hq] = top / 32767.0f;
  }
  memset(acc32, 0, sizeof(int32_t) * Hq * D);
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const int8_t *v = v_cache + row * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* (blocks of up to 4 heads: their sums in registers) */
      const int16_t *w = wq + (h * G + g0) * L + pos;
      int32_t *a = acc32 + (h * G + g0) * D;
      switch (G - g0 < 4 ? G - g0 : 4) {
        case 1: pv_i16_block(v, m, D, w, L, 1, 4, a); break;
        case 2: pv_i16_block(v, m, D, w, L, 2, 4, a); break;
        case 3: pv_i16_block(v, m, D, w, L, 3, 2, a); break;
        default: pv_i16_block(v, m, D, w, L, 4, 2, a); break;
      }
    }
  })
  for (int64_t hq = 0; hq < Hq; hq++) pv_i16_finish(acc32 + hq * D, D, wscale[hq], acc + hq * D);
}
#else
/* acc [Hq][D] (float32) = sum over the span's rows of w V, w the softmax's numerators in scores [Hq][L] times each
 * row's V scale, V's rows widened to float32 (pv_int8_block). */
static void span_values(const kv_span sp, float *scores, const int8_t *v_cache, const float *v_scales, int64_t Hq,
                        int64_t G, int64_t D, int64_t L, int16_t *wq, int32_t *acc32, float *wscale, float *acc) {
  (void)wq, (void)acc32, (void)wscale;
  memset(acc, 0, sizeof(float) * Hq * D);
  float w[64];
  FOR_EACH_BLOCK(sp, row, pos, m, {
    const vf vs = vf_load_n(v_scales + row, m, 0.0f);
    const int8_t *v = v_cache + row * D;
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* (blocks of up to 4 heads: their sums in registers) */
      const int64_t gb = G - g0 < 4 ? G - g0 : 4;
      for (int64_t g = 0; g < gb; g++) /* (each weight times its row's V scale) */
        vf_store(w + 16 * g, vf_mul(vf_load_n(scores + (h * G + g0 + g) * L + pos, m, 0.0f), vs));
      float *a = acc + (h * G + g0) * D;
      switch (gb) {
        case 1: pv_int8_block(v, m, D, w, 1, a); break;
        case 2: pv_int8_block(v, m, D, w, 2, a); break;
        case 3: pv_int8_block(v, m, D, w, 3, a); break;
        default: pv_int8_block(v, m, D, w, 4, a); break;
      }
    }
  })
}
#endif

#define KV_CHUNK 256 /* positions a decode task: a sequence's chunks run on any thread (at most 512: span_values) */

/* mili_decode_attention over int8 pages (k_cache, v_cache with their scales; the other arguments as there), split
 * like flash decoding: a task is one sequence's chunk of KV_CHUNK positions for all its heads, so it reads each
 * page's K, then each page's V, as one run of Hkv x page_size rows (read head by head, the runs would be a page's
 * share, page_size x D bytes, Hkv runs apart). Per task: the queries as int16 (a scale per head: quantize_q16); the
 * scores of blocks of up to 16 rows of a page and kv head in int32 against the group's queries (span_scores); the
 * chunk's softmax in float32 (its own maximum); V's weighted sum (span_values). Then per sequence and head, the
 * chunks' sums rescaled to the largest maximum M and added: sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) s_c. The
 * chunks are fixed by the positions, not the threads: the result does not depend on the thread count. Each K and V
 * row is read from memory once. D % 32 == 0, D <= 512; any page size. */
void mili_decode_attention_int8(const bf16 *q, int64_t ldq, const int8_t *k_cache, const float *k_scales,
                                const int8_t *v_cache, const float *v_scales, const int64_t *page_table, int64_t ldp,
                                const int64_t *context_lens, bf16 *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                                int64_t page_size, float scale, int nthreads) {
  const int64_t G = Hq / Hkv, L = KV_CHUNK;
  int64_t *first = malloc(sizeof(int64_t) * (B + 1)); /* sequence b's tasks: first[b] .. first[b + 1] */
  first[0] = 0;
  for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + (context_lens[b] + L - 1) / L;
  const int64_t ntasks = first[B];
  float *partial = malloc(sizeof(float) * ntasks * Hq * (D + 2)); /* per task and head: D sums, maximum, total */
#pragma omp parallel num_threads(nthreads) if (ntasks > 1)
  {
    float *scores = malloc(sizeof(float) * (Hq * L + 2 * Hq)), *qscale = scores + Hq * L, *wscale = qscale + Hq;
    int16_t *q16 = malloc(sizeof(int16_t) * (Hq * D + Hq * L)), *wq = q16 + Hq * D;
    int32_t *acc32 = malloc(sizeof(int32_t) * Hq * D);
    int64_t quantized = -1; /* (the sequence whose queries q16 holds) */
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < ntasks; task++) {
      int64_t b = 0;
      while (first[b + 1] <= task) b++;
      const int64_t p0 = (task - first[b]) * L;
      const kv_span sp = {page_table + b * ldp, p0, context_lens[b] - p0 < L ? context_lens[b] - p0 : L, Hkv, page_size};
      if (quantized != b) {
        for (int64_t hq = 0; hq < Hq; hq++) qscale[hq] = quantize_q16(q + b * ldq + hq * D, D, q16 + hq * D) * scale;
        quantized = b;
      }
      span_scores(sp, q16, qscale, k_cache, k_scales, G, D, L, scores);
      float *part = partial + task * Hq * (D + 2);
      for (int64_t hq = 0; hq < Hq; hq++) /* the chunk's softmax: its maximum, exp(s - max), their total */
        part[Hq * D + Hq + hq] = exp_shifted_max(scores + hq * L, sp.n, part + Hq * D + hq);
      span_values(sp, scores, v_cache, v_scales, Hq, G, D, L, wq, acc32, wscale, part);
    }
    free(scores);
    free(q16);
    free(acc32);
  }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * Hq >= 8)
  for (int64_t b = 0; b < B; b++)
    for (int64_t hq = 0; hq < Hq; hq++) { /* the chunks rescaled to the largest maximum and added */
      float top = -INFINITY, total = 0.0f;
      for (int64_t t = first[b]; t < first[b + 1]; t++) {
        const float mt = partial[t * Hq * (D + 2) + Hq * D + hq];
        top = mt > top ? mt : top;
      }
      for (int64_t t = first[b]; t < first[b + 1]; t++) {
        const float *part = partial + t * Hq * (D + 2);
        total += expf(part[Hq * D + hq] - top) * part[Hq * D + Hq + hq];
      }
      for (int64_t d = 0; d < D; d += 16) {
        vf o = vf_zero();
        for (int64_t t = first[b]; t < first[b + 1]; t++) {
          const float *part = partial + t * Hq * (D + 2);
          o = vf_fmadd(vf_load(part + hq * D + d), vf_set1(expf(part[Hq * D + hq] - top) / total), o);
        }
        vf_store_bf16(out + (b * Hq + hq) * D + d, o);
      }
    }
  free(partial);
  free(first);
}

/* Causal attention of one sequence's prefill chunk: q [Lq, Hq, D] (token stride ldq) are the last Lq of the
 * Lk positions whose K/V are k, v [Lk, Hkv, D] (token strides ldk, ldv); out [Lq, Hq, D] (stride ldo).
 * Both products run on the linear layers' micro-kernel: each head's K is packed as a weight [Lk, D]
 * (scores = Q K^T), its V^T as a weight [D, Lk] (out = P V, P the softmax in bf16, as torch's CPU flash
 * attention also multiplies it). One task per (kv head, 16 queries): its group's G x 16 query rows share
 * every packed K and V row, and only the key blocks the causal mask leaves are computed. D % 32 == 0. */
void mili_prefill_attention(const bf16 *q, int64_t ldq, const bf16 *k, int64_t ldk, const bf16 *v, int64_t ldv,
                            bf16 *out, int64_t ldo, int64_t Lq, int64_t Lk, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, int nthreads) {
  const int64_t G = Hq / Hkv, nkb = (Lk + 15) / 16, Lkp = nkb * 16, QB = 16, nqb = (Lq + QB - 1) / QB;
  bf16 *kp = malloc(sizeof(bf16) * Hkv * Lkp * D); /* [Hkv][nkb][D/2][16][2] */
  bf16 *vp = malloc(sizeof(bf16) * Hkv * D * Lkp); /* [Hkv][D/16][Lkp/2][16][2] */
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static)
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t key = 0; key < Lkp; key++) {
      const bf16 *kr = k + key * ldk + h * D, *vr = v + key * ldv + h * D;
      bf16 *kdst = kp + (h * nkb + key / 16) * 16 * D + (key % 16) * 2;
      bf16 *vdst = vp + h * D * Lkp + (key / 2) * 32 + key % 2;
      for (int64_t d = 0; d < D; d++) {
        kdst[(d / 2) * 32 + d % 2] = key < Lk ? kr[d] : 0;
        vdst[(d / 16) * 16 * Lkp + (d % 16) * 2] = key < Lk ? vr[d] : 0;
      }
    }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(dynamic)
  for (int64_t h = 0; h < Hkv; h++)
    for (int64_t qb = 0; qb < nqb; qb++) {
      const int64_t i0 = qb * QB, n = Lq - i0 < QB ? Lq - i0 : QB, rows = G * n;
      const int64_t width = (Lk - Lq + i0 + n + 15) / 16 * 16; /* keys the block's last query sees, padded */
      bf16 *xq = malloc(sizeof(bf16) * rows * D), *pr = malloc(sizeof(bf16) * rows * width);
      float *sc = malloc(sizeof(float) * rows * width);
      for (int64_t g = 0; g < G; g++) /* row g * n + i: query i0 + i of head h * G + g */
        for (int64_t i = 0; i < n; i++) memcpy(xq + (g * n + i) * D, q + (i0 + i) * ldq + (h * G + g) * D, D * 2);
      gemm_serial((const uint8_t *)(kp + h * Lkp * D), D * 32, width / 16, xq, D, rows, D / 2,
                  NULL, sc, width);
      for (int64_t r = 0; r < rows; r++) {
        const int64_t valid = Lk - Lq + i0 + r % n + 1;
        float *sr = sc + r * width;
        for (int64_t c = 0; c < valid; c++) sr[c] *= scale;
        const float inv = 1.0f / exp_shifted(sr, valid);
        bf16 *prow = pr + r * width;
        to_bf16_row(sr, inv, valid, prow);
        memset(prow + valid, 0, sizeof(bf16) * (width - valid));
      }
      for (int64_t g = 0; g < G; g++)
        gemm_serial((const uint8_t *)(vp + h * D * Lkp), Lkp * 32, D / 16, pr + g * n * width, width, n, width / 2,
                    out + i0 * ldo + (h * G + g) * D, NULL, ldo);
      free(xq);
      free(pr);
      free(sc);
    }
  free(kp);
  free(vp);
}

/* -- one decoder layer of a decode step in one call --------------------------------------------------------
 * The model's layer (norm, qkv, q/k-norm + RoPE, KV store, attention, o_proj, norm, gate_up, SwiGLU, down)
 * as a sequence of the kernels above, so that a decode step crosses from Python once per layer instead of
 * ~15 times (the Python and torch work between kernels was a quarter of a batch-32 step). Same kernels,
 * same order, same roundings: the result is bit for bit the module path's. */
/* -- LoRA adapters: each row's own adapter's low-rank product, added to a linear layer's output --------------
 * A layer keeps `slots` adapters of rank up to `rank` (mili/lora.py, LoRALinear): A packed [columns, K] with slot s's
 * shard j at rows s x width + j x rank (width = shards x rank; columns: slots x width padded to 32), and for each of
 * the layer's output shards j (q|k|v, gate|up, or one) B_j packed [n_j, kb] over the columns of every slot's shard j
 * (slot s at s x rank; kb: slots x rank padded to 32): y[:, shard j] += B_j (A_j x) per row, its slot's part only.
 * u = x A^T runs over every slot at once (a decode step's rows are few: cheaper than a product per adapter); each
 * shard then gathers its rows' own slot's columns (the others zero) and multiplies by B_j, whose block-diagonal
 * zeros (other shards' columns) are never read. */
typedef struct mili_lora_desc {
  const bf16 *a;        /* packed A [columns, k] */
  const bf16 *b[3];     /* per shard: packed B_j [n_j (padded to 16), kb] */
  int64_t n[3];         /* per shard: output features */
  int64_t shards, columns, width, rank, slots, kb;
} mili_lora_desc;

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

typedef struct mili_linear_desc {
  const void *w;       /* packed weight */
  const void *scales;  /* int8: float per output column; int4, int8g: per column and group (scale_mode's form) */
  const void *aux;     /* int8: column sums (int32); int4, int8g: offsets (as the scales; NULL: symmetric) */
  int64_t n, k; /* output (a multiple of 16: no padding) and input features */
  int64_t group; /* int4, int8g: input features per scale, else 0 */
  int64_t scale_mode; /* int4, int8g: SCALES_F16, SCALES_F32 or SCALES_K */
  int64_t sub; /* int4, int8g with SCALES_K: groups per super-block */
  int64_t int8g; /* 8-bit weights per group (mili_linear_int8g; 2: signed with offsets), else int4 where group is set */
  int64_t high_bits; /* int4: bits above the nibble (0, 1, 2) */
  const struct mili_linear_desc *next; /* the layer's next output columns, in another form (a fused layer whose parts
                                          differ in type: Q4_K_M's q|k beside a Q6_K v), or NULL */
  const mili_lora_desc *lora; /* the layer's LoRA adapters (on the first part: the whole layer's output), or NULL */
} mili_linear_desc;

typedef struct {
  int64_t hidden, q_heads, kv_heads, head_dim, inter;
  float eps, scale; /* RMSNorm's epsilon; attention's softmax scale */
  const bf16 *input_norm, *post_norm, *q_norm, *k_norm;
  mili_linear_desc qkv, o, gate_up, down;
} mili_layer_desc;

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
    if (l->int8g)
      mili_linear_int8g(l->w, l->scales, l->aux, x, y, M, l->n, l->k, l->group, (int)l->scale_mode, l->sub,
                        l->int8g == 2, ldy, nthreads);
    else if (l->group)
      mili_linear_int4(l->w, l->scales, l->aux, x, y, M, l->n, l->k, l->group, (int)l->scale_mode, l->sub,
                       (int)l->high_bits, ldy, nthreads);
    else if (l->scales) mili_linear_int8(l->w, l->scales, l->aux, x, y, M, l->n, l->k, nthreads);
    else mili_linear(l->w, x, y, M, l->n, l->k, nthreads);
  }
}

/* T decode tokens, one per sequence. h [T, hidden] in: the layer's input; out: its MLP output (in place).
 * residual [T, hidden]: the residual stream in and out (in place); with first != 0 there is none yet and
 * h is the stream. slots [T]: where each token's K/V go (< 0: skipped). cos/sin [T, head_dim] float32.
 * work: T x (hidden + qkv.n + q_heads x head_dim + hidden + gate_up.n + inter) bf16. lora_slots [T]: each token's
 * LoRA adapter slot (< 0: none), or NULL: no adapters this step. k_scales NULL: the pages are bf16; else they are
 * int8 pages (k_cache, v_cache their values, k_scales, v_scales their scales: see "int8 pages"). */
void mili_decode_layer(const mili_layer_desc *L, bf16 *h, bf16 *residual, int first, void *k_cache, void *v_cache,
                       float *k_scales, float *v_scales, const int64_t *slots, const float *cos_t, const float *sin_t, const int64_t *page_table,
                       int64_t ldp, const int64_t *context_lens, int64_t page_size, int64_t T, bf16 *work,
                       const int64_t *lora_slots, int nthreads) {
  const int64_t H = L->hidden, D = L->head_dim, Hq = L->q_heads, Hkv = L->kv_heads, nqkv = linear_n(&L->qkv);
  bf16 *normed = work, *qkv = normed + T * H, *attn = qkv + T * nqkv, *o = attn + T * Hq * D;
  bf16 *gate_up = o + T * H, *act = gate_up + T * linear_n(&L->gate_up);
  if (first) { /* the stream starts as the embeddings */
    memcpy(residual, h, sizeof(bf16) * T * H);
    mili_rms_norm(h, H, NULL, L->input_norm, normed, NULL, T, H, L->eps, nthreads);
  } else {
    mili_rms_norm(h, H, residual, L->input_norm, normed, residual, T, H, L->eps, nthreads);
  }
  run_linear(&L->qkv, normed, qkv, T, lora_slots, nthreads);
  mili_qk_norm_rope(qkv, nqkv, T, Hq, Hkv, D, L->q_norm, L->k_norm, L->eps, cos_t, sin_t, nthreads);
  if (k_scales) {
    mili_store_kv_int8(qkv + Hq * D, nqkv, qkv + (Hq + Hkv) * D, nqkv, k_cache, k_scales, v_cache, v_scales, slots, T,
                       Hkv, D, page_size, nthreads);
    mili_decode_attention_int8(qkv, nqkv, k_cache, k_scales, v_cache, v_scales, page_table, ldp, context_lens, attn, T,
                               Hq, Hkv, D, page_size, L->scale, nthreads);
  } else {
    mili_store_kv(qkv + Hq * D, nqkv, qkv + (Hq + Hkv) * D, nqkv, k_cache, v_cache, slots, T, Hkv, D, page_size);
    mili_decode_attention(qkv, nqkv, k_cache, v_cache, page_table, ldp, context_lens, attn, T, Hq, Hkv, D, page_size,
                          L->scale, nthreads);
  }
  run_linear(&L->o, attn, o, T, lora_slots, nthreads);
  mili_rms_norm(o, H, residual, L->post_norm, normed, residual, T, H, L->eps, nthreads);
  run_linear(&L->gate_up, normed, gate_up, T, lora_slots, nthreads);
  mili_silu_and_mul(gate_up, act, T, L->inter, nthreads);
  run_linear(&L->down, act, h, T, lora_slots, nthreads);
}

/* A decode step's n decoder layers in one call: mili_decode_layer for each in turn (the first starts the residual
 * stream), layer i's K/V pages at k_caches[i] and v_caches[i] (int8 pages: their scales at k_scales[i] and
 * v_scales[i]; NULL arrays: bf16 pages); the other arguments are every layer's. (One call a step rather than one a
 * layer: Python's 28 calls cost ~0.35 ms of a 0.6B's 14 ms 4-bit step.) */
void mili_decode_layers(const mili_layer_desc *layers, int64_t n, bf16 *h, bf16 *residual, void *const *k_caches,
                        void *const *v_caches, float *const *k_scales, float *const *v_scales, const int64_t *slots, const float *cos_t, const float *sin_t,
                        const int64_t *page_table, int64_t ldp, const int64_t *context_lens, int64_t page_size,
                        int64_t T, bf16 *work, const int64_t *lora_slots, int nthreads) {
  for (int64_t i = 0; i < n; i++)
    mili_decode_layer(&layers[i], h, residual, i == 0, k_caches[i], v_caches[i], k_scales ? k_scales[i] : NULL,
                      v_scales ? v_scales[i] : NULL, slots, cos_t, sin_t, page_table, ldp,
                      context_lens, page_size, T, work, lora_slots, nthreads);
}

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

/* ---- Gated DeltaNet: one decode step of B sequences, in place on their state slots ----------------------
 * The hybrid models' linear-attention mixer after its projections (mili/kernels/gated_delta.py is the torch
 * reference, with HF's numerics). For each sequence b (slot slots[b]; a fresh one starts from zeros):
 *  1. the depthwise causal conv over the C = 2 Hk Dk + Hv Dv channels q|k|v: the slot's last K - 1 inputs
 *     and this one, SiLU; the conv state shifts by one;
 *  2. per value head h (key head h / (Hv / Hk)): q, k L2-normalised (q scaled by 1/sqrt(Dk)),
 *     g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), then on the float32 state S [Dk, Dv]:
 *     S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
 * Two passes over S: one reads it (S^T k), one updates it and forms S^T q, where torch's ops take ~8.
 * qkv [B, ldq] and ba [B, ldba] (b | a, Hv each) and the conv states are bf16 when bf16_io, else float32;
 * in bf16 the conv output, its SiLU and beta are rounded as torch's bf16 ops round them. Dv % 16 == 0. */
static inline float io_load(const void *p, int64_t i, int bf16_io) {
  return bf16_io ? bf16_to_float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

void mili_gdn_decode(const void *qkv, int64_t ldq, const void *ba, int64_t ldba, int bf16_io, void *conv_states,
                     float *ssm_states, const int64_t *slots, const uint8_t *fresh, const float *conv_w,
                     const float *A_log, const float *dt_bias, float *out, int64_t B, int64_t Hk, int64_t Hv,
                     int64_t Dk, int64_t Dv, int64_t K, int nthreads) {
  const int64_t C = 2 * Hk * Dk + Hv * Dv, W = K - 1, rep = Hv / Hk;
  float *xs = malloc(sizeof(float) * B * C); /* the conv's output, float32 */
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * C >= 4096)
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = 0; c < C; c++) {
      const int zero = fresh && fresh[b];
      const int64_t at = (slots[b] * C + c) * W;
      const float x = io_load(qkv, b * ldq + c, bf16_io), *w = conv_w + c * K;
      float y = w[W] * x;
      for (int64_t j = 0; j < W; j++) {
        const float s = zero ? 0.0f : io_load(conv_states, at + j, bf16_io);
        y += w[j] * s;
        if (j > 0) { /* shift: the state keeps the last W inputs */
          if (bf16_io) ((bf16 *)conv_states)[at + j - 1] = zero ? 0 : ((bf16 *)conv_states)[at + j];
          else ((float *)conv_states)[at + j - 1] = s;
        }
      }
      if (W > 0) {
        if (bf16_io) ((bf16 *)conv_states)[at + W - 1] = ((const bf16 *)qkv)[b * ldq + c];
        else ((float *)conv_states)[at + W - 1] = x;
      }
      if (bf16_io) y = round_to_bf16(y);
      y = y / (1.0f + expf(-y));
      xs[b * C + c] = bf16_io ? round_to_bf16(y) : y;
    }
#pragma omp parallel for num_threads(nthreads) collapse(2) schedule(static) if (B * Hv > 1)
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hv; h++) {
      const int64_t kh = h / rep;
      const float *q = xs + b * C + kh * Dk, *k = xs + b * C + Hk * Dk + kh * Dk, *v = xs + b * C + 2 * Hk * Dk + h * Dv;
      float qn[1024], kn[1024], qq = 0.0f, kk = 0.0f;
      for (int64_t i = 0; i < Dk; i++) qq += q[i] * q[i], kk += k[i] * k[i];
      const float qs = 1.0f / sqrtf(qq + 1e-6f) / sqrtf((float)Dk), ks = 1.0f / sqrtf(kk + 1e-6f);
      for (int64_t i = 0; i < Dk; i++) qn[i] = q[i] * qs, kn[i] = k[i] * ks;
      const float a = io_load(ba, b * ldba + Hv + h, bf16_io) + dt_bias[h];
      const float softplus = a > 20.0f ? a : log1pf(expf(a));
      const float decay = expf(-expf(A_log[h]) * softplus);
      float beta = 1.0f / (1.0f + expf(-io_load(ba, b * ldba + h, bf16_io)));
      if (bf16_io) beta = round_to_bf16(beta);
      float *S = ssm_states + (slots[b] * Hv + h) * Dk * Dv, *o = out + (b * Hv + h) * Dv;
      if (fresh && fresh[b]) memset(S, 0, sizeof(float) * Dk * Dv);
      for (int64_t j = 0; j < Dv; j += 16) { /* 16 value columns at a time, both passes */
        vf mem = vf_zero(), acc = vf_zero();
        for (int64_t i = 0; i < Dk; i++) mem = vf_fmadd(vf_load(S + i * Dv + j), vf_set1(kn[i]), mem);
        const vf dec = vf_set1(decay);
        const vf delta = vf_mul(vf_sub(vf_load(v + j), vf_mul(mem, dec)), vf_set1(beta));
        for (int64_t i = 0; i < Dk; i++) {
          const vf s = vf_fmadd(vf_set1(kn[i]), delta, vf_mul(vf_load(S + i * Dv + j), dec));
          vf_store(S + i * Dv + j, s);
          acc = vf_fmadd(s, vf_set1(qn[i]), acc);
        }
        vf_store(o + j, acc);
      }
    }
  free(xs);
}
