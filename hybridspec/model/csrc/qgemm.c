/* Matmuls with group-quantized weights on CPU: y = f(x) @ W.T, W in blocks of 32 columns.
 *
 * W [N, K] holds codes c and, per row and sub-group of ``group`` columns (32, or 16: S = 32 /
 * group sub-groups per group of 32), a float32 scale d and optionally an offset m:
 * W[n, group s + j] = d c + m (``hybridspec.model.quant``; 4-bit codes 0..15, 8-bit codes
 * -128..127). ``hs_pack`` reorders them into tiles of 16 rows (``ROWS``): for each tile and
 * group of 32, 8 quads of 4 columns, each quad as 16 rows x 4 bytes (one 512-bit vector whose
 * int32 lane r is row r, or two 256-bit halves of 8 rows). A 4-bit tile stores quads u and
 * u + 4 in one vector, in the low and the high nibbles; an 8-bit tile stores c + 128 (0..255).
 * Scales and offsets are stored [tiles, G, S, 16]; with S = 2, quads 0..3 take the first
 * sub-group's, quads 4..7 the second's. They are float32, float16 (where each is one: a block's
 * float16 d or m), or (``factors_t``) int8 steps times a
 * float32 factor per row and super-block of 256 columns (8 groups), [tiles, ceil(G / 8), 16]:
 * a K-quant's d sc, whose float32 product is exact, formed in the kernel from the bytes that
 * the file holds per 256 weights instead of 4 bytes per 16 or 32.
 *
 * The activations are quantized per row and group of 32 to 8 bits (llama.cpp's Q8_1: scale
 * dx = amax / 127, codes q rounded to nearest even), so that each group's sum is an integer
 * one, exact, then scaled:
 *   acc = fma(float(sum_j c q), d dx, acc);  acc = fma(m, dx sum_j q, acc)
 * (8 bits: sum_j c q = sum_j (c + 128) q - 128 sum_j q, the same integer)
 * for each sub-group in order (j over its columns), in this order, for every (t, n) alike, in one thread: a row's result does not depend on the
 * other rows of x, nor on the instruction set (AVX512-VNNI, AVX2, or portable C compute the
 * same integers and the same float operations).
 *
 * Prologue (on each row of x, before quantizing): none; RMSNorm with a weight; or
 * silu(x[:, :K]) * x[:, K:]. Epilogue: round to bfloat16, optionally add a bfloat16 residual
 * (rounding again, as a bfloat16 add does). x, the residual and y are bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache_layout.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HS_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HS_VNNI 1
#define TILE_T 8 /* rows of x against one tile of W: accumulators kept in registers */
#else
#define TILE_T 4 /* AVX2 has 16 vector registers */
#endif
#else
#define TILE_T 8
#endif

#define GS 32
#define ROWS 16 /* rows of W per tile: one 512-bit vector of int32 lanes, or two 256-bit ones */
#define QUADS (GS / 4)
#define QB (ROWS * 4) /* bytes of one quad of columns for a tile's rows */

enum { PRO_NONE = 0, PRO_RMSNORM = 1, PRO_SILU_MUL = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* nearest even */
    return (uint16_t)(u >> 16);
}

/* Per-sub-group factors (scales or offsets) of one matrix: float32 ``f``, float16 ``h``, or
 * int8 ``step`` times float32 ``super`` per super-block of 8 groups; all NULL: none (zero).
 * Pointers start at one tile's (hs_qgemm) or at the matrix's (hs_dequant_rows). */
typedef struct {
    const float *f;
    const uint16_t *h;
    const int8_t *step;
    const float *super;
} factors_t;

#define SUPER 8 /* groups of 32 per super-block (256 columns) */

static inline int has_factors(factors_t w) { return w.f || w.h || w.step; }

/* A float16 value in float32, exactly (subnormals, infinities and NaN included). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = (float)man * 5.9604644775390625e-8f; /* man 2^-24, exact */
        return sign ? -f : f;
    }
    uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}

/* The factor of rows at ``at`` (of [G, S, 16]) in group g: exact, as float32 products are. */
static inline float factor_at(factors_t w, int64_t at, int64_t g, int r) {
    if (w.f) return w.f[at];
    if (w.h) return f16_to_f32(w.h[at]);
    if (w.step) return (float)w.step[at] * w.super[(g / SUPER) * ROWS + r];
    return 0.0f;
}

