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
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "fastmath.h"
#include "gguf_decode.h"

#define GS 32
#define ROWS 16
#define QB (ROWS * 4)
#define SUPER 8

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

int hs_pack_type_known(int type) {
    int a, b, c, d;
    return type_info(type, &a, &b, &c, &d);
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

/* The greatest common divisor by shifts and subtractions (no division). */
static uint32_t gcd_binary(uint32_t a, uint32_t b) {
    if (a == 0 || b == 0) return a | b;
    int shift = __builtin_ctz(a | b);
    a >>= __builtin_ctz(a);
    do {
        b >>= __builtin_ctz(b);
        if (a > b) {
            uint32_t t = a;
            a = b, b = t;
        }
        b -= a;
    } while (b);
    return a << shift;
}

/* ``factor_run`` where each value is ``base`` times the integer ``k`` (a K-quant's run of 256
 * columns: d sc, dmin m, decoded exactly: gguf_decode.h), the same result in fewer steps: the
 * factor is |base| gcd(k), exact, as the general one then is; 0 where ``base`` is 0 or not
 * finite, or the steps do not fit int8 (then ``factor_run``). */
static int factor_multiples(const float *v, const int16_t *k, int n, float base, int8_t *steps,
                            float *factor) {
    if (base == 0.0f || !isfinite(base) || n <= 0) return 0;
    uint32_t g = 0;
    for (int i = 0; i < n && g != 1; i++) g = gcd_binary(g, (uint32_t)(k[i] < 0 ? -k[i] : k[i]));
    if (g == 0) { /* every value zero: steps 0, factor 1 */
        memset(steps, 0, (size_t)n);
        *factor = 1.0f;
        return 1;
    }
    int32_t s[64];
    int top = INT32_MIN, sign = base < 0 ? -1 : 1;
    for (int i = 0; i < n; i++) {
        s[i] = g == 1 ? sign * k[i] : sign * k[i] / (int32_t)g;
        top = s[i] > top ? s[i] : top;
    }
    int flip = top > 127; /* d < 0 with a step of -128: a negative factor */
    for (int i = 0; i < n; i++) {
        int32_t step = flip ? -s[i] : s[i];
        if (step < -128 || step > 127) return 0;
        steps[i] = (int8_t)step;
    }
    float f = fabsf(base) * (float)g;
    *factor = flip ? -f : f;
    for (int i = 0; i < n; i++)
        if ((float)steps[i] * *factor != v[i]) return 0;
    return 1;
}

/* One row's factors (X per row; ``k`` their integer multipliers of ``base``) into the tile's
 * [X, 16] at row r, by mode; 0: not exact. */
static int store_factors(const float *v, const int16_t *k, const float *base, int64_t X, int S,
                         int mode, int64_t tile, int r, void *out, float *super) {
    if (mode == 0) {
        int8_t *steps = (int8_t *)out + tile * X * ROWS;
        int64_t per = SUPER * S, runs = (X + per - 1) / per;
        for (int64_t run = 0; run < runs; run++) {
            int n = (int)(X - run * per < per ? X - run * per : per);
            int8_t s[64];
            float f;
            const float *run_v = v + run * per;
            if (!factor_multiples(run_v, k + run * per, n, base[2 * run], s, &f) &&
                !factor_run(run_v, n, s, &f))
                return 0;
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

/* Bytes of scratch one thread needs: a tile's codes, a row's scales, offsets, bases and the
 * scales' and offsets' integer multipliers. */
int64_t hs_pack_scratch(int64_t K, int group) {
    return ROWS * K + 2 * (K / group) * 4 + 2 * (K / GS) * 4 + 2 * (K / group) * 2 + 64;
}

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
    float *sc = (float *)(scratch + ROWS * K), *off = sc + X, *base = off + X;
    int16_t *ks = (int16_t *)(base + 2 * (K / GS)), *ko = ks + X;
    for (int r = 0; r < ROWS; r++) {
        int64_t n = tile * ROWS + r;
        if (n >= N) { /* rows past N: zero codes and factors */
            memset(codes + r * K, 0, (size_t)K);
            zero_factors(X, S, mode, tile, r, out->scales, out->scale_super);
            if (out->offsets) zero_factors(X, S, mode, tile, r, out->offsets, out->offset_super);
            continue;
        }
        int type = 0;
        const uint8_t *row = source_row(parts, nparts, n, K, &type);
        decode_row(type, row, K, group, bits == 6 ? 32 : 0, codes + r * K, sc, off, base, ks, ko);
        if (!store_factors(sc, ks, base, X, S, mode, tile, r, out->scales, out->scale_super))
            return 0;
        if (out->offsets && !store_factors(off, ko, base + 1, X, S, mode, tile, r, out->offsets,
                                           out->offset_super))
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

/* Rows ``index`` (``count`` of them) of one GGUF tensor of ``type`` with ``K`` columns, its
 * blocks at ``data``, decoded to bfloat16 (an embedding lookup from the mapped file): each value
 * d c + m in float32 (d c alone for a type without offsets), rounded once: the values that
 * ``hs_dequant_rows`` gives from the matrix packed, which holds every d, c and m exactly (a zero
 * may differ in sign, as a factor of zero does there). ``scratch``: ``hs_pack_scratch(K, group)``
 * bytes, the type's group. */
void hs_gguf_rows(const uint8_t *data, int type, int64_t K, const int64_t *index, int64_t count,
                  uint16_t *out, uint8_t *scratch) {
    int per, bytes, group, has_off;
    type_info(type, &per, &bytes, &group, &has_off);
    int64_t X = K / group, row_bytes = K / per * bytes;
    int8_t *codes = (int8_t *)scratch; /* int8 for every type: 4-bit codes are 0..15 */
    float *sc = (float *)(scratch + ROWS * K), *off = sc + X, *base = off + X;
    int16_t *ks = (int16_t *)(base + 2 * (K / GS)), *ko = ks + X;
    for (int64_t i = 0; i < count; i++) {
        decode_row(type, data + index[i] * row_bytes, K, group, 0, (uint8_t *)codes, sc, off,
                   base, ks, ko);
        uint16_t *row = out + i * K;
        for (int64_t k = 0; k < K; k++) {
            float d = sc[k / group], c = (float)codes[k];
            row[k] = f32_to_bf16(has_off ? fmaf(d, c, off[k / group]) : d * c);
        }
    }
}

/* The file behind ``fd`` (``size`` bytes) asked into the page cache from its start, one
 * ``posix_fadvise(WILLNEED)`` per ``step`` bytes: a call reads ahead at most a device's
 * read-ahead size (a few MB, 128 KB on some disks), so a whole file takes one call per step.
 * Each call only queues reads (pages already cached are looked up); returns 1 where one fails. */
int hs_read_ahead(int fd, int64_t size, int64_t step) {
    for (int64_t at = 0; at < size; at += step)
        if (posix_fadvise(fd, at, step, POSIX_FADV_WILLNEED)) return 1;
    return 0;
}
