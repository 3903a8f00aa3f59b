/* A run of decoder layers in one call: each layer as hs_attn_in, hs_attend (on the pool) and
 * hs_mlp_block compute it, the same calls in the same order, so the result is equal to the bit
 * to calling them one by one (``hybridspec.model.decoder.KernelStack``). One call for a
 * forward's layers leaves the caller nothing to do between them. */
#include <stdint.h>

#include "cache_layout.h"
#include "layers.h"
#include "matmul.h"
#include "scratch.h"

/* One layer as hs_layers reads it (``kernel_abi.StackLayer``), built once per layer. */
typedef struct {
    const qweight_t *wqkv, *wo, *w_gate_up, *w_down;
    const uint16_t *attn_norm, *mlp_norm; /* [D] bfloat16 */
    const float *rope;                    /* [S, hd / 2, 2] float32: the layer's rope table */
    const cache_layout_t *cache;          /* the layer's keys and values */
    float eps;
    int64_t window; /* 0: every earlier key */
} stack_layer_t;

/* What every layer of one forward reads (``kernel_abi.StackPass``): its T tokens' cache slots
 * and positions, the attention's items (attention.c), and two float32 buffers [T, H, hd] for
 * each layer's q and attention output. */
typedef struct {
    int64_t T, H, KV, hd;
    const int64_t *slots, *positions;
    const int32_t *items;
    int64_t num_items;
    float scale, softcap;
    int f32; /* the cache holds float32, else bfloat16 */
    float *q, *attn;
} stack_pass_t;

/* Layers ``first`` up to ``end`` of ``layers``: layer i reads ``x`` [T, D] bfloat16 where i is
 * even, ``y`` where it is odd, and writes the other, so the last one's output is in ``y`` where
 * ``end`` is odd, else in ``x``. Returns ``end``, or the layer whose call found the scratch
 * short (scratch.h): the layers before it are done, and calling again from it once the scratch
 * has grown gives the same result (its input is as it was; its cache stores are written again,
 * the same values). */
int64_t hs_layers(const stack_layer_t *layers, int64_t first, int64_t end, const stack_pass_t *p,
                  uint16_t *x, uint16_t *y, hs_scratch_t *scratch) {
    for (int64_t i = first; i < end; i++) {
        const stack_layer_t *l = layers + i;
        uint16_t *in = i % 2 ? y : x, *out = i % 2 ? x : y;
        if (hs_attn_in(l->wqkv, in, p->T, l->attn_norm, l->eps, p->H, p->KV, p->hd, l->rope,
                       p->slots, p->positions, l->cache, p->q, scratch) ||
            hs_attend(p->q, p->H, p->KV, p->hd, l->cache, p->f32, p->items, p->num_items,
                      p->scale, p->softcap, l->window, p->attn, 1, scratch) ||
            hs_mlp_block(l->wo, l->w_gate_up, l->w_down, p->attn, 1, p->T, in, l->mlp_norm,
                         l->eps, out, scratch))
            return i;
    }
    return end;
}
