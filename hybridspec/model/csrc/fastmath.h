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

/* hs_exp on HS_VF_LANES lanes (isa.h): the same operations in the same order, lane by lane
 * (max and min return their second operand for NaN, as the scalar comparisons do; the floor
 * is the instruction's, equal to floor_small's). */
static inline hs_vf hs_expv(hs_vf x) {
    x = HS_MM(min_ps)(HS_MM(max_ps)(x, HS_MM(set1_ps)(-87.0f)), HS_MM(set1_ps)(88.0f));
    hs_vf n = HS_MM(add_ps)(HS_MM(mul_ps)(x, HS_MM(set1_ps)(1.44269504f)), HS_MM(set1_ps)(0.5f));
    n = HS_VF_FLOOR(n);
    hs_vf r = HS_MM(sub_ps)(x, HS_MM(mul_ps)(n, HS_MM(set1_ps)(0.693359375f)));
    r = HS_MM(sub_ps)(r, HS_MM(mul_ps)(n, HS_MM(set1_ps)(-2.12194440e-4f)));
    hs_vf p = HS_MM(add_ps)(HS_MM(mul_ps)(HS_MM(set1_ps)(1.9875691500e-4f), r),
                            HS_MM(set1_ps)(1.3981999507e-3f));
    p = HS_MM(add_ps)(HS_MM(mul_ps)(p, r), HS_MM(set1_ps)(8.3334519073e-3f));
    p = HS_MM(add_ps)(HS_MM(mul_ps)(p, r), HS_MM(set1_ps)(4.1665795894e-2f));
    p = HS_MM(add_ps)(HS_MM(mul_ps)(p, r), HS_MM(set1_ps)(1.6666665459e-1f));
    p = HS_MM(add_ps)(HS_MM(mul_ps)(p, r), HS_MM(set1_ps)(5.0000001201e-1f));
    p = HS_MM(add_ps)(HS_MM(add_ps)(HS_MM(mul_ps)(p, HS_MM(mul_ps)(r, r)), r), HS_MM(set1_ps)(1.0f));
    hs_vf scale = HS_VF_FROM_BITS(HS_MM(slli_epi32)(
        HS_MM(add_epi32)(HS_MM(cvttps_epi32)(n), HS_MM(set1_epi32)(127)), 23));
    return HS_MM(mul_ps)(p, scale);
}
#endif

#endif
