/* paged_decode.c's prompt tiles with bfloat16 queries over bf16 or fp8 pages, on CPUs with AVX512-BF16 (included by
 * paged_decode_avx512.h; its `exp2_weights16` serves paged_decode_amx.h too): attend_vec16's tile (the
 * query heads along the lanes, outer products, the online softmax lane-wise), its two products by `vdpbf16ps`,
 * which sums two bfloat16 products into each float32 lane, so each instruction does the work of two FMAs:
 *   scores: lane i of a Q vector holds query head i's dims c, c+1 as a bfloat16 pair (the tile's queries in that
 *     layout once, `tile_query_pairs`), times key j's dims c, c+1 broadcast as one 32-bit word straight from the
 *     page row (fp8 rows: their exact bfloat16 values in L1 first, `fp8_row_to_bf16`). Exact products, summed in
 *     float32 as attend_vec16 sums them but pairwise.
 *   values: keys 2p, 2p+1's V rows interleaved once a block into words of (dim c of one, dim c of the other)
 *     (`value_pairs`), times a query head's weights of those two keys broadcast as one word. The weights enter
 *     rounded to bfloat16, as flash attention on GPUs and the AMX tiles round them, and the softmax's sum adds the
 *     rounded weights, so the output is within a few bfloat16 rounding units (2^-8) of its magnitude where
 *     attend_vec16 is within one (tests/kernels/test_cpu_paged_attention.py bounds it by 3, as for the AMX tiles).
 *   softmax: since the weights are rounded to bfloat16, they are powers of two by the AMX tiles' short polynomial
 *     (`exp2_weights16`) of scores that come times log2 e, and two keys' weights are rounded and paired in one
 *     conversion and one permute (`tile_softmax_pairs`), in blocks of PAIR_BLOCK keys.
 * Over fp8 pages the token's 2^e multiplies the scores and, after rounding, the weights (exact), as in
 * attend_vec16, so a call over the pages dequantised to bfloat16 first (`fp8_pages_dequantise`) gives the same
 * bits. Per key and tile of 30 query heads (SmolLM2: 10 rows x G = 3) at 64 dims, 124 `vdpbf16ps` where
 * attend_vec16 has 248 FMAs. Measured on a 2-core Zen 4 VM, 2 threads, the two builds alternating in one process:
 * one prompt chunk of SmolLM2's shape in tiles of 10 rows, 30 calls, 1,024 rows 233-246 -> 142-161 ms over bf16
 * pages, 234-238 -> 145-147 over fp8 (~255 GFLOP/s where the GEMMs run at ~410); 2,048 rows 902-912 -> 549-562
 * and 907-912 -> 567-581. A bfloat16 engine's lone-prompt TTFT: 1,024 tokens 813-825 -> 718-737 ms, 2,048
 * 2,105-2,114 -> 1,743-1,781 (FP8 pages: 836-850 -> 740-754, 2,111-2,142 -> 1,746-1,760). The softmax in base 2,
 * blocks of 64 and the queries' prefetch then (medians, same harness): 1,024 rows 163 -> 139 ms over bf16 pages,
 * 167 -> 140 over fp8, 2,048 rows 585 -> 523 (~290 GFLOP/s); TTFT by the minima 0.94-0.97x at 1,024-4,096 tokens. */

/* acc + per lane i: x's bfloat16 pair i times y's, both products summed (`vdpbf16ps`). */
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i x, __m512i y) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)y);
}

#define LOG2E 1.44269504088896341f
#define EXP2_CUTOFF (EXP_CUTOFF * LOG2E) /* the weights' floor e^EXP_CUTOFF, as a power of two: -86.6 */

/* 2^x for the softmax's weights, which are rounded to bfloat16 next: x = n + r (n = rint(x), |r| <= 1/2), 2^r by a
 * degree-4 polynomial (Taylor of e^(r ln 2); truncation < 5e-5 relative, against the 2^-9 of that rounding), then
 * scaled by 2^n. Below EXP2_CUTOFF 0, as the vector copies' floor (its comment: a weight there, times an fp8 token's
 * 2^e, was a float32 subnormal, a microcode assist, then flushed by the bfloat16 rounding anyway). NaN stays NaN.
 * -inf gives 0. The AMX tiles and the pair tiles (`tile_softmax_pairs`) take their weights from it. */
static inline __m512 exp2_weights16(__m512 x) {
    const __m512 c = _mm512_max_ps(_mm512_set1_ps(EXP2_CUTOFF), x); /* the second operand where either is NaN */
    const __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(c, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0096181291f), r, _mm512_set1_ps(0.0555041087f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265070f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471806f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP2_CUTOFF), _CMP_LT_OQ), p, n);
}

