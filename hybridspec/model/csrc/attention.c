/* Row-invariant attention on CPU (``hybridspec.model.attention_kernels`` states the contract;
 * this is the same computation, bit for bit, where the kernel library builds).
 *
 * For each query row: the scores over the keys at positions 0 .. position of its sequence
 * (with a window > 0, only the last ``window`` of them), softmax, and the weighted sum of the
 * values, in float32 with one fixed order of operations that depends only on the row:
 *   score_j = fma(qs[hd - 1], k[hd - 1, j], ... fma(qs[1], k[1, j], fma(qs[0], k[0, j], 0)))
 *     with qs = q * scale (each dim in order, one rounding per step);
 *   with softcap > 0, score_j = softcap tanh(score_j / softcap) (``att_soft_cap``);
 *   e_j = exp(score_j - max) (``att_exp``), 0 before the window; 1 / sum by 16 lanes in a fixed
 *     tree (``softmax_weights``);
 *   out[d] = (fma chain over positions j in order of e_j v[j, d], from 0) * (1 / sum).
 * Vector lanes hold different positions (scores) or dims (values), never parts of one sum, so
 * the AVX-512, AVX2 and portable paths give the same bits; rows share key and value loads but
 * not sums, so a row's result does not depend on the rows beside it, the items, or the threads.
 *
 * Items (int32 ``[n, 5]``: slot, key/value head, first token in q, its position, tokens) are
 * the unit of work, run in parallel on OpenMP threads (torch's, as the matmuls).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache_layout.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#include <immintrin.h>
#define HA_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HA_AVX2 1
#endif

#define LANES 16
#define SCORE_ROWS 8 /* query rows sharing each key load */
#define VALUE_ROWS 4 /* query rows sharing each value load */
#define VALUE_DIMS 64 /* dims of the values held in registers at once (4 vectors) */
enum { IT_SLOT, IT_HEAD, IT_TOKEN, IT_POSITION, IT_NUM_TOKENS, IT_COLUMNS };

static inline float att_widen(const char *base, int f32, int64_t i) {
    if (f32)
        return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) in float32 for x <= 0: attention_kernels.fast_exp, operation for operation. */
static inline float att_exp(float x) {
    x = x > -87.0f ? x : -87.0f;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f * r + 1.3981999507e-3f;
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

/* cap tanh(x / cap): attention_kernels.soft_cap. */
static inline float att_soft_cap(float x, float cap) {
    float z = x / cap;
    float e = att_exp(-2.0f * fabsf(z));
    float t = (1.0f - e) / (1.0f + e);
    return cap * (z >= 0.0f ? t : -t);
}

#if defined(HA_AVX512)
/* att_exp on 16 lanes: the same operations in the same order, lane by lane. */
static inline __m512 att_exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _mm512_set1_ps(0.5f));
    n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(1.9875691500e-4f), r),
                             _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* att_soft_cap on 16 lanes. */
static inline __m512 att_soft_cap16(__m512 x, float cap) {
    __m512 z = _mm512_div_ps(x, _mm512_set1_ps(cap));
    __m512 e = att_exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(z)));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    __mmask16 positive = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
    t = _mm512_mask_blend_ps(positive, _mm512_sub_ps(_mm512_setzero_ps(), t), t);
    return _mm512_mul_ps(_mm512_set1_ps(cap), t);
}
#endif

#if defined(HA_AVX2)
/* att_exp on 8 lanes: the same operations in the same order, lane by lane. */
static inline __m256 att_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(0.5f));
    n = _mm256_round_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(1.9875691500e-4f), r),
                             _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* row[:length] becomes softcap tanh(row / softcap) where softcap > 0. */
static void soft_cap_row(float *row, int64_t length, float softcap) {
    int64_t j = 0;
#if defined(HA_AVX512)
    for (; j + 16 <= length; j += 16)
        _mm512_storeu_ps(row + j, att_soft_cap16(_mm512_loadu_ps(row + j), softcap));
#endif
    for (; j < length; j++)
        row[j] = att_soft_cap(row[j], softcap);
}

/* row[:length] becomes exp(score - max), 0 before ``first``; returns 1 / sum (16 lanes over
 * the whole blocks of 16, folded 8, 4, 2, 1, plus the rest in order): attention_kernels.
 * softmax_weights. */
