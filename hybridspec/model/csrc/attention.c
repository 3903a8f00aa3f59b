/* Row-invariant attention on CPU (``hybridspec.model.attention_kernels`` states the contract;
 * this is the same computation, bit for bit, where the kernel library builds).
 *
 * For each query row: the scores over the keys at positions 0 .. position of its sequence
 * (with a window > 0, only the last ``window`` of them), softmax, and the weighted sum of the
 * values, in float32 with one fixed order of operations that depends only on the row:
 *   score_j = fma(qs[hd - 1], k[hd - 1, j], ... fma(qs[1], k[1, j], fma(qs[0], k[0, j], 0)))
 *     with qs = q * scale (each dim in order, one rounding per step);
 *   with softcap > 0, score_j = softcap tanh(score_j / softcap) (``att_soft_cap``);
 *   e_j = exp(score_j - max) (fastmath.h's ``hs_exp``), 0 before the window; 1 / sum by 16
 *     lanes in a fixed tree (``softmax_weights``);
 *   out[d] = (fma chain over positions j in order of e_j v[j, d], from 0) * (1 / sum).
 * Vector lanes hold different positions (scores) or dims (values), never parts of one sum, so
 * the AVX-512, AVX2 and portable paths give the same bits; rows share key and value loads but
 * not sums, so a row's result does not depend on the rows beside it, the items, or the threads.
 *
 * Items (int32 ``[n, 5]``: slot, key/value head, first token in q, its position, tokens) are
 * the unit of work, run in parallel on OpenMP threads (torch's, as the matmuls), each in its
 * thread's part of the caller's scratch (scratch.h). The scores and the weighted values of an
 * item's rows are attention_tiles.h's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cache_layout.h"
#include "fastmath.h"
#include "isa.h"
#include "layers.h"
#include "pool.h"
#include "scratch.h"

#define LANES 16
enum { IT_SLOT, IT_HEAD, IT_TOKEN, IT_POSITION, IT_NUM_TOKENS, IT_COLUMNS };

#include "attention_tiles.h"

/* cap tanh(x / cap): attention_kernels.soft_cap. */
static inline float att_soft_cap(float x, float cap) {
    float z = x / cap;
    float e = hs_exp(-2.0f * fabsf(z));
    float t = (1.0f - e) / (1.0f + e);
    return cap * (z >= 0.0f ? t : -t);
}

#if defined(HS_AVX512)
/* att_soft_cap on 16 lanes. */
static inline __m512 att_soft_cap16(__m512 x, float cap) {
    __m512 z = _mm512_div_ps(x, _mm512_set1_ps(cap));
    __m512 e = hs_expv(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(z)));
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    __mmask16 positive = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
    t = _mm512_mask_blend_ps(positive, _mm512_sub_ps(_mm512_setzero_ps(), t), t);
    return _mm512_mul_ps(_mm512_set1_ps(cap), t);
}
#endif

/* row[:length] becomes softcap tanh(row / softcap) where softcap > 0. */
static void soft_cap_row(float *row, int64_t length, float softcap) {
    int64_t j = 0;
#if defined(HS_AVX512)
    for (; j + 16 <= length; j += 16)
        _mm512_storeu_ps(row + j, att_soft_cap16(_mm512_loadu_ps(row + j), softcap));
#endif
    for (; j < length; j++)
        row[j] = att_soft_cap(row[j], softcap);
}

/* lanes[l] = max(lanes[l], row[j0 + l]) over the whole blocks of 16 in row[:blocked], as
 * lanes[l] >= x ? lanes[l] : x on every path (max(b, a) is a >= b ? a : b). */
static void lanes_max(const float *row, int64_t blocked, float lanes[LANES]) {
#if defined(HS_AVX512)
    __m512 vmax = _mm512_loadu_ps(lanes);
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        vmax = _mm512_max_ps(_mm512_loadu_ps(row + j0), vmax);
    _mm512_storeu_ps(lanes, vmax);
#elif defined(HS_AVX2)
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
}

/* lanes[l] = the sum of row[j0 + l] in order over the whole blocks of 16 in row[:blocked],
 * from 0. */
static void lanes_sum(const float *row, int64_t blocked, float lanes[LANES]) {
#if defined(HS_AVX512)
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        vsum = _mm512_add_ps(vsum, _mm512_loadu_ps(row + j0));
    _mm512_storeu_ps(lanes, vsum);
#elif defined(HS_AVX2)
    __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES) {
        sum_lo = _mm256_add_ps(sum_lo, _mm256_loadu_ps(row + j0));
        sum_hi = _mm256_add_ps(sum_hi, _mm256_loadu_ps(row + j0 + 8));
    }
    _mm256_storeu_ps(lanes, sum_lo);
    _mm256_storeu_ps(lanes + 8, sum_hi);
#else
    for (int l = 0; l < LANES; l++)
        lanes[l] = 0.0f;
    for (int64_t j0 = 0; j0 < blocked; j0 += LANES)
        for (int l = 0; l < LANES; l++)
            lanes[l] += row[j0 + l];
#endif
}

