/* A GGUF file's blocks straight into the block kernel's tiles (qgemm.c's layout), tile by tile,
 * equal to the byte to ``gguf_blocks.from_gguf_blocks`` + ``quant.cat_rows`` +
 * ``qgemm.Kernel.pack`` (``hybridspec.model.gguf_pack``).
 *
 * A matrix is one or more parts (q, k, v stacked; or one tensor), each with its own GGUF type
 * and, optionally, a row order (llama.cpp's q/k permutation undone). Each row is decoded the way
 * ``gguf_blocks`` decodes it: codes (0..15 for the 4-bit types, int8 otherwise) and float32
 * scales and offsets per sub-group of the type, the same float32 products; widened to the
 * matrix's group (each scale repeated) with a zero offset where its type has none, as
 * ``quant.widen`` does. Codes go to the tile as ``hs_pack`` puts them (bits 4, or 6 for codes
 * within -32..31). Scales and offsets, per ``mode``: 0 int8 steps times a float32 factor per row
 * and 256 columns (``quant.factor_steps``: the greatest common divisor at the run's least
 * exponent), 1 float16, 2 float32. A mode that cannot hold some value exactly fails the call
 * (returns 1) and the caller tries the next, as ``Kernel.pack`` chooses.
 *
 * The caller owns every buffer: ``scratch`` holds ``hs_pack_scratch(K, group)`` bytes per
 * thread (``hs_max_threads``).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define GS 32
#define ROWS 16
#define QB (ROWS * 4)
#define SUPER 8
#define QK_K 256

/* GGUF types (ggml's numbering), the ones decoded here. */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14 };

/* One part of a stacked matrix: its blocks (row after row), type, rows and row order. */
typedef struct {
    const uint8_t *data;
    int32_t type;
    int32_t pad;
    int64_t rows;
    const int64_t *order; /* output row i of this part is source row order[i]; NULL: i */
} pack_part_t;

/* Where a matrix's tiles go: codes [tiles, G, tile bytes], scales and offsets [tiles, X, 16]
 * (int8 steps, float16 or float32 by mode; offsets NULL: none) and, mode 0, the factors
 * [tiles, runs, 16] float32. */
typedef struct {
    uint8_t *codes;
    void *scales, *offsets;
    float *scale_super, *offset_super;
} pack_out_t;

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

/* ``x`` as float16 bits when it is a float16 value exactly (infinities too), else -1. */
static int32_t float_to_half_exact(float x) {
    if (isnan(x)) return -1;
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    if (isinf(x)) return (int32_t)(sign | 0x7c00);
    float a = fabsf(x);
    if (a == 0.0f) return (int32_t)sign;
    if (a >= 65520.0f) return -1;
    int e;
    float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    int32_t bits;
    if (e >= -13) { /* normal: 11 significant bits */
        float q = ldexpf(m, 11);
        if (q != floorf(q)) return -1;
        bits = ((e + 14) << 10) | ((int32_t)q - 1024);
    } else { /* subnormal: a multiple of 2^-24 */
        float q = ldexpf(a, 24);
        if (q != floorf(q)) return -1;
        bits = (int32_t)q;
    }
    return (int32_t)(sign | (uint32_t)bits);
}

/* Values per block, bytes per block, group, whether the type has offsets. */
static int type_info(int type, int *per, int *bytes, int *group, int *offsets) {
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

int hs_pack_type_known(int type) {
    int a, b, c, d;
    return type_info(type, &a, &b, &c, &d);
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
 * computes them. */

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

static void block_q2_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off) {
    float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int i = 0; i < 2; i++) /* runs of 32 bytes, shifts 0, 2, 4, 6 */
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++)
                c[i * 128 + s * 32 + j] = (uint8_t)(((b[16 + i * 32 + j] >> (2 * s)) & 3) + bias);
    for (int j = 0; j < 16; j++) {
        sc[j] = d * (float)(b[j] & 0x0f);
        off[j] = -(dmin * (float)(b[j] >> 4));
    }
}

