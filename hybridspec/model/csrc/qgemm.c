/* Matmuls with group-quantized weights on CPU: y = f(x) @ W.T, W in blocks of 32 columns.
 *
 * W [N, K] holds codes c and, per row and group of 32 columns, a float32 scale d and (4 bits)
 * an offset m: W[n, 32 g + j] = d c + m (``hybridspec.model.quant``; 4-bit codes 0..15, 8-bit
 * codes -128..127 with no offset). ``hs_pack`` reorders them into tiles of 8 rows (``ROWS``):
 * for each tile and group, 8 quads of 4 columns, each quad as 8 rows x 4 bytes (one 256-bit
 * vector whose int32 lane r is row r). A 4-bit tile stores quads u and u + 4 in one vector, in
 * the low and the high nibbles. Scales and offsets are stored [tiles, G, 8].
 *
 * The activations are quantized per row and group of 32 to 8 bits (llama.cpp's Q8_1: scale
 * dx = amax / 127, codes q rounded to nearest even), so that each group's sum is an integer
 * one, exact, then scaled:
 *   acc = fma(float(sum_j c q), d dx, acc);  acc = fma(m, dx sum_j q, acc)   for g = 0 .. G-1
 * in this order, for every (t, n) alike, in one thread: a row's result does not depend on the
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
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HS_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HS_VNNI 1
#define TILE_T 8 /* rows of x against one tile of W: accumulators kept in registers */
#else
#define TILE_T 4 /* AVX2 has 16 vector registers */
#endif
#else
#define TILE_T 8
#endif

#define GS 32
#define ROWS 8
#define QUADS (GS / 4)

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
static inline int64_t tile_bytes(int bits) { return bits == 4 ? ROWS * GS / 2 : ROWS * GS; }

/* The packed layout (top of file) of codes [N, K] as ``quant`` keeps them: 4 bits two a byte in
 * column order (low nibble first), 8 bits one a byte. out: [ceil(N / 8), G, tile_bytes];
 * scales_out, offsets_out [ceil(N / 8), G, 8] (offsets may be NULL); csum_out (8 bits only)
 * [ceil(N / 8), G, 8]: -128 * sum of the group's codes. Rows past N are zero. */
void hs_pack(const uint8_t *codes, const float *scales, const float *offsets, int bits,
             int64_t N, int64_t K, uint8_t *out, float *scales_out, float *offsets_out,
             int32_t *csum_out) {
    int64_t G = K / GS, tiles = (N + ROWS - 1) / ROWS, tb = tile_bytes(bits);
    memset(out, 0, (size_t)(tiles * G * tb));
    memset(scales_out, 0, sizeof(float) * (size_t)(tiles * G * ROWS));
    if (offsets_out) memset(offsets_out, 0, sizeof(float) * (size_t)(tiles * G * ROWS));
    if (csum_out) memset(csum_out, 0, sizeof(int32_t) * (size_t)(tiles * G * ROWS));
    for (int64_t n = 0; n < N; n++) {
        int64_t tile = n / ROWS, r = n % ROWS;
        for (int64_t g = 0; g < G; g++) {
            uint8_t *dst = out + (tile * G + g) * tb;
            int64_t at = (tile * G + g) * ROWS + r;
            scales_out[at] = scales[n * G + g];
            if (offsets_out) offsets_out[at] = offsets[n * G + g];
            int32_t sum = 0;
            for (int j = 0; j < GS; j++) {
                int64_t k = g * GS + j;
                int u = j / 4, e = j % 4;
                if (bits == 4) {
                    uint8_t c = (codes[n * (K / 2) + k / 2] >> (4 * (k % 2))) & 15;
                    dst[(u % 4) * 32 + r * 4 + e] |= (uint8_t)(c << (4 * (u / 4)));
                } else {
                    uint8_t c = codes[n * K + k];
                    dst[u * 32 + r * 4 + e] = c;
                    sum += (int8_t)c;
                }
            }
            if (csum_out) csum_out[at] = -128 * sum;
        }
    }
}

/* Rows ``index`` of the packed matrix dequantized to bfloat16 (an embedding lookup):
 * W[n, 32 g + j] = d c + m in float32, rounded once. */