/* The bfloat16 query rows of the work item after (tile t, KV head h) on this thread (run_chunk's order), into L2:
 * a tile's first reads of its queries missed the caches (~3% of a SmolLM2 prompt chunk's time). */
static inline void prefetch_next_queries(const Args *a, int t, int h) {
    const int t2 = h + 1 < a->KVH ? t : t + 1, h2 = h + 1 < a->KVH ? h + 1 : 0;
    if (t2 >= a->ntiles) return;
    const int d = tile_first(a, t2), R = tile_first(a, t2 + 1) - d;
    const int64_t bytes = (int64_t)a->G * a->HD * 2;
    for (int i = 0; i < R; i++)
        prefetch_bytes((const uint16_t *)a->q + ((int64_t)(d + i) * a->KVH + h2) * a->G * a->HD, bytes);
}

/* Tile t's R x G bfloat16 query heads of KV head h as pairs: qp[c / 2][head] the word (dim c, dim c+1); heads from
 * R x G to `lanes` zero, and each head's key count in qlf (tile_queries' layout, words for floats). */
static inline void tile_query_pairs(const Args *a, int t, int h, int HD, int lanes, uint32_t *qp, float *qlf) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d, G = a->G;
    for (int i = 0; i < R; i++) {
        const uint32_t *qi = (const uint32_t *)((const uint16_t *)a->q + ((int64_t)(d + i) * a->KVH + h) * G * HD);
        for (int g = 0; g < G; g++) {
            for (int c = 0; c < HD / 2; c++) qp[c * MAX_G + i * G + g] = qi[g * HD / 2 + c];
            qlf[i * G + g] = (float)a->lens[d + i];
        }
    }
    for (int g = R * G; g < lanes; g++) {
        for (int c = 0; c < HD / 2; c++) qp[c * MAX_G + g] = 0;
        qlf[g] = (float)a->lens[d + R - 1];
    }
}

/* Scores of keys j0 .. j0+KB-1 (bfloat16 rows kr[]) for the tile's NHV head vectors, as tile_scores16. */
static inline __attribute__((always_inline)) void tile_scores_pairs(const uint32_t *qp, const uint16_t *const *kr,
                                                                   int j0, int n, int key0, const float *mul,
                                                                   const __m512 *qlen, float (*st)[MAX_G],
                                                                   __m512 *top, const int HD, const int NHV,
                                                                   const int KB) {
    __m512 acc[8][TILE_HV16];
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < HD / 2; c++) {
        __m512i qv[TILE_HV16];
        for (int v = 0; v < NHV; v++) {
            qv[v] = _mm512_load_si512(qp + c * MAX_G + 16 * v);
            __asm__("" : "+v"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m512i x = _mm512_set1_epi32(((const int32_t *)kr[j0 + k])[c]);
            for (int v = 0; v < NHV; v++) acc[k][v] = dot_pairs(acc[k][v], qv[v], x);
        }
    }
    tile_scores_out16(acc, j0, n, key0, mul, qlen, st, top, NHV, KB);
}

/* The online softmax of a block's n keys for every head at once (tile_softmax16's), in base 2: the scores come times
 * log2 e, each weight is 2^(s - m) by `exp2_weights16` and the running sums' correction 2^(m - m') too (l and the
 * outputs take the same factor, so its few 1e-5 of error cancel in their quotient). The weights of keys 2p, 2p+1,
 * times the tokens' 2^e over fp8 pages (wmul, exact), are rounded to bfloat16 as one word per head into wp[p] (key
 * 2p's low, 2p+1's high; a key past n weighs 0) by one `vcvtne2ps2bf16` and a `vpermw`, and the sum adds the
 * rounded weights without their 2^e by `vdpbf16ps` against winv[p], the words of the keys' 2^-e (NULL: ones). */