static void block_q3_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off) {
    const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
    float d = half_to_float(b + 108);
    for (int j = 0; j < 16; j++) {
        int low = (packed[j % 8] >> (4 * (j / 8))) & 15;
        int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = d * (float)((int8_t)(low | (high << 4)) - 32);
        off[j] = sc[j] * -4.0f;
    }
    for (int i = 0; i < 2; i++)
        for (int s = 0; s < 4; s++)
            for (int j = 0; j < 32; j++) {
                int ql = (qs[i * 32 + j] >> (2 * s)) & 3, qh = (hmask[j] >> (i * 4 + s)) & 1;
                c[i * 128 + s * 32 + j] = (uint8_t)((ql | (qh << 2)) + bias);
            }
}

static void block_q45_k(int type, const uint8_t *b, int bias, uint8_t *c, float *sc, float *off) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *qs = b + (type == T_Q5_K ? 48 : 16), *qh = b + 16;
    for (int j = 0; j < 8; j++) {
        int s, m;
        k_scale_min(b + 4, j, &s, &m);
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

static void block_q6_k(const uint8_t *b, int bias, uint8_t *c, float *sc, float *off) {
    float d = half_to_float(b + 208);
    uint8_t shift = (uint8_t)(bias - 32);
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 64; j++) {
                int ql = (b[i * 64 + j] >> (4 * h)) & 15;
                int qh = (b[128 + i * 32 + j % 32] >> (2 * (2 * h + j / 32))) & 3;
                c[i * 128 + h * 64 + j] = (uint8_t)((ql | (qh << 4)) + shift);
            }
    for (int j = 0; j < 16; j++) {
        sc[j] = d * (float)(int8_t)b[192 + j];
        off[j] = 0.0f;
    }
}

/* One row of ``type``: codes c[K] (plus ``bias``), scales and offsets per sub-group of
 * ``group`` (the matrix's, at most the type's: each of the type's repeated). */
static void decode_row(int type, const uint8_t *row, int64_t K, int group, int bias, uint8_t *c,
                       float *sc, float *off) {
    int per, bytes, tgroup, has_off;
    type_info(type, &per, &bytes, &tgroup, &has_off);
    float bsc[16], boff[16];
    int rep = tgroup / group, nsub = per / tgroup;
    for (int64_t blk = 0; blk < K / per; blk++) {
        const uint8_t *b = row + blk * bytes;
        uint8_t *bc = c + blk * per;
        if (per == 32) block32(type, b, bias, bc, bsc, boff);
        else if (type == T_Q2_K) block_q2_k(b, bias, bc, bsc, boff);
        else if (type == T_Q3_K) block_q3_k(b, bias, bc, bsc, boff);
        else if (type == T_Q6_K) block_q6_k(b, bias, bc, bsc, boff);
        else block_q45_k(type, b, bias, bc, bsc, boff);
        for (int j = 0; j < nsub * rep; j++) {
            int64_t at = blk * nsub * rep + j;
            sc[at] = bsc[j / rep];
            off[at] = has_off ? boff[j / rep] : 0.0f;
        }
    }
}

static uint32_t gcd32(uint32_t a, uint32_t b) {
    while (b) {
        uint32_t t = a % b;
        a = b, b = t;
    }
    return a;
}

/* ``x`` as an integer times 2^exp, as numpy's frexp and ldexp(m, 24) give it: the 24-bit
 * significand (normal numbers read from their bits, the rest through frexp). */
static int32_t scaled_integer(float x, int *exp) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t biased = (u >> 23) & 0xff;
    if (biased != 0) {
        int32_t m = (int32_t)((u & 0x7fffffu) | 0x800000u);
        *exp = (int)biased - 150;
        return (u >> 31) ? -m : m;
    }
    int e;
    double m = frexp((double)x, &e);
    *exp = e - 24;
    return (int32_t)rint(ldexp(m, 24));
}

/* ``quant.factor_steps`` for one run of ``n`` values (the rest of the run zero): int8 steps and
 * a float32 factor whose products are the values exactly; 0 where they have no such form.
 * factor_steps aligns the values' 24-bit significands to the least exponent and takes their
 * greatest common divisor; the same divisor is G 2^(t - least), with G the divisor of the
 * significands' odd parts and t the least exponent of their lowest set bits: found here in
 * 32 bits, one division per value where G divides it. */
