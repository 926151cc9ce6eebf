/* MILI's CPU kernels: one library over a thin per-ISA layer, its kernel families in files of their own, compiled as
 * one unit (this file includes them: their static helpers are shared, and each ISA's build is one compile).
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
 * Everything else is written once, in the families' files:
 *  - common.h: the ABI (mili_kernels.h), bf16 helpers, the generic vector helpers, exp, prefetch;
 *  - linear.c: the linear layers (bf16 on the micro-kernel or AMX tiles; int8; int4 and int8g in groups);
 *  - norms.c: RMSNorm, q/k-norm + RoPE, SwiGLU;
 *  - attention.c: decode and prefill attention over bf16 pages, the KV store;
 *  - kv_int8.c: the int8 pages (--kv-cache-dtype int8): store, gather, decode attention;
 *  - lora.c: LoRA adapters' products; decode_layer.c: a decode step's decoder layers in one call;
 *  - sampling.c: argmax, the grammar bitmask; gdn.c: Gated DeltaNet's decode step.
 * The ABI (every exported function and descriptor) is written once, in mili_kernels.h, which the Python side parses
 * (mili/kernels/cpu/abi.py) for its ctypes types.
 *
 * Layouts: bf16 values are uint16_t. A linear layer's weight [N, K] is packed once as [N/16][K/2][16][2]:
 * for each block of 16 output rows, K/2 rows of 64 bytes, each holding 16 pairs of consecutive k (int8:
 * [N/16][K/4][16][4]). That is exactly AMX's "B" tile layout (16 pair-rows x 16 columns x 2), so a block's
 * weights stream from memory in one sequential run, and the same bytes serve every ISA.
 */
#include "common.h"
#include "linear.c"
#include "norms.c"
#include "attention.c"
#include "kv_int8.c"
#include "lora.c"
#include "decode_layer.c"
#include "sampling.c"
#include "gdn.c"
