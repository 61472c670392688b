/* paged_decode.c's copies for CPUs with AVX-512F, head sizes 64 and 128: decode rows (`attend_dec16`), prompt
 * tiles (`attend_vec16`; `attend_pairs16` by `vdpbf16ps` on CPUs with AVX512-BF16, paged_decode_pairs.h) and the
 * rest (`attend_vec`), chosen per work item by `attend_vec_dec` at the end. Included by paged_decode.c after its
 * common helpers (Args, load_q, store_out, the fp8 bits, the prefetches, tile_queries); it keeps the entry points,
 * and its opening comment the layouts and the numerics. */

/* The same attention with AVX-512 intrinsics, for head sizes that are whole vectors (NV = HD / 16). Per
 * block of up to 32 tokens: the block's K rows are widened once into `kb` (fp32 pages are read in place),
 * then for each query head the scores of 16 tokens at a time: one vector of partial sums per token (NV
 * chained FMAs; the 16 tokens are independent chains), folded into one vector of 16 dot products by
 * `sum16` (45 shuffles and adds for 16 dots, where a horizontal sum per dot took ~11 operations each).
 * Each V row is widened once into registers and used by up to 4 query heads, whose outputs stay in
 * registers over the block (`accumulate_v`). The exponent of a token (fp8) is an exact power of two made
 * from its bits (`pow2i`), not a libm call. Sums are float32 in another order than the generic code's
 * (tests compare both to the reference). One thread, 32 sequences x 150 keys, G = 3, HD = 64, bf16
 * pages, a 2-core AMD EPYC VM: 23.6 -> ~14-17 ns per (sequence, KV head, key) row, with the pages in
 * cache. In a decode step they are not: each layer's pages come from memory, a row of 64-256 bytes per
 * token and KV head, page by page, which the hardware prefetchers do not follow. So the rows that come
 * next (the item's next block, or the next item's first) are prefetched into L2 a few per token while
 * the current block is computed. Measured over 30 layers' own page pools (32 sequences, G = 3, HD = 64,
 * random page tables), alternating with the kernel without it, same VM: bf16 pages 0.54-0.73x the
 * time at 80-600 keys (1 and 2 threads), fp8 0.69-0.70x; into L1 instead (the first try): 0.78-1.0x. */
static inline __m512 sum16(const __m512 v[16]) { /* lane j: the sum of v[j]'s 16 lanes */
    __m512 a[8], b[4];
    for (int k = 0; k < 8; k++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2k] = x, v[2k+1] = y */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
        b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* add the four 128-bit lanes: b[k]'s lanes end up in lane k */
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

/* e^x for x <= 0 on 16 lanes (-inf and below EXP_CUTOFF: 0; NaN stays NaN), as exp_nonpositive lane by lane. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 c = _mm512_max_ps(_mm512_set1_ps(EXP_CUTOFF), x); /* the second operand where either is NaN */
    __m512 n;
    const __m512 p = exp_reduced16(c, &n);
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_CUTOFF), _CMP_LT_OQ),
                               _mm512_scalef_ps(p, n));
}

/* 16 values c .. c+15 of page row `row` as float32 (fp8: the codes' values, as load_row: `fp8x16_half_bits`, F16C's
 * conversion, then times 2^8). */
static inline __attribute__((always_inline)) __m512 widen16(const void *base, int64_t row, int c, const int HD,
                                                            const int fmt) {
    if (fmt == 0) return _mm512_loadu_ps((const float *)base + row * HD + c);
    if (fmt == 1) return bf16x16_to_float((const uint16_t *)base + row * HD + c);
    return _mm512_mul_ps(_mm512_cvtph_ps(fp8x16_half_bits((const uint8_t *)base + row * HD + c)),
                         _mm512_set1_ps(0x1p8f));
}

#ifdef __AVX512BF16__
/* 32 fp8_e4m3 values at src as bfloat16 bits, exactly (the true values, no 2^120): for e > 0 the bits
 * move into place and the exponent is rebiased (+120); e = 0 (zero and the subnormals m 2^-9, normal
 * numbers in bfloat16) comes from a table by m, where the bit placement would make bfloat16 subnormals
 * that `vdpbf16ps` reads as zero. Nine simple instructions per 32 values. */
static inline __m512i fp8x32_to_bf16(const uint8_t *src) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0)),
                                            _mm512_set1_epi16(120 << 7));
    /* m 2^-9 for m = 0..7 (indexed by w's low 5 bits, which are m where e = 0, signed or not) */
    const __m512i sub = _mm512_permutexvar_epi16(w, _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                     0, 0, 0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20,
                                                                     0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0));
    const __m512i mag = _mm512_mask_mov_epi16(normal, _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78)), sub);
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
}
#endif

#ifdef __AVX512VBMI__
/* fp8x32_to_bf16 for 64 codes by table: the bfloat16 of each of the 128 magnitudes, its high and low bytes in two
 * 128-byte tables that `vpermi2b` reads by the code's low 7 bits (magnitude 0x7f, a NaN, as torch converts it),
 * the sign bit copied in; the two bytes interleaved into 16-bit lanes (the codes put in the order that makes
 * `vpunpck{l,h}bw`'s per-128-bit-lane interleave come out in sequence). 6 instructions a 64 codes where
 * fp8x32_to_bf16 takes 18. Out: codes 0-31 in *lo, 32-63 in *hi. */
