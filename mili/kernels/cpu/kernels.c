/* MILI's CPU kernels for bf16 on x86-64 with AVX-512 (BF16 instructions on Zen 4, Cooper Lake, Sapphire Rapids
 * and later; emulated in AVX-512F on Skylake-X to Ice Lake, below);
 * the linear layers use AMX where the CPU has it (Sapphire Rapids and later).
 *
 * Built on first use by mili/kernels/cpu/__init__.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes. The library links libgomp by its soname, so it shares the OpenMP runtime torch already loaded
 * (one thread pool). Every function takes the thread count to use.
 *
 * Layouts: bf16 values are uint16_t. A linear layer's weight [N, K] is packed once as
 * [N/16][K/2][16][2]: for each block of 16 output rows, K/2 rows of 64 bytes, each holding 16 pairs of
 * consecutive k. That is exactly AMX's "B" tile layout (16 pair-rows x 16 columns x 2), so a block's
 * weights stream from memory in one sequential run, 1 KB per tile load.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16;

/* The three AVX-512 BF16 instructions the kernels use, as AVX-512F where the CPU lacks that extension
 * (Skylake-X, Cascade Lake, Ice Lake, Tiger Lake: -march=native leaves __AVX512BF16__ undefined there).
 * A bf16 is the top half of a float32, so widening is a shift; the dot product of a pair is two FMAs
 * (the odd element first, as vdpbf16ps adds them); narrowing rounds to nearest even, NaNs kept quiet.
 * The loads stay bf16, so the bytes each kernel streams, what bounds decode, are the same. */
#ifdef __AVX512BF16__
static inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
static inline __m256i narrow_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 widen_bf16(__m256i v) { return _mm512_cvtpbh_ps((__m256bh)v); }
#else
static inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}
static inline __m256i narrow_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_or_si512(x, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

static inline float bf16_to_float(bf16 v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Linux hands AMX tile state to a process only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
 * Returns 0 when granted; the linear layers then run on AMX, else on AVX-512 (mili_use_amx). */
static int use_amx = 0;
int mili_amx_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }
void mili_use_amx(int on) { use_amx = on; }
int mili_uses_amx(void) { return use_amx; }

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
    __m512 v;
    if (sx) /* int8: scale by the activation row's and the weight columns' scales */
      v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const int32_t *)c + r * 16)),
                        _mm512_mul_ps(_mm512_set1_ps(sx[r]), _mm512_loadu_ps(sw)));
    else
      v = _mm512_loadu_ps((const float *)c + r * 16);
    _mm256_storeu_si256((__m256i *)(y + r * N), narrow_bf16(v));
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

/* The same product without AMX, on AVX-512 (Zen 4, Cooper Lake, ...), over the same packed layout: one
 * 64-byte row of a block holds the 16 columns' weights for 2 consecutive k (bf16) or 4 (int8), which is
 * exactly the operand vdpbf16ps / vpdpbusd pair with one broadcast 32-bit word of x. A micro-kernel
 * keeps MR rows x NB blocks of sums in registers over the whole of K, so each weight vector loaded serves
 * MR rows and each x word NB blocks. int8: x holds q + 128 (unsigned), so sums carry 128 * colsum(W),
 * taken off with `colsum` before scaling. */
#define MR_MAX 6
#define NB_MAX 4
/* vpdpbusd is AVX-512 VNNI: enabled for these functions only, so a CPU with AVX-512 BF16 but without
 * VNNI still builds the library (its int8 layers then use aten's kernel: kernels.int8_available). */