void hs_dequant_rows(const uint8_t *packed, const float *scales, const float *offsets, int bits,
                     int64_t K, const int64_t *index, int64_t count, uint16_t *out) {
    int64_t G = K / GS, tb = tile_bytes(bits);
    for (int64_t i = 0; i < count; i++) {
        int64_t n = index[i], tile = n / ROWS, r = n % ROWS;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *src = packed + (tile * G + g) * tb;
            int64_t at = (tile * G + g) * ROWS + r;
            float d = scales[at], m = offsets ? offsets[at] : 0.0f;
            for (int j = 0; j < GS; j++) {
                int u = j / 4, e = j % 4;
                float c = bits == 4 ? (float)((src[(u % 4) * 32 + r * 4 + e] >> (4 * (u / 4))) & 15)
                                    : (float)(int8_t)src[u * 32 + r * 4 + e];
                out[i * K + g * GS + j] = f32_to_bf16(offsets ? fmaf(d, c, m) : d * c);
            }
        }
    }
}

/* One row of activations: the prologue in float32, then 8-bit codes per group. */
static void quantize_row(const uint16_t *x, int64_t K, int prologue, const uint16_t *norm_w,
                         float eps, float *a, int8_t *q, float *dx, float *sx) {
    if (prologue == PRO_SILU_MUL) {
        for (int64_t k = 0; k < K; k++) {
            float g = bf16_to_f32(x[k]);
            a[k] = g / (1.0f + expf(-g)) * bf16_to_f32(x[K + k]);
        }
    } else {
        for (int64_t k = 0; k < K; k++) a[k] = bf16_to_f32(x[k]);
        if (prologue == PRO_RMSNORM) {
            float ss = 0.0f;
            for (int64_t k = 0; k < K; k++) ss = fmaf(a[k], a[k], ss);
            float r = 1.0f / sqrtf(ss / (float)K + eps);
            for (int64_t k = 0; k < K; k++) a[k] = a[k] * r * bf16_to_f32(norm_w[k]);
        }
    }
    for (int64_t g = 0; g < K / GS; g++) {
        const float *ag = a + g * GS;
        float amax = 0.0f;
        for (int j = 0; j < GS; j++) amax = fmaxf(amax, fabsf(ag[j]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < GS; j++) {
            int v = (int)nearbyintf(ag[j] * id);
            q[g * GS + j] = (int8_t)v;
            sum += v;
        }
        dx[g] = d;
        sx[g] = d * (float)sum;
    }
}

/* out[i][r] for rows t0 + i of x (tt of them) against one tile of 8 rows of W. */
static inline __attribute__((always_inline)) void tile_dot(
    const uint8_t *codes, const float *dw, const float *mw, const int32_t *csum, int bits,
    int64_t G, int64_t K, const int8_t *q, const float *dx, const float *sx, int tt,
    float out[][ROWS]) {
#ifdef HS_SIMD
    __m256 acc[TILE_T];
    for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t tb = tile_bytes(bits);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *src = codes + g * tb;
        __m256i c[QUADS];
        if (bits == 4) {
            for (int p = 0; p < 4; p++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32 * p));
                c[p] = _mm256_and_si256(b, low4);
                c[p + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
            }
        } else {
            for (int u = 0; u < QUADS; u++) {
                c[u] = _mm256_loadu_si256((const __m256i *)(src + 32 * u));
#ifndef HS_VNNI
                c[u] = _mm256_sign_epi8(c[u], c[u]); /* |c| (the sign goes to q below) */
#endif
            }
        }
        const __m256 d = _mm256_loadu_ps(dw + g * ROWS);
        const __m256 m = mw ? _mm256_loadu_ps(mw + g * ROWS) : _mm256_setzero_ps();
#ifdef HS_VNNI
        const __m256i init = bits == 8 ? _mm256_loadu_si256((const __m256i *)(csum + g * ROWS))
                                       : _mm256_setzero_si256();
#endif
        __m256i s[TILE_T];
#ifdef HS_VNNI
        for (int i = 0; i < tt; i++) s[i] = init;
        for (int u = 0; u < QUADS; u++) { /* rows innermost: tt independent dpbusd chains */
            for (int i = 0; i < tt; i++) {
                int32_t quad;
                memcpy(&quad, q + i * K + g * GS + 4 * u, 4);
                __m256i qb = _mm256_set1_epi32(quad);
                if (bits == 4) {
                    s[i] = _mm256_dpbusd_epi32(s[i], c[u], qb); /* codes u8 x q s8 */
                } else {
                    qb = _mm256_add_epi8(qb, _mm256_set1_epi8((char)0x80)); /* q + 128 as u8 */
                    s[i] = _mm256_dpbusd_epi32(s[i], qb, c[u]); /* + init: -128 sum c */
                }
            }
        }
#else
        (void)csum;
        const __m256i ones = _mm256_set1_epi16(1);
        for (int i = 0; i < tt; i++) s[i] = _mm256_setzero_si256();
        for (int u = 0; u < QUADS; u++) {
            for (int i = 0; i < tt; i++) {
                int32_t quad;
                memcpy(&quad, q + i * K + g * GS + 4 * u, 4);
                __m256i qb = _mm256_set1_epi32(quad);
                if (bits == 8) { /* |c| (u8) x sign(q, c) (s8): pairs stay within int16 */
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(src + 32 * u));
                    qb = _mm256_sign_epi8(qb, raw);
                }
                s[i] = _mm256_add_epi32(
                    s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(c[u], qb), ones));
            }
        }
