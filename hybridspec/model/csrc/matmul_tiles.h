/* One tile's dot products (matmul.c): out[i][r] for rows i < tt of x against the 16 rows r of
 * one tile of W whose scales come in S sub-groups per group of 32 (quads 8 / S at a time), per
 * instruction set (isa.h), each as its named steps: unpack a group's codes into vectors of
 * unsigned bytes, reduce each sub-group to one integer per row (``dot``), scale it into the
 * float accumulators (``scale``). The portable C is its own function; all three compute the
 * same integers and the same float operations in the same order (the vector paths leave out
 * the offsets' step for a matrix without offsets: it adds a zero product to a sum that is never
 * -0, which changes no bit). The vector paths are specialised on the kinds of matrix a GGUF
 * file holds most (matmul.c, ``tile_dot_kind``); the VNNI one takes up to 16 rows in one pass,
 * the AVX2 one a row alone (a decode step's) in one pass and more rows in two, 8 rows of the
 * tile each. Included once, by matmul.c, after ``tile_job_t``. */
#ifndef HS_MATMUL_TILES_H
#define HS_MATMUL_TILES_H

#if defined(HS_VNNI)
/* c[u]: quad u of a group's 4- or 6-bit codes for a tile's 16 rows as unsigned bytes
 * (matmul.c's layout): 4 bits in the low and high nibbles of 4 vectors; 6 bits with their high
 * 2 bits at bits 2 (u % 4) of vector 4 + u / 4. */
HS_INLINE void unpack_nibbles(const uint8_t *src, int bits, __m512i c[QUADS]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int p = 0; p < 4; p++) {
        __m512i b = _mm512_loadu_si512((const void *)(src + QB * p));
        c[p] = _mm512_and_si512(b, low4);
        c[p + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    }
    if (bits != 6) return;
    const __m512i mask = _mm512_set1_epi8(0x30);
    for (int v = 0; v < 2; v++) {
        __m512i b = _mm512_loadu_si512((const void *)(src + QB * (4 + v)));
        c[4 * v] = _mm512_or_si512(c[4 * v], _mm512_and_si512(_mm512_slli_epi16(b, 4), mask));
        c[4 * v + 1] =
            _mm512_or_si512(c[4 * v + 1], _mm512_and_si512(_mm512_slli_epi16(b, 2), mask));
        c[4 * v + 2] = _mm512_or_si512(c[4 * v + 2], _mm512_and_si512(b, mask));
        c[4 * v + 3] =
            _mm512_or_si512(c[4 * v + 3], _mm512_and_si512(_mm512_srli_epi16(b, 2), mask));
    }
}
#endif

#if defined(HS_AVX2)
#ifndef HS_PF
#define HS_PF 2048 /* bytes of codes read ahead (software prefetch) */
#endif
/* Software prefetch of the codes HS_PF bytes past group g's (and of the factors about as far
 * ahead in their own streams): a tile's codes are read once, in order, and the hardware's
 * prefetcher alone leaves the loop waiting on memory while it computes, and computing while
 * it waits (a verify's rows then cost more than their arithmetic). The addresses are formed
 * as integers: past the end of the matrix a prefetch is a hint that never faults. */
HS_INLINE void prefetch_ahead(const tile_job_t job, int64_t g, int S, int64_t tb) {
    const uintptr_t codes = (uintptr_t)job.codes + (uintptr_t)(g * tb + HS_PF);
    for (int64_t line = 0; line < tb; line += 64)
        _mm_prefetch((const char *)(codes + (uintptr_t)line), _MM_HINT_T0);
    const int64_t ahead = g * S * ROWS + HS_PF / 8; /* S * 16 factors a group */
    const factors_t w[2] = {job.dw, job.mw};
    for (int i = 0; i < 2; i++) {
        uintptr_t at = w[i].step ? (uintptr_t)w[i].step + (uintptr_t)ahead
                       : w[i].h  ? (uintptr_t)w[i].h + 2 * (uintptr_t)ahead
                       : w[i].f  ? (uintptr_t)w[i].f + 4 * (uintptr_t)ahead
                                 : 0;
        if (at) _mm_prefetch((const char *)at, _MM_HINT_T0);
    }
}

#endif

