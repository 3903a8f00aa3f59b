/* The kernel library's own threads (pool.c): a call's parallel work as numbered chunks that the
 * calling thread and its workers claim one at a time, the call returning once every chunk is
 * done, whoever did it.
 *
 * OpenMP's regions end at a barrier that every thread of the team must reach: on a busy machine
 * the worker the OS descheduled, even one with nothing left to do, holds the others there until
 * it runs again, at each of a forward's hundreds of regions. Here a call waits only for the
 * chunks that were claimed: a worker that has not woken yet claims nothing, and the calling
 * thread does its share. Only a worker descheduled inside a chunk is waited for. */
#ifndef HS_POOL_H
#define HS_POOL_H
#include <stdint.h>

/* One chunk of a call's work, run by team member ``member`` (0: the calling thread; each
 * member's scratch is its own). */
typedef void (*pool_fn)(void *ctx, int64_t chunk, int64_t member);

/* fn(ctx, c, member) for every c in [0, chunks), each exactly once, on the calling thread and
 * up to team_size() - 1 workers of its own (started on its first call); returns when all are
 * done. One chunk, or a team of one, runs on the calling thread alone. */
__attribute__((visibility("hidden"))) void pool_run(pool_fn fn, void *ctx, int64_t chunks);

#endif