#define VNNI __attribute__((target("avx512vnni")))
#define PF_DIST 1024 /* bytes ahead in each weight stream (M <= MR_MAX: the weights come from memory) */
VNNI static inline __attribute__((always_inline)) void avx_micro(const uint8_t *w, int64_t wblock,
                                                             const uint8_t *x, int64_t ldx, bf16 *y, float *yf,
                                                             int64_t N,
                                                             int64_t kwords, const int MR, const int NB,
                                                             const int int8, const float *sx, const float *sw,
                                                             const int32_t *colsum, int prefetch) {
  __m512 acc[MR_MAX][NB_MAX];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kwords; p++) {
    __m512i wv[NB_MAX];
    for (int j = 0; j < NB; j++) {
      const uint8_t *wp = w + j * wblock + p * 64;
      if (prefetch) _mm_prefetch((const char *)wp + PF_DIST, _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(wp);
    }
    for (int i = 0; i < MR; i++) {
      int32_t word;
      memcpy(&word, x + i * ldx + p * 4, 4);
      const __m512i xb = _mm512_set1_epi32(word);
      for (int j = 0; j < NB; j++)
        acc[i][j] = int8 ? (__m512)_mm512_dpbusd_epi32((__m512i)acc[i][j], xb, wv[j])
                         : dot_bf16_pairs(acc[i][j], xb, wv[j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) {
      __m512 v = acc[i][j];
      if (int8) {
        const __m512i c = _mm512_slli_epi32(_mm512_loadu_si512(colsum + j * 16), 7);
        v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32((__m512i)v, c)),
                          _mm512_mul_ps(_mm512_set1_ps(sx[i]), _mm512_loadu_ps(sw + j * 16)));
      }
      if (yf) _mm512_storeu_ps(yf + i * N + j * 16, v);
      else _mm256_storeu_si256((__m256i *)(y + i * N + j * 16), narrow_bf16(v));
    }
}

/* Instantiates avx_micro for every (rows, blocks) with constants, so its arrays live in registers. */
#define MICRO_NB(MR, NB) avx_micro(w, wblock, x, ldx, y, yf, N, kwords, MR, NB, int8, sx, sw, colsum, prefetch)
#define MICRO_MR(MR)                  \
  switch (nb) {                       \
    case 1: MICRO_NB(MR, 1); break;   \
    case 2: MICRO_NB(MR, 2); break;   \
    case 3: MICRO_NB(MR, 3); break;   \
    default: MICRO_NB(MR, 4); break;  \
  }
VNNI static void avx_micro_any(const uint8_t *w, int64_t wblock, const uint8_t *x, int64_t ldx, bf16 *y, float *yf, int64_t N,
                          int64_t kwords, int mr, int nb, int int8, const float *sx, const float *sw,
                          const int32_t *colsum, int prefetch) {
  switch (mr) {
    case 1: MICRO_MR(1); break;
    case 2: MICRO_MR(2); break;
    case 3: MICRO_MR(3); break;
    case 4: MICRO_MR(4); break;
    case 5: MICRO_MR(5); break;
    default: MICRO_MR(6); break;
  }
}

/* All M rows of the nb column blocks from block nb0 on, MR_MAX rows at a time: y (bf16) or yf (float32)
 * [M, .] with row stride ldy; sx, sw, colsum: int8's scales and column sums (else NULL). */
VNNI static void avx_blocks(const uint8_t *w, int64_t wblock, int64_t nb0, int nb, const uint8_t *x, int64_t ldx,
                            int64_t M, int64_t kwords, bf16 *y, float *yf, int64_t ldy, int int8, const float *sx,
                            const float *sw, const int32_t *colsum, int prefetch) {
  for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
    const int mr = M - m0 < MR_MAX ? (int)(M - m0) : MR_MAX;
    avx_micro_any(w + nb0 * wblock, wblock, x + m0 * ldx, ldx, y ? y + m0 * ldy + nb0 * 16 : NULL,
                  yf ? yf + m0 * ldy + nb0 * 16 : NULL, ldy, kwords, mr, nb, int8, sx ? sx + m0 : NULL,
                  sw ? sw + nb0 * 16 : NULL, colsum ? colsum + nb0 * 16 : NULL, prefetch);
  }
}

/* Each thread takes a contiguous run of NB_MAX-block column groups (its share of the weights, streamed
 * once when M <= MR_MAX) and all rows, MR_MAX at a time, while the group's weights sit in its L2. */