static int factor_run(const float *v, int n, int8_t *steps, float *factor) {
    uint32_t odd[64];
    int low[64], least = INT32_MAX, most = INT32_MIN, tmin = INT32_MAX;
    uint32_t g = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(v[i])) return 0;
        int e;
        int32_t m = scaled_integer(v[i], &e);
        odd[i] = 0;
        if (m == 0) continue;
        uint32_t a = (uint32_t)(m < 0 ? -m : m);
        int z = __builtin_ctz(a);
        odd[i] = a >> z, low[i] = e + z;
        least = e < least ? e : least, most = e > most ? e : most;
        tmin = low[i] < tmin ? low[i] : tmin;
        g = g == 0 ? odd[i] : (odd[i] % g ? gcd32(g, odd[i]) : g);
    }
    if (g == 0) { /* every value zero: steps 0, factor 1 */
        memset(steps, 0, (size_t)n);
        *factor = 1.0f;
        return 1;
    }
    if (most - least > 38) return 0;
    int top = INT32_MIN;
    int32_t s[64];
    for (int i = 0; i < n; i++) {
        s[i] = 0;
        if (odd[i] == 0) continue;
        int shift = low[i] - tmin;
        if (shift > 8) return 0; /* at least 2^9 steps */
        s[i] = (int32_t)((odd[i] / g) << shift);
        if (v[i] < 0) s[i] = -s[i];
        top = s[i] > top ? s[i] : top;
    }
    float f = (float)ldexp((double)g, tmin);
    int flip = top > 127; /* d < 0 with a step of -128: a negative factor */
    for (int i = 0; i < n; i++) {
        int32_t step = flip ? -s[i] : s[i];
        if (step < -128 || step > 127) return 0;
        steps[i] = (int8_t)step;
    }
    *factor = flip ? -f : f;
    for (int i = 0; i < n; i++)
        if ((float)steps[i] * *factor != v[i]) return 0;
    return 1;
}

/* Row r of a tile past the matrix's rows: zero factors (``quant.tiled`` pads with zeros). */
static void zero_factors(int64_t X, int S, int mode, int64_t tile, int r, void *out, float *super) {
    int64_t size = mode == 0 ? 1 : mode == 1 ? 2 : 4, runs = (X + SUPER * S - 1) / (SUPER * S);
    uint8_t *base = (uint8_t *)out + tile * X * ROWS * size;
    for (int64_t x = 0; x < X; x++) memset(base + (x * ROWS + r) * size, 0, (size_t)size);
    if (mode == 0)
        for (int64_t run = 0; run < runs; run++) super[(tile * runs + run) * ROWS + r] = 0.0f;
}

/* One row's factors (X per row) into the tile's [X, 16] at row r, by mode; 0: not exact. */
static int store_factors(const float *v, int64_t X, int S, int mode, int64_t tile, int r,
                         void *out, float *super) {
    if (mode == 0) {
        int8_t *steps = (int8_t *)out + tile * X * ROWS;
        int64_t per = SUPER * S, runs = (X + per - 1) / per;
        for (int64_t run = 0; run < runs; run++) {
            int n = (int)(X - run * per < per ? X - run * per : per);
            int8_t s[64];
            float f;
            if (!factor_run(v + run * per, n, s, &f)) return 0;
            for (int i = 0; i < n; i++) steps[(run * per + i) * ROWS + r] = s[i];
            super[(tile * runs + run) * ROWS + r] = f;
        }
    } else if (mode == 1) {
        uint16_t *h = (uint16_t *)out + tile * X * ROWS;
        for (int64_t x = 0; x < X; x++) {
            int32_t bits = float_to_half_exact(v[x]);
            if (bits < 0) return 0;
            h[x * ROWS + r] = (uint16_t)bits;
        }
    } else {
        float *f = (float *)out + tile * X * ROWS;
        for (int64_t x = 0; x < X; x++) f[x * ROWS + r] = v[x];
    }
    return 1;
}