static inline __attribute__((always_inline)) void tile_softmax_pairs(float (*st)[MAX_G], int n,
                                                                    const __m512 *top, const float *wmul,
                                                                    const uint32_t *winv, __m512 *m, __m512 *l,
                                                                    float *corr, uint32_t (*wp)[MAX_G],
                                                                    const int NHV) {
    /* word i of the result: lane i of the first operand (low), lane i of the second (high) */
    const __m512i spread = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi16(0x3F80); /* bfloat16 1.0 */
    for (int v = 0; v < NHV; v++) {
        const __m512 bm = _mm512_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m512 cv = exp2_weights16(_mm512_sub_ps(m[v], bm));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 2) {
            __m512 w0 = exp2_weights16(_mm512_sub_ps(_mm512_load_ps(&st[j][16 * v]), bm)), w1 = _mm512_setzero_ps();
            if (j + 1 < n) w1 = exp2_weights16(_mm512_sub_ps(_mm512_load_ps(&st[j + 1][16 * v]), bm));
            if (wmul) {
                w0 = _mm512_mul_ps(w0, _mm512_set1_ps(wmul[j]));
                if (j + 1 < n) w1 = _mm512_mul_ps(w1, _mm512_set1_ps(wmul[j + 1]));
            }
            const __m512i w = _mm512_permutexvar_epi16(spread, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            sum = dot_pairs(sum, w, winv ? _mm512_set1_epi32((int32_t)winv[j / 2]) : ones);
            _mm512_store_si512(&wp[j / 2][16 * v], w);
        }
        l[v] = _mm512_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm512_store_ps(corr + 16 * v, cv);
    }
}