VNNI static void avx_matmul(const uint8_t *w, const uint8_t *x, bf16 *y, int64_t M, int64_t N, int64_t K, int xsize,
                            const float *sx, const float *sw, const int32_t *colsum, int nthreads) {
  const int64_t nblocks = N / 16, ngroups = (nblocks + NB_MAX - 1) / NB_MAX, ldx = K * xsize;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (ngroups > 1)
  for (int64_t g = 0; g < ngroups; g++) {
    const int64_t nb0 = g * NB_MAX;
    avx_blocks(w, 16 * ldx, nb0, nblocks - nb0 < NB_MAX ? (int)(nblocks - nb0) : NB_MAX, x, ldx, M, K * xsize / 4,
               y, NULL, N, xsize == 1, sx, sw, colsum, M <= MR_MAX);
  }
}

/* One thread's bf16 product: [M, nblocks x 16] (row stride ldy; bf16 into y, or float32 into yf) = x[M, 2 kwords]
 * (row stride ldx bytes) @ W^T, W packed as 16-column blocks of kwords 64-byte rows, wblock bytes apart. */
VNNI static void avx_gemm_serial(const uint8_t *w, int64_t wblock, int64_t nblocks, const uint8_t *x, int64_t ldx,
                                 int64_t M, int64_t kwords, bf16 *y, float *yf, int64_t ldy) {
  for (int64_t nb0 = 0; nb0 < nblocks; nb0 += NB_MAX)
    avx_blocks(w, wblock, nb0, nblocks - nb0 < NB_MAX ? (int)(nblocks - nb0) : NB_MAX, x, ldx, M, kwords, y, yf, ldy,
               0, NULL, NULL, NULL, 0);
}

/* bf16: y[M, N] = x[M, K] @ W^T, W packed [N/16][K/2][16][2]. K % 32 == 0, N % 16 == 0. */
void mili_linear(const bf16 *w, const bf16 *x, bf16 *y, int64_t M, int64_t N, int64_t K, int nthreads) {
  if (!use_amx) {
    avx_matmul((const uint8_t *)w, (const uint8_t *)x, y, M, N, K, 2, NULL, NULL, NULL, nthreads);
    return;
  }
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
}

/* n bf16 values to int8 with one symmetric scale, returned (amax / 127; q = x / scale rounded to nearest
 * even, as lrintf does in the default rounding mode): stores q + offset (128: unsigned, for vpdpbusd's first
 * operand) and the sum of q (without the offset) in *sum. Masked tails, so any n. Vectorized because the
 * scalar loop it replaced (lrintf is a libm call under -O3) cost ~4.3 ns a value against ~0.4 here, run by
 * one thread while the others waited: ~0.8 ms of a 0.6B decode step (200k values over its 112 linears). */
static inline float quantize_int8(const bf16 *x, int64_t n, int8_t *q, int offset, int32_t *sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, x + k))));
  }
  const float a = _mm512_reduce_max_ps(amax), scale = a > 0.f ? a / 127.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / scale);
  __m512i s = _mm512_setzero_si512();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = n - k >= 16 ? 0xFFFF : (__mmask16)((1u << (n - k)) - 1);
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(_mm256_maskz_loadu_epi16(m, x + k)), inv));
    s = _mm512_add_epi32(s, r);
    _mm512_mask_cvtepi32_storeu_epi8(q + k, m, _mm512_add_epi32(r, _mm512_set1_epi32(offset)));
  }
  *sum = _mm512_reduce_add_epi32(s);
  return scale;
}

/* int8 weights with one float scale per output row (sw[N]) and their column sums (colsum[N], for the
 * AVX-512 path), W packed [N/16][K/4][16][4]; x is quantized here to int8 with one scale per row
 * (symmetric, round to nearest). K % 64 == 0. */
void mili_linear_int8(const int8_t *w, const float *sw, const int32_t *colsum, const bf16 *x, bf16 *y, int64_t M,
                      int64_t N, int64_t K, int nthreads) {
  const int64_t mp = M <= 16 ? M : (M + 15) / 16 * 16;
  const int offset = use_amx ? 0 : 128; /* AVX-512's vpdpbusd takes x unsigned */
  int8_t *xq = calloc(mp * K, 1);
  float *sx = calloc(mp, sizeof(float));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
  for (int64_t m = 0; m < M; m++) {
    int32_t unused;
    sx[m] = quantize_int8(x + m * K, K, xq + m * K, offset, &unused);
  }
  if (use_amx)
    amx_matmul((const uint8_t *)w, (const uint8_t *)xq, y, M, N, K, 1, sx, sw, nthreads);
  else
    avx_matmul((const uint8_t *)w, (const uint8_t *)xq, y, M, N, K, 1, sx, sw, colsum, nthreads);
  free(xq);
  free(sx);
}