const char *hs_isa(void) {
#if defined(HS_VNNI)
    return "avx512vnni";
#elif defined(HS_SIMD)
    return "avx2";
#else
    return "portable";
#endif
}

int hs_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Bytes of packed codes per tile and group. */
static inline int64_t tile_bytes(int bits) { return bits == 8 ? QUADS * QB : QUADS / 2 * QB * bits / 4; }

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

/* The packed layout (top of file) of codes [N, K] as ``quant`` keeps them: 4 bits two a byte in
 * column order (low nibble first), 8 bits one a byte (int8); bits 6: int8 codes -32..31 held
 * in 6 bits, c + 32, as a 4-bit tile followed by 2 vectors of the high 2 bits (quads u of
 * 4 (u / 4) + i at bits 2 i). out: [ceil(N / 16), G,
 * tile_bytes]; rows past N are zero. The scales and offsets are laid out by the caller. */
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
static factors_t tile_factors(factors_t w, int64_t tile, int64_t G, int64_t S) {
    int64_t sb = tile * G * S * ROWS, supers = (G + SUPER - 1) / SUPER;
    factors_t t = {w.f ? w.f + sb : NULL, w.h ? w.h + sb : NULL, w.step ? w.step + sb : NULL,
                   w.step ? w.super + tile * supers * ROWS : NULL};
    return t;
}

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

/* exp(x) in float32 (Cephes expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), for
 * x clamped to [-87, 88]. Plain arithmetic with no library call, so that the compiler
 * vectorizes the loops that use it, lane for lane the same operations as a scalar build. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* nearest integer */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* One row of activations: the prologue in float32, then 8-bit codes per group. The rounding
 * to the nearest integer (even on ties) adds and subtracts 1.5 * 2^23, exact for |v| < 2^22. */
static void quantize_row(const uint16_t *x, const float *x32, int64_t K, int prologue,
                         const uint16_t *norm_w, float eps, int group, float *a, int8_t *q,
                         float *dx, float *sx, int32_t *qs) {
    if (prologue == PRO_SILU_MUL) {
        for (int64_t k = 0; k < K; k++) {
            float g = bf16_to_f32(x[k]);
            a[k] = g / (1.0f + fast_exp(-g)) * bf16_to_f32(x[K + k]);
        }
    } else if (x32) {
        memcpy(a, x32, sizeof(float) * (size_t)K);
    } else {
        for (int64_t k = 0; k < K; k++) a[k] = bf16_to_f32(x[k]);
    }
    if (prologue == PRO_RMSNORM) {
        float ss = 0.0f;
        for (int64_t k = 0; k < K; k++) ss = fmaf(a[k], a[k], ss);
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        for (int64_t k = 0; k < K; k++) a[k] = a[k] * r * bf16_to_f32(norm_w[k]);
    }
    for (int64_t g = 0; g < K / GS; g++) {
        float *ag = a + g * GS;
        float amax = 0.0f;
        for (int j = 0; j < GS; j++) {
            float v = fabsf(ag[j]);
            amax = v > amax ? v : amax;
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *qg = q + g * GS;
        int S = GS / group;
        for (int h = 0; h < S; h++) {
            int sum = 0;
            for (int j = h * group; j < (h + 1) * group; j++) {
                int v = (int)((ag[j] * id + 12582912.0f) - 12582912.0f);
                qg[j] = (int8_t)v;
                sum += v;
            }
            sx[g * S + h] = d * (float)sum;
            qs[g * S + h] = sum;
        }
        dx[g] = d;
    }
}

#if defined(HS_VNNI)
/* The factors of a tile's 16 rows at ``at`` in group g, as float32 (exact products). */
static inline __m512 factors512(factors_t w, int64_t at, int64_t g) {
    if (w.f) return _mm512_loadu_ps(w.f + at);
    if (w.h) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w.h + at)));
    if (!w.step) return _mm512_setzero_ps();
    __m512i steps = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w.step + at)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(steps), _mm512_loadu_ps(w.super + (g / SUPER) * ROWS));
}
#elif defined(HS_SIMD)
static inline __m256 factors256(factors_t w, int64_t at, int64_t g, int half) {
    if (w.f) return _mm256_loadu_ps(w.f + at);
#if defined(__F16C__)
    if (w.h) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.h + at)));
#else
    if (w.h) {
        float v[8];
        for (int i = 0; i < 8; i++) v[i] = f16_to_f32(w.h[at + i]);
        return _mm256_loadu_ps(v);
    }