#if defined(HS_VNNI)
/* The factors of a tile's 16 rows at ``at`` in group g, as float32 (exact products), in the
 * form ``form`` (a constant where the caller specialises on it: FORM_ANY tests ``w``). */
HS_INLINE __m512 factors512(factors_t w, int64_t at, int64_t g, int form) {
    if (form == FORM_NONE) return _mm512_setzero_ps();
    if (form == FORM_ANY && w.f) return _mm512_loadu_ps(w.f + at);
    if (form == FORM_ANY && w.h)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w.h + at)));
    if (form == FORM_ANY && !w.step) return _mm512_setzero_ps();
    __m512i steps = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w.step + at)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(steps), _mm512_loadu_ps(w.super + (g / SUPER) * ROWS));
}

/* c[u]: quad u of one group's codes for the tile's 16 rows, as unsigned bytes (8 bits: c +
 * 128 as stored; 4 and 6 bits: unpack_nibbles). */
HS_INLINE void unpack512(const uint8_t *src, int bits, __m512i c[QUADS]) {
    if (bits != 8) {
        unpack_nibbles(src, bits, c);
        return;
    }
    for (int u = 0; u < QUADS; u++) c[u] = _mm512_loadu_si512((const void *)(src + QB * u));
}

/* s + the integer dot of quads [u0, u0 + span) of ``c`` with one row's codes ``qg`` (u8 x s8,
 * VNNI), in ``chains`` independent sums added at the end (integers: the same sum in any
 * order), so that a row alone does not wait on one chain of ``span`` dependent VNNI steps. */
HS_INLINE __m512i dot512(const __m512i *c, int u0, int span, const int8_t *qg, int chains,
                         __m512i s) {
    __m512i part[4];
    part[0] = s;
    for (int p = 1; p < chains; p++) part[p] = _mm512_setzero_si512();
#pragma GCC unroll 8 /* whole: c[u] stays in registers */
    for (int u = u0; u < u0 + span; u++) {
        int32_t quad;
        memcpy(&quad, qg + 4 * u, 4);
        part[u % chains] = _mm512_dpbusd_epi32(part[u % chains], c[u], _mm512_set1_epi32(quad));
    }
    if (chains == 4) {
        part[0] = _mm512_add_epi32(part[0], part[2]);
        part[1] = _mm512_add_epi32(part[1], part[3]);
    }
    return chains > 1 ? _mm512_add_epi32(part[0], part[1]) : part[0];
}

/* tile_dot for ``tt`` rows with the codes' ``bits`` and the factors' forms ``dform`` and
 * ``mform`` constant where the caller knows them (``bits`` 0: the job's), in one pass over
 * the tile: each group's codes are unpacked once for all rows. */
HS_INLINE void tile_dot_vnni(const tile_job_t job, int bits, int S, int tt, int dform,
                             int mform, float out[][ROWS]) {
    if (!bits) bits = job.bits;
    const int span = QUADS / S, zero = code_zero(bits);
    const int offset = mform == FORM_ANY ? has_factors(job.mw) : mform != FORM_NONE;
    const int chains = tt == 1 ? 4 : (tt == 2 ? 2 : 1); /* independent sums a row's dot takes */
    const int64_t G = job.G, K = job.K, tb = tile_bytes(bits), GS_ = G * S;
    __m512 acc[TILE_T];
    for (int i = 0; i < tt; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i c[QUADS];
        prefetch_ahead(job, g, S, tb);
        unpack512(job.codes + g * tb, bits, c);
        for (int h = 0; h < S; h++) {
            const int64_t at = (g * S + h) * ROWS, sub = g * S + h;
            const __m512 d = factors512(job.dw, at, g, dform);
            const __m512 m = offset ? factors512(job.mw, at, g, mform) : _mm512_setzero_ps();
            for (int i = 0; i < tt; i++) { /* 6, 8 bits: from - 32 or - 128 sum q */
                __m512i s = zero ? _mm512_set1_epi32(-zero * job.qs[i * GS_ + sub])
                                 : _mm512_setzero_si512();
                s = dot512(c, h * span, span, job.q + i * K + g * GS, chains, s);
                /* scale: fma(s, d dx, acc), then fma(m, sx, acc) where there are offsets */
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(job.dx[i * G + g]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
                if (offset)
                    acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(job.sx[i * GS_ + sub]), acc[i]);
            }
        }
    }
    for (int i = 0; i < tt; i++) _mm512_storeu_ps(out[i], acc[i]);
}