/* -- int4 weights (AWQ: 4-bit, a scale and zero point per group of input channels) --------------------------
 * W[n, k] = (q - z[n, g]) * s[n, g], g = k / group. q packed [N/16][K/8][64 bytes]: byte 4c + j of a row holds
 * column c's q at k0 + j in its low nibble and at k0 + 4 + j in its high one, so masking and shifting a
 * 64-byte load gives two of the int8 kernel's [16 columns][4 k] operands. Scales (fp16) and zero points
 * (uint8) are [N/16][G][16]. x is quantized to int8 per row and group (sx, and each group's sum xsum, which
 * takes the zero points off: sum_k x (q - z) = sum_k x q - z sum_k x); vpdpbusd takes q unsigned, x signed. */
#define I4_MR 2
VNNI static inline __attribute__((always_inline)) void int4_micro(
    const uint8_t *w, int64_t wblock, const uint16_t *ws, const uint8_t *wz, int64_t G, int64_t k8_per_group,
    const int8_t *xq, int64_t K, const float *sx, const int32_t *xsum, bf16 *y, int64_t ldy, const int MR,
    const int NB, int prefetch) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
  __m512 f[I4_MR][NB_MAX];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++) f[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    /* One row (decode): the high nibbles are used in place (16 q: masked, not shifted, one instruction less
     * a load) and summed apart, 16 times too large, which also gives each sum two independent vpdpbusd
     * chains instead of one chain of two. Two rows keep one sum each: twice the sums would not fit the
     * registers (measured slower at M = 64). */
    const int apart = MR == 1;
    __m512i acc[I4_MR][NB_MAX], acc16[I4_MR][NB_MAX];
    for (int i = 0; i < MR; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = acc16[i][j] = _mm512_setzero_si512();
    for (int64_t p = g * k8_per_group; p < (g + 1) * k8_per_group; p++) {
      __m512i lo[NB_MAX], hi[NB_MAX];
      for (int j = 0; j < NB; j++) {
        const uint8_t *wp = w + j * wblock + p * 64;
        if (prefetch) _mm_prefetch((const char *)wp + PF_DIST, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(wp);
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = apart ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int i = 0; i < MR; i++) {
        int32_t w0, w1;
        memcpy(&w0, xq + i * K + p * 8, 4);
        memcpy(&w1, xq + i * K + p * 8 + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(w0), x1 = _mm512_set1_epi32(w1);
        for (int j = 0; j < NB; j++) {
          acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lo[j], x0);
          if (apart) acc16[i][j] = _mm512_dpbusd_epi32(acc16[i][j], hi[j], x1);
          else acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], hi[j], x1);
        }
      }
    }
    for (int j = 0; j < NB; j++) {
      const int64_t at = j * G * 16 + g * 16;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + at)));
      const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wz + at)));
      for (int i = 0; i < MR; i++) {
        const __m512i sum = apart ? _mm512_add_epi32(acc[i][j], _mm512_srai_epi32(acc16[i][j], 4)) /* 16 | acc16 */
                                  : acc[i][j];
        const __m512i t = _mm512_sub_epi32(sum, _mm512_mullo_epi32(z, _mm512_set1_epi32(xsum[i * G + g])));
        f[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, _mm512_set1_ps(sx[i * G + g])), f[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NB; j++)
      _mm256_storeu_si256((__m256i *)(y + i * ldy + j * 16), narrow_bf16(f[i][j]));
}

#define I4_NB(MR, NB) \
  int4_micro(w, wblock, ws, wz, G, k8g, xq, K, sx, xsum, y, ldy, MR, NB, prefetch)
#define I4_MR_CASE(MR)               \
  switch (nb) {                      \
    case 1: I4_NB(MR, 1); break;     \
    case 2: I4_NB(MR, 2); break;     \
    case 3: I4_NB(MR, 3); break;     \
    default: I4_NB(MR, 4); break;    \
  }
