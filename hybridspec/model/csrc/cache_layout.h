/* One layer's KV cache as the kernel's calls read it (``hybridspec.model.qgemm.CacheLayout``):
 * keys transposed, ``keys[slot, kv, d, pos]`` at element offset slot ks_slot + kv ks_head + d
 * ks_dim + pos; values ``values[slot, kv, pos, d]`` at slot vs_slot + kv vs_head + pos vs_pos +
 * d. Elements are bfloat16 bits, or float32 where a call says so. Built once per layer, since
 * the cache's tensors stay where they are. */
#ifndef HS_CACHE_LAYOUT_H
#define HS_CACHE_LAYOUT_H
#include <stdint.h>

typedef struct {
    uint16_t *keys;
    int64_t ks_slot, ks_head, ks_dim;
    uint16_t *values;
    int64_t vs_slot, vs_head, vs_pos;
} cache_layout_t;

#endif