#endif
    if (!w.step) return _mm256_setzero_ps();
    __m256i steps = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w.step + at)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(steps),
                         _mm256_loadu_ps(w.super + (g / SUPER) * ROWS + 8 * half));
}
#endif

/* out[i][r] for rows t0 + i of x (tt of them) against one tile of 16 rows of W, whose scales
 * come in S sub-groups per group of 32 (quads 8 / S at a time). qs: the integer sums of q per
 * sub-group (for 8-bit codes held as c + 128). */
static inline __attribute__((always_inline)) void tile_dot(
    const uint8_t *codes, factors_t dw, factors_t mw, int bits, int S, int64_t G, int64_t K,
    const int8_t *q, const float *dx, const float *sx, const int32_t *qs, int tt,
    float out[][ROWS]) {
    const int64_t tb = tile_bytes(bits), GS_ = G * S;
    const int span = QUADS / S; /* quads per sub-group */
    const int offset = has_factors(mw);
#if defined(HS_VNNI)
    __m512 acc[TILE_T];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *src = codes + g * tb;
        __m512i c[QUADS];
        if (bits != 8) {
            for (int p = 0; p < 4; p++) {
                __m512i b = _mm512_loadu_si512((const void *)(src + QB * p));
                c[p] = _mm512_and_si512(b, low4);
                c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
            }
            if (bits == 6) { /* bits 4, 5 of quad u from bits 2 (u % 4) of high vector u / 4 */
                const __m512i mask = _mm512_set1_epi8(0x30);
                for (int v = 0; v < 2; v++) {
                    __m512i b = _mm512_loadu_si512((const void *)(src + QB * (4 + v)));
                    c[4 * v] = _mm512_or_si512(c[4 * v], _mm512_and_si512(_mm512_slli_epi16(b, 4), mask));
                    c[4 * v + 1] = _mm512_or_si512(c[4 * v + 1], _mm512_and_si512(_mm512_slli_epi16(b, 2), mask));
                    c[4 * v + 2] = _mm512_or_si512(c[4 * v + 2], _mm512_and_si512(b, mask));
                    c[4 * v + 3] = _mm512_or_si512(c[4 * v + 3], _mm512_and_si512(_mm512_srli_epi16(b, 2), mask));
                }
            }
        } else {
            for (int u = 0; u < QUADS; u++) c[u] = _mm512_loadu_si512((const void *)(src + QB * u));
        }
        for (int h = 0; h < S; h++) {
            const int64_t at = (g * S + h) * ROWS;
            const __m512 d = factors512(dw, at, g);
            const __m512 m = offset ? factors512(mw, at, g) : _mm512_setzero_ps();
            __m512i s[TILE_T];
            for (int i = 0; i < tt; i++) /* 6, 8 bits: - 32 or - 128 sum q */
                s[i] = _mm512_set1_epi32(-code_zero(bits) * qs[i * GS_ + g * S + h]);
            for (int u = h * span; u < (h + 1) * span; u++) { /* rows of x innermost */
                for (int i = 0; i < tt; i++) {
                    int32_t quad;
                    memcpy(&quad, q + i * K + g * GS + 4 * u, 4);
                    s[i] = _mm512_dpbusd_epi32(s[i], c[u], _mm512_set1_epi32(quad)); /* u8 x s8 */
                }
            }
            for (int i = 0; i < tt; i++) {
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[i * G + g]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), scale, acc[i]);
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i * GS_ + g * S + h]), acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) _mm512_storeu_ps(out[i], acc[i]);
#elif defined(HS_SIMD)
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int half = 0; half < 2; half++) { /* rows 0..7, then 8..15 */
        __m256 acc[TILE_T];
        for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *src = codes + g * tb + 32 * half;
            __m256i c[QUADS];
            if (bits != 8) {
                for (int p = 0; p < 4; p++) {
                    __m256i b = _mm256_loadu_si256((const __m256i *)(src + QB * p));
                    c[p] = _mm256_and_si256(b, low4);
                    c[p + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                }
                if (bits == 6) { /* codes 0..63: u8 x s8 pairs stay within int16 */
                    const __m256i mask = _mm256_set1_epi8(0x30);
                    for (int v = 0; v < 2; v++) {
                        __m256i b = _mm256_loadu_si256((const __m256i *)(src + QB * (4 + v)));
                        c[4 * v] = _mm256_or_si256(c[4 * v], _mm256_and_si256(_mm256_slli_epi16(b, 4), mask));
                        c[4 * v + 1] = _mm256_or_si256(c[4 * v + 1], _mm256_and_si256(_mm256_slli_epi16(b, 2), mask));
                        c[4 * v + 2] = _mm256_or_si256(c[4 * v + 2], _mm256_and_si256(b, mask));
                        c[4 * v + 3] = _mm256_or_si256(c[4 * v + 3], _mm256_and_si256(_mm256_srli_epi16(b, 2), mask));
                    }
                }
            } else {
                for (int u = 0; u < QUADS; u++) {
                    c[u] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + QB * u)),
                                            bias); /* c (int8) */
                    c[u] = _mm256_sign_epi8(c[u], c[u]); /* |c| (the sign goes to q below) */
                }
            }
            for (int h = 0; h < S; h++) {
                const int64_t at = (g * S + h) * ROWS + 8 * half;
                const __m256 d = factors256(dw, at, g, half);
                const __m256 m = offset ? factors256(mw, at, g, half) : _mm256_setzero_ps();
                __m256i s[TILE_T];
                for (int i = 0; i < tt; i++) /* 6 bits: - 32 sum q (8 bits: signed codes) */
                    s[i] = _mm256_set1_epi32(bits == 6 ? -32 * qs[i * GS_ + g * S + h] : 0);
                for (int u = h * span; u < (h + 1) * span; u++) {
                    for (int i = 0; i < tt; i++) {
                        int32_t quad;
                        memcpy(&quad, q + i * K + g * GS + 4 * u, 4);
                        __m256i qb = _mm256_set1_epi32(quad);
                        if (bits == 8) { /* |c| (u8) x sign(q, c) (s8): pairs within int16 */
                            __m256i raw = _mm256_loadu_si256((const __m256i *)(src + QB * u));
                            qb = _mm256_sign_epi8(qb, _mm256_xor_si256(raw, bias));
                        }
                        s[i] = _mm256_add_epi32(
                            s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(c[u], qb), ones));
                    }
                }
                for (int i = 0; i < tt; i++) {
                    const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[i * G + g]));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, acc[i]);
                    acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i * GS_ + g * S + h]), acc[i]);
                }
            }
        }
        for (int i = 0; i < tt; i++) _mm256_storeu_ps(out[i] + 8 * half, acc[i]);
    }
