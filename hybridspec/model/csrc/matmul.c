/* Matmuls with group-quantized weights on CPU: y = f(x) @ W.T, W in blocks of 32 columns.
 *
 * W [N, K] holds codes c and, per row and sub-group of ``group`` columns (32, or 16: S = 32 /
 * group sub-groups per group of 32), a float32 scale d and optionally an offset m:
 * W[n, group s + j] = d c + m (``hybridspec.model.quant``; 4-bit codes 0..15, 8-bit codes
 * -128..127). ``hs_pack`` (tiles.c) reorders them into tiles of 16 rows (``ROWS``): for each
 * tile and group of 32, 8 quads of 4 columns, each quad as 16 rows x 4 bytes (one 512-bit
 * vector whose int32 lane r is row r, or two 256-bit halves of 8 rows). A 4-bit tile stores
 * quads u and u + 4 in one vector, in the low and the high nibbles; an 8-bit tile stores
 * c + 128 (0..255). Scales and offsets are stored [tiles, G, S, 16]; with S = 2, quads 0..3
 * take the first sub-group's, quads 4..7 the second's. They are float32, float16 (where each
 * is one: a block's float16 d or m), or (``factors_t``) int8 steps times a float32 factor per
 * row and super-block of 256 columns (8 groups), [tiles, ceil(G / 8), 16]: a K-quant's d sc,
 * whose float32 product is exact, formed in the kernel from the bytes that the file holds per
 * 256 weights instead of 4 bytes per 16 or 32.
 *
 * The activations are quantized per row and group of 32 to 8 bits (llama.cpp's Q8_1: scale
 * dx = amax / 127, codes q rounded to nearest even), so that each group's sum is an integer
 * one, exact, then scaled:
 *   acc = fma(float(sum_j c q), d dx, acc);  acc = fma(m, dx sum_j q, acc)
 * (8 bits: sum_j c q = sum_j (c + 128) q - 128 sum_j q, the same integer)
 * for each sub-group in order (j over its columns), in this order, for every (t, n) alike, in
 * one thread: a row's result does not depend on the other rows of x, nor on the instruction
 * set (AVX512-VNNI, AVX2, or the portable C compute the same integers and the same float
 * operations; isa.h).
 *
 * Prologue (on each row of x, before quantizing): none; RMSNorm with a weight; or
 * silu(x[:, :K]) * x[:, K:]. Epilogue: round to bfloat16, optionally add a bfloat16 residual
 * (rounding again, as a bfloat16 add does). x, the residual and y are bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"
#include "matmul.h"
#include "pool.h"

/* activations (T Kx values) that one thread prepares faster than it shares them out */
#define SMALL_ACTIVATIONS 65536

#if defined(HS_VNNI)
#define TILE_T 16 /* rows of x against one tile of W in one pass: 32 vector registers */
#elif defined(HS_AVX2)
#define TILE_T 4 /* rows of x against one tile of W: AVX2 has 16 vector registers */
#else
#define TILE_T 8 /* rows of x against one tile of W */
#endif

/* The form of a matrix's factors, where a tile_dot is specialised on it (else FORM_ANY). */
enum { FORM_ANY = 0, FORM_NONE = 1, FORM_STEP = 2 };

/* The kinds of matrix with a tile_dot of their own (constant bits and factor forms, no tests
 * inside the loop): a Q4_K's, a Q6_K's, a fused Q4_K / Q6_K's (6 bits with offsets); any other
 * in groups of 32 (S = 1) or 16 (S = 2). */
enum { KIND_S1, KIND_S2, KIND_Q4K, KIND_Q6K, KIND_Q6K_M };

