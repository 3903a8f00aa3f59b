/* The library's per-layer entry points (layer.c, attention.c), as stack.c calls them in turn. */
#ifndef HS_LAYERS_H
#define HS_LAYERS_H
#include <stdint.h>

#include "cache_layout.h"
#include "matmul.h"
#include "scratch.h"

int hs_attn_in(const qweight_t *wqkv, const uint16_t *x, int64_t T, const uint16_t *attn_norm,
               float eps, int64_t H, int64_t KV, int64_t hd, const float *rope,
               const int64_t *slots, const int64_t *positions, const cache_layout_t *cache,
               float *q_out, hs_scratch_t *scratch);

int hs_attend(const float *q, int64_t H, int64_t KV, int64_t hd, const cache_layout_t *cache,
              int f32, const int32_t *items, int64_t num_items, float scale, float softcap,
              int64_t window, float *out, int pooled, hs_scratch_t *scratch);

int hs_mlp_block(const qweight_t *wo, const qweight_t *w_gate_up, const qweight_t *w_down,
                 const void *attn, int attn_f32, int64_t T, const uint16_t *x,
                 const uint16_t *mlp_norm, float eps, uint16_t *y, hs_scratch_t *scratch);

#endif