#else
    (void)qs;
    for (int i = 0; i < tt; i++) {
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *src = codes + g * tb;
                const int8_t *qg = q + i * K + g * GS;
                for (int h = 0; h < S; h++) {
                    int32_t s = 0;
                    for (int j = 4 * h * span; j < 4 * (h + 1) * span; j++) {
                        int u = j / 4, e = j % 4;
                        int c = code_at(src, bits, u, r, e) - code_zero(bits);
                        s += c * qg[j];
                    }
                    const int64_t at = (g * S + h) * ROWS + r;
                    float m = offset ? factor_at(mw, at, g, r) : 0.0f;
                    acc = fmaf((float)s, factor_at(dw, at, g, r) * dx[i * G + g], acc);
                    acc = fmaf(m, sx[i * GS_ + g * S + h], acc);
                }
            }
            out[i][r] = acc;
        }
    }
#endif
}

#define TILE_DOT_CASE(n)                                                                 \
    case n:                                                                              \
        if (S == 1)                                                                      \
            tile_dot(codes, dw, mw, bits, 1, G, K, q, dx, sx, qs, n, out);               \
        else                                                                             \
            tile_dot(codes, dw, mw, bits, 2, G, K, q, dx, sx, qs, n, out);               \
        break;

static void tile_dot_rows(const uint8_t *codes, factors_t dw, factors_t mw, int bits, int S,
                          int64_t G, int64_t K, const int8_t *q, const float *dx,
                          const float *sx, const int32_t *qs, int tt, float out[][ROWS]) {
    switch (tt) { /* constant heights, so that the accumulators live in registers */
        TILE_DOT_CASE(1) TILE_DOT_CASE(2) TILE_DOT_CASE(3) TILE_DOT_CASE(4)
#if TILE_T > 4
        TILE_DOT_CASE(5) TILE_DOT_CASE(6) TILE_DOT_CASE(7) TILE_DOT_CASE(8)
#endif
    }
}