const char *hs_isa(void) {
#if defined(HS_VNNI)
    return "avx512vnni";
#elif defined(HS_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

int hs_max_threads(void) { return (int)team_size(); }

/* a[:K] = the prologue of one row of activations, in float32. The vector loops do the scalar
 * loops' operations lane by lane (the sum of squares stays one chain, in order). */
static void prologue_row(const uint16_t *x, const float *x32, int64_t K, int prologue,
                         const uint16_t *norm_w, float eps, float *a) {
    int64_t k = 0;
    if (prologue == PRO_SILU_MUL) {
#if defined(HS_AVX2)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; k + 8 <= K; k += 8) {
            __m256 g = bf16x8_to_f32(x + k);
            __m256 e = hs_exp8(_mm256_xor_ps(g, sign));
            _mm256_storeu_ps(a + k, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                  bf16x8_to_f32(x + K + k)));
        }
#endif
        for (; k < K; k++) {
            float g = bf16_to_f32(x[k]);
            a[k] = g / (1.0f + hs_exp(-g)) * bf16_to_f32(x[K + k]);
        }
    } else if (x32) {
        memcpy(a, x32, sizeof(float) * (size_t)K);
    } else {
#if defined(HS_AVX2)
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(a + k, bf16x8_to_f32(x + k));
#endif
        for (; k < K; k++) a[k] = bf16_to_f32(x[k]);
    }
    if (prologue == PRO_RMSNORM) {
        float ss = 0.0f;
        for (k = 0; k < K; k++) ss = fmaf(a[k], a[k], ss);
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        k = 0;
#if defined(HS_AVX2)
        const __m256 vr = _mm256_set1_ps(r);
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(a + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(a + k), vr),
                                                  bf16x8_to_f32(norm_w + k)));
#endif
        for (; k < K; k++) a[k] = a[k] * r * bf16_to_f32(norm_w[k]);
    }
}

/* One row of activations ``a`` as 8-bit codes ``q`` per group (scale ``dx``), with each
 * sub-group's integer sum ``qs`` and its scaled sum ``sx``. The rounding to the nearest
 * integer (even on ties) adds and subtracts 1.5 * 2^23, exact for |v| < 2^22. */
static void quantize_row(const float *a, int64_t K, int group, int8_t *q, float *dx, float *sx,
                         int32_t *qs) {
    int S = GS / group;
    for (int64_t g = 0; g < K / GS; g++) {
        const float *ag = a + g * GS;
        int8_t *qg = q + g * GS;
        float amax = 0.0f;
#if defined(HS_AVX2) /* the scalar loop's max, lane by lane: max_ps(v, m) is v > m ? v : m */
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < GS; j += 8)
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(ag + j), abs), m);
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#else
        for (int j = 0; j < GS; j++) {
            float v = fabsf(ag[j]);
            amax = v > amax ? v : amax;
        }
#endif
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int h = 0; h < S; h++) {
            int sum = 0, j = h * group;
#if defined(HS_AVX2)
            const __m256 vid = _mm256_set1_ps(id), big = _mm256_set1_ps(12582912.0f);
            __m256i vsum = _mm256_setzero_si256();
            for (; j + 8 <= (h + 1) * group; j += 8) {
                __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(ag + j), vid),
                                                       big), big);
                __m256i v = _mm256_cvttps_epi32(t);
                vsum = _mm256_add_epi32(vsum, v);
                /* the low byte of each lane, as the scalar cast keeps it */
                const __m128i lo = _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                 -1, -1, -1, -1);
                const __m128i hi = _mm_setr_epi8(-1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                                 -1, -1, -1, -1);
                __m128i w = _mm_or_si128(_mm_shuffle_epi8(_mm256_castsi256_si128(v), lo),
                                         _mm_shuffle_epi8(_mm256_extracti128_si256(v, 1), hi));
                _mm_storel_epi64((__m128i *)(qg + j), w);
            }
            int32_t parts[8];
            _mm256_storeu_si256((__m256i *)parts, vsum);
            for (int l = 0; l < 8; l++) sum += parts[l];