static uint8_t fp8_bf16_hi[128] __attribute__((aligned(64))), fp8_bf16_lo[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fp8_bf16_tables(void) {
    for (int m = 0; m < 128; m++) {
        const int e = m >> 3, f = m & 7;
        const float x = m == 0x7f ? NAN : e ? ldexpf(1.0f + f / 8.0f, e - 7) : ldexpf((float)f, -9);
        const uint16_t b = m == 0x7f ? 0x7fc0 : (uint16_t)(float_to_bits(x) >> 16); /* exact: 4 significant bits */
        fp8_bf16_hi[m] = (uint8_t)(b >> 8), fp8_bf16_lo[m] = (uint8_t)b;
    }
}

static inline __attribute__((always_inline)) void fp8x64_to_bf16(const uint8_t *src, __m512i *lo, __m512i *hi) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
        14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
        52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
    const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(src));
    const __m512i h = _mm512_ternarylogic_epi32(
        _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16_hi), c, _mm512_load_si512(fp8_bf16_hi + 64)), c,
        _mm512_set1_epi8((char)0x80), 0xF8); /* the table's byte, or the code's sign bit */
    const __m512i l = _mm512_permutex2var_epi8(_mm512_load_si512(fp8_bf16_lo), c, _mm512_load_si512(fp8_bf16_lo + 64));
    *lo = _mm512_unpacklo_epi8(l, h);
    *hi = _mm512_unpackhi_epi8(l, h);
}
#endif

#ifdef __AVX512BF16__
/* HD fp8 codes (HD a multiple of 32) as their exact bfloat16 values into dst (64-byte aligned): by table
 * (`fp8x64_to_bf16`) where the CPU has AVX512-VBMI and HD is a multiple of 64, else `fp8x32_to_bf16`. */
static inline __attribute__((always_inline)) void fp8_row_to_bf16(const uint8_t *src, uint16_t *dst, int HD) {
#ifdef __AVX512VBMI__
    if (HD % 64 == 0) {
        for (int c = 0; c < HD; c += 64) {
            __m512i lo, hi;
            fp8x64_to_bf16(src + c, &lo, &hi);
            _mm512_store_si512(dst + c, lo);
            _mm512_store_si512(dst + c + 32, hi);
        }
        return;
    }
#endif
    for (int c = 0; c < HD; c += 32) _mm512_store_si512(dst + c, fp8x32_to_bf16(src + c));
}
#endif

/* Page row `row` as float32: fp32 in place, else widened into dst. */
static inline __attribute__((always_inline)) const float *widen_row(const void *base, int64_t row, float *dst,
                                                                     const int HD, const int fmt) {
    if (fmt == 0) return (const float *)base + row * HD;
    for (int c = 0; c < HD; c += 16) _mm512_store_ps(dst + c, widen16(base, row, c, HD, fmt));
    return dst;
}

/* acc[g0 .. g0+GB) += sum over the block's tokens j of w[g][j] * V row j: each V row is widened once into
 * registers and used by GB query heads, whose outputs stay in GB * NV registers (GB * NV independent
 * chains, where one head at a time had NV). */