static float softmax_weights(float *row, int64_t first, int64_t length) {
    float lanes[LANES];
    int64_t blocked = length - length % LANES;
    for (int64_t j = 0; j < first; j++)
        row[j] = -INFINITY;
    float top = row[0];
    for (int l = 0; l < LANES; l++)
        lanes[l] = top;
#if defined(HA_AVX512) /* max(b, a) is a >= b ? a : b, as the scalar loop */
    __m512 vmax = _mm512_loadu_ps(lanes);
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        vmax = _mm512_max_ps(_mm512_loadu_ps(row + j0), vmax);
    _mm512_storeu_ps(lanes, vmax);
#elif defined(HA_AVX2)
    __m256 lo = _mm256_loadu_ps(lanes), hi = _mm256_loadu_ps(lanes + 8);
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES) {
        lo = _mm256_max_ps(_mm256_loadu_ps(row + j0), lo);
        hi = _mm256_max_ps(_mm256_loadu_ps(row + j0 + 8), hi);
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
#else
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        for (int l = 0; l < LANES; l++)
            lanes[l] = lanes[l] >= row[j0 + l] ? lanes[l] : row[j0 + l];
#endif
    for (int l = 0; l < LANES; l++)
        top = top >= lanes[l] ? top : lanes[l];
    for (int64_t j = blocked; j < length; j++)
        top = top >= row[j] ? top : row[j];
    int64_t j = 0;
#if defined(HA_AVX512)
    __m512 vtop = _mm512_set1_ps(top);
    for (; j + 16 <= length; j += 16)
        _mm512_storeu_ps(row + j, att_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vtop)));
#elif defined(HA_AVX2)
    __m256 vtop = _mm256_set1_ps(top);
    for (; j + 8 <= length; j += 8)
        _mm256_storeu_ps(row + j, att_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), vtop)));
#endif
    for (; j < length; j++)
        row[j] = att_exp(row[j] - top);
    for (int64_t j = 0; j < first; j++)
        row[j] = 0.0f;
    for (int l = 0; l < LANES; l++)
        lanes[l] = 0.0f;
#if defined(HA_AVX512)
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        vsum = _mm512_add_ps(vsum, _mm512_loadu_ps(row + j0));
    _mm512_storeu_ps(lanes, vsum);
#elif defined(HA_AVX2)
    __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES) {
        sum_lo = _mm256_add_ps(sum_lo, _mm256_loadu_ps(row + j0));
        sum_hi = _mm256_add_ps(sum_hi, _mm256_loadu_ps(row + j0 + 8));
    }
    _mm256_storeu_ps(lanes, sum_lo);
    _mm256_storeu_ps(lanes + 8, sum_hi);
#else
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        for (int l = 0; l < LANES; l++)
            lanes[l] += row[j0 + l];
#endif
    float tail = 0.0f;
    for (int64_t j = blocked; j < length; j++)
        tail += row[j];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lanes[l] += lanes[l + w];
    return 1.0f / (lanes[0] + tail);
}

#if defined(HA_AVX512)
static inline __m512 load16(const char *p, int f32, __mmask16 mask) {
    if (f32)
        return _mm512_maskz_loadu_ps(mask, p);
    __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __mmask16 mask_of(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1));
}