#endif
            for (; j < (h + 1) * group; j++) {
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

/* One tile's work: its packed codes, factors and shape, and the activations of the rows of x
 * it meets (``tt`` of them, from row t0): codes ``q`` [tt, K], group scales ``dx`` [tt, G],
 * sub-group scaled sums ``sx`` and integer sums ``qs`` [tt, G S]. */
typedef struct {
    const uint8_t *codes;
    factors_t dw, mw;
    int bits;
    int64_t G, K;
    const int8_t *q;
    const float *dx, *sx;
    const int32_t *qs;
} tile_job_t;

#include "matmul_tiles.h"

/* The kind of ``w`` (KIND_*): which tile_dot runs it. */
static int kind_of(const qweight_t *w) {
    int S = GS / w->group, steps = w->scales.step && (!w->offsets.f && !w->offsets.h);
    if (steps && w->bits == 4 && S == 1 && w->offsets.step) return KIND_Q4K;
    if (steps && w->bits == 6 && S == 2) return w->offsets.step ? KIND_Q6K_M : KIND_Q6K;
    return S == 1 ? KIND_S1 : KIND_S2;
}

/* tile_dot for one kind of matrix at a constant height ``tt``. */
HS_INLINE void tile_dot_kind(const tile_job_t *job, int kind, int tt, float out[][ROWS]) {
#if defined(HS_VNNI)
    if (kind == KIND_Q4K) tile_dot_vnni(*job, 4, 1, tt, FORM_STEP, FORM_STEP, out);
    else if (kind == KIND_Q6K) tile_dot_vnni(*job, 6, 2, tt, FORM_STEP, FORM_NONE, out);
    else if (kind == KIND_Q6K_M) tile_dot_vnni(*job, 6, 2, tt, FORM_STEP, FORM_STEP, out);
    else if (kind == KIND_S1) tile_dot_vnni(*job, 0, 1, tt, FORM_ANY, FORM_ANY, out);
    else tile_dot_vnni(*job, 0, 2, tt, FORM_ANY, FORM_ANY, out);
#elif defined(HS_AVX2) /* constant bits always: dot256's runs */
    const int A = FORM_ANY;
    if (kind == KIND_Q4K) tile_dot(*job, 4, 1, tt, FORM_STEP, FORM_STEP, out);
    else if (kind == KIND_Q6K) tile_dot(*job, 6, 2, tt, FORM_STEP, FORM_NONE, out);
    else if (kind == KIND_Q6K_M) tile_dot(*job, 6, 2, tt, FORM_STEP, FORM_STEP, out);
    else if (kind == KIND_S1 && job->bits == 4) tile_dot(*job, 4, 1, tt, A, A, out);
    else if (kind == KIND_S1 && job->bits == 6) tile_dot(*job, 6, 1, tt, A, A, out);
    else if (kind == KIND_S1) tile_dot(*job, 8, 1, tt, A, A, out);
    else if (job->bits == 4) tile_dot(*job, 4, 2, tt, A, A, out);
    else if (job->bits == 6) tile_dot(*job, 6, 2, tt, A, A, out);
    else tile_dot(*job, 8, 2, tt, A, A, out);
#else
    if (kind == KIND_S1 || kind == KIND_Q4K) tile_dot(*job, 1, tt, out);
    else tile_dot(*job, 2, tt, out);
#endif
}

#define TILE_DOT_CASE(n) \
    case n:              \
        tile_dot_kind(job, kind, n, out); \
        break;

/* tile_dot at constant heights, so that the accumulators live in registers. */
static void tile_dot_rows(const tile_job_t *job, int kind, int tt, float out[][ROWS]) {
    switch (tt) {
        TILE_DOT_CASE(1) TILE_DOT_CASE(2) TILE_DOT_CASE(3) TILE_DOT_CASE(4)
#if TILE_T > 4
        TILE_DOT_CASE(5) TILE_DOT_CASE(6) TILE_DOT_CASE(7) TILE_DOT_CASE(8)
#endif
#if TILE_T > 8
        TILE_DOT_CASE(9) TILE_DOT_CASE(10) TILE_DOT_CASE(11) TILE_DOT_CASE(12)
        TILE_DOT_CASE(13) TILE_DOT_CASE(14) TILE_DOT_CASE(15) TILE_DOT_CASE(16)
#endif
    }
}

/* Row ``t`` of the activations: its prologue (in ``a``), then its codes and sums. */
HS_INLINE void activation_row(const void *x, int x_f32, int64_t Kx, int64_t K, int64_t t,
                              int prologue, const uint16_t *norm_w, float eps, int group, float *a,
                              int8_t *q, float *dx, float *sx, int32_t *qs) {
    int64_t G = K / GS, S = GS / group;
    prologue_row(x_f32 ? NULL : (const uint16_t *)x + t * Kx,
                 x_f32 ? (const float *)x + t * Kx : NULL, K, prologue, norm_w, eps, a);
    quantize_row(a, K, group, q + t * K, dx + t * G, sx + t * G * S, qs + t * G * S);
}

/* The epilogue of one tile's ``rows`` outputs for ``tt`` rows of x from t0: y = bfloat16(out),
 * plus the residual rounded again. */
static void store_tile(float out[][ROWS], int tt, int rows, int64_t t0, int64_t n0, int64_t N,
                       const uint16_t *residual, uint16_t *y) {
    for (int i = 0; i < tt; i++) {
        for (int r = 0; r < rows; r++) {
            int64_t at = (t0 + i) * N + n0 + r;
            uint16_t v = f32_to_bf16(out[i][r]);
            if (residual) v = f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(residual[at]));
            y[at] = v;
        }
    }
}