static inline __attribute__((always_inline)) void accumulate_v(const Args *a, const int64_t *rows, int n,
                                                               float (*w)[BLOCK], float (*acc)[MAX_HD], int g0,
                                                               const int GB, const int HD, const int fmt,
                                                               const int64_t *pf, int npf) {
    enum { NVMAX = MAX_HD / 16 };
    const int NV = HD / 16;
    __m512 o[4][NVMAX];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) o[g][c] = _mm512_load_ps(&acc[g0 + g][16 * c]);
    for (int j = 0; j < n; j++) {
        if (j < npf) prefetch_row(a->v, pf[j], HD, fmt);
        __m512 v[NVMAX];
        for (int c = 0; c < NV; c++) v[c] = widen16(a->v, rows[j], 16 * c, HD, fmt);
        for (int g = 0; g < GB; g++) {
            const __m512 p = _mm512_set1_ps(w[g0 + g][j]);
            for (int c = 0; c < NV; c++) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(&acc[g0 + g][16 * c], o[g][c]);
}

/* acc[q0 .. q0+GB) += sum over the block's tokens j of w[q][j] * V row j, the V rows already float32 (vr[j]):
 * a tile of more query heads than one group widens each V row once for all its groups. */
static inline __attribute__((always_inline)) void accumulate_vrows(const float *const *vr, int n,
                                                                   float (*w)[BLOCK], float (*acc)[MAX_HD], int q0,
                                                                   const int GB, const int HD) {
    enum { NVMAX = MAX_HD / 16 };
    const int NV = HD / 16;
    __m512 o[4][NVMAX];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) o[g][c] = _mm512_load_ps(&acc[q0 + g][16 * c]);
    for (int j = 0; j < n; j++) {
        for (int g = 0; g < GB; g++) {
            const __m512 p = _mm512_set1_ps(w[q0 + g][j]);
            for (int c = 0; c < NV; c++) o[g][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr[j] + 16 * c), o[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < NV; c++) _mm512_store_ps(&acc[q0 + g][16 * c], o[g][c]);
}

/* One work item: KV head h of tile t, rows d .. d+R-1 (R = 1: a decode row). Its NQ = R * G query heads
 * (row i's G heads are queries i*G .. i*G+G-1) run together against each block of keys, so a block's K and V
 * rows are widened once for all of them; query q sees the first lens[d + q / G] keys, and in a block it
 * reaches only in part (the causal diagonal of a prompt chunk) its scores past that are left out of the
 * softmax and its weights there are 0. A tile's rows share their page table (rows of one prompt chunk). */
static inline __attribute__((always_inline)) void attend_vec(const Args *a, int t, int h, const int HD,
                                                             const int fmt) {
    enum { NVMAX = MAX_HD / 16 };
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int NV = HD / 16, G = a->G, S = a->S, KVH = a->KVH, NQ = R * G;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float q[MAX_G * MAX_HD] __attribute__((aligned(64)));
    int qlen[MAX_G];
    for (int i = 0; i < R; i++) {
        const float *qi = load_q(a, d + i, h, q + i * G * HD);
        if (qi != q + i * G * HD) memcpy(q + i * G * HD, qi, sizeof(float) * G * HD);
        for (int g = 0; g < G; g++) qlen[i * G + g] = a->lens[d + i];
    }
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    float kb[BLOCK][MAX_HD] __attribute__((aligned(64)));
    float vb[BLOCK][MAX_HD] __attribute__((aligned(64)));
    const float *kr[BLOCK], *vr[BLOCK];
    float m[MAX_G], l[MAX_G];
    float s[MAX_G][BLOCK] __attribute__((aligned(64)));
    float kmul[BLOCK];
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK];
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, S, KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        /* the rows that come next (this item's next block, else the next item's first), prefetched a few
         * at a time while this block is computed: K rows during the first head's scores, V rows during
         * the first heads' sums */
        const int64_t *pf;
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, BLOCK);
        for (int j = 0; j < n; j++) {
            kr[j] = widen_row(a->k, rows[j], kb[j], HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int g = 0; g < NQ; g++) {
            const int nq = qlen[g] - t0 < n ? qlen[g] - t0 : n; /* this query's keys in the block */
            if (nq <= 0) { /* past its last key: no scores, weights 0 */
                for (int j = 0; j < n; j++) s[g][j] = 0.0f;
                continue;
            }
            __m512 qv[NVMAX];
            for (int c = 0; c < NV; c++) qv[c] = _mm512_load_ps(q + g * HD + 16 * c);
            for (int j0 = 0; j0 < n; j0 += 16) {
                __m512 dots[16];
                for (int jj = 0; jj < 16; jj++) {
                    const int j = j0 + jj;
                    if (g == 0 && j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
                    if (j >= nq) {
                        dots[jj] = _mm512_setzero_ps();
                        continue;
                    }
                    __m512 t = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr[j]));
                    for (int c = 1; c < NV; c++) t = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr[j] + 16 * c), t);
                    dots[jj] = t;
                }
                _mm512_store_ps(&s[g][j0], sum16(dots));
            }
            for (int j = 0; j < nq; j++) s[g][j] = s[g][j] * kmul[j];
            /* online softmax over the query's nq keys, as the generic code */
            const __mmask16 lo = nq >= 16 ? 0xffff : (__mmask16)((1u << nq) - 1);
            const __mmask16 hi = nq > 16 ? (__mmask16)((1u << (nq - 16)) - 1) : 0;
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const __m512 mx = _mm512_max_ps(_mm512_mask_load_ps(ninf, lo, s[g]),
                                            _mm512_mask_load_ps(ninf, hi, s[g] + 16));
            const float top = _mm512_reduce_max_ps(mx);
            softmax_step(s[g], nq, top > m[g] ? top : m[g], &m[g], &l[g], acc[g], HD);
            /* s[g][nq .. n) stays 0: those keys' dots were zero vectors */
        }
        if (fmt == 2) /* the token's 2^e into its weights */
            for (int j = 0; j < n; j++) {
                const float mul = pow2i(a->ve[rows[j]]);
                for (int g = 0; g < NQ; g++) s[g][j] *= mul;
            }
        /* heads in groups that fit the registers: 4 x 4 vectors at HD 64, 2 x 8 at 128 */
        const int GB = HD == 64 ? 4 : 2;
        if (NQ > GB) { /* several groups: widen the block's V rows once, prefetching the next ones */
            for (int j = 0; j < n; j++) {
                if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
                vr[j] = widen_row(a->v, rows[j], vb[j], HD, fmt);
            }
            for (int g0 = 0; g0 < NQ; g0 += GB) {
                const int left = NQ - g0;
                if (left >= 4 && GB == 4) accumulate_vrows(vr, n, s, acc, g0, 4, HD);
                else if (left == 3 && GB == 4) accumulate_vrows(vr, n, s, acc, g0, 3, HD);
                else if (left >= 2) accumulate_vrows(vr, n, s, acc, g0, 2, HD);
                else accumulate_vrows(vr, n, s, acc, g0, 1, HD);
            }
        } else { /* one group (a decode row of up to 4 heads, or 2 at 128): V rows straight from the pages */
            if (NQ == 4) accumulate_v(a, rows, n, s, acc, 0, 4, HD, fmt, pf, n_next);
            else if (NQ == 3) accumulate_v(a, rows, n, s, acc, 0, 3, HD, fmt, pf, n_next);
            else if (NQ == 2) accumulate_v(a, rows, n, s, acc, 0, 2, HD, fmt, pf, n_next);
            else accumulate_v(a, rows, n, s, acc, 0, 1, HD, fmt, pf, n_next);
        }
    }
    for (int g = 0; g < NQ; g++) store_out(a, d + g / G, h, g % G, acc[g], 1.0f / l[g]);
}
/* ---- Decode rows on AVX-512F (Skylake-SP on, with or without AVX512-BF16): attend_dec8's scheme on 16 lanes.
 * A decode row against up to DEC_Q / G of its KV heads at once, each key row read once (a token's rows of those
 * heads lie side by side in a page) and converted in registers, per block of up to 32 keys:
 *   scores: each K row becomes HD / 16 float32 vectors (`row32`: a bf16 row gives 32 dims a 64-byte load, the even
 *     dims by a shift and the odd ones by a mask, so the lanes hold dims c, c + 2, ... then c + 1, c + 3, ...; q and
 *     the output are kept in that order and put back at the end; fp32 and fp8 rows in dim order), and each of its
 *     query heads' dots with it two chains of FMAs into one vector of partial sums; `sum16` folds 16 keys' vectors
 *     into their 16 scores;
 *   softmax: 16 scores a vector (`exp_nonpositive16`), keys past the block's end masked to -inf; every query
 *     head's block maximum first, then their rescales e^(m - max) in one vector, then each head's weights;
 *   values: per KV head, 64 dims of up to DEC16_PV of its query heads' outputs in registers over the block's keys,
 *     each V row's 64 dims converted once for all of them.
 * fp8 pages (AVX512-BW for the 16-bit lanes): row32 converts by float16 (`_mm512_cvtph_ps`, exact), 2^-8 of the
 * values; the 2^8 goes into the scores' multiplier with the token's 2^e and the scale, and into the output's 1 / l,
 * the V rows' 2^e into the weights (after their sum: l is the weights' sum), as attend_dec8.
 * Sums are float32 in another order than attend_vec's (per head: two chains over HD, then sum16's tree); the
 * exponentials are the same polynomial. Against attend_vec, which decode rows took here before: SmolLM2's shape
 * (3 KV heads x 3, HD = 64), 32 sequences x 30 layers' own page pools (page tables shuffled), 2 threads, a 2-core
 * Ice Lake-SP VM, the builds alternating in one process (medians of 9): bf16 pages 0.91x the time at 256 keys and
 * 0.83x at 1,024, fp8 pages 0.76x and 0.89x; one thread over pages in cache (4 sequences, one layer's pool) bf16
 * 0.70x, fp8 0.82x; fp32 pages 0.97-1.02x, so they stay with attend_vec. attend_dec8 itself (the AVX2 copy, 8
 * lanes) measured 0.93x / 0.83x over bf16 pages and 0.98x / 1.06x over fp8 in the same runs. */