VNNI static void int4_micro_any(const uint8_t *w, int64_t wblock, const uint16_t *ws, const uint8_t *wz, int64_t G,
                                int64_t k8g, const int8_t *xq, int64_t K, const float *sx, const int32_t *xsum,
                                bf16 *y, int64_t ldy, int mr, int nb, int prefetch) {
  if (mr == 1) {
    I4_MR_CASE(1);
  } else {
    I4_MR_CASE(2);
  }
}

/* y[M, N] = x[M, K] @ W^T for int4 W (layout above). N % 16 == 0, K % group == 0, group % 8 == 0. */
void mili_linear_int4(const uint8_t *w, const uint16_t *ws, const uint8_t *wz, const bf16 *x, bf16 *y, int64_t M,
                      int64_t N, int64_t K, int64_t group, int nthreads) {
  const int64_t G = K / group, nblocks = N / 16, ngroups = (nblocks + NB_MAX - 1) / NB_MAX, wblock = K * 8;
  int8_t *xq = malloc(M * K);
  float *sx = malloc(M * G * sizeof(float));
  int32_t *xsum = malloc(M * G * sizeof(int32_t));
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
  for (int64_t r = 0; r < M * G; r++) { /* one group of one row */
    const int64_t at = (r / G) * K + (r % G) * group;
    sx[r] = quantize_int8(x + at, group, xq + at, 0, xsum + r);
  }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (ngroups > 1)
  for (int64_t c = 0; c < ngroups; c++) {
    const int64_t nb0 = c * NB_MAX;
    const int nb = nblocks - nb0 < NB_MAX ? (int)(nblocks - nb0) : NB_MAX;
    for (int64_t m0 = 0; m0 < M; m0 += I4_MR) {
      const int mr = M - m0 < I4_MR ? (int)(M - m0) : I4_MR;
      int4_micro_any(w + nb0 * wblock, wblock, ws + nb0 * G * 16, wz + nb0 * G * 16, G, group / 8, xq + m0 * K, K,
                     sx + m0 * G, xsum + m0 * G, y + m0 * N + nb0 * 16, N, mr, nb, M <= 8);
    }
  }
  free(xq);
  free(sx);
  free(xsum);
}

/* exp(x): x = n ln2 + r, 2^n exactly by scalef, e^r by its Taylor series to r^6 (|r| <= ln2/2:
 * relative error ~1e-7); below -87 it gives ~0, above ~88 infinity. */
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 load_bf16x16(const bf16 *p) {
  return widen_bf16(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m256i to_bf16x16(__m512 v) { return narrow_bf16(v); } /* nearest even */

static inline __m512 round_bf16(__m512 v) { return widen_bf16(to_bf16x16(v)); }

/* One row of RMSNorm as torch rounds it: out = bf16(w * bf16(s / sqrt(mean(s^2) + eps))). D % 16 == 0. */
static inline void rms_norm_row(const bf16 *s, const bf16 *w, bf16 *out, int64_t D, float eps) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 v = load_bf16x16(s + i);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)D + eps));
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16x16(s + i), inv));
    _mm256_storeu_si256((__m256i *)(out + i), to_bf16x16(_mm512_mul_ps(load_bf16x16(w + i), normed)));
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
        _mm256_storeu_si256((__m256i *)(res_out + t * D + i),
                            to_bf16x16(_mm512_add_ps(load_bf16x16(src + i), load_bf16x16(residual + t * D + i))));
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
        const __m512 lo = load_bf16x16(normed + i), hi = load_bf16x16(normed + half + i);
        _mm256_storeu_si256((__m256i *)(head + i), to_bf16x16(_mm512_fnmadd_ps(
            hi, _mm512_loadu_ps(s + i), _mm512_mul_ps(lo, _mm512_loadu_ps(c + i)))));
        _mm256_storeu_si256((__m256i *)(head + half + i), to_bf16x16(_mm512_fmadd_ps(
            lo, _mm512_loadu_ps(s + half + i), _mm512_mul_ps(hi, _mm512_loadu_ps(c + half + i)))));
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
      const __m512 g = load_bf16x16(gate_up + t * 2 * I + i), u = load_bf16x16(gate_up + t * 2 * I + I + i);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      _mm256_storeu_si256((__m256i *)(out + t * I + i), to_bf16x16(_mm512_mul_ps(round_bf16(silu), u)));
    }
}