#elif defined(HS_AVX2)
/* factors512 for the 8 rows of one half of a tile. */
HS_INLINE __m256 factors256(factors_t w, int64_t at, int64_t g, int half, int form) {
    if (form == FORM_NONE) return _mm256_setzero_ps();
    if (form == FORM_ANY && w.f) return _mm256_loadu_ps(w.f + at);
#if defined(__F16C__)
    if (form == FORM_ANY && w.h)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.h + at)));
#else
    if (form == FORM_ANY && w.h) {
        float v[8];
        for (int i = 0; i < 8; i++) v[i] = f16_to_f32(w.h[at + i]);
        return _mm256_loadu_ps(v);
    }
#endif
    if (form == FORM_ANY && !w.step) return _mm256_setzero_ps();
    __m256i steps = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w.step + at)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(steps),
                         _mm256_loadu_ps(w.super + (g / SUPER) * ROWS + 8 * half));
}

/* Quad u of one half tile's group of codes (``src`` at its 8 rows, matmul.c's layout) as
 * dot256 multiplies it, read where it is used: 4 and 6 bits as unsigned bytes (as VNNI's
 * unpack_nibbles gives them), 8 bits as the signed codes c (dot256 multiplies |c| by q with
 * c's sign, so that u8 x s8 pairs stay within int16). Unpacking a quad at its use keeps two
 * code vectors live instead of eight, which leaves the registers to the rows' sums (AVX2 has
 * 16); the loads it repeats hit the cache lines the first one brought in. */
HS_INLINE __m256i quad256(const uint8_t *src, int bits, int u) {
    if (bits == 8)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(src + QB * u)),
                                _mm256_set1_epi8((char)0x80));
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(src + QB * (u % 4)));
    __m256i c = _mm256_and_si256(u < 4 ? b : _mm256_srli_epi16(b, 4), low4);
    if (bits == 6) { /* the high 2 bits, at bits 2 (u % 4) of vector 4 + u / 4, to bits 4..5 */
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(src + QB * (4 + u / 4)));
        const int shift = 4 - 2 * (u % 4);
        const __m256i high = shift > 0    ? _mm256_slli_epi16(hb, shift)
                             : shift == 0 ? hb
                                          : _mm256_srli_epi16(hb, -shift);
        c = _mm256_or_si256(c, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    }
    return c;
}

/* The quads whose u8 x s8 pair sums (maddubs) add up in int16 before they widen to int32:
 * a pair sums to at most 2 * 127 |c|, so 8 quads of 4-bit codes (30,480), 2 of 6-bit ones
 * (32,004), 1 of 8-bit |c| (32,512) stay under 32,768 (|q| <= 127: quantize_row). The sum is
 * the same integer either way. */
#define RUN_OF(bits) ((bits) == 4 ? 8 : ((bits) == 6 ? 2 : 1))

/* One quad's products of codes ``c`` with x's quad ``q`` (broadcast), as the ``n``-th quad of
 * a run of quads (RUN_OF) whose int16 sum is ``*p``: added to it, and the sum widened into
 * ``*s`` at the run's end or at ``last`` (8 bits: |c| times q with c's sign). ``*p`` is held in
 * a register as it is formed (the empty asm): left to itself the compiler reassociates the
 * integer adds after all of a tile's products, which keeps them all live and spills them. */
HS_INLINE void run_step(__m256i c, __m256i q, int bits, int n, int last, __m256i *p, __m256i *s) {
    const int run = RUN_OF(bits);
    if (bits == 8) { /* |c| (u8) x sign(q, c) (s8) */
        q = _mm256_sign_epi8(q, c);
        c = _mm256_sign_epi8(c, c);
    }
    const __m256i pair = _mm256_maddubs_epi16(c, q);
    *p = n % run == 0 ? pair : _mm256_add_epi16(*p, pair);
    __asm__("" : "+x"(*p));
    if (n % run == run - 1 || last)
        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(*p, _mm256_set1_epi16(1)));
}

/* A row's integer sum of a sub-group before its products: 6 bits, - 32 times the sum of its
 * activations' codes ``qs`` (the codes are stored plus 32); 4 and 8 bits, 0. */