#ifdef __AVX512BW__
#define DEC16_FP8 1
#else
#define DEC16_FP8 0
#endif
#define DEC16_PV 6 /* query heads whose outputs one pass over a block's V rows holds: 6 x 4 vectors at 64 dims */

/* Dims c .. c+31 of page row `row` as two float32 vectors in attend_dec16's lane order (see above). */
static inline __attribute__((always_inline)) void row32(const void *base, int64_t row, int c, const int HD,
                                                        const int fmt, __m512 *lo, __m512 *hi) {
    if (fmt == 0) {
        *lo = _mm512_loadu_ps((const float *)base + row * HD + c);
        *hi = _mm512_loadu_ps((const float *)base + row * HD + c + 16);
    } else if (fmt == 1) {
        const __m512i x = _mm512_loadu_si512((const uint16_t *)base + row * HD + c);
        *lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else { /* fp8: as `fp8x16_half_bits`, 32 codes */
#if DEC16_FP8
        const __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)base + row * HD + c));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                                           _mm512_set1_epi16(FP8_HALF_MASK));
        *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#endif
    }
}

/* Query heads g0 .. g0+NG-1 (NG <= DEC16_PV): outputs o[g] (rescaled by corr[g] first) plus the block's n V rows
 * weighted by w[g * wh + j * wk] (head g, key j; any layout of the weights), 64 dims at a time, each V row's 64
 * dims loaded once for all NG heads: vr[j], float32, where fmt is -1 (prompt tiles: rows widened once a block);
 * else page row rows[j] + hh of the V pages in format fmt, converted in registers by row32 (decode rows). As
 * attend_dec8's accumulate_v8 on 8 lanes; fmt is a constant in each copy, so the choice is made at compile time. */
