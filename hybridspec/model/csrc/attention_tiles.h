/* The two halves of one attention item (attention.c), per instruction set (isa.h): the
 * scores of its rows against the keys (``item_scores``) and their weighted sums of the values
 * (``item_values``). AVX-512 tiles of 8 rows x 32 positions (scores) and 4 rows x 64 dims
 * (values), AVX2 tiles of 4 x 16 and 2 x 32, and the portable C (``scalar_scores``,
 * ``scalar_values``) for what the tiles leave. Lanes hold positions or dims, never parts of one
 * sum: every path gives the same bits. Included once, by attention.c. */
#ifndef HS_ATTENTION_TILES_H
#define HS_ATTENTION_TILES_H

#define SCORE_ROWS 8  /* query rows sharing each key load */
#define VALUE_ROWS 4  /* query rows sharing each value load */
#define VALUE_DIMS 64 /* dims of the values held in registers at once (4 vectors) */

/* Element i of a cache row at ``base``: float32, or bfloat16 bits widened. */
static inline float att_widen(const char *base, int f32, int64_t i) {
    return f32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

#if defined(HS_AVX2)
/* a[r][c] += w[r ld] vs[c] for rows r < nr: one position's values (4 vectors of dims) into
 * the accumulators, at either vector width (isa.h's hs_vf): values_tile's and values_tile8's
 * step. */
HS_INLINE void values_step(hs_vf a[][4], const hs_vf vs[4], const float *w, int64_t ld, int nr) {
    for (int r = 0; r < nr; r++) {
        hs_vf p = HS_MM(set1_ps)(w[r * ld]);
        for (int c = 0; c < 4; c++) a[r][c] = HS_MM(fmadd_ps)(p, vs[c], a[r][c]);
    }
}
#endif

#if defined(HS_AVX512)
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
HS_INLINE void scores_tile(
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
HS_INLINE void values_tile(
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
        const __m512 vs[4] = {load16(v, f32, m[0]), load16(v + step, f32, m[1]),
                              load16(v + 2 * step, f32, m[2]), load16(v + 3 * step, f32, m[3])};
        values_step(a, vs, w + j, ld, nr);
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

#if defined(HS_AVX2) && !defined(HS_AVX512)
static inline __m256 load8(const char *p, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)p) : bf16x8_to_f32((const uint16_t *)p);
}

/* scores_tile's AVX2 form: ``nr`` (<= 4) rows and 16 whole positions. */
HS_INLINE void scores_tile8(
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
HS_INLINE void values_tile8(
    const float *w, int64_t ld, const char *values, int64_t pos_bytes, int f32, int64_t j_lo,
    int64_t j_hi, int nr, float *acc, int64_t hd) {
    __m256 a[2][4];
    int64_t step = f32 ? 32 : 16;
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < 4; c++)
            a[r][c] = _mm256_loadu_ps(acc + r * hd + 8 * c);
    for (int64_t j = j_lo; j < j_hi; j++) {
        const char *v = values + j * pos_bytes;
        const __m256 vs[4] = {load8(v, f32), load8(v + step, f32), load8(v + 2 * step, f32),
                              load8(v + 3 * step, f32)};
        values_step(a, vs, w + j, ld, nr);
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
#if defined(HS_AVX512)
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
#elif defined(HS_AVX2)
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
#if defined(HS_AVX512)
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
#elif defined(HS_AVX2)
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

#endif