/* dst[i] = bf16(src[i] * scale), i < n (the last partial vector masked). */
static void to_bf16_row(const float *src, float scale, int64_t n, bf16 *dst) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(src + i), s)));
  if (n - i) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, to_bf16x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), s)));
  }
}

/* Softmax numerator in place: s[i] = exp(s[i] - max); returns the sum. */
static float exp_shifted(float *s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + i));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), top));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

/* K/V rows are scattered over pages (one head's row, then the other heads' rows): fetch ahead. */
static inline void prefetch_row(const bf16 *row, int64_t n, int hint) {
  for (int64_t c = 0; c < n; c += 32)
    if (hint == 0) _mm_prefetch((const char *)(row + c), _MM_HINT_T0);
    else _mm_prefetch((const char *)(row + c), _MM_HINT_T1);
}

/* o[g] = bf16(inv[g] * sum_p w[g][p] V[p]) for the G heads of a group (o[g] at o + g * D), over NC chunks
 * of 32 values of the V rows at v + offset[p]. Two positions at a time: their rows interleaved by
 * vpunpck{l,h}wd are vdpbf16ps operands against the broadcast bf16 pair (w[g][p], w[g][p + 1]) (wb[g]:
 * the weights in bf16, as 32-bit pairs), so one instruction takes 32 multiply-adds where widening V to
 * float32 took 16 and two conversions; each V row is loaded once for all G heads. Lane i of the "lo" sums
 * holds value 8 (i / 4) + i % 4 of its chunk, of the "hi" sums 4 more: the final permutes put them in
 * order. G and NC are constants at each call (the loops unroll, the 2 x NC x G sums stay in registers). */
static inline __attribute__((always_inline)) void pv_slice(const bf16 *v, const int64_t *offset,
                                                           const uint32_t *wb, int64_t npairs, int64_t ctx,
                                                           const int G, const int NC, const float *inv, bf16 *o,
                                                           int64_t D) {
  __m512 lo[16], hi[16];
  for (int i = 0; i < G * NC; i++) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < npairs; j++) {
    const bf16 *ra = v + offset[2 * j], *rb = 2 * j + 1 < ctx ? v + offset[2 * j + 1] : ra; /* (weight 0) */
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
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; g++)
    for (int c = 0; c < NC; c++) {
      const __m512 scale = _mm512_set1_ps(inv[g]), l = lo[g * NC + c], h = hi[g * NC + c];
      _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c), to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(l, first, h), scale)));
      _mm256_storeu_si256((__m256i *)(o + g * D + 32 * c + 16), to_bf16x16(_mm512_mul_ps(_mm512_permutex2var_ps(l, second, h), scale)));
    }
}

/* The weighted sums of V for the G heads of a group, w [G][ctx] float32 (unnormalized; inv[g] the
 * reciprocal of each head's sum): the weights rounded to bf16 once (as torch's CPU flash attention
 * multiplies P), then slices of NC x 32 values with G x NC <= 8, or one head and 32 values at a time for
 * other group sizes. D % 32 == 0. */
static void pv_all(const bf16 *v, const int64_t *offset, const float *w, int64_t ctx, int64_t G, int64_t D,
                   const float *inv, bf16 *o) {
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
        __m512 s = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 32)
          s = dot_bf16_pairs(s, _mm512_loadu_si512(qh + g * D + c), _mm512_loadu_si512(kr + c));
        scores[g * ctx + p] = _mm512_reduce_add_ps(s) * scale;
      }
    }
    for (int64_t g = 0; g < group; g++) inv[g] = 1.0f / exp_shifted(scores + g * ctx, ctx);
    pv_all(v_cache, offset, scores, ctx, group, D, inv, out + (b * Hq + h * group) * D);
    free(scores);
    free(offset);
  }
}

