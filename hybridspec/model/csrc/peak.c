/* The machine's int8 multiply-accumulate peak, as the matmul computes them (``bench
 * compute_bound``): each thread of the OpenMP team runs ``steps`` rounds of CHAINS independent
 * u8 x s8 dot steps on values held in registers, with no memory read, so that the time is the
 * instruction's throughput alone. The steps are the matmul's own (isa.h): AVX512-VNNI's
 * _mm512_dpbusd_epi32 (64 multiply-accumulates), AVX2's maddubs + madd + add (32), else
 * portable C (one). CHAINS independent accumulators cover the instruction's latency. */
#include <stdint.h>

#include <omp.h>

#include "isa.h"

#define CHAINS 12 /* independent sums: enough to hide a dot step's latency at 2 per cycle */

/* One thread's ``steps`` rounds; returns the integers' sum, which the caller keeps (so that
 * no step is dead code) and ``*macs`` gets the multiply-accumulates done. */
static int64_t thread_peak(int64_t steps, int32_t seed, int64_t *macs) {
    int64_t total = 0;
#if defined(HS_VNNI)
    __m512i a = _mm512_set1_epi32(seed), b = _mm512_set1_epi32(seed ^ 0x01020304);
    __m512i acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
    for (int64_t i = 0; i < steps; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        __asm__ volatile("" : "+v"(a)); /* a is not known constant: no step is folded away */
    }
    for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_epi32(acc[c]);
    *macs = steps * CHAINS * 64;
#elif defined(HS_AVX2)
    __m256i a = _mm256_set1_epi32(seed), b = _mm256_set1_epi32(seed ^ 0x01020304);
    __m256i ones = _mm256_set1_epi16(1), acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_epi32(c);
    for (int64_t i = 0; i < steps; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++)
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
        __asm__ volatile("" : "+x"(a));
    }
    int32_t lanes[8];
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_si256((__m256i *)lanes, acc[c]);
        for (int j = 0; j < 8; j++) total += lanes[j];
    }
    *macs = steps * CHAINS * 32;
#else
    uint8_t a = (uint8_t)seed;
    int8_t b = (int8_t)(seed >> 8);
    int32_t acc[CHAINS];
    for (int c = 0; c < CHAINS; c++) acc[c] = c;
    for (int64_t i = 0; i < steps; i++) {
        for (int c = 0; c < CHAINS; c++) acc[c] += (int32_t)a * b;
        __asm__ volatile("" : "+r"(a));
    }
    for (int c = 0; c < CHAINS; c++) total += acc[c];
    *macs = steps * CHAINS;
#endif
    return total;
}

/* ``steps`` rounds on each thread of the team (torch's threads: the runtime is shared);
 * returns the multiply-accumulates done by all of them, ``*checksum`` their integers' sum. */
int64_t hs_int8_peak(int64_t steps, int32_t seed, int64_t *checksum) {
    int64_t macs = 0, sum = 0;
#pragma omp parallel reduction(+ : macs, sum)
    {
        int64_t done = 0;
        sum += thread_peak(steps, seed + omp_get_thread_num(), &done);
        macs += done;
    }
    *checksum = sum;
    return macs;
}