/* row[j] = exp(row[j] - top) for j < length. */
static void exp_row(float *row, int64_t length, float top) {
    int64_t j = 0;
#if defined(HS_AVX2)
    hs_vf vtop = HS_MM(set1_ps)(top);
    for (; j + HS_VF_LANES <= length; j += HS_VF_LANES)
        HS_MM(storeu_ps)(row + j, hs_expv(HS_MM(sub_ps)(HS_MM(loadu_ps)(row + j), vtop)));
#endif
    for (; j < length; j++)
        row[j] = hs_exp(row[j] - top);
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
    lanes_max(row, blocked, lanes);
    for (int l = 0; l < LANES; l++)
        top = top >= lanes[l] ? top : lanes[l];
    for (int64_t j = blocked; j < length; j++)
        top = top >= row[j] ? top : row[j];
    exp_row(row, length, top);
    for (int64_t j = 0; j < first; j++)
        row[j] = 0.0f;
    lanes_sum(row, blocked, lanes);
    float tail = 0.0f;
    for (int64_t j = blocked; j < length; j++)
        tail += row[j];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            lanes[l] += lanes[l + w];
    return 1.0f / (lanes[0] + tail);
}

/* An item's first key position (a multiple of LANES, at or before every row's window), its
 * rows, and the width of its score rows (``ld``: whole blocks of 32 positions). */
typedef struct {
    int64_t start, rows, width, ld;
} item_shape_t;

static item_shape_t item_shape(const int32_t *item, int64_t rep, int64_t window) {
    item_shape_t s = {0, (int64_t)item[IT_NUM_TOKENS] * rep, 0, 0};
    if (window > 0) {
        s.start = item[IT_POSITION] + 1 - window;
        s.start = s.start < 0 ? 0 : s.start / LANES * LANES;
    }
    s.width = item[IT_POSITION] + item[IT_NUM_TOKENS] - s.start;
    s.ld = (s.width + 31) / 32 * 32;
    return s;
}

/* Scratch bytes of one item of this shape: scaled queries, scores, sums, 1 / sums, lengths. */
static int64_t item_scratch(item_shape_t s, int64_t hd) {
    return 2 * lines(4 * s.rows * hd) + lines(4 * s.rows * s.ld) + lines(4 * s.rows) +
           lines(8 * s.rows);
}

/* One item: its rows' attention into out, in ``item_scratch`` bytes at ``scratch``. */
static void attend_item(const float *q, int64_t H, int64_t hd, int64_t rep,
                        const cache_layout_t *cache, int f32, const int32_t *item, float scale,
                        float softcap, int64_t window, uint8_t *scratch, float *out) {
    int64_t slot = item[IT_SLOT], head = item[IT_HEAD], token0 = item[IT_TOKEN];
    int64_t position0 = item[IT_POSITION];
    item_shape_t shape = item_shape(item, rep, window);
    int64_t start = shape.start, rows = shape.rows, width = shape.width, ld = shape.ld;
    float *qs = take(&scratch, 4 * rows * hd), *scores = take(&scratch, 4 * rows * ld);
    float *acc = take(&scratch, 4 * rows * hd), *inverse = take(&scratch, 4 * rows);
    int64_t *lengths = take(&scratch, 8 * rows);
    memset(acc, 0, sizeof(float) * (size_t)(rows * hd));
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

/* One hs_attend call's work, as the pool's chunks see it: one item a chunk (pool.h). */
typedef struct {
    const float *q;
    int64_t H, hd, rep;
    const cache_layout_t *cache;
    int f32;
    const int32_t *items;
    float scale, softcap;
    int64_t window;
    float *out;
    uint8_t *data; /* per_thread bytes per member */
    int64_t per_thread;
} attend_job_t;

static void attend_chunk(void *ctx, int64_t it, int64_t member) {
    const attend_job_t *j = ctx;
    attend_item(j->q, j->H, j->hd, j->rep, j->cache, j->f32, j->items + it * IT_COLUMNS,
                j->scale, j->softcap, j->window, j->data + member * j->per_thread, j->out);
}

/* Attention of the query rows named by ``items`` over one layer's cache (keys and values of
 * this forward already stored). q and out [T, H, hd] float32; query head h r + i reads key/value
 * head h (r = H / KV). ``f32``: the cache holds float32, else bfloat16 bits. ``scale``
 * multiplies the queries; ``softcap`` (0: none) caps the scores; ``window`` (0: none) is the
 * number of most recent keys a row attends, its own included. Each thread takes the largest
 * item's scratch. ``pooled``: the items are the kernel's pool's chunks (pool.h), where the
 * forward's matmuls run on the pool too; else OpenMP's (torch's) threads share them, where
 * torch's matmuls run on those, so that the two teams never wait on the same cores. Returns 0,
 * or HS_SCRATCH_SHORT (scratch.h) before any work. */
int hs_attend(const float *q, int64_t H, int64_t KV, int64_t hd, const cache_layout_t *cache,
              int f32, const int32_t *items, int64_t num_items, float scale, float softcap,
              int64_t window, float *out, int pooled, hs_scratch_t *scratch) {
    int64_t rep = H / KV, per_thread = 0;
    for (int64_t it = 0; it < num_items; it++) {
        int64_t bytes = item_scratch(item_shape(items + it * IT_COLUMNS, rep, window), hd);
        per_thread = bytes > per_thread ? bytes : per_thread;
    }
    if (scratch_short(scratch, team_size() * per_thread)) return HS_SCRATCH_SHORT;
    attend_job_t job = {q, H, hd, rep, cache, f32, items, scale, softcap, window, out,
                        scratch->data, per_thread};
    if (pooled) {
        pool_run(attend_chunk, &job, num_items);
    } else {
#pragma omp parallel for schedule(dynamic, 1) if (num_items > 1)
        for (int64_t it = 0; it < num_items; it++) attend_chunk(&job, it, team_member());
    }
    return 0;
}

/* 1 where hs_attend runs a vector path (AVX-512 or AVX2), 0 where it runs the portable C. */
int hs_attend_vectorized(void) {
#if defined(HS_AVX2)
    return 1;
#else
    return 0;
#endif
}
