/* A GGUF row decoded the way ``hybridspec.model.gguf_blocks`` decodes it (csrc/pack.c): codes,
 * and float32 scales and offsets computed with the same float32 operations. Static functions for
 * pack.c, the one file that includes it. */
#ifndef HS_GGUF_DECODE_H
#define HS_GGUF_DECODE_H
#include <stdint.h>
#include <string.h>

#define QK_K 256

/* GGUF types (ggml's numbering), the ones decoded here. */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14 };


static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}


/* Values per block, bytes per block, group, whether the type has offsets; 0 for a type not
 * decoded here (then 32, 0, 32, 0: sizes no caller reads, callers check the type first). */
static int type_info(int type, int *per, int *bytes, int *group, int *offsets) {
    *per = 32, *bytes = 0, *group = 32, *offsets = 0;
    static const int table[][5] = {
        {T_Q4_0, 32, 18, 32, 1},   {T_Q4_1, 32, 20, 32, 1},   {T_Q5_0, 32, 22, 32, 0},
        {T_Q5_1, 32, 24, 32, 1},   {T_Q2_K, QK_K, 84, 16, 1}, {T_Q3_K, QK_K, 110, 16, 1},
        {T_Q4_K, QK_K, 144, 32, 1}, {T_Q5_K, QK_K, 176, 32, 1}, {T_Q6_K, QK_K, 210, 16, 0}};
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (table[i][0] == type) {
            *per = table[i][1], *bytes = table[i][2], *group = table[i][3], *offsets = table[i][4];
            return 1;
        }
    return 0;
}


/* Q4_K / Q5_K's 6-bit sub-block scales and mins (gguf_blocks._k_scale_min). */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 0x3f, *mn = s[4 + j] & 0x3f;
    } else {
        *sc = (s[8 + j - 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
    }
}

/* The decoders below write each code plus ``bias`` (0, or 32 for a 6-bit tile, whose bytes
 * hold c + 32) as uint8, and the block's float32 scales and offsets, computed as gguf_blocks
 * computes them. The K-quants' also write each scale's and offset's integer multiplier of the
 * block's float16 factor (``ks``, ``ko``: scale = base[0] ks, offset = base[1] ko, exactly,
 * since a float16 times an integer of at most 8 bits fits float32's 24 bits), which spares
 * pack.c's factoring a division per value. */

/* One block of 32 (Q4_0, Q4_1, Q5_0, Q5_1). */
static void block32(int type, const uint8_t *b, int bias, uint8_t *c, float *sc, float *off) {
    int five = type == T_Q5_0 || type == T_Q5_1;
    int lead = type == T_Q4_0 ? 2 : type == T_Q5_0 ? 6 : type == T_Q4_1 ? 4 : 8;
    uint8_t shift = (uint8_t)(bias - (type == T_Q5_0 ? 16 : 0));
    uint32_t qh = 0;
    if (five) memcpy(&qh, b + lead - 4, 4);
    for (int j = 0; j < 16; j++) {
        c[j] = (uint8_t)((b[lead + j] & 15) + shift);
        c[j + 16] = (uint8_t)((b[lead + j] >> 4) + shift);
    }
    if (five)
        for (int j = 0; j < 32; j++) c[j] = (uint8_t)(c[j] + (((qh >> j) & 1) << 4));
    sc[0] = half_to_float(b);
    off[0] = type == T_Q4_0 ? sc[0] * -8.0f
             : (type == T_Q4_1 || type == T_Q5_1) ? half_to_float(b + 2)
                                                  : 0.0f;
}

static void block_q2_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off, float *base,
                       int16_t *ks, int16_t *ko) {
    float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    base[0] = d, base[1] = dmin;
    for (int i = 0; i < 2; i++) /* runs of 32 bytes, shifts 0, 2, 4, 6 */
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++)
                c[i * 128 + s * 32 + j] = (uint8_t)(((b[16 + i * 32 + j] >> (2 * s)) & 3) + bias);
    for (int j = 0; j < 16; j++) {
        ks[j] = (int16_t)(b[j] & 0x0f), ko[j] = (int16_t)-(b[j] >> 4);
        sc[j] = d * (float)(b[j] & 0x0f);
        off[j] = -(dmin * (float)(b[j] >> 4));
    }
}