static inline __attribute__((always_inline)) void accumulate_v16(const Args *a, const int64_t *rows, int hh,
                                                                 const float *const *vr, int n, const float *w,
                                                                 const int wh, const int wk, const float *corr,
                                                                 float (*o)[MAX_HD], int g0, const int NG,
                                                                 const int HD, const int fmt) {
    for (int c = 0; c < HD; c += 64) {
        __m512 x[DEC16_PV][4];
        for (int i = 0; i < NG; i++) {
            const __m512 ci = _mm512_set1_ps(corr[g0 + i]);
            for (int u = 0; u < 4; u++) x[i][u] = _mm512_mul_ps(_mm512_load_ps(&o[g0 + i][c + 16 * u]), ci);
        }
        for (int j = 0; j < n; j++) {
            __m512 v[4];
            if (fmt < 0) {
                for (int u = 0; u < 4; u++) v[u] = _mm512_loadu_ps(vr[j] + c + 16 * u);
            } else {
                row32(a->v, rows[j] + hh, c, HD, fmt, &v[0], &v[1]);
                row32(a->v, rows[j] + hh, c + 32, HD, fmt, &v[2], &v[3]);
            }
            for (int i = 0; i < NG; i++) {
                const __m512 p = _mm512_set1_ps(w[(g0 + i) * wh + j * wk]);
                for (int u = 0; u < 4; u++) x[i][u] = _mm512_fmadd_ps(p, v[u], x[i][u]);
            }
        }
        for (int i = 0; i < NG; i++)
            for (int u = 0; u < 4; u++) _mm512_store_ps(&o[g0 + i][c + 16 * u], x[i][u]);
    }
}

/* KV heads h .. h+NH-1 of decode row t, its NQ = NH x G query heads (head hh's g-th is query hh * G + g), NQ <=
 * DEC_Q; HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_dec16(const Args *a, int t, int h, int NH, const int HD,
                                                               const int fmt) {
    const int d = tile_first(a, t), G = a->G, NQ = NH * G, len = a->lens[d];
    float q[DEC_Q * MAX_HD] __attribute__((aligned(64))); /* in row32's lane order */
    float acc[DEC_Q][MAX_HD] __attribute__((aligned(64)));
    float part[BLOCK][DEC_Q][16] __attribute__((aligned(64))); /* per key and query head: 16 partial sums */
    float s[DEC_Q][BLOCK] __attribute__((aligned(64)));
    float kmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(64))); /* fp8, per KV head and key: 2^e 2^8 scale */
    float vmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(64))); /* 2^e */
    float m[DEC_Q] __attribute__((aligned(64))), l[DEC_Q], corr[DEC_Q] __attribute__((aligned(64)));
    float bm[DEC_Q] __attribute__((aligned(64))); /* a block's running max per query head */
    for (int hh = 0; hh < NH; hh++) {
        float qbuf[MAX_G * MAX_HD];
        const float *qd = load_q(a, d, h + hh, qbuf);
        float *qh = q + hh * G * HD;
        for (int i = 0; i < G * HD; i += 32) /* bf16: each 32 dims' even ones, then the odd ones */
            for (int j = 0; j < 16; j++) {
                qh[i + j] = qd[i + (fmt == 1 ? 2 * j : j)];
                qh[i + 16 + j] = qd[i + (fmt == 1 ? 2 * j + 1 : 16 + j)];
            }
    }
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const __m512 scale = _mm512_set1_ps(a->scale), ninf = _mm512_set1_ps(-INFINITY);
    const float kscale = a->scale * 256.0f; /* fp8: row32's rows are 2^-8 of the values, K's and V's */
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK]; /* head h's page rows (head h + hh's: rows + hh) */
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, NH, pages, t0, n, len, next, first, &pf, BLOCK);
        if (fmt == 2) /* the tokens' 2^e (K's times scale and row32's 2^8) */
            block_exponents(a, rows, n, h, NH, kscale, kmul, vmul);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_next_key(a, pf, j, NH, HD, fmt); /* a key's at a time */
            for (int hh = 0; hh < NH; hh++)
                for (int c0 = 0; c0 < HD; c0 += 128) { /* 8 vectors of the row at a time */
                    const int nv = HD - c0 < 128 ? (HD - c0) / 16 : 8;
                    __m512 k[8];
                    for (int c = 0; c < nv; c += 2) row32(a->k, rows[j] + hh, c0 + 16 * c, HD, fmt, &k[c], &k[c + 1]);
                    for (int g = hh * G; g < hh * G + G; g++) {
                        const float *qg = q + g * HD + c0;
                        __m512 x0 = _mm512_mul_ps(_mm512_load_ps(qg), k[0]);
                        __m512 x1 = _mm512_mul_ps(_mm512_load_ps(qg + 16), k[1]);
                        for (int c = 2; c < nv; c += 2) {
                            x0 = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c), k[c], x0);
                            x1 = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c + 16), k[c + 1], x1);
                        }
                        __m512 x = _mm512_add_ps(x0, x1);
                        if (c0) x = _mm512_add_ps(x, _mm512_load_ps(part[j][g]));
                        _mm512_store_ps(part[j][g], x);
                    }
                }
        }
        if (fmt != 0) /* the block's V rows from L2 into L1 while the softmax runs (fp32's would evict K's) */
            for (int j = 0; j < n; j++) prefetch_rows(a->v, rows[j], NH, HD, fmt, 1);
        const int nb = (n + 15) / 16; /* vectors of 16 keys; lanes past n masked */
        for (int g = 0; g < NQ; g++) {
            __m512 top = _mm512_set1_ps(m[g]);
            for (int b = 0; b < nb; b++) {
                __m512 v[16];
                for (int jj = 0; jj < 16; jj++) v[jj] = _mm512_load_ps(part[16 * b + jj][g]);
                const int left = n - 16 * b;
                const __mmask16 live = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                const __m512 mul = fmt == 2 ? _mm512_load_ps(&kmul[g / G][16 * b]) : scale;
                const __m512 sc = _mm512_mask_mul_ps(ninf, live, sum16(v), mul); /* keys past n: -inf */
                _mm512_store_ps(&s[g][16 * b], sc);
                top = _mm512_max_ps(top, sc);
            }
            bm[g] = _mm512_reduce_max_ps(top); /* >= m[g] */
        }
        /* every head's rescale in one vector (0 on the first block: m = -inf); lanes past NQ unused */
        const __mmask16 heads = (__mmask16)((1u << NQ) - 1);
        _mm512_store_ps(corr, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_load_ps(heads, m),
                                                              _mm512_maskz_load_ps(heads, bm))));
        for (int g = 0; g < NQ; g++) {
            const __m512 bmv = _mm512_set1_ps(bm[g]);
            __m512 sum = _mm512_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const __m512 w = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(&s[g][16 * b]), bmv));
                sum = _mm512_add_ps(sum, w);
                _mm512_store_ps(&s[g][16 * b], fmt == 2 ? _mm512_mul_ps(w, _mm512_load_ps(&vmul[g / G][16 * b])) : w);
            }
            l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
            m[g] = bm[g];
        }
        for (int hh = 0; hh < NH; hh++) /* each KV head's V rows converted once for up to DEC16_PV of its heads */
            for (int g = hh * G; g < hh * G + G; g += DEC16_PV) {
                switch (hh * G + G - g) {
                case 1: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 1, HD, fmt); break;
                case 2: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 2, HD, fmt); break;
                case 3: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 3, HD, fmt); break;
                case 4: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 4, HD, fmt); break;
                case 5: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 5, HD, fmt); break;
                default: accumulate_v16(a, rows, hh, NULL, n, s[0], BLOCK, 1, corr, acc, g, 6, HD, fmt);
                }
            }
    }
    for (int g = 0; g < NQ; g++) { /* back in dim order */
        float o[MAX_HD];
        for (int i = 0; i < HD; i += 32)
            for (int j = 0; j < 16; j++) {
                o[i + (fmt == 1 ? 2 * j : j)] = acc[g][i + j];
                o[i + (fmt == 1 ? 2 * j + 1 : 16 + j)] = acc[g][i + 16 + j];
            }
        store_out(a, d, h + g / G, g % G, o, (fmt == 2 ? 256.0f : 1.0f) / l[g]);
    }
}

