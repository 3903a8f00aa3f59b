/* The kernel library's threads (pool.h): each calling thread's team of workers, and the claims
 * by which a call's chunks are shared out.
 *
 * A call (an epoch) closes the last call's claims (``claim`` = epoch << 32 | CLOSED), writes its
 * job (function, context, chunks, members), then opens ``claim``: epoch << 32 | the next chunk.
 * A member takes a chunk by a compare-and-swap of ``claim`` from the value it read to the next,
 * and reads the job between the two: where the swap succeeds the claim word has not changed, so
 * the job it read is this epoch's (a new job is written only after ``claim`` is closed, and a
 * claim word never takes a value twice). A worker that wakes late finds the epoch changed or
 * every chunk taken and claims nothing. ``done`` counts finished chunks; the caller returns when
 * it reaches ``chunks``, and only then starts the next call.
 *
 * Waits spin, then sleep on a futex: a worker waits for the next epoch, the caller for the last
 * claimed chunks. How long they spin is the wait mode (``hs_set_passive``): alone, long enough
 * to span the gaps between a forward's calls; on a busy machine hardly at all, so that a
 * waiting thread's core goes to the thread it waits for; or, for a team whose threads share
 * cores (``threads.py`` packs them on a busy machine), yielding: a waiting thread gives its
 * core to the team mate it waits for at once and stays runnable, for a while, then sleeps. */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "pool.h"
#include "scratch.h"

#define MAX_WORKERS 255
#define CLOSED 0xffffffffu /* a claim word's chunk while its job is being written: none left */
#define SPIN_NS 2000000 /* spinning waits: 2 ms, past the gap between two decode rounds */
#define PASSIVE_SPIN_NS 20000 /* passive waits: 20 us, a sleep's cost, then the core is given up */
/* yielding waits: 50 ms, past a decode step's gaps (a worker waits through the step's Python
 * part), then the thread sleeps (an engine with nothing to do) */
#define YIELD_SPIN_NS 50000000

typedef struct pool pool_t;

/* What a worker starts from: its pool, its member number, and the epoch it has seen; the worker
 * writes its thread id (``hs_team_tids``) first. */
typedef struct {
    pool_t *pool;
    int64_t member;
    uint32_t epoch;
    int32_t tid;
} worker_arg_t;

struct pool {
    /* the job of the current epoch: written by the caller before it publishes ``claim`` */
    pool_fn fn;
    void *ctx;
    int64_t chunks, members;
    _Alignas(64) uint64_t claim; /* epoch << 32 | next chunk */
    _Alignas(64) uint32_t done;  /* chunks of this epoch done (futex: the caller waits) */
    int32_t caller_sleeps;
    _Alignas(64) uint32_t epoch; /* futex: idle workers wait for it to change */
    int32_t sleepers;
    int32_t quit;
    int32_t workers;
    unsigned forks; /* the process's fork count when the workers started */
    pthread_t threads[MAX_WORKERS];
    worker_arg_t args[MAX_WORKERS];
};

static volatile int passive; /* hs_set_passive: 0 spinning, 1 passive, 2 yielding waits */
static unsigned forks;       /* forks of this process's parents: a child's pools are not its own */
static __thread pool_t mine; /* the calling thread's (a worker's own is unused) */
static pthread_key_t owner_key;
static pthread_once_t once = PTHREAD_ONCE_INIT;

void hs_set_passive(int mode) { passive = mode == 2 ? 2 : mode != 0; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(uint32_t *word, uint32_t value) {
#if defined(__linux__)
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)word, (void)value;
    sched_yield();
#endif
}

static void futex_wake(uint32_t *word, int count) {
#if defined(__linux__)
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
#else
    (void)word, (void)count;
#endif
}

/* Spins until (*word == value) == equal, for the wait mode's time (the clock read every 256
 * turns; yielding waits yield the core every 8); returns the word's last value. */
static uint32_t spin_until(const uint32_t *word, uint32_t value, int equal) {
    int mode = passive;
    int64_t budget = mode == 2 ? YIELD_SPIN_NS : mode ? PASSIVE_SPIN_NS : SPIN_NS;
    int64_t start = now_ns();
    for (uint32_t turn = 1;; turn++) {
        uint32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if ((v == value) == equal) return v;
        if (mode == 2 && turn % 8 == 0)
            sched_yield();
        else
            CPU_RELAX();
        if (turn % 256 == 0 && now_ns() - start > budget) return v;
    }
}

/* Claims and runs chunks of epoch ``epoch`` as ``member`` until none is left. */
static void work(pool_t *p, uint32_t epoch, int64_t member) {
    uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((uint32_t)(c >> 32) != epoch) return;
#if defined(HS_POOL_DELAY_NS) /* the tests' build: a worker slow to read the job */
        if (member) nanosleep(&(struct timespec){0, HS_POOL_DELAY_NS}, NULL);
#endif
        pool_fn fn = __atomic_load_n(&p->fn, __ATOMIC_RELAXED);
        void *ctx = __atomic_load_n(&p->ctx, __ATOMIC_RELAXED);
        int64_t chunks = __atomic_load_n(&p->chunks, __ATOMIC_RELAXED);
        int64_t members = __atomic_load_n(&p->members, __ATOMIC_RELAXED);
        int64_t chunk = (int64_t)(uint32_t)c;
        if (chunk >= chunks || member >= members) return;
        /* the job read above is this epoch's only where claim has not changed since (the
         * fences: a job read here that the caller wrote after closing the claims means the
         * swap sees them closed) */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (!__atomic_compare_exchange_n(&p->claim, &c, c + 1, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_ACQUIRE))
            continue; /* c now holds claim's value */
        fn(ctx, chunk, member);
        uint32_t done = __atomic_add_fetch(&p->done, 1, __ATOMIC_SEQ_CST);
        if (done == (uint32_t)chunks && __atomic_load_n(&p->caller_sleeps, __ATOMIC_SEQ_CST))
            futex_wake(&p->done, 1);
        c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    }
}