static void block_q3_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off, float *base,
                       int16_t *ks, int16_t *ko) {
    const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
    float d = half_to_float(b + 108);
    base[0] = d, base[1] = d;
    for (int j = 0; j < 16; j++) {
        int low = (packed[j % 8] >> (4 * (j / 8))) & 15;
        int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        int k = (int8_t)(low | (high << 4)) - 32;
        ks[j] = (int16_t)k, ko[j] = (int16_t)(-4 * k);
        sc[j] = d * (float)k;
        off[j] = sc[j] * -4.0f;
    }
    for (int i = 0; i < 2; i++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) {
                int ql = (qs[i * 32 + j] >> (2 * s)) & 3, qh = (hmask[j] >> (i * 4 + s)) & 1;
                c[i * 128 + s * 32 + j] = (uint8_t)((ql | (qh << 2)) + bias);
            }
}

static void block_q45_k(int type, const uint8_t *b, int bias, uint8_t *c, float *sc, float *off,
                        float *base, int16_t *ks, int16_t *ko) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    base[0] = d, base[1] = dmin;
    const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16), *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        int s, m;
        k_scale_min(b + 4, j, &s, &m);
        ks[j] = (int16_t)s, ko[j] = (int16_t)-m;
        sc[j] = d * (float)s;
        off[j] = -(dmin * (float)m);
    }
    for (int i = 0; i < 4; i++) /* runs of 32 bytes, low nibbles then high */
        for (int j = 0; j < 32; j++) {
            c[i * 64 + j] = (uint8_t)((qs[i * 32 + j] & 15) + bias);
            c[i * 64 + 32 + j] = (uint8_t)((qs[i * 32 + j] >> 4) + bias);
        }
    if (type == T_Q5_K)
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 32; j++)
                c[i * 32 + j] = (uint8_t)(c[i * 32 + j] + (((qh[j] >> i) & 1) << 4));
}

static void block_q6_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off, float *base,
                       int16_t *ks, int16_t *ko) {
    float d = half_to_float(b + 208);
    base[0] = d, base[1] = 0.0f;
    uint8_t shift = (uint8_t)(bias - 32);
    for (int i = 0; i < 2; i++) /* column i 128 + s 32 + j: nibble s / 2, high bits 2 s */
        for (int s = 0; s < 4; s++) {
            const uint8_t *ql = b + i * 64 + (s % 2) * 32, *qh = b + 128 + i * 32;
            uint8_t *out = c + i * 128 + s * 32;
            int low = 4 * (s / 2), high = 2 * s;
            for (int j = 0; j < 32; j++)
                out[j] = (uint8_t)((((ql[j] >> low) & 15) | (((qh[j] >> high) & 3) << 4)) + shift);
        }
    for (int j = 0; j < 16; j++) {
        ks[j] = (int8_t)b[192 + j], ko[j] = 0;
        sc[j] = d * (float)(int8_t)b[192 + j];
        off[j] = 0.0f;
    }
}

/* One row of ``type``: codes c[K] (plus ``bias``), scales and offsets per sub-group of
 * ``group`` (the matrix's, at most the type's: each of the type's repeated) with their integer
 * multipliers ``ks``, ``ko`` (0 for the blocks of 32) and, for a K-quant, each block's float16
 * factors of its scales and offsets (base[2 b], base[2 b + 1]; 0 for the blocks of 32, whose
 * runs of 256 columns span 8 blocks). */
static void decode_row(int type, const uint8_t *row, int64_t K, int group, int bias, uint8_t *c,
                       float *sc, float *off, float *base, int16_t *ks, int16_t *ko) {
    int per, bytes, tgroup, has_off;
    type_info(type, &per, &bytes, &tgroup, &has_off);
    float bsc[16], boff[16];
    int16_t bks[16] = {0}, bko[16] = {0};
    int rep = tgroup / group, nsub = per / tgroup;
    for (int64_t blk = 0; blk < K / per; blk++) {
        const uint8_t *b = row + blk * bytes;
        uint8_t *bc = c + blk * per;
        float *bb = base + 2 * blk;
        if (per == 32) block32(type, b, bias, bc, bsc, boff), bb[0] = bb[1] = 0.0f;
        else if (type == T_Q2_K) block_q2_k(b, bias, bc, bsc, boff, bb, bks, bko);
        else if (type == T_Q3_K) block_q3_k(b, bias, bc, bsc, boff, bb, bks, bko);
        else if (type == T_Q6_K) block_q6_k(b, bias, bc, bsc, boff, bb, bks, bko);
        else block_q45_k(type, b, bias, bc, bsc, boff, bb, bks, bko);
        for (int j = 0; j < nsub * rep; j++) {
            int64_t at = blk * nsub * rep + j;
            sc[at] = bsc[j / rep], ks[at] = bks[j / rep];
            off[at] = has_off ? boff[j / rep] : 0.0f, ko[at] = bko[j / rep];
        }
    }
}

#endif
