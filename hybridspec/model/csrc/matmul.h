/* The block kernel's packed matrices (matmul.c's layout), shared by the files that read them:
 * matmul.c (the matmul), tiles.c (packing, rows read back) and layer.c (fused layers). */
#ifndef HS_MATMUL_H
#define HS_MATMUL_H
#include <stdint.h>
#include <stddef.h>

#include "fastmath.h"
#include "scratch.h"

#define GS 32     /* columns per group: one 8-bit activation scale each */
#define ROWS 16   /* rows of W per tile: one 512-bit vector of int32 lanes, or two 256-bit ones */
#define QUADS (GS / 4)
#define QB (ROWS * 4) /* bytes of one quad of columns for a tile's rows */
#define SUPER 8       /* groups of 32 per super-block (256 columns) */

enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SILU_MUL = 2 };

/* Per-sub-group factors (scales or offsets) of one matrix: float32 ``f``, float16 ``h``, or
 * int8 ``step`` times float32 ``super`` per super-block of 8 groups; all NULL: none (zero).
 * Pointers start at one tile's (``tile_factors``) or at the matrix's. */
typedef struct {
    const float *f;
    const uint16_t *h;
    const int8_t *step;
    const float *super;
} factors_t;

/* One packed matrix as the kernel reads it: hs_pack's codes, its scales and offsets, bits,
 * group, and its shape N x K. Built once per matrix by the caller
 * (``hybridspec.model.qgemm.QWeight``), so that a call passes one pointer for all of it. */
typedef struct {
    const uint8_t *packed;
    factors_t scales;
    factors_t offsets;
    int32_t bits;
    int32_t group;
    int64_t N;
    int64_t K;
} qweight_t;

static inline int has_factors(factors_t w) { return w.f || w.h || w.step; }

/* The factor of row r at ``at`` (of [G, S, 16]) in group g: exact, as float32 products are. */
static inline float factor_at(factors_t w, int64_t at, int64_t g, int r) {
    if (w.f) return w.f[at];
    if (w.h) return f16_to_f32(w.h[at]);
    if (w.step) return (float)w.step[at] * w.super[(g / SUPER) * ROWS + r];
    return 0.0f;
}

/* The factors of one tile (of G groups, S sub-groups each). */
static inline factors_t tile_factors(factors_t w, int64_t tile, int64_t G, int64_t S) {
    int64_t sb = tile * G * S * ROWS, supers = (G + SUPER - 1) / SUPER;
    factors_t t = {w.f ? w.f + sb : NULL, w.h ? w.h + sb : NULL, w.step ? w.step + sb : NULL,
                   w.step ? w.super + tile * supers * ROWS : NULL};
    return t;
}

/* Bytes of packed codes per tile and group. */
static inline int64_t tile_bytes(int bits) {
    return bits == 8 ? QUADS * QB : QUADS / 2 * QB * bits / 4;
}

/* The code at quad u, row r, byte e of one tile's group (``src``), as the kernel multiplies it:
 * 0..15 (4 bits), c + 32 (6 bits: 0..63), c + 128 (8 bits: 0..255). */
static inline int code_at(const uint8_t *src, int bits, int u, int64_t r, int e) {
    if (bits == 8) return src[u * QB + r * 4 + e];
    int c = (src[(u % 4) * QB + r * 4 + e] >> (4 * (u / 4))) & 15;
    if (bits == 6) c |= ((src[(4 + u / 4) * QB + r * 4 + e] >> (2 * (u % 4))) & 3) << 4;
    return c;
}

/* The integer the kernel subtracts per code, times the sum of q: 32 (6 bits), 128 (8 bits). */
static inline int code_zero(int bits) { return bits == 8 ? 128 : (bits == 6 ? 32 : 0); }

/* Scratch bytes ``matmul_run`` takes for T rows of activations against ``w``. */
__attribute__((visibility("hidden"))) int64_t matmul_scratch(const qweight_t *w, int64_t T);

/* y [T, N] = prologue(x) @ W.T (+ residual), with ``matmul_scratch`` bytes at ``scratch``
 * (matmul.c). */
__attribute__((visibility("hidden"))) void matmul_run(const qweight_t *w, const void *x,
                                                      int x_f32, int64_t T, int prologue,
                                                      const uint16_t *norm_w, float eps,
                                                      const uint16_t *residual, uint16_t *y,
                                                      uint8_t *scratch);

#endif