#endif
        for (int i = 0; i < tt; i++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[i * G + g]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, acc[i]);
            acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i * G + g]), acc[i]);
        }
    }
    for (int i = 0; i < tt; i++) _mm256_storeu_ps(out[i], acc[i]);
#else
    (void)csum;
    const int64_t tb = tile_bytes(bits);
    for (int i = 0; i < tt; i++) {
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *src = codes + g * tb;
                const int8_t *qg = q + i * K + g * GS;
                int32_t s = 0;
                for (int j = 0; j < GS; j++) {
                    int u = j / 4, e = j % 4;
                    int c = bits == 4 ? (src[(u % 4) * 32 + r * 4 + e] >> (4 * (u / 4))) & 15
                                      : (int)(int8_t)src[u * 32 + r * 4 + e];
                    s += c * qg[j];
                }
                float m = mw ? mw[g * ROWS + r] : 0.0f;
                acc = fmaf((float)s, dw[g * ROWS + r] * dx[i * G + g], acc);
                acc = fmaf(m, sx[i * G + g], acc);
            }
            out[i][r] = acc;
        }
    }
#endif
}

#define TILE_DOT_CASE(n) \
    case n: tile_dot(codes, dw, mw, csum, bits, G, K, q, dx, sx, n, out); break;

static void tile_dot_rows(const uint8_t *codes, const float *dw, const float *mw,
                          const int32_t *csum, int bits, int64_t G, int64_t K, const int8_t *q,
                          const float *dx, const float *sx, int tt, float out[][ROWS]) {
    switch (tt) { /* constant heights, so that the accumulators live in registers */
        TILE_DOT_CASE(1) TILE_DOT_CASE(2) TILE_DOT_CASE(3) TILE_DOT_CASE(4)
#if TILE_T > 4
        TILE_DOT_CASE(5) TILE_DOT_CASE(6) TILE_DOT_CASE(7) TILE_DOT_CASE(8)
#endif
    }
}

/* y [T, N] = prologue(x) @ W.T (+ residual), W packed by hs_pack. x [T, Kx] bfloat16 with
 * Kx = K (2 K for PRO_SILU_MUL). Returns 0, or -1 when scratch memory cannot be had. */
int hs_qgemm(const uint16_t *x, int64_t T, int64_t K, int prologue, const uint16_t *norm_w,
             float eps, const uint8_t *packed, const float *scales, const float *offsets,
             const int32_t *csum, int bits, int64_t N, const uint16_t *residual, uint16_t *y) {
    int64_t G = K / GS, Kx = prologue == PRO_SILU_MUL ? 2 * K : K;
    int64_t tiles = (N + ROWS - 1) / ROWS, tb = tile_bytes(bits);
    int8_t *q = malloc((size_t)(T * K));
    float *dx = malloc(sizeof(float) * (size_t)(T * G));
    float *sx = malloc(sizeof(float) * (size_t)(T * G));
    int failed = !q || !dx || !sx;
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
                if (a) quantize_row(x + t * Kx, K, prologue, norm_w, eps, a, q + t * K, dx + t * G, sx + t * G);
            free(a);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < tiles; b++) {
                if (failed) continue;
                int rows = N - b * ROWS < ROWS ? (int)(N - b * ROWS) : ROWS;
                for (int64_t t0 = 0; t0 < T; t0 += TILE_T) {
                    int tt = T - t0 < TILE_T ? (int)(T - t0) : TILE_T;
                    float out[TILE_T][ROWS];
                    tile_dot_rows(packed + b * G * tb, scales + b * G * ROWS,
                                  offsets ? offsets + b * G * ROWS : NULL,
                                  csum ? csum + b * G * ROWS : NULL, bits, G, K, q + t0 * K,
                                  dx + t0 * G, sx + t0 * G, tt, out);
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
    return failed ? -1 : 0;
}