/* ---- Prompt tiles on AVX-512F (bf16 q over bf16 or fp8 pages on AVX512-BF16 CPUs: `attend_pairs16`, in
 * paged_decode_pairs.h): the AVX2 copy's prompt tiles (`attend_vec8`, its comment) on 16 lanes: a tile's NQ =
 * R x G query heads (up to MAX_G) of one KV head along the lanes, 16 a vector (NHV16 <= 2 vectors), K and V
 * rows widened to float32 once a block
 * (`widen_row`), scores S^T [key][head] by broadcasts of a key's dims times Q^T's vectors (KB keys x NHV16 vectors of
 * accumulators), the softmax lane by lane, and the outputs O [head][dim] over the V rows, 64 dims of up to DEC16_PV
 * heads in registers (`tile_values16`). Against attend_vec, which prompt tiles took here before, 100 prompt rows in
 * tiles of 10 (SmolLM2's shape), 30 layers, the builds alternating in one process on a 2-core Ice Lake-SP VM: after
 * 256 keys bf16 pages 0.55-0.64x the time, fp8 ~0.6x, fp32 0.51-0.55x; from key 0 bf16 0.55-0.85x, fp8 0.75-0.9x, fp32
 * 0.63-0.64x. */
#define TILE_HV16 (MAX_G / 16) /* head vectors of a tile, at most */
static const float zero_row[MAX_HD] __attribute__((aligned(64))); /* the K row of a key past a block's end */

/* A prompt tile's running state at its start: each head vector's key counts (qlf) into qlen, maxima -inf, sums 0,
 * and the NQ heads' outputs 0. */
static inline __attribute__((always_inline)) void tile_start16(const float *qlf, int NHV, int NQ, const int HD,
                                                              __m512 *qlen, __m512 *m, __m512 *l,
                                                              float (*acc)[MAX_HD]) {
    for (int v = 0; v < TILE_HV16; v++) { /* past NHV: unused */
        qlen[v] = v < NHV ? _mm512_load_ps(qlf + 16 * v) : _mm512_setzero_ps();
        m[v] = _mm512_set1_ps(-INFINITY);
        l[v] = _mm512_setzero_ps();
    }
    for (int g = 0; g < NQ; g++)
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
}