static inline uint32_t load32(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

/* A tile's codes c[16][K] (plus the bias: 0..15, or c + 32 for 6 bits) in hs_pack's layout:
 * per group of 32, quads u and u + 4 in the low and high nibbles of quad u's 16 rows x 4
 * bytes; for 6 bits then the high 2 bits of quad 4 v + i at bits 2 i of vector v. */
static void pack_codes(const uint8_t *c, int64_t K, int bits, uint8_t *tile) {
    int64_t tb = bits == 4 ? 4 * QB : 6 * QB;
    for (int64_t g = 0; g < K / GS; g++) {
        uint8_t *dst = tile + g * tb;
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *row = c + r * K + g * GS;
            for (int u = 0; u < 4; u++) {
                uint32_t lo = load32(row + u * 4) & 0x0f0f0f0fu;
                uint32_t word = lo | ((load32(row + u * 4 + 16) & 0x0f0f0f0fu) << 4);
                memcpy(dst + u * QB + r * 4, &word, 4);
            }
            if (bits == 4) continue;
            for (int v = 0; v < 2; v++) {
                uint32_t word = 0;
                for (int i = 0; i < 4; i++)
                    word |= ((load32(row + (4 * v + i) * 4) >> 4) & 0x03030303u) << (2 * i);
                memcpy(dst + (4 + v) * QB + r * 4, &word, 4);
            }
        }
    }
}

/* Bytes of scratch one thread needs: a tile's codes, a row's scales and offsets. */
int64_t hs_pack_scratch(int64_t K, int group) { return ROWS * K + 2 * (K / group) * 4 + 64; }

/* Row n of the stacked matrix: its part's blocks. */
static const uint8_t *source_row(const pack_part_t *parts, int nparts, int64_t n, int64_t K,
                                 int *type) {
    for (int p = 0; p < nparts; p++) {
        if (n < parts[p].rows) {
            int per, bytes, group, off;
            type_info(parts[p].type, &per, &bytes, &group, &off);
            int64_t src = parts[p].order ? parts[p].order[n] : n;
            *type = parts[p].type;
            return parts[p].data + src * (K / per) * bytes;
        }
        n -= parts[p].rows;
    }
    return 0;
}

/* One tile: its 16 rows decoded, factored and packed; 0 where ``mode`` cannot hold a value. */
static int pack_tile(const pack_part_t *parts, int nparts, int64_t N, int64_t K, int bits,
                     int group, int mode, int64_t tile, const pack_out_t *out, uint8_t *scratch) {
    int64_t X = K / group;
    int S = GS / group;
    uint8_t *codes = scratch;
    float *sc = (float *)(scratch + ROWS * K), *off = sc + X;
    for (int r = 0; r < ROWS; r++) {
        int64_t n = tile * ROWS + r;
        if (n >= N) { /* rows past N: zero codes and factors */
            memset(codes + r * K, 0, (size_t)K);
            zero_factors(X, S, mode, tile, r, out->scales, out->scale_super);
            if (out->offsets) zero_factors(X, S, mode, tile, r, out->offsets, out->offset_super);
            continue;
        }
        int type;
        const uint8_t *row = source_row(parts, nparts, n, K, &type);
        decode_row(type, row, K, group, bits == 6 ? 32 : 0, codes + r * K, sc, off);
        if (!store_factors(sc, X, S, mode, tile, r, out->scales, out->scale_super)) return 0;
        if (out->offsets &&
            !store_factors(off, X, S, mode, tile, r, out->offsets, out->offset_super))
            return 0;
    }
    pack_codes(codes, K, bits, out->codes + tile * (K / GS) * (bits == 4 ? 4 : 6) * QB);
    return 1;
}

/* Tiles [t0, t1) of the stacked matrix [N, K] (module docstring), in parallel over tiles.
 * Returns 0, or 1 where
 * ``mode`` cannot hold some scale or offset exactly. */
int hs_pack_gguf(const pack_part_t *parts, int nparts, int64_t N, int64_t K, int bits, int group,
                 int mode, int64_t t0, int64_t t1, const pack_out_t *out, uint8_t *scratch) {
    int failed = 0;
    int64_t stride = hs_pack_scratch(K, group);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t tile = t0; tile < t1; tile++) {
        int done;
#pragma omp atomic read
        done = failed;
        if (done) continue;
#ifdef _OPENMP
        uint8_t *mine = scratch + omp_get_thread_num() * stride;
#else
        uint8_t *mine = scratch;
#endif
        if (!pack_tile(parts, nparts, N, K, bits, group, mode, tile, out, mine)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}
