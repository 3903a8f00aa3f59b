/* The kernel library's float conversions and its one exp, as plain arithmetic (no library
 * call), so that a loop using them vectorizes with the same operations lane for lane as the
 * scalar code; the vector forms below spell out those operations in the same order. */
#ifndef HS_FASTMATH_H
#define HS_FASTMATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Rounded to the nearest bfloat16, ties to even; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

/* floor(y) for |y| < 2^22, exactly: the nearest integer (adding and subtracting 1.5 * 2^23
 * rounds to it, ties to even), less one where that is above y. Plain arithmetic, where a
 * floorf call would keep the loops that use it from vectorizing. */
static inline float floor_small(float y) {
    float t = (y + 12582912.0f) - 12582912.0f;
    return t > y ? t - 1.0f : t;
}

/* exp(x) in float32 (Cephes expf): x clamped to [-87, 88] (NaN to -87), n = floor(x log2 e +
 * 1/2), r = x - n ln 2 in two steps, a degree-6 polynomial in r, times 2^n. For x <= 0 it is
 * ``attention_kernels.fast_exp`` value for value (the attention's weights); the MLP's silu
 * takes it at every bfloat16 value. */
static inline float hs_exp(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    float n = floor_small(x * 1.44269504f + 0.5f);
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

#if defined(HS_AVX2)
/* bf16_to_f32 on the 8 bfloat16 values at ``x``. */
static inline __m256 bf16x8_to_f32(const uint16_t *x) {
    __m128i h = _mm_loadu_si128((const __m128i *)x);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* hs_exp on the lanes of a vector type ``vf`` whose intrinsics MM(op) names: the same
 * operations in the same order, lane by lane (max and min return their second operand for NaN,
 * as the scalar comparisons do; the floor is the instruction's, equal to floor_small's).
 * Defined once per width: hs_exp8 (AVX2, the matmul's 8-lane prologues) and hs_expv on
 * HS_VF_LANES lanes (isa.h: 16 with AVX-512, the attention's). */
#define HS_EXP_VECTOR(name, vf, MM, FLOOR, FROM_BITS)                                        \
    static inline vf name(vf x) {                                                          \
        x = MM(min_ps)(MM(max_ps)(x, MM(set1_ps)(-87.0f)), MM(set1_ps)(88.0f));             \
        vf n = FLOOR(MM(add_ps)(MM(mul_ps)(x, MM(set1_ps)(1.44269504f)), MM(set1_ps)(0.5f))); \
        vf r = MM(sub_ps)(x, MM(mul_ps)(n, MM(set1_ps)(0.693359375f)));                      \
        r = MM(sub_ps)(r, MM(mul_ps)(n, MM(set1_ps)(-2.12194440e-4f)));                      \
        vf p = MM(add_ps)(MM(mul_ps)(MM(set1_ps)(1.9875691500e-4f), r),                      \
                          MM(set1_ps)(1.3981999507e-3f));                                    \
        p = MM(add_ps)(MM(mul_ps)(p, r), MM(set1_ps)(8.3334519073e-3f));                     \
        p = MM(add_ps)(MM(mul_ps)(p, r), MM(set1_ps)(4.1665795894e-2f));                     \
        p = MM(add_ps)(MM(mul_ps)(p, r), MM(set1_ps)(1.6666665459e-1f));                     \
        p = MM(add_ps)(MM(mul_ps)(p, r), MM(set1_ps)(5.0000001201e-1f));                     \
        p = MM(add_ps)(MM(add_ps)(MM(mul_ps)(p, MM(mul_ps)(r, r)), r), MM(set1_ps)(1.0f));   \
        vf scale = FROM_BITS(                                                                \
            MM(slli_epi32)(MM(add_epi32)(MM(cvttps_epi32)(n), MM(set1_epi32)(127)), 23));    \
        return MM(mul_ps)(p, scale);                                                         \
    }

#define HS_MM256(op) _mm256_##op
#define HS_FLOOR256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
HS_EXP_VECTOR(hs_exp8, __m256, HS_MM256, HS_FLOOR256, _mm256_castsi256_ps)
#if defined(HS_AVX512)
HS_EXP_VECTOR(hs_expv, hs_vf, HS_MM, HS_VF_FLOOR, HS_VF_FROM_BITS)
#else
#define hs_expv hs_exp8
#endif
#endif

#endif