/* scores[r * ld + j0 + i] for ``nr`` rows and the 32 positions from ``keys`` (dim 0 of
 * position j0; dims ``dim_bytes`` apart), lanes past ``n`` left alone. */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qs, int64_t hd, const char *keys, int64_t dim_bytes, int f32, int64_t n,
    int nr, float *scores, int64_t ld) {
    __m512 acc[SCORE_ROWS][2];
    __mmask16 m0 = mask_of(n), m1 = mask_of(n - 16);
    int64_t half = f32 ? 64 : 32;
    for (int r = 0; r < nr; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const char *k = keys + d * dim_bytes;
        __m512 k0 = load16(k, f32, m0), k1 = load16(k + half, f32, m1);
        for (int r = 0; r < nr; r++) {
            __m512 a = _mm512_set1_ps(qs[r * hd + d]);
            acc[r][0] = _mm512_fmadd_ps(a, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm512_mask_storeu_ps(scores + r * ld, m0, acc[r][0]);
        _mm512_mask_storeu_ps(scores + r * ld + 16, m1, acc[r][1]);
    }
}

/* acc[r * hd + i] (i < 64, lanes past ``dims`` alone) = fma chain over positions j in
 * [j_lo, j_hi) of w[r * ld + j] * value[j, i], continuing from acc as it holds. */
static inline __attribute__((always_inline)) void values_tile(
    const float *w, int64_t ld, const char *values, int64_t pos_bytes, int f32, int64_t dims,
    int64_t j_lo, int64_t j_hi, int nr, float *acc, int64_t hd) {
    __m512 a[VALUE_ROWS][4];
    __mmask16 m[4];
    int64_t step = f32 ? 64 : 32;
    for (int c = 0; c < 4; c++)
        m[c] = mask_of(dims - 16 * c);
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++)
            a[r][c] = _mm512_maskz_loadu_ps(m[c], acc + r * hd + 16 * c);
    for (int64_t j = j_lo; j < j_hi; j++) {
        const char *v = values + j * pos_bytes;
        __m512 v0 = load16(v, f32, m[0]), v1 = load16(v + step, f32, m[1]);
        __m512 v2 = load16(v + 2 * step, f32, m[2]), v3 = load16(v + 3 * step, f32, m[3]);
        for (int r = 0; r < nr; r++) {
            __m512 p = _mm512_set1_ps(w[r * ld + j]);
            a[r][0] = _mm512_fmadd_ps(p, v0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(p, v1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(p, v2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(p, v3, a[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++)
            _mm512_mask_storeu_ps(acc + r * hd + 16 * c, m[c], a[r][c]);
}
#endif

/* scores[m * ld + j] for rows [0, rows) and positions [j_lo, j_hi), one at a time. */
static inline void scalar_scores(const float *qs, int64_t rows, int64_t hd, const char *keys,
                                 int64_t ks_dim, int f32, int64_t j_lo, int64_t j_hi, float *scores,
                          int64_t ld) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = j_lo; j < j_hi; j++) {
            float s = 0.0f;
            for (int64_t d = 0; d < hd; d++)
                s = fmaf(qs[m * hd + d], att_widen(keys, f32, d * ks_dim + j), s);
            scores[m * ld + j] = s;
        }
}

/* acc[m * hd + d] for rows [0, rows) and dims [d_lo, hd), one at a time. */
static inline void scalar_values(const float *w, int64_t rows, int64_t ld, const int64_t *lengths,
                          const char *values, int64_t vs_pos, int f32, int64_t d_lo, int64_t hd,
                          float *acc) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t d = d_lo; d < hd; d++) {
            float s = 0.0f;
            for (int64_t j = 0; j < lengths[m]; j++)
                s = fmaf(w[m * ld + j], att_widen(values, f32, j * vs_pos + d), s);
            acc[m * hd + d] = s;
        }
}

#if defined(HA_AVX2)
static inline __m256 load8(const char *p, int f32) {
    if (f32)
        return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* scores_tile's AVX2 form: ``nr`` (<= 4) rows and 16 whole positions. */
static inline __attribute__((always_inline)) void scores_tile8(
    const float *qs, int64_t hd, const char *keys, int64_t dim_bytes, int f32, int nr,
    float *scores, int64_t ld) {
    __m256 acc[4][2];
    int64_t half = f32 ? 32 : 16;
    for (int r = 0; r < nr; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d++) {
        const char *k = keys + d * dim_bytes;
        __m256 k0 = load8(k, f32), k1 = load8(k + half, f32);
        for (int r = 0; r < nr; r++) {
            __m256 a = _mm256_set1_ps(qs[r * hd + d]);
            acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        _mm256_storeu_ps(scores + r * ld, acc[r][0]);
        _mm256_storeu_ps(scores + r * ld + 8, acc[r][1]);
    }
}

/* values_tile's AVX2 form: ``nr`` (<= 2) rows and 32 whole dims. */
static inline __attribute__((always_inline)) void values_tile8(
    const float *w, int64_t ld, const char *values, int64_t pos_bytes, int f32, int64_t j_lo,
    int64_t j_hi, int nr, float *acc, int64_t hd) {
    __m256 a[2][4];
    int64_t step = f32 ? 32 : 16;
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++)
            a[r][c] = _mm256_loadu_ps(acc + r * hd + 8 * c);
    for (int64_t j = j_lo; j < j_hi; j++) {
        const char *v = values + j * pos_bytes;
        __m256 v0 = load8(v, f32), v1 = load8(v + step, f32);
        __m256 v2 = load8(v + 2 * step, f32), v3 = load8(v + 3 * step, f32);
        for (int r = 0; r < nr; r++) {
            __m256 p = _mm256_set1_ps(w[r * ld + j]);
            a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(p, v2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(p, v3, a[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(acc + r * hd + 8 * c, a[r][c]);
}
#endif

/* scores [rows, ld]: the first ``width`` columns of each row, from the keys at ``keys``
 * (position ``start`` of dim 0). */
static void item_scores(const float *qs, int64_t rows, int64_t hd, const char *keys,
                        int64_t ks_dim, int f32, int64_t width, float *scores, int64_t ld) {
    int64_t es = f32 ? 4 : 2;
#if defined(HA_AVX512)
    for (int64_t j0 = 0; j0 < width; j0 += 32) {
        const char *k = keys + j0 * es;
        int64_t n = width - j0;
        int64_t m = 0;
        for (; m + SCORE_ROWS <= rows; m += SCORE_ROWS)
            scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, SCORE_ROWS, scores + m * ld + j0,
                        ld);
        switch (rows - m) { /* constant row counts, so the tile's loops unroll */
        case 7: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 7, scores + m * ld + j0, ld); break;
        case 6: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 6, scores + m * ld + j0, ld); break;
        case 5: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 5, scores + m * ld + j0, ld); break;
        case 4: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 4, scores + m * ld + j0, ld); break;
        case 3: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 3, scores + m * ld + j0, ld); break;
        case 2: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 2, scores + m * ld + j0, ld); break;
        case 1: scores_tile(qs + m * hd, hd, k, ks_dim * es, f32, n, 1, scores + m * ld + j0, ld); break;
        default: break;
        }
    }
#elif defined(HA_AVX2)
    int64_t whole = width - width % 16;
    for (int64_t j0 = 0; j0 < whole; j0 += 16) {
        const char *k = keys + j0 * es;
        for (int64_t m = 0; m < rows; m += 4) {
            float *out = scores + m * ld + j0;
            switch (rows - m) {
            case 3: scores_tile8(qs + m * hd, hd, k, ks_dim * es, f32, 3, out, ld); break;
            case 2: scores_tile8(qs + m * hd, hd, k, ks_dim * es, f32, 2, out, ld); break;
            case 1: scores_tile8(qs + m * hd, hd, k, ks_dim * es, f32, 1, out, ld); break;
            default: scores_tile8(qs + m * hd, hd, k, ks_dim * es, f32, 4, out, ld); break;
            }
        }
    }
    scalar_scores(qs, rows, hd, keys, ks_dim, f32, whole, width, scores, ld);
#else
    (void)es;
    scalar_scores(qs, rows, hd, keys, ks_dim, f32, 0, width, scores, ld);
#endif
}

/* acc [rows, hd] (zeros on entry) += the weighted values: row m sums positions j < lengths[m]
 * of ``values`` (position ``start``, dim 0). */
static void item_values(const float *w, int64_t rows, int64_t ld, const int64_t *lengths,
                        const char *values, int64_t vs_pos, int f32, int64_t hd, float *acc) {
    int64_t es = f32 ? 4 : 2;
#if defined(HA_AVX512)
    for (int64_t d0 = 0; d0 < hd; d0 += VALUE_DIMS) {
        const char *v = values + d0 * es;
        int64_t dims = hd - d0;
        for (int64_t m = 0; m < rows; m += VALUE_ROWS) {
            int64_t nr = rows - m < VALUE_ROWS ? rows - m : VALUE_ROWS;
            int64_t common = lengths[m]; /* lengths grow with m: the block's first is the least */
            const float *wm = w + m * ld;
            float *am = acc + m * hd + d0;
            switch (nr) {
            case 4: values_tile(wm, ld, v, vs_pos * es, f32, dims, 0, common, 4, am, hd); break;
            case 3: values_tile(wm, ld, v, vs_pos * es, f32, dims, 0, common, 3, am, hd); break;
            case 2: values_tile(wm, ld, v, vs_pos * es, f32, dims, 0, common, 2, am, hd); break;
            default: values_tile(wm, ld, v, vs_pos * es, f32, dims, 0, common, 1, am, hd); break;
            }
            for (int64_t r = 1; r < nr; r++)
                values_tile(wm + r * ld, ld, v, vs_pos * es, f32, dims, common, lengths[m + r], 1,
                            am + r * hd, hd);
        }
    }
#elif defined(HA_AVX2)
    int64_t whole = hd - hd % 32;
    for (int64_t d0 = 0; d0 < whole; d0 += 32) {
        const char *v = values + d0 * es;
        for (int64_t m = 0; m < rows; m += 2) {
            const float *wm = w + m * ld;
            float *am = acc + m * hd + d0;
            if (rows - m >= 2) {
                values_tile8(wm, ld, v, vs_pos * es, f32, 0, lengths[m], 2, am, hd);
                values_tile8(wm + ld, ld, v, vs_pos * es, f32, lengths[m], lengths[m + 1], 1,
                             am + hd, hd);
            } else {
                values_tile8(wm, ld, v, vs_pos * es, f32, 0, lengths[m], 1, am, hd);
            }
        }
    }
    scalar_values(w, rows, ld, lengths, values, vs_pos, f32, whole, hd, acc);
#else
    (void)es;
    scalar_values(w, rows, ld, lengths, values, vs_pos, f32, 0, hd, acc);
#endif
}

/* One item: its rows' attention into out. Returns -1 when scratch memory runs out. */
static int attend_item(const float *q, int64_t H, int64_t hd, int64_t rep,
                       const cache_layout_t *cache, int f32, const int32_t *item, float scale,
                       float softcap, int64_t window, float *out) {
    int64_t slot = item[IT_SLOT], head = item[IT_HEAD], token0 = item[IT_TOKEN];
    int64_t position0 = item[IT_POSITION], rows = (int64_t)item[IT_NUM_TOKENS] * rep;
    int64_t start = 0; /* a multiple of LANES, at or before every row's window */
    if (window > 0) {
        start = position0 + 1 - window;
        start = start < 0 ? 0 : start / LANES * LANES;
    }
    int64_t width = position0 + item[IT_NUM_TOKENS] - start, ld = (width + 31) / 32 * 32;
    float *qs = malloc(sizeof(float) * (size_t)(rows * hd));
    float *scores = malloc(sizeof(float) * (size_t)(rows * ld));
    float *acc = calloc((size_t)(rows * hd), sizeof(float));
    float *inverse = malloc(sizeof(float) * (size_t)rows);
    int64_t *lengths = malloc(sizeof(int64_t) * (size_t)rows);
    int failed = !qs || !scores || !acc || !inverse || !lengths;
    if (!failed) {
        int64_t es = f32 ? 4 : 2;
        for (int64_t m = 0; m < rows; m++) {
            const float *src = q + ((token0 + m / rep) * H + head * rep + m % rep) * hd;
            for (int64_t d = 0; d < hd; d++)
                qs[m * hd + d] = src[d] * scale;
        }
        const char *keys = (const char *)cache->keys +
                           (slot * cache->ks_slot + head * cache->ks_head + start) * es;
        item_scores(qs, rows, hd, keys, cache->ks_dim, f32, width, scores, ld);
        for (int64_t m = 0; m < rows; m++) {
            int64_t length = position0 + m / rep + 1;
            float *row = scores + m * ld;
            if (softcap > 0.0f)
                soft_cap_row(row, length - start, softcap);
            int64_t first = window > 0 && length > window ? length - window : 0;
            inverse[m] = softmax_weights(row, first - start, length - start);
            lengths[m] = length - start;
        }
        const char *values = (const char *)cache->values +
                             (slot * cache->vs_slot + head * cache->vs_head + start * cache->vs_pos) * es;
        item_values(scores, rows, ld, lengths, values, cache->vs_pos, f32, hd, acc);
        for (int64_t m = 0; m < rows; m++) {
            float *dst = out + ((token0 + m / rep) * H + head * rep + m % rep) * hd;
            for (int64_t d = 0; d < hd; d++)
                dst[d] = acc[m * hd + d] * inverse[m];
        }
    }
    free(qs);
    free(scores);
    free(acc);
    free(inverse);
    free(lengths);
    return failed ? -1 : 0;
}

/* Attention of the query rows named by ``items`` over one layer's cache (keys and values of
 * this forward already stored). q and out [T, H, hd] float32; query head h r + i reads key/value
 * head h (r = H / KV). ``f32``: the cache holds float32, else bfloat16 bits. ``scale``
 * multiplies the queries; ``softcap`` (0: none) caps the scores; ``window`` (0: none) is the
 * number of most recent keys a row attends, its own included. Returns 0, or -1 when scratch
 * memory runs out (``out`` then incomplete). */
int hs_attend(const float *q, int64_t H, int64_t KV, int64_t hd, const cache_layout_t *cache,
              int f32, const int32_t *items, int64_t num_items, float scale, float softcap,
              int64_t window, float *out) {
    int failed = 0;
    int64_t rep = H / KV;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) if (num_items > 1)
    for (int64_t it = 0; it < num_items; it++)
        failed |= attend_item(q, H, hd, rep, cache, f32, items + it * IT_COLUMNS, scale, softcap,
                              window, out);
    return failed ? -1 : 0;
}

/* 1 where hs_attend runs a vector path (AVX-512 or AVX2), 0 where it runs the portable C. */
int hs_attend_vectorized(void) {
#if defined(HA_AVX512) || defined(HA_AVX2)
    return 1;
#else
    return 0;
#endif
}