/* Keys j0 .. j0+KB-1's scores (acc[k][v]: key k, head vector v) times their multipliers into st, -inf for a head
 * whose row does not see the key, and each head's running block maximum into top. */
static inline __attribute__((always_inline)) void tile_scores_out16(__m512 (*acc)[TILE_HV16], int j0, int n,
                                                                   int key0, const float *mul, const __m512 *qlen,
                                                                   float (*st)[MAX_G], __m512 *top, const int NHV,
                                                                   const int KB) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < KB && j0 + k < n; k++) {
        const __m512 key = _mm512_set1_ps((float)(key0 + j0 + k)), m = _mm512_set1_ps(mul[j0 + k]);
        for (int v = 0; v < NHV; v++) {
            const __m512 s = _mm512_mask_mul_ps(ninf, _mm512_cmp_ps_mask(key, qlen[v], _CMP_LT_OQ), acc[k][v], m);
            _mm512_store_ps(&st[j0 + k][16 * v], s);
            top[v] = _mm512_max_ps(top[v], s);
        }
    }
}

/* The tile's NQ heads' outputs acc / l into out (rows d .. of KV head h). */
static inline void tile_finish16(const Args *a, int d, int h, int NQ, int NHV, const __m512 *l,
                                 float (*acc)[MAX_HD]) {
    float lf[MAX_G] __attribute__((aligned(64)));
    for (int v = 0; v < NHV; v++) _mm512_store_ps(lf + 16 * v, l[v]);
    for (int g = 0; g < NQ; g++) store_out(a, d + g / a->G, h, g % a->G, acc[g], 1.0f / lf[g]);
}

/* Scores of keys j0 .. j0+KB-1 (rows kr[]) for the tile's NHV head vectors, as attend_vec8's tile_scores. */
static inline __attribute__((always_inline)) void tile_scores16(const float *qt, const float *const *kr, int j0, int n,
                                                               int key0, const float *mul, const __m512 *qlen,
                                                               float (*st)[MAX_G], __m512 *top, const int HD,
                                                               const int NHV, const int KB) {
    __m512 acc[8][TILE_HV16];
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int c = 0; c < HD; c++) {
        __m512 qv[TILE_HV16];
        for (int v = 0; v < NHV; v++) { /* in registers: not a memory operand of every FMA */
            qv[v] = _mm512_load_ps(qt + c * MAX_G + 16 * v);
            __asm__("" : "+v"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m512 x = _mm512_set1_ps(kr[j0 + k][c]);
            for (int v = 0; v < NHV; v++) acc[k][v] = _mm512_fmadd_ps(x, qv[v], acc[k][v]);
        }
    }
    tile_scores_out16(acc, j0, n, key0, mul, qlen, st, top, NHV, KB);
}

/* The online softmax of a block's n keys for every head at once, as attend_vec8's tile_softmax. */
static inline __attribute__((always_inline)) void tile_softmax16(float (*st)[MAX_G], int n, const __m512 *top,
                                                                const float *wmul, __m512 *m, __m512 *l, float *corr,
                                                                const int NHV) {
    for (int v = 0; v < NHV; v++) {
        const __m512 bm = _mm512_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m512 cv = exp_nonpositive16(_mm512_sub_ps(m[v], bm));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m512 w = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(&st[j][16 * v]), bm));
            sum = _mm512_add_ps(sum, w);
            _mm512_store_ps(&st[j][16 * v], wmul ? _mm512_mul_ps(w, _mm512_set1_ps(wmul[j])) : w);
        }
        l[v] = _mm512_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm512_store_ps(corr + 16 * v, cv);
    }
}

/* Outputs of the tile's NQ heads: acc[g] = acc[g] corr[g] + the block's n V rows (vr) weighted by st[key][g], in
 * passes of DEC16_PV heads (accumulate_v16). */
static inline __attribute__((always_inline)) void tile_values16(float (*acc)[MAX_HD], const float (*st)[MAX_G],
                                                               const float *const *vr, int n, const float *corr,
                                                               int NQ, const int HD) {
    const float *w = st[0];
    int g0 = 0;
    for (; g0 + DEC16_PV <= NQ; g0 += DEC16_PV)
        accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, DEC16_PV, HD, -1);
    switch (NQ - g0) {
    case 1: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 1, HD, -1); break;
    case 2: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 2, HD, -1); break;
    case 3: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 3, HD, -1); break;
    case 4: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 4, HD, -1); break;
    case 5: accumulate_v16(NULL, NULL, 0, vr, n, w, 1, MAX_G, corr, acc, g0, 5, HD, -1); break;
    default: break;
    }
}