static void *worker(void *arg) {
    worker_arg_t *a = arg;
#if defined(__linux__)
    __atomic_store_n(&a->tid, (int32_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
#else
    __atomic_store_n(&a->tid, -1, __ATOMIC_RELEASE);
#endif
    pool_t *p = a->pool;
    uint32_t seen = a->epoch;
    int spare = 0; /* the last job had no place for this member (a smaller team): sleep at once */
    for (;;) {
        uint32_t e = spare ? seen : spin_until(&p->epoch, seen, 0);
        if (e == seen) {
            __atomic_add_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
            while ((e = __atomic_load_n(&p->epoch, __ATOMIC_SEQ_CST)) == seen)
                futex_wait(&p->epoch, seen);
            __atomic_sub_fetch(&p->sleepers, 1, __ATOMIC_SEQ_CST);
        }
        if (__atomic_load_n(&p->quit, __ATOMIC_ACQUIRE)) return NULL;
        seen = e;
        work(p, e, a->member);
        spare = a->member >= __atomic_load_n(&p->members, __ATOMIC_RELAXED);
    }
}

/* Publishes epoch ``e``, waking the sleeping workers. */
static void publish(pool_t *p, uint32_t e) {
    __atomic_store_n(&p->epoch, e, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST) > 0) futex_wake(&p->epoch, INT_MAX);
}

/* Ends the workers of a calling thread that exits (the key's destructor). */
static void pool_end(void *arg) {
    pool_t *p = arg;
    __atomic_store_n(&p->quit, 1, __ATOMIC_RELEASE);
    publish(p, p->epoch + 1);
    for (int i = 0; i < p->workers; i++) pthread_join(p->threads[i], NULL);
}

static void after_fork(void) { forks++; }

static void init_once(void) {
    pthread_key_create(&owner_key, pool_end);
    pthread_atfork(NULL, NULL, after_fork);
}

/* The calling thread's pool with at least ``workers`` workers (fewer where threads cannot be
 * started: the members that exist do the work). Starting them is the one allocation (their
 * stacks), on a thread's first parallel call. */
static pool_t *pool_with(int64_t workers) {
    pthread_once(&once, init_once);
    pool_t *p = &mine;
    if (p->workers && p->forks != forks) p->workers = 0; /* a forked child: its workers are not */
    if (!p->workers) {
        p->forks = forks;
        pthread_setspecific(owner_key, p);
    }
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    if (p->workers < workers) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* signals go to the process's own threads */
        while (p->workers < workers) {
            worker_arg_t *arg = &p->args[p->workers];
            *arg = (worker_arg_t){p, p->workers + 1, p->epoch, 0};
            if (pthread_create(&p->threads[p->workers], NULL, worker, arg)) break;
            while (!__atomic_load_n(&arg->tid, __ATOMIC_ACQUIRE)) CPU_RELAX(); /* hs_team_tids */
            p->workers++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    return p;
}

int64_t hs_team_tids(int32_t *out, int64_t max) {
    pool_t *p = &mine;
    if (p->workers && p->forks != forks) return 0; /* a forked child's: not started here */
    int64_t n = 0;
    for (int i = 0; i < p->workers && n < max; i++) out[n++] = p->args[i].tid;
    return n;
}

void pool_run(pool_fn fn, void *ctx, int64_t chunks) {
    int64_t members = team_size();
    pool_t *p = members > 1 && chunks > 1 ? pool_with(members - 1) : NULL;
    if (!p || p->workers == 0) {
        for (int64_t c = 0; c < chunks; c++) fn(ctx, c, 0);
        return;
    }
    /* close the last job's claims first: a member that read its claim word (every chunk taken)
     * and then this job's count would otherwise take a chunk that is not there */
    uint32_t e = p->epoch + 1;
    __atomic_store_n(&p->claim, (uint64_t)e << 32 | CLOSED, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&p->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&p->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&p->chunks, chunks, __ATOMIC_RELAXED);
    __atomic_store_n(&p->members, members, __ATOMIC_RELAXED);
    __atomic_store_n(&p->done, 0, __ATOMIC_RELAXED);
#if defined(HS_POOL_DELAY_NS) /* the tests' build: a caller slow to open the claims */
    nanosleep(&(struct timespec){0, HS_POOL_DELAY_NS}, NULL);
#endif
    __atomic_store_n(&p->claim, (uint64_t)e << 32, __ATOMIC_RELEASE);
    publish(p, e);
    work(p, e, 0);
    uint32_t done = (uint32_t)chunks, d = spin_until(&p->done, done, 1);
    if (d == done) return;
    /* sleep until the last claimed chunk is done (its worker was descheduled in it) */
    __atomic_store_n(&p->caller_sleeps, 1, __ATOMIC_SEQ_CST);
    while ((d = __atomic_load_n(&p->done, __ATOMIC_SEQ_CST)) != done) futex_wait(&p->done, d);
    __atomic_store_n(&p->caller_sleeps, 0, __ATOMIC_RELAXED);
}