/* Tile ``b``'s outputs for every row of x, in passes of ``height`` rows: codes ``q`` [T, K],
 * group scales ``dx`` [T, G], sub-group sums ``sx`` and ``qs`` [T, G S] (matmul_run's). */
HS_INLINE void tile_rows(const qweight_t *w, int kind, int64_t b, int64_t T, int64_t height,
                         const int8_t *q, const float *dx, const float *sx, const int32_t *qs,
                         const uint16_t *residual, uint16_t *y) {
    int bits = w->bits;
    int64_t N = w->N, K = w->K, G = K / GS, S = GS / w->group, tb = tile_bytes(bits);
    int rows = N - b * ROWS < ROWS ? (int)(N - b * ROWS) : ROWS;
    factors_t td = tile_factors(w->scales, b, G, S), tm = tile_factors(w->offsets, b, G, S);
    for (int64_t t0 = 0; t0 < T; t0 += height) {
        int tt = T - t0 < height ? (int)(T - t0) : (int)height;
        tile_job_t job = {w->packed + b * G * tb, td, tm, bits, G, K, q + t0 * K,
                          dx + t0 * G, sx + t0 * G * S, qs + t0 * G * S};
        float out[TILE_T][ROWS];
        tile_dot_rows(&job, kind, tt, out);
        store_tile(out, tt, rows, t0, b * ROWS, N, residual, y);
    }
}

int64_t matmul_scratch(const qweight_t *w, int64_t T) {
    int64_t K = w->K, G = K / GS, S = GS / w->group;
    return lines(T * K) + lines(4 * T * G) + 2 * lines(4 * T * G * S) + team_size() * lines(4 * K);
}

/* One matmul_run call's work, as the pool's chunks see it (pool.h). */
typedef struct {
    const qweight_t *w;
    const void *x;
    int x_f32, prologue, kind;
    int64_t Kx, T, height, chunk, tiles;
    const uint16_t *norm_w, *residual;
    float eps;
    float *rows_a; /* one row of K floats per member, lines(4 K) apart */
    int8_t *q;
    float *dx, *sx;
    int32_t *qs;
    uint16_t *y;
} matmul_job_t;

/* Row ``t`` of the activations' codes and sums, in member's own prologue row. */
static void activation_chunk(void *ctx, int64_t t, int64_t member) {
    const matmul_job_t *j = ctx;
    int64_t K = j->w->K;
    activation_row(j->x, j->x_f32, j->Kx, K, t, j->prologue, j->norm_w, j->eps, j->w->group,
                   j->rows_a + member * (lines(4 * K) / 4), j->q, j->dx, j->sx, j->qs);
}