/* Bfloat16 rows r0 and r1 as words (r0's dim c, r1's dim c), dims in order, into dst [HD]. */
static inline __attribute__((always_inline)) void value_pairs(const uint16_t *r0, const uint16_t *r1, uint32_t *dst,
                                                             const int HD) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int c = 0; c < HD; c += 32) {
        const __m512i x = _mm512_loadu_si512(r0 + c), y = _mm512_loadu_si512(r1 + c);
        _mm512_store_si512(dst + c, _mm512_permutex2var_epi16(x, lo, y));
        _mm512_store_si512(dst + c + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* Query heads g0 .. g0+NG-1 (NG <= DEC16_PV): o[g] = o[g] corr[g] + the block's np key pairs' V words vp[p] times
 * their weights wp[p][g], 64 dims at a time (accumulate_v16's scheme, two keys an instruction). */
static inline __attribute__((always_inline)) void accumulate_pairs(uint32_t (*vp)[MAX_HD], int np,
                                                                  uint32_t (*wp)[MAX_G], const float *corr,
                                                                  float (*o)[MAX_HD], int g0, const int NG,
                                                                  const int HD) {
    for (int c = 0; c < HD; c += 64) {
        __m512 x[DEC16_PV][4];
        for (int i = 0; i < NG; i++) {
            const __m512 ci = _mm512_set1_ps(corr[g0 + i]);
            for (int u = 0; u < 4; u++) x[i][u] = _mm512_mul_ps(_mm512_load_ps(&o[g0 + i][c + 16 * u]), ci);
        }
        for (int p = 0; p < np; p++) {
            __m512i v[4];
            for (int u = 0; u < 4; u++) v[u] = _mm512_load_si512(&vp[p][c + 16 * u]);
            for (int i = 0; i < NG; i++) {
                const __m512i w = _mm512_set1_epi32((int32_t)wp[p][g0 + i]);
                for (int u = 0; u < 4; u++) x[i][u] = dot_pairs(x[i][u], w, v[u]);
            }
        }
        for (int i = 0; i < NG; i++)
            for (int u = 0; u < 4; u++) _mm512_store_ps(&o[g0 + i][c + 16 * u], x[i][u]);
    }
}

/* Keys per softmax block of attend_pairs16: twice BLOCK, so that the outputs' reload and correction and the block's
 * setup come half as often (its buffers ~30 KB at 64 dims, L1's size on Zen 4). SmolLM2's 1,024-row chunk (the
 * measurement above), 32 -> 64: 128 -> 120 ms; GLM-4.5's shape (128 dims) even. */
#define PAIR_BLOCK 64

/* One work item: KV head h of prompt tile t (rows d .. d+R-1, R > 1), bfloat16 q, fmt 1 or 2, HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_pairs16(const Args *a, int t, int h, const int HD,
                                                                 const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int G = a->G, NQ = R * G, NHV = (NQ + 15) / 16;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    uint32_t qp[MAX_HD / 2 * MAX_G] __attribute__((aligned(64))); /* [dim pair][head] */
    float qlf[MAX_G] __attribute__((aligned(64)));
    tile_query_pairs(a, t, h, HD, 16 * NHV, qp, qlf);
    prefetch_next_queries(a, t, h);
    __m512 qlen[TILE_HV16], m[TILE_HV16], l[TILE_HV16];
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    tile_start16(qlf, NHV, NQ, HD, qlen, m, l, acc);
    uint16_t kb[fmt == 2 ? PAIR_BLOCK : 1][MAX_HD] __attribute__((aligned(64))); /* fp8: the rows as bfloat16 */
    uint16_t vb[fmt == 2 ? PAIR_BLOCK : 1][MAX_HD] __attribute__((aligned(64)));
    uint32_t vp[PAIR_BLOCK / 2][MAX_HD] __attribute__((aligned(64)));
    uint32_t wp[PAIR_BLOCK / 2][MAX_G] __attribute__((aligned(64)));
    float st[PAIR_BLOCK][MAX_G] __attribute__((aligned(64)));
    float corr[MAX_G] __attribute__((aligned(64)));
    const uint16_t *kr[PAIR_BLOCK + 8], *vr[PAIR_BLOCK + 1];
    float kmul[PAIR_BLOCK], vmul[PAIR_BLOCK];
    uint32_t vinv[PAIR_BLOCK / 2];
    const float scale2 = a->scale * LOG2E; /* scores in base 2 (tile_softmax_pairs) */
    for (int j = 0; j < PAIR_BLOCK + 8; j++) kr[j] = (const uint16_t *)zero_row;
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[PAIR_BLOCK], next[PAIR_BLOCK], first[PAIR_BLOCK];
    block_rows(pages, 0, len < PAIR_BLOCK ? len : PAIR_BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += PAIR_BLOCK) {
        const int n = len - t0 < PAIR_BLOCK ? len - t0 : PAIR_BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, PAIR_BLOCK);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
            if (fmt == 2) {
                fp8_row_to_bf16((const uint8_t *)a->k + rows[j] * HD, kb[j], HD);
                kr[j] = kb[j];
            } else {
                kr[j] = (const uint16_t *)a->k + rows[j] * HD;
            }
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * scale2;
        }
        for (int j = n; j < PAIR_BLOCK; j++) kr[j] = (const uint16_t *)zero_row;
        __m512 top[TILE_HV16];
        for (int v = 0; v < NHV; v++) top[v] = _mm512_set1_ps(-INFINITY);
        if (NHV == 1)
            for (int j0 = 0; j0 < n; j0 += 8) tile_scores_pairs(qp, kr, j0, n, t0, kmul, qlen, st, top, HD, 1, 8);
        else
            for (int j0 = 0; j0 < n; j0 += 6) tile_scores_pairs(qp, kr, j0, n, t0, kmul, qlen, st, top, HD, 2, 6);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            if (fmt == 2) {
                fp8_row_to_bf16((const uint8_t *)a->v + rows[j] * HD, vb[j], HD);
                vr[j] = vb[j];
                vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights, 2^-e out of their sum */
                const uint32_t inv = float_to_bits(pow2i(-a->ve[rows[j]])) >> 16; /* exact in bfloat16 */
                vinv[j / 2] = j % 2 ? vinv[j / 2] | inv << 16 : inv;
            } else {
                vr[j] = (const uint16_t *)a->v + rows[j] * HD;
            }
        }
        vr[n] = (const uint16_t *)zero_row; /* the pair of an odd block's last key */
        for (int p = 0; 2 * p < n; p++) value_pairs(vr[2 * p], vr[2 * p + 1], vp[p], HD);
        if (NHV == 1) tile_softmax_pairs(st, n, top, fmt == 2 ? vmul : NULL, fmt == 2 ? vinv : NULL, m, l, corr, wp, 1);
        else tile_softmax_pairs(st, n, top, fmt == 2 ? vmul : NULL, fmt == 2 ? vinv : NULL, m, l, corr, wp, 2);
        const int np = (n + 1) / 2;
        int g0 = 0;
        for (; g0 + DEC16_PV <= NQ; g0 += DEC16_PV) accumulate_pairs(vp, np, wp, corr, acc, g0, DEC16_PV, HD);
        switch (NQ - g0) { /* the last heads, fewer than DEC16_PV: a copy per count */
        case 1: accumulate_pairs(vp, np, wp, corr, acc, g0, 1, HD); break;
        case 2: accumulate_pairs(vp, np, wp, corr, acc, g0, 2, HD); break;
        case 3: accumulate_pairs(vp, np, wp, corr, acc, g0, 3, HD); break;
        case 4: accumulate_pairs(vp, np, wp, corr, acc, g0, 4, HD); break;
        case 5: accumulate_pairs(vp, np, wp, corr, acc, g0, 5, HD); break;
        default: break;
        }
    }
    tile_finish16(a, d, h, NQ, NHV, l, acc);
}
