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

/* y[M, N] = x[M, K] @ W^T for int8 weights (l: N = n, K = k; w) with one float scale per output row (scales: sw[N])
 * and their column sums (aux: colsum[N], for the ISAs whose dot product takes x unsigned), W packed
 * [N/16][K/4][16][4]; x is quantized here to int8 with one scale per row (symmetric, round to nearest).
 * K % 64 == 0. l's group and after are not read. */
void mili_linear_int8(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int nthreads) {
  const int8_t *w = l->w;
  const float *sw = l->scales;
  const int32_t *colsum = l->aux;
  const int64_t N = l->n, K = l->k;
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

/* The int4 and int8g kernels' one driver: y[M, l->n] (rows ldy apart) = x[M, l->k] @ W^T, W int8g (int8g 1; 2: signed
 * with offsets) or int4 with high_bits (0, 1 or 2), scales and offsets (aux NULL: none) in the form scale_mode
 * (SCALES_K: sub groups a super-block). x is quantized per row and group once; few rows go to grouped_streams. */
static void grouped_linear(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t ldy, int64_t M, int int8g,
                           int high_bits, int nthreads) {
  const uint8_t *w = l->w;
  const void *ws = l->scales, *wb = l->aux;
  const int64_t N = l->n, K = l->k, group = l->group, sub = l->sub;
  const int scale_mode = (int)l->scale_mode;
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

/* y[M, N] (rows ldy apart) = x[M, K] @ W^T for int4 W (l: N = n, K = k; the layout above; high_bits 0, 1 or 2; aux
 * NULL: symmetric, w = s (q - 8 << high_bits)), scales and offsets in the form scale_mode (SCALES_K: sub groups a
 * super-block). N % 16 == 0, K % group == 0, group % 8 == 0 (with high bits K % 32 == 0); SCALES_K: (K / group) % sub
 * == 0. l's int8g, next and lora are not read. */
void mili_linear_int4(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int64_t ldy, int nthreads) {
  grouped_linear(l, x, y, ldy, M, 0, (int)l->high_bits, nthreads);
}

/* y[M, N] (rows ldy apart) = x[M, K] @ W^T for int8g W (l: N = n, K = k; the layout above; aux NULL: symmetric,
 * w = s (u - 128); with aux w = s u + b, or with int8g 2 (signed) s (u - 128) + b), scales and offsets as
 * mili_linear_int4's. N % 16 == 0, K % group == 0, group % 8 == 0; SCALES_K: (K / group) % sub == 0. l's high_bits,
 * next and lora are not read. */
void mili_linear_int8g(const mili_linear_desc *l, const bf16 *x, bf16 *y, int64_t M, int64_t ldy, int nthreads) {
  grouped_linear(l, x, y, ldy, M, l->int8g == 2 ? 2 : 1, 0, nthreads);
}
