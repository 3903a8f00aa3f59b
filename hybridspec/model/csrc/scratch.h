/* The one scratch buffer of the kernel library's calls, owned by the caller
 * (``hybridspec.model.qgemm``: one per calling thread, grown when a call needs more, reused):
 * no kernel call allocates. A call that needs more than ``bytes`` writes what it needs to
 * ``need`` and returns HS_SCRATCH_SHORT before touching anything; the caller grows the buffer
 * and calls again. A call carves its parts from ``data``, each on a cache line of its own. */
#ifndef HS_SCRATCH_H
#define HS_SCRATCH_H
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct {
    uint8_t *data;
    int64_t bytes;
    int64_t need;
} hs_scratch_t;

enum { HS_SCRATCH_SHORT = 1 };

/* ``bytes`` rounded up to whole cache lines. */
static inline int64_t lines(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* The next ``bytes`` of the scratch at ``*at``, which moves past them (whole lines). */
static inline void *take(uint8_t **at, int64_t bytes) {
    void *part = *at;
    *at += lines(bytes);
    return part;
}

/* 0 when the scratch holds ``need`` bytes; else HS_SCRATCH_SHORT, ``need`` recorded. */
static inline int scratch_short(hs_scratch_t *scratch, int64_t need) {
    if (need <= scratch->bytes) return 0;
    scratch->need = need;
    return HS_SCRATCH_SHORT;
}

/* The OpenMP threads a parallel region may run (each takes its own part), and this one's. */
static inline int64_t team_size(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int64_t team_member(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#endif