/* One packed matrix as the kernel reads it: hs_pack's codes, its scales and offsets
 * (``factors_t``), bits, group, and its shape N x K. Built once per matrix by the caller
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

/* y [T, N] = prologue(x) @ W.T (+ residual), W packed by hs_pack with its scales and offsets
 * (``factors_t``: float32, float16, or int8 steps and float32 super-block factors; offsets
 * all NULL: none). x [T, Kx] bfloat16 with Kx = K (2 K for PRO_SILU_MUL), or float32 when x_f32 (not
 * with PRO_SILU_MUL). Returns 0, or -1 when scratch memory cannot be had. */
static int qgemm_run(const qweight_t *w, const void *x, int x_f32, int64_t T, int prologue,
                     const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *y) {
    const uint8_t *packed = w->packed;
    int bits = w->bits, group = w->group;
    int64_t N = w->N, K = w->K;
    int64_t G = K / GS, S = GS / group, Kx = prologue == PRO_SILU_MUL ? 2 * K : K;
    int64_t tiles = (N + ROWS - 1) / ROWS, tb = tile_bytes(bits);
    factors_t dw = w->scales, mw = w->offsets;
    int8_t *q = malloc((size_t)(T * K));
    float *dx = malloc(sizeof(float) * (size_t)(T * G));
    float *sx = malloc(sizeof(float) * (size_t)(T * G * S));
    int32_t *qs = malloc(sizeof(int32_t) * (size_t)(T * G * S));
    int failed = !q || !dx || !sx || !qs;
    if (!failed) {
#pragma omp parallel
        {
            float *a = malloc(sizeof(float) * (size_t)K);
            if (!a) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                if (a)
                    quantize_row(x_f32 ? NULL : (const uint16_t *)x + t * Kx,
                                 x_f32 ? (const float *)x + t * Kx : NULL, K, prologue, norm_w,
                                 eps, group, a, q + t * K, dx + t * G, sx + t * G * S,
                                 qs + t * G * S);
            free(a);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < tiles; b++) {
                if (failed) continue;
                int rows = N - b * ROWS < ROWS ? (int)(N - b * ROWS) : ROWS;
                factors_t td = tile_factors(dw, b, G, S), tm = tile_factors(mw, b, G, S);
                for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
                    int tt = T - t0 < TILE_T ? (int)(T - t0) : TILE_T;
                    float out[TILE_T][ROWS];
                    tile_dot_rows(packed + b * G * tb, td, tm, bits, (int)S, G, K, q + t0 * K,
                                  dx + t0 * G, sx + t0 * G * S, qs + t0 * G * S, tt, out);
                    for (int i = 0; i < tt; i++) {
                        for (int r = 0; r < rows; r++) {
                            int64_t at = (t0 + i) * N + b * ROWS + r;
                            uint16_t v = f32_to_bf16(out[i][r]);
                            if (residual) v = f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(residual[at]));
                            y[at] = v;
                        }
                    }
                }
            }
        }
    }
    free(q);
    free(dx);
    free(sx);
    free(qs);
    return failed ? -1 : 0;
}

int hs_qgemm(const void *x, int x_f32, int64_t T, int64_t K, int prologue, const uint16_t *norm_w,
             float eps, const uint8_t *packed, const float *scales, const uint16_t *scales_f16,
             const int8_t *scale_steps, const float *scale_super, const float *offsets,
             const uint16_t *offsets_f16, const int8_t *offset_steps, const float *offset_super,
             int bits, int group, int64_t N, const uint16_t *residual, uint16_t *y) {
    qweight_t w = {packed, {scales, scales_f16, scale_steps, scale_super},
                   {offsets, offsets_f16, offset_steps, offset_super}, bits, group, N, K};
    return qgemm_run(&w, x, x_f32, T, prologue, norm_w, eps, residual, y);
}

/* hs_qgemm with the matrix as one ``qweight_t``: what the runtime calls, four times a layer. */
int hs_qgemm_w(const qweight_t *w, const void *x, int x_f32, int64_t T, int prologue,
               const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *y) {
    return qgemm_run(w, x, x_f32, T, prologue, norm_w, eps, residual, y);
}

/* A decoder layer after its attention, as three hs_qgemm calls would compute it, in one call:
 * h = attn @ wo.T + x; y = silu_mul(rms_norm(h) * mlp_norm @ w_gate_up.T) @ w_down.T + h.
 * attn [T, wo.K] bfloat16 or float32 (attn_f32); x and y [T, wo.N] bfloat16. The same
 * operations in the same order as the three calls: the results are equal to the bit. */