/* One work item: KV head h of prompt tile t (rows d .. d+R-1, R > 1), HD a multiple of 64. */
static inline __attribute__((always_inline)) void attend_vec16(const Args *a, int t, int h, const int HD,
                                                               const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    const int G = a->G, NQ = R * G, NHV = (NQ + 15) / 16;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float qt[MAX_HD * MAX_G] __attribute__((aligned(64))); /* [dim][head] */
    float qlf[MAX_G] __attribute__((aligned(64)));
    tile_queries(a, t, h, HD, 16 * NHV, qt, qlf);
    __m512 qlen[TILE_HV16], m[TILE_HV16], l[TILE_HV16];
    float acc[MAX_G][MAX_HD] __attribute__((aligned(64)));
    tile_start16(qlf, NHV, NQ, HD, qlen, m, l, acc);
    float kb[BLOCK * MAX_HD] __attribute__((aligned(64))); /* rows HD apart (attend_vec8: L1 sets) */
    float vb[BLOCK * MAX_HD] __attribute__((aligned(64)));
    float st[BLOCK][MAX_G] __attribute__((aligned(64)));
    float corr[MAX_G] __attribute__((aligned(64)));
    const float *kr[BLOCK + 8], *vr[BLOCK];
    float kmul[BLOCK], vmul[BLOCK];
    for (int j = BLOCK; j < BLOCK + 8; j++) kr[j] = zero_row;
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK];
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are widened */
        const int n_next = rows_after(a, t, h, 1, pages, t0, n, len, next, first, &pf, BLOCK);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->k, pf[j], HD, fmt);
            kr[j] = widen_row(a->k, rows[j], kb + j * HD, HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int j = n; j < BLOCK; j++) kr[j] = zero_row;
        __m512 top[TILE_HV16];
        for (int v = 0; v < NHV; v++) top[v] = _mm512_set1_ps(-INFINITY);
        if (NHV == 1)
            for (int j0 = 0; j0 < n; j0 += 8) tile_scores16(qt, kr, j0, n, t0, kmul, qlen, st, top, HD, 1, 8);
        else
            for (int j0 = 0; j0 < n; j0 += 6) tile_scores16(qt, kr, j0, n, t0, kmul, qlen, st, top, HD, 2, 6);
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            vr[j] = widen_row(a->v, rows[j], vb + j * HD, HD, fmt);
            if (fmt == 2) vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights */
        }
        if (NHV == 1) tile_softmax16(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 1);
        else tile_softmax16(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 2);
        tile_values16(acc, (const float (*)[MAX_G])st, vr, n, corr, NQ, HD);
    }
    tile_finish16(a, d, h, NQ, NHV, l, acc);
}

#if HAVE_BF16
#include "paged_decode_pairs.h" /* prompt tiles by vdpbf16ps: attend_pairs16 */
#endif

/* A work item on AVX-512F CPUs: decode rows take attend_dec16 (fp8 pages only with AVX512-BW), prompt tiles
 * attend_vec16 (every format; bf16 q over bf16 or fp8 pages attend_pairs16 where the CPU has AVX512-BF16), the
 * rest attend_vec. Over fp32 pages attend_dec16 measured as fast as attend_vec
 * (32 rows of 512 keys, 30 layers, Zen 4 VM: 36.0-36.7 ms against 33.3-36.9); it takes them too so that a prompt
 * chunk's one-row last tile over FP8 pages dequantised to float32 gives the bits the call over the FP8 pages
 * gives, as the other rows do (tests/kernels/test_cpu_paged_attention.py). On CPUs with
 * AVX512-BF16 too, since 2026-12-07: there attend_vec had scored bf16 q by `vdpbf16ps`, each query head on its
 * own, every dot folded across lanes. Zen 4 VM, 2 threads, the builds alternating twice: `bench cpu-kernels`' 32
 * decode rows x 30 layers, 512 keys, fp8 pages 33.1 -> 17.3 ms, bf16 23.2 -> 22.3; 2,000 keys fp8 96.7-100.1 ->
 * 63.7-65.9, bf16 81.8-85.3 -> 75.8-76.3; a 1,024-token prompt's attention in the engine (SmolLM2 bfloat16, 30
 * layers) 389-446 -> 245-274 ms, 2,048 tokens 1,530-1,622 -> 965-1,059. */
static inline __attribute__((always_inline)) void attend_vec_dec(const Args *a, int t, int h, const int HD,
                                                                 const int fmt) {
    const int d = tile_first(a, t);
    if ((fmt <= 1 || DEC16_FP8) && HD % 64 == 0 && tile_first(a, t + 1) == d + 1 &&
        a->G <= DEC_Q) { /* a decode row: an item of its KV heads, DEC_Q / G */
        const int per = a->item_heads == 1 ? 1 : DEC_Q / a->G;
        if (h % per == 0) attend_dec16(a, t, h, a->KVH - h < per ? a->KVH - h : per, HD, fmt);
        return; /* the other heads of its group: done with the first */
    }
    if (HD % 64 == 0 && tile_first(a, t + 1) > d + 1) { /* a prompt tile */
#if HAVE_BF16
        if (a->half && fmt >= 1) {
            attend_pairs16(a, t, h, HD, fmt);
            return;
        }
#endif
        attend_vec16(a, t, h, HD, fmt);
    } else
        attend_vec(a, t, h, HD, fmt);
}
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_vec_dec(a, t, h, hd, f); }