/* Causal attention of one sequence's prefill chunk: q [Lq, Hq, D] (token stride ldq) are the last Lq of the
 * Lk positions whose K/V are k, v [Lk, Hkv, D] (token strides ldk, ldv); out [Lq, Hq, D] (stride ldo).
 * Both products run on the linear layers' AVX-512 micro-kernel: each head's K is packed as a weight
 * [Lk, D] (scores = Q K^T), its V^T as a weight [D, Lk] (out = P V, P the softmax in bf16, as torch's CPU
 * flash attention also multiplies it). One task per (kv head, 16 queries): its group's G x 16 query rows
 * share every packed K and V row, and only the key blocks the causal mask leaves are computed.
 * D % 32 == 0. */
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
      avx_gemm_serial((const uint8_t *)(kp + h * Lkp * D), D * 32, width / 16, (const uint8_t *)xq, D * 2, rows,
                      D / 2, NULL, sc, width);
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
        avx_gemm_serial((const uint8_t *)(vp + h * D * Lkp), Lkp * 32, D / 16, (const uint8_t *)(pr + g * n * width),
                        width * 2, n, width / 2, out + i0 * ldo + (h * G + g) * D, NULL, ldo);
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
typedef struct {
  const void *w;       /* packed weight */
  const void *scales;  /* int8: float per output column; int4: fp16 per column and group; bf16: NULL */
  const void *aux;     /* int8: column sums (int32); int4: zero points (uint8) */
  int64_t n, k; /* output (a multiple of 16: no padding) and input features */
  int64_t group; /* int4: input features per scale, else 0 */
} mili_linear_desc;

typedef struct {
  int64_t hidden, q_heads, kv_heads, head_dim, inter;
  float eps, scale; /* RMSNorm's epsilon; attention's softmax scale */
  const bf16 *input_norm, *post_norm, *q_norm, *k_norm;
  mili_linear_desc qkv, o, gate_up, down;
} mili_layer_desc;

static void run_linear(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int nthreads) {
  if (l->group) mili_linear_int4(l->w, l->scales, l->aux, x, y, M, l->n, l->k, l->group, nthreads);
  else if (l->scales) mili_linear_int8(l->w, l->scales, l->aux, x, y, M, l->n, l->k, nthreads);
  else mili_linear(l->w, x, y, M, l->n, l->k, nthreads);
}

/* T decode tokens, one per sequence. h [T, hidden] in: the layer's input; out: its MLP output (in place).
 * residual [T, hidden]: the residual stream in and out (in place); with first != 0 there is none yet and
 * h is the stream. slots [T]: where each token's K/V go (< 0: skipped). cos/sin [T, head_dim] float32.
 * work: T x (hidden + qkv.n + q_heads x head_dim + hidden + gate_up.n + inter) bf16. */
void mili_decode_layer(const mili_layer_desc *L, bf16 *h, bf16 *residual, int first, bf16 *k_cache, bf16 *v_cache,
                       const int64_t *slots, const float *cos_t, const float *sin_t, const int64_t *page_table,
                       int64_t ldp, const int64_t *context_lens, int64_t page_size, int64_t T, bf16 *work,
                       int nthreads) {
  const int64_t H = L->hidden, D = L->head_dim, Hq = L->q_heads, Hkv = L->kv_heads, nqkv = L->qkv.n;
  bf16 *normed = work, *qkv = normed + T * H, *attn = qkv + T * nqkv, *o = attn + T * Hq * D;
  bf16 *gate_up = o + T * H, *act = gate_up + T * L->gate_up.n;
  if (first) { /* the stream starts as the embeddings */
    memcpy(residual, h, sizeof(bf16) * T * H);
    mili_rms_norm(h, H, NULL, L->input_norm, normed, NULL, T, H, L->eps, nthreads);
  } else {
    mili_rms_norm(h, H, residual, L->input_norm, normed, residual, T, H, L->eps, nthreads);
  }
  run_linear(&L->qkv, normed, qkv, T, nthreads);
  mili_qk_norm_rope(qkv, nqkv, T, Hq, Hkv, D, L->q_norm, L->k_norm, L->eps, cos_t, sin_t, nthreads);
  mili_store_kv(qkv + Hq * D, nqkv, qkv + (Hq + Hkv) * D, nqkv, k_cache, v_cache, slots, T, Hkv, D, page_size);
  mili_decode_attention(qkv, nqkv, k_cache, v_cache, page_table, ldp, context_lens, attn, T, Hq, Hkv, D, page_size,
                        L->scale, nthreads);
  run_linear(&L->o, attn, o, T, nthreads);
  mili_rms_norm(o, H, residual, L->post_norm, normed, residual, T, H, L->eps, nthreads);
  run_linear(&L->gate_up, normed, gate_up, T, nthreads);
  mili_silu_and_mul(gate_up, act, T, L->inter, nthreads);
  run_linear(&L->down, act, h, T, nthreads);
}