int hs_mlp_block(const qweight_t *wo, const qweight_t *w_gate_up, const qweight_t *w_down,
                 const void *attn, int attn_f32, int64_t T, const uint16_t *x,
                 const uint16_t *mlp_norm, float eps, uint16_t *y) {
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(T * wo->N));
    uint16_t *gate_up = malloc(sizeof(uint16_t) * (size_t)(T * w_gate_up->N));
    int failed = !h || !gate_up;
    if (!failed) failed = qgemm_run(wo, attn, attn_f32, T, PRO_NONE, NULL, 0.0f, x, h);
    if (!failed) failed = qgemm_run(w_gate_up, h, 0, T, PRO_RMSNORM, mlp_norm, eps, NULL, gate_up);
    if (!failed) failed = qgemm_run(w_down, gate_up, 0, T, PRO_SILU_MUL, NULL, 0.0f, h, y);
    free(h);
    free(gate_up);
    return failed ? -1 : 0;
}

/* The attention's inputs from the fused q/k/v projection ``qkv [T, (H + 2 KV) hd]`` bfloat16:
 * q and k rotated by rope (rotate-half convention, float32: out[i] = x[i] c - x[i + hd/2] s,
 * out[i + hd/2] = x[i + hd/2] c + x[i] s with c, s = ``rope[pos, i]``), q written to ``q_out
 * [T, H, hd]`` float32, k (rounded to bfloat16) and v (as they are) into the cache at token t's
 * ``slots[t]`` and ``positions[t]``: keys transposed, ``keys[slot, kv, d, pos]`` at element
 * offset slot ks_slot + kv ks_head + d ks_dim + pos; values ``values[slot, kv, pos, d]`` at
 * slot vs_slot + kv vs_head + pos vs_pos + d (``cache``). ``rope [S, hd / 2, 2]`` float32 (cos, sin). */
void hs_rope_store(const uint16_t *qkv, int64_t T, int64_t H, int64_t KV, int64_t hd,
                   const float *rope, const int64_t *slots, const int64_t *positions,
                   const cache_layout_t *cache, float *q_out) {
    uint16_t *keys = cache->keys, *values = cache->values;
    int64_t ks_slot = cache->ks_slot, ks_head = cache->ks_head, ks_dim = cache->ks_dim;
    int64_t vs_slot = cache->vs_slot, vs_head = cache->vs_head, vs_pos = cache->vs_pos;
    int64_t width = (H + 2 * KV) * hd, half = hd / 2;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * width;
        int64_t slot = slots[t], pos = positions[t];
        const float *cs = rope + pos * hd;
        for (int64_t h = 0; h < H + KV; h++) {
            const uint16_t *x = row + h * hd;
            for (int64_t i = 0; i < half; i++) {
                float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                float c = cs[2 * i], s = cs[2 * i + 1];
                float r1 = x1 * c - x2 * s, r2 = x2 * c + x1 * s;
                if (h < H) {
                    q_out[(t * H + h) * hd + i] = r1;
                    q_out[(t * H + h) * hd + i + half] = r2;
                } else {
                    uint16_t *k = keys + slot * ks_slot + (h - H) * ks_head + pos;
                    k[i * ks_dim] = f32_to_bf16(r1);
                    k[(i + half) * ks_dim] = f32_to_bf16(r2);
                }
            }
        }
        for (int64_t kv = 0; kv < KV; kv++)
            memcpy(values + slot * vs_slot + kv * vs_head + pos * vs_pos,
                   row + (H + KV) * hd + kv * hd, sizeof(uint16_t) * (size_t)hd);
    }
}

/* A decoder layer up to its attention in one call, as hs_qgemm then hs_rope_store would
 * compute it: qkv = rms_norm(x) * attn_norm @ wqkv.T, then q, k and v as hs_rope_store
 * leaves them. x [T, wqkv.K] bfloat16; q_out [T, H, hd] float32. Equal to the two calls. */
int hs_attn_in(const qweight_t *wqkv, const uint16_t *x, int64_t T, const uint16_t *attn_norm,
               float eps, int64_t H, int64_t KV, int64_t hd, const float *rope,
               const int64_t *slots, const int64_t *positions, const cache_layout_t *cache,
               float *q_out) {
    uint16_t *qkv = malloc(sizeof(uint16_t) * (size_t)(T * wqkv->N));
    int failed = !qkv || qgemm_run(wqkv, x, 0, T, PRO_RMSNORM, attn_norm, eps, NULL, qkv);
    if (!failed)
        hs_rope_store(qkv, T, H, KV, hd, rope, slots, positions, cache, q_out);
    free(qkv);
    return failed ? -1 : 0;
}