HS_INLINE __m256i sum_start(int bits, int32_t qs) {
    return _mm256_set1_epi32(bits == 6 ? -32 * qs : 0);
}

/* acc plus a sub-group's integer sums ``s`` scaled by the factors ``d`` times x's group scale
 * ``dx``, then, where the matrix has offsets, plus ``m`` times x's scaled sum ``sx`` (as
 * tile_dot_vnni's, in the same order). */
HS_INLINE __m256 scale256(__m256 acc, __m256i s, __m256 d, float dx, int offset, __m256 m,
                          float sx) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
    return offset ? _mm256_fmadd_ps(m, _mm256_set1_ps(sx), acc) : acc;
}

/* dot512 on 256 bits for quads [u0, u1) of the codes at ``src`` (quad256): u8 x s8 pairs
 * summed to int16, runs of quads (RUN_OF) added in int16, then widened to int32 (8 bits: |c|
 * times q with c's sign). 6 bits (runs of 2) unpack a run's two quads, then form each row's
 * int16 sum of the run and widen it at once: no row's partial sum outlives its run; longer
 * runs take a quad at a time (run_step). ``u0`` and ``u1`` are constants where this is inlined
 * (tile_dot unrolls its sub-groups), so that quad256's shifts and vectors are too. */
HS_INLINE void dot256(const uint8_t *src, int bits, int u0, int u1, const int8_t *qg, int64_t K,
                      int tt, __m256i *s) {
    if (RUN_OF(bits) == 2 && (u1 - u0) % 2 == 0) {
#pragma GCC unroll 4
        for (int u = u0; u < u1; u += 2) {
            const __m256i c0 = quad256(src, bits, u), c1 = quad256(src, bits, u + 1);
            for (int i = 0; i < tt; i++) {
                int32_t q0, q1;
                memcpy(&q0, qg + i * K + 4 * u, 4);
                memcpy(&q1, qg + i * K + 4 * u + 4, 4);
                /* run_step's integers, without its hold on the sum: it lives only here */
                const __m256i p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(q0)),
                                     _mm256_maddubs_epi16(c1, _mm256_set1_epi32(q1)));
                s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
        }
        return;
    }
    __m256i p[TILE_T];
#pragma GCC unroll 8 /* whole: the runs' tests fold */
    for (int u = u0; u < u1; u++) {
        const __m256i c = quad256(src, bits, u);
        for (int i = 0; i < tt; i++) {
            int32_t quad;
            memcpy(&quad, qg + i * K + 4 * u, 4);
            run_step(c, _mm256_set1_epi32(quad), bits, u - u0, u == u1 - 1, &p[i], &s[i]);
        }
    }
}

/* dot256 for one row of x against both halves of the tile at once (``src`` at rows 0..7;
 * rows 8..15 are 32 bytes on): each broadcast of x's quad serves 16 rows of W. The same
 * integers as dot256's, summed in the same runs. */
HS_INLINE void dot256_pair(const uint8_t *src, int bits, int u0, int u1, const int8_t *qg,
                           __m256i s[2]) {
    __m256i p[2];
#pragma GCC unroll 8 /* whole: the runs' tests fold */
    for (int u = u0; u < u1; u++) {
        int32_t quad;
        memcpy(&quad, qg + 4 * u, 4);
        const __m256i q = _mm256_set1_epi32(quad);
        for (int half = 0; half < 2; half++)
            run_step(quad256(src + 32 * half, bits, u), q, bits, u - u0, u == u1 - 1, &p[half],
                     &s[half]);
    }
}

/* tile_dot for one row of x in one pass over the tile, both halves at once (a decode step's
 * matmuls, which read each tile once and have least arithmetic to hide the reads behind):
 * each lane's operations are tile_dot's, in the same order. */