/* Tiles [c chunk, (c + 1) chunk) of W against every row of x. */
static void tile_chunk(void *ctx, int64_t c, int64_t member) {
    const matmul_job_t *j = ctx;
    (void)member;
    int64_t end = (c + 1) * j->chunk < j->tiles ? (c + 1) * j->chunk : j->tiles;
    for (int64_t b = c * j->chunk; b < end; b++)
        tile_rows(j->w, j->kind, b, j->T, j->height, j->q, j->dx, j->sx, j->qs, j->residual, j->y);
}

/* y [T, N] = prologue(x) @ W.T (+ residual) (top of file). x [T, Kx] bfloat16 with Kx = K
 * (2 K for PRO_SILU_MUL), or float32 when x_f32 (not with PRO_SILU_MUL). ``scratch``: the
 * activations' codes and sums, and each member's prologue row (``matmul_scratch`` bytes).
 *
 * The rows of activations, then the tiles, are the pool's chunks (pool.h): whichever thread
 * runs, the running ones take the others' tiles, and a tile's sums do not depend on who takes
 * it. A few rows of activations (a decode or verify step's) run on the calling thread alone:
 * fewer than a chunk's worth to share. */
void matmul_run(const qweight_t *w, const void *x, int x_f32, int64_t T, int prologue,
                const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *y,
                uint8_t *scratch) {
    int64_t N = w->N, K = w->K;
    int64_t G = K / GS, S = GS / w->group, Kx = prologue == PRO_SILU_MUL ? 2 * K : K;
    int64_t tiles = (N + ROWS - 1) / ROWS;
    /* rows of x a pass over a tile takes: T in passes of equal heights up to TILE_T (17 rows:
     * 9 + 8, not 16 + 1, a pass of one row being the slowest per row) */
    int64_t passes = (T + TILE_T - 1) / TILE_T, height = (T + passes - 1) / passes;
    /* about 16 chunks a member (1B decode at 2 threads: 4 tiles a chunk of the output
     * projection's 128, 250 of the LM head's 8016) */
    int64_t chunk = tiles / (16 * team_size());
    if (chunk < 1) chunk = 1;
    matmul_job_t job = {.w = w, .x = x, .x_f32 = x_f32, .prologue = prologue, .kind = kind_of(w),
                        .Kx = Kx, .T = T, .height = height, .chunk = chunk, .tiles = tiles,
                        .norm_w = norm_w, .residual = residual, .eps = eps, .y = y};
    job.q = take(&scratch, T * K);
    job.dx = take(&scratch, 4 * T * G);
    job.sx = take(&scratch, 4 * T * G * S);
    job.qs = take(&scratch, 4 * T * G * S);
    job.rows_a = (float *)scratch;
    if (T * Kx <= SMALL_ACTIVATIONS) {
        for (int64_t t = 0; t < T; t++) activation_chunk(&job, t, 0);
    } else {
        pool_run(activation_chunk, &job, T);
    }
    pool_run(tile_chunk, &job, (tiles + chunk - 1) / chunk);
}

/* y [T, w->N] = prologue(x) @ W.T (+ residual) for one packed matrix ``w``: what the runtime
 * calls for a matrix alone. Returns 0, or HS_SCRATCH_SHORT (scratch.h). */
int hs_matmul(const qweight_t *w, const void *x, int x_f32, int64_t T, int prologue,
              const uint16_t *norm_w, float eps, const uint16_t *residual, uint16_t *y,
              hs_scratch_t *scratch) {
    if (scratch_short(scratch, matmul_scratch(w, T))) return HS_SCRATCH_SHORT;
    matmul_run(w, x, x_f32, T, prologue, norm_w, eps, residual, y, scratch->data);
    return 0;
}
