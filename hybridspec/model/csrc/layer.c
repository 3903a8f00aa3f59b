/* A decoder layer's calls around its attention, each equal to the bit to the separate calls it
 * fuses: ``hs_attn_in`` (RMSNorm, the fused q/k/v projection, rope and the cache stores,
 * ``hs_rope_store``) and ``hs_mlp_block`` (the output projection and residual, RMSNorm, the
 * gate/up projection, silu(gate) * up, the down projection and residual). The matmuls are
 * matmul.c's; the intermediate rows live in the caller's scratch (scratch.h). */
#include <stdint.h>
#include <string.h>

#include "cache_layout.h"
#include "fastmath.h"
#include "layers.h"
#include "matmul.h"
#include "pool.h"

/* One hs_rope_store call's work: one token a chunk (pool.h). */
typedef struct {
    const uint16_t *qkv;
    int64_t H, KV, hd;
    const float *rope;
    const int64_t *slots, *positions;
    const cache_layout_t *cache;
    float *q_out;
} rope_job_t;

static void rope_store_token(void *ctx, int64_t t, int64_t member) {
    const rope_job_t *j = ctx;
    (void)member;
    const cache_layout_t *cache = j->cache;
    uint16_t *keys = cache->keys, *values = cache->values;
    int64_t ks_slot = cache->ks_slot, ks_head = cache->ks_head, ks_dim = cache->ks_dim;
    int64_t vs_slot = cache->vs_slot, vs_head = cache->vs_head, vs_pos = cache->vs_pos;
    int64_t H = j->H, KV = j->KV, hd = j->hd, width = (H + 2 * KV) * hd, half = hd / 2;
    const uint16_t *row = j->qkv + t * width;
    int64_t slot = j->slots[t], pos = j->positions[t];
    const float *cs = j->rope + pos * hd;
    float *q_out = j->q_out;
    for (int64_t h = 0; h < H + KV; h++) {
        const uint16_t *x = row + h * hd;
        for (int64_t i = 0; i < half; i++) {
            float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
            float c = cs[2 * i], s = cs[2 * i + 1];
            float r1 = x1 * c - x2 * s, r2 = x2 * c + x1 * s;
            if (h < H) {
                q_out[(t * H + h) * hd + i] = r1;
                q_out[(t * H + h) * hd + i + half] = r2;
            } else {
                uint16_t *k = keys + slot * ks_slot + (h - H) * ks_head + pos;
                k[i * ks_dim] = f32_to_bf16(r1);
                k[(i + half) * ks_dim] = f32_to_bf16(r2);
            }
        }
    }
    for (int64_t kv = 0; kv < KV; kv++)
        memcpy(values + slot * vs_slot + kv * vs_head + pos * vs_pos,
               row + (H + KV) * hd + kv * hd, sizeof(uint16_t) * (size_t)hd);
}

/* The attention's inputs from the fused q/k/v projection ``qkv [T, (H + 2 KV) hd]`` bfloat16:
 * q and k rotated by rope (rotate-half convention, float32: out[i] = x[i] c - x[i + hd/2] s,
 * out[i + hd/2] = x[i + hd/2] c + x[i] s with c, s = ``rope[pos, i]``), q written to ``q_out
 * [T, H, hd]`` float32, k (rounded to bfloat16) and v (as they are) into the cache at token t's
 * ``slots[t]`` and ``positions[t]`` (``cache``, cache_layout.h: keys transposed).
 * ``rope [S, hd / 2, 2]`` float32 (cos, sin). */
void hs_rope_store(const uint16_t *qkv, int64_t T, int64_t H, int64_t KV, int64_t hd,
                   const float *rope, const int64_t *slots, const int64_t *positions,
                   const cache_layout_t *cache, float *q_out) {
    rope_job_t job = {qkv, H, KV, hd, rope, slots, positions, cache, q_out};
    if (T > 16) {
        pool_run(rope_store_token, &job, T);
    } else {
        for (int64_t t = 0; t < T; t++) rope_store_token(&job, t, 0); /* a round's few tokens */
    }
}

/* A decoder layer up to its attention in one call, as hs_matmul then hs_rope_store would
 * compute it: qkv = rms_norm(x) * attn_norm @ wqkv.T, then q, k and v as hs_rope_store
 * leaves them. x [T, wqkv.K] bfloat16; q_out [T, H, hd] float32. Equal to the two calls.
 * Returns 0, or HS_SCRATCH_SHORT (scratch.h). */
int hs_attn_in(const qweight_t *wqkv, const uint16_t *x, int64_t T, const uint16_t *attn_norm,
               float eps, int64_t H, int64_t KV, int64_t hd, const float *rope,
               const int64_t *slots, const int64_t *positions, const cache_layout_t *cache,
               float *q_out, hs_scratch_t *scratch) {
    int64_t qkv_bytes = 2 * T * wqkv->N;
    if (scratch_short(scratch, lines(qkv_bytes) + matmul_scratch(wqkv, T)))
        return HS_SCRATCH_SHORT;
    uint8_t *at = scratch->data;
    uint16_t *qkv = take(&at, qkv_bytes);
    matmul_run(wqkv, x, 0, T, PRO_RMSNORM, attn_norm, eps, NULL, qkv, at);
    hs_rope_store(qkv, T, H, KV, hd, rope, slots, positions, cache, q_out);
    return 0;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* A decoder layer after its attention, as three hs_matmul calls would compute it, in one call:
 * h = attn @ wo.T + x; y = silu_mul(rms_norm(h) * mlp_norm @ w_gate_up.T) @ w_down.T + h.
 * attn [T, wo.K] bfloat16 or float32 (attn_f32); x and y [T, wo.N] bfloat16. The same
 * operations in the same order as the three calls: the results are equal to the bit.
 * Returns 0, or HS_SCRATCH_SHORT (scratch.h). */
int hs_mlp_block(const qweight_t *wo, const qweight_t *w_gate_up, const qweight_t *w_down,
                 const void *attn, int attn_f32, int64_t T, const uint16_t *x,
                 const uint16_t *mlp_norm, float eps, uint16_t *y, hs_scratch_t *scratch) {
    int64_t h_bytes = 2 * T * wo->N, gate_up_bytes = 2 * T * w_gate_up->N;
    int64_t matmuls = max3(matmul_scratch(wo, T), matmul_scratch(w_gate_up, T),
                           matmul_scratch(w_down, T));
    if (scratch_short(scratch, lines(h_bytes) + lines(gate_up_bytes) + matmuls))
        return HS_SCRATCH_SHORT;
    uint8_t *at = scratch->data;
    uint16_t *h = take(&at, h_bytes), *gate_up = take(&at, gate_up_bytes);
    matmul_run(wo, attn, attn_f32, T, PRO_NONE, NULL, 0.0f, x, h, at);
    matmul_run(w_gate_up, h, 0, T, PRO_RMSNORM, mlp_norm, eps, NULL, gate_up, at);
    matmul_run(w_down, gate_up, 0, T, PRO_SILU_MUL, NULL, 0.0f, h, y, at);
    return 0;
}