/* out[r] = the first index of the largest of the N bf16 values of row r (rows at stride ld): greedy
 * sampling straight from the lm_head's output, where torch's argmax over a float32 copy of a batch of
 * 152k-wide rows took several ms. Each lane keeps its first maximum; the lanes' maxima then the
 * smallest index among them. */
void mili_argmax_rows(const bf16 *x, int64_t ld, int64_t R, int64_t N, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1)
  for (int64_t r = 0; r < R; r++) {
    const bf16 *row = x + r * ld;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_i = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 m = N - i >= 16 ? 0xffff : (__mmask16)((1u << (N - i)) - 1);
      const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m,
                                          widen_bf16(_mm256_maskz_loadu_epi16(m, row + i)));
      /* greater, or NaN (torch's argmax takes the first NaN as the largest): lanes already at NaN stay */
      const __mmask16 settled = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_mask_cmp_ps_mask((__mmask16)~settled, v, best, _CMP_NLE_UQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    const __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at_top = nan ? nan : _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    out[r] = _mm512_mask_reduce_min_epi32(at_top, best_i);
  }
}

/* Structured outputs: logits[rows[j], t] = -inf for every token t whose bit is 0 in row rows[j] of an
 * xgrammar bitmask (int32 words, bit b of word w = token 32 w + b; rows at stride ldm, logits at ld,
 * V tokens). A word of all ones (the common case inside a JSON string) is skipped; the rest are two
 * masked 16-lane stores. */
void mili_apply_bitmask(float *logits, int64_t ld, const int32_t *bitmask, int64_t ldm, const int64_t *rows,
                        int64_t nrows, int64_t V, int nthreads) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nrows > 1)
  for (int64_t j = 0; j < nrows; j++) {
    float *row = logits + rows[j] * ld;
    const uint32_t *words = (const uint32_t *)(bitmask + rows[j] * ldm);
    for (int64_t w = 0; w * 32 < V; w++) {
      uint32_t drop = ~words[w];
      const int64_t left = V - w * 32;
      if (left < 32) drop &= (uint32_t)((1ull << left) - 1);
      if (!drop) continue;
      _mm512_mask_storeu_ps(row + w * 32, (__mmask16)(drop & 0xffff), neg_inf);
      _mm512_mask_storeu_ps(row + w * 32 + 16, (__mmask16)(drop >> 16), neg_inf);
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

static inline float round_to_bf16(float f) { /* nearest even, as torch rounds */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  memcpy(&f, &u, 4);
  return f;
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
        __m512 mem = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; i++) mem = _mm512_fmadd_ps(_mm512_loadu_ps(S + i * Dv + j), _mm512_set1_ps(kn[i]), mem);
        const __m512 dec = _mm512_set1_ps(decay);
        const __m512 delta = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + j), _mm512_mul_ps(mem, dec)),
                                           _mm512_set1_ps(beta));
        for (int64_t i = 0; i < Dk; i++) {
          const __m512 s = _mm512_fmadd_ps(_mm512_set1_ps(kn[i]), delta, _mm512_mul_ps(_mm512_loadu_ps(S + i * Dv + j), dec));
          _mm512_storeu_ps(S + i * Dv + j, s);
          acc = _mm512_fmadd_ps(s, _mm512_set1_ps(qn[i]), acc);
        }
        _mm512_storeu_ps(o + j, acc);
      }
    }
  free(xs);
}
