/* The instruction sets the kernel library is compiled for, decided once from the compiler's
 * target macros (``-march=native``, or the tests' ``-mno-avx512vnni``, ``-mno-avx512f`` and
 * ``-mno-avx2`` builds), each implying the one before:
 *   HS_AVX2    AVX2 and FMA: the matmul's 256-bit integer dots, the attention's 8-lane tiles;
 *   HS_AVX512  AVX-512 F, BW and VL as well: the attention's 16-lane tiles;
 *   HS_VNNI    AVX512-VNNI as well: the matmul's 512-bit u8 x s8 dots.
 * Without HS_AVX2 every kernel runs its portable C, which computes the same integers and the
 * same float operations in the same order: every path gives the same bits. */
#ifndef HS_ISA_H
#define HS_ISA_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HS_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HS_AVX512 1
#if defined(__AVX512VNNI__)
#define HS_VNNI 1
#endif
#endif
#endif

/* The float vectors of the attention and the exp: 16 lanes with AVX-512, else 8 with AVX2.
 * HS_MM(op) names an intrinsic at that width (HS_MM(add_ps): _mm512_add_ps or _mm256_add_ps),
 * so that a loop is written once for both. */
#if defined(HS_AVX512)
typedef __m512 hs_vf;
#define HS_VF_LANES 16
#define HS_MM(op) _mm512_##op
#define HS_VF_FLOOR(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define HS_VF_FROM_BITS(x) _mm512_castsi512_ps(x)
#elif defined(HS_AVX2)
typedef __m256 hs_vf;
#define HS_VF_LANES 8
#define HS_MM(op) _mm256_##op
#define HS_VF_FLOOR(x) _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define HS_VF_FROM_BITS(x) _mm256_castsi256_ps(x)
#endif

/* Small helpers whose callers pass constant row counts: inlined, so that loops over those
 * rows unroll and their accumulators stay in registers. */
#define HS_INLINE static inline __attribute__((always_inline))

#endif
