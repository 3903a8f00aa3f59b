/* The block kernel's tiles (matmul.h): codes packed into them (``hs_pack``), and rows read back
 * out of them (``hs_dequant_rows``: an embedding lookup from a tied packed matrix). */
#include <stdint.h>
#include <string.h>

#include "matmul.h"

/* The packed layout (matmul.c) of codes [N, K] as ``quant`` keeps them: 4 bits two a byte in
 * column order (low nibble first), 8 bits one a byte (int8); bits 6: int8 codes -32..31 held
 * in 6 bits, c + 32, as a 4-bit tile followed by 2 vectors of the high 2 bits (quads u of
 * 4 (u / 4) + i at bits 2 i). out: [ceil(N / 16), G, tile_bytes]; rows past N are zero. The
 * scales and offsets are laid out by the caller. */
void hs_pack(const uint8_t *codes, int bits, int64_t N, int64_t K, uint8_t *out) {
    int64_t G = K / GS, tb = tile_bytes(bits);
    memset(out, 0, (size_t)(((N + ROWS - 1) / ROWS) * G * tb));
    for (int64_t n = 0; n < N; n++) {
        int64_t tile = n / ROWS, r = n % ROWS;
        for (int64_t g = 0; g < G; g++) {
            uint8_t *dst = out + (tile * G + g) * tb;
            for (int j = 0; j < GS; j++) {
                int64_t k = g * GS + j;
                int u = j / 4, e = j % 4;
                if (bits == 4) {
                    uint8_t c = (codes[n * (K / 2) + k / 2] >> (4 * (k % 2))) & 15;
                    dst[(u % 4) * QB + r * 4 + e] |= (uint8_t)(c << (4 * (u / 4)));
                } else if (bits == 6) { /* int8 codes -32..31 as c + 32: 4 low bits, 2 high */
                    uint8_t c = (uint8_t)((int8_t)codes[n * K + k] + 32);
                    dst[(u % 4) * QB + r * 4 + e] |= (uint8_t)((c & 15) << (4 * (u / 4)));
                    dst[(4 + u / 4) * QB + r * 4 + e] |= (uint8_t)((c >> 4) << (2 * (u % 4)));
                } else {
                    dst[u * QB + r * 4 + e] = codes[n * K + k] ^ 0x80; /* c + 128 */
                }
            }
        }
    }
}

/* Rows ``index`` of the packed matrix dequantized to bfloat16 (an embedding lookup):
 * W[n, 32 g + j] = d c + m in float32, rounded once. */
void hs_dequant_rows(const uint8_t *packed, const float *scales, const uint16_t *scales_f16,
                     const int8_t *scale_steps, const float *scale_super, const float *offsets,
                     const uint16_t *offsets_f16, const int8_t *offset_steps,
                     const float *offset_super, int bits, int group, int64_t K,
                     const int64_t *index, int64_t count, uint16_t *out) {
    int64_t G = K / GS, S = GS / group, tb = tile_bytes(bits);
    factors_t dw = {scales, scales_f16, scale_steps, scale_super};
    factors_t mw = {offsets, offsets_f16, offset_steps, offset_super};
    int offset = has_factors(mw);
    for (int64_t i = 0; i < count; i++) {
        int64_t n = index[i], tile = n / ROWS, r = n % ROWS;
        factors_t td = tile_factors(dw, tile, G, S), tm = tile_factors(mw, tile, G, S);
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *src = packed + (tile * G + g) * tb;
            for (int j = 0; j < GS; j++) {
                int64_t at = (g * S + j / group) * ROWS + r;
                float d = factor_at(td, at, g, (int)r), m = factor_at(tm, at, g, (int)r);
                int u = j / 4, e = j % 4;
                float c = (float)(code_at(src, bits, u, r, e) - code_zero(bits));
                out[i * K + g * GS + j] = f32_to_bf16(offset ? fmaf(d, c, m) : d * c);
            }
        }
    }
}