HS_INLINE void tile_dot_row(const tile_job_t job, int bits, int S, int dform, int mform,
                            float out[][ROWS]) {
    const int span = QUADS / S;
    const int offset = mform == FORM_ANY ? has_factors(job.mw) : mform != FORM_NONE;
    const int64_t G = job.G, tb = tile_bytes(bits);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) {
        prefetch_ahead(job, g, S, tb);
        const uint8_t *src = job.codes + g * tb;
#pragma GCC unroll 2
        for (int h = 0; h < S; h++) {
            __m256i s[2];
            s[0] = s[1] = sum_start(bits, job.qs[g * S + h]);
            dot256_pair(src, bits, h * span, (h + 1) * span, job.q + g * GS, s);
            const float sx = offset ? job.sx[g * S + h] : 0.0f;
            for (int half = 0; half < 2; half++) {
                const int64_t at = (g * S + h) * ROWS + 8 * half;
                const __m256 m = offset ? factors256(job.mw, at, g, half, mform)
                                        : _mm256_setzero_ps();
                acc[half] = scale256(acc[half], s[half], factors256(job.dw, at, g, half, dform),
                                     job.dx[g], offset, m, sx);
            }
        }
    }
    _mm256_storeu_ps(out[0], acc[0]);
    _mm256_storeu_ps(out[0] + 8, acc[1]);
}

/* tile_dot for ``tt`` rows with the codes' ``bits`` and the factors' forms ``dform`` and
 * ``mform`` constant where the caller knows them (tile_dot_vnni's), in two passes over the
 * tile: rows 0..7, then 8..15 (one row: tile_dot_row). */
HS_INLINE void tile_dot(const tile_job_t job, int bits, int S, int tt, int dform, int mform,
                        float out[][ROWS]) {
    if (tt == 1) {
        tile_dot_row(job, bits, S, dform, mform, out);
        return;
    }
    const int span = QUADS / S;
    const int offset = mform == FORM_ANY ? has_factors(job.mw) : mform != FORM_NONE;
    const int64_t G = job.G, K = job.K, tb = tile_bytes(bits), GS_ = G * S;
    for (int half = 0; half < 2; half++) { /* rows 0..7, then 8..15 */
        __m256 acc[TILE_T];
        for (int i = 0; i < tt; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            if (half == 0) prefetch_ahead(job, g, S, tb); /* half 1 reads the lines again */
            const uint8_t *src = job.codes + g * tb + 32 * half;
#pragma GCC unroll 2 /* whole: each sub-group's quads are constants in dot256 */
            for (int h = 0; h < S; h++) {
                const int64_t at = (g * S + h) * ROWS + 8 * half;
                const __m256 d = factors256(job.dw, at, g, half, dform);
                const __m256 m = offset ? factors256(job.mw, at, g, half, mform)
                                        : _mm256_setzero_ps();
                __m256i s[TILE_T];
                for (int i = 0; i < tt; i++) s[i] = sum_start(bits, job.qs[i * GS_ + g * S + h]);
                dot256(src, bits, h * span, (h + 1) * span, job.q + g * GS, K, tt, s);
                for (int i = 0; i < tt; i++)
                    acc[i] = scale256(acc[i], s[i], d, job.dx[i * G + g], offset, m,
                                      offset ? job.sx[i * GS_ + g * S + h] : 0.0f);
            }
        }
        for (int i = 0; i < tt; i++) _mm256_storeu_ps(out[i] + 8 * half, acc[i]);
    }
}

#else
/* The portable C: each (row of x, row of W) alone, the same sums in the same order. */
HS_INLINE void tile_dot(const tile_job_t job, int S, int tt, float out[][ROWS]) {
    const int bits = job.bits, span = QUADS / S, offset = has_factors(job.mw);
    const int64_t G = job.G, K = job.K, tb = tile_bytes(bits), GS_ = G * S;
    for (int i = 0; i < tt; i++) {
        for (int r = 0; r < ROWS; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *src = job.codes + g * tb;
                const int8_t *qg = job.q + i * K + g * GS;
                for (int h = 0; h < S; h++) {
                    int32_t s = 0;
                    for (int j = 4 * h * span; j < 4 * (h + 1) * span; j++)
                        s += (code_at(src, bits, j / 4, r, j % 4) - code_zero(bits)) * qg[j];
                    const int64_t at = (g * S + h) * ROWS + r;
                    float m = offset ? factor_at(job.mw, at, g, r) : 0.0f;
                    acc = fmaf((float)s, factor_at(job.dw, at, g, r) * job.dx[i * G + g], acc);
                    acc = fmaf(m, job.sx[i * GS_ + g * S + h], acc);
                }
            }
            out[i][r] = acc;
        }
    }
}
#endif

#endif
