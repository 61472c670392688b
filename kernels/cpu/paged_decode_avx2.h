/* paged_decode.c's AVX2 copies (included by it in place of paged_decode_avx512.h), for CPUs with AVX2 and FMA but
 * no AVX-512, head sizes 64 and 128 (NV = HD / 8 vectors), float32, bfloat16 or fp8 pages (no bfloat16 dot products
 * here: rows are converted to float32): decode rows in `attend_dec8`, prompt tiles in `attend_vec8` (their sections
 * below). The decode rows' history: before
 * `attend_dec8` they ran a scheme like attend_vec's (each query head's scores 8 tokens at a time, 8 chains of FMAs
 * folded by `sum8`), which against the generic code it replaced, one thread, 30 layers' own page pools (32
 * sequences, G = 3, HD = 64, page tables shuffled), the two builds alternating in one process on a 2-core AMD EPYC
 * VM (Zen 3) took: bf16 pages 0.79x the time at 150 keys, 0.69x at 600; fp8 0.57x and 0.48x (~44 and ~36 ns per
 * sequence, KV head and key); pages in cache 0.84x and 0.73x. Without the prefetches 1.13x (bf16) and 1.54x (fp8)
 * its time; issued one per token among the scores and sums instead of a burst per block, 1.04-1.3x. */
static inline __m256 sum8(const __m256 v[8]) { /* lane j: the sum of v[j]'s 8 lanes */
    __m256 a[4], b[2];
    for (int k = 0; k < 4; k++) /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2k] = x, v[2k+1] = y */
        a[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 2; k++) { /* per 128-bit lane: that lane's sums of v[4k .. 4k+3] */
        const __m256d x = _mm256_castps_pd(a[2 * k]), y = _mm256_castps_pd(a[2 * k + 1]);
        b[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    /* add the two 128-bit lanes: b[k]'s sums end up in lanes 4k .. 4k+3 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

/* Page row `row` as float32: fp32 in place, else widened into dst (fp8: the codes' values, as load_row). */
static inline __attribute__((always_inline)) const float *widen_row8(const void *base, int64_t row, float *dst,
                                                                      const int HD, const int fmt) {
    if (fmt == 0) return (const float *)base + row * HD;
    for (int c = 0; c < HD; c += 8) {
        __m256 v;
        if (fmt == 1) {
            v = bf16x8_to_float((const uint16_t *)base + row * HD + c);
        } else { /* as widen16: by float16 where the CPU has F16C, else the float32 bits (load_row's) */
            const uint8_t *src = (const uint8_t *)base + row * HD + c;
#ifdef __F16C__
            v = _mm256_mul_ps(_mm256_cvtph_ps(fp8x8_half_bits(src)), _mm256_set1_ps(0x1p8f));
#else
            const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src));
            const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32((int)0x87FFFFFFu));
            v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
#endif
        }
        _mm256_store_ps(dst + c, v);
    }
    return dst;
}

/* ---- Decode rows on AVX2: a decode row (a tile of one row, what each sequence of a decode
 * step is) against all its KV heads at once, every key row read once and kept in registers.
 * Prompt tiles (attend_vec8 below) convert a block's K and V rows into float32 buffers, one KV head an item. Here
 * an item's KV heads run together (up to DEC_Q query heads; SmolLM2's 3 KV heads x 3),
 * so a token's rows of those heads, which lie side by side in the page, are read as one span; per block of up to
 * 32 keys:
 *   scores: each K row becomes HD / 8 float32 vectors in registers (`row16`: a bf16 row gives 16 dims a 32-byte
 *     load, the even dims by a shift and the odd ones by a mask, so the lanes hold dims c, c + 2, ... then c + 1,
 *     c + 3, ...; q and the output are kept in that order and put back at the end), and each of its query heads'
 *     dots with it is two chains of FMAs into one vector of partial sums (`part`); `sum8` folds 8 keys' vectors
 *     into their 8 scores;
 *   softmax: 8 scores a vector (`exp_nonpositive8`: exp_reduced's operations lane by lane), keys past the block's
 *     end masked to -inf;
 *   values: per query head its output stays in registers over the block's keys, each V row converted in registers
 *     as K's (the rescale by the new maximum folded into loading the output); over fp8 pages per KV head instead,
 *     16 dims of up to 4 query heads' outputs in registers, so that each V row is converted once
 *     (`accumulate_v8`). The block's V rows (bf16, fp8) are prefetched from L2 into L1 before the softmax.
 * fp8 pages (where the CPU has F16C): row16 converts by float16, 2^-8 of the values; the 2^8 goes into the
 * scores' multiplier with the token's 2^e and the scale, and into the output's 1 / l, the V rows' 2^e into the
 * weights (after their sum: l is the weights' sum).
 * Sums are float32 in another order than attend_vec8's (per head: two chains over HD, then the lanes' tree); the
 * exponentials are the same polynomial. A 2-core AMD EPYC VM (AVX2, Zen 3 flags), SmolLM2's shape (3 KV heads x 3,
 * HD = 64), 32 sequences x 30 layers' own pools, 2 threads, the two copies alternating in one process: bf16 pages
 * 0.99x attend_vec8's time at 128 keys, 0.85x at 256, 0.90x at 1,024, fp32 pages 0.82x at 512; with the pages in
 * L2 (2 sequences, one thread) 0.80x. The pages come from memory in a decode step, and there the pattern of reads
 * (128 of every 384 bytes of a token's row, pages scattered; a plain C loop reading the same bytes gets ~8 GB/s
 * on one core, ~11 GB/s whole rows) bounds both copies more than their arithmetic. Over fp8 pages a first try of
 * this loop (V rows converted per query head, by attend_vec8's float32 bit placement) took 1.09x attend_vec8's
 * time; as above, with V's prefetches spread over the K loop, 0.79x at 128-1,024 keys (in L2 0.83x), bf16 pages
 * 0.88x, fp32 0.92x (the L1 prefetch for bf16 and fp8 only: fp32's 24 KB of a block's V rows would evict K's).
 * V's loop per KV head took 1.12-1.16x the time over fp32 rows (each 16-dim pass reads a quarter of a 256-byte
 * row) and 1.01x over bf16: they keep theirs. */
#define TILE_PV 6 /* query heads whose outputs one pass over a block's V rows holds (accumulate_v8) */
#ifdef __F16C__
#define DEC8_FP8 1 /* fp8 rows converted by float16 (row16) */
#else
#define DEC8_FP8 0
#endif

/* e^x for x <= 0 on 8 lanes, as exp_nonpositive: below EXP_CUTOFF (and -inf) 0; NaN stays NaN. */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 c = _mm256_max_ps(_mm256_set1_ps(EXP_CUTOFF), x); /* the second operand where either is NaN */
    __m256 n;
    const __m256 p = exp_reduced8(c, &n);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(EXP_CUTOFF), _CMP_LT_OQ),
                            _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Lanes i with i < k all ones (keys within a block's live part), the others zero. */
static inline __m256 lanes_below8(int k) {
    return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps((float)k), _CMP_LT_OQ);
}

/* The largest of v's 8 lanes, in every lane. */
static inline __m256 max_all8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
}

/* One block of a query head's online softmax on 8 lanes: its scores s[0 .. 8 nb) (lanes past its keys -inf), top
 * their lanes' maxima with its running max m (unreduced). s becomes the weights (times wmul's lanes where given, V's
 * 2^e, after their sum), m and the running sum l move on; returns e^(old m - new m), the rescale of what came
 * before (0 on the first block, m = -inf). */
static inline __attribute__((always_inline)) float softmax_block8(float *s, int nb, __m256 top, const float *wmul,
                                                                  float *m, float *l) {
    top = max_all8(top);
    const float bm = _mm256_cvtss_f32(top), corr = exp_nonpositive(*m - bm);
    __m256 sum = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 w = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(s + 8 * b), top));
        _mm256_store_ps(s + 8 * b, wmul ? _mm256_mul_ps(w, _mm256_load_ps(wmul + 8 * b)) : w);
        sum = _mm256_add_ps(sum, w);
    }
    *l = *l * corr + hsum8(sum);
    *m = bm;
    return corr;
}

/* Dims c .. c+15 of page row `row` as two float32 vectors in attend_dec8's lane order: bf16 the even dims then the
 * odd ones (one 32-byte load, a shift and a mask); fp32 and fp8 c .. c+7 then c+8 .. c+15. fp8 by float16: the
 * e4m3 bits s eeee mmm placed as float16 bits s 0eeee mmm0000000 read as 2^(e-15) (1 + m/8), or 2^-14 (m/8) for
 * e = 0, where the true values are 2^(e-7) (1 + m/8) and 2^-6 (m/8): exactly 2^-8 of them (F16C's conversion is
 * exact, subnormals too); the caller folds 2^8 into the token's 2^e. */
static inline __attribute__((always_inline)) void row16(const void *base, int64_t row, int c, const int HD,
                                                        const int fmt, __m256 *lo, __m256 *hi) {
    if (fmt == 0) {
        *lo = _mm256_loadu_ps((const float *)base + row * HD + c);
        *hi = _mm256_loadu_ps((const float *)base + row * HD + c + 8);
    } else if (fmt == 1) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row * HD + c));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else { /* fp8: `fp8x16_half_bits` */
#if DEC8_FP8
        const __m256i h = fp8x16_half_bits((const uint8_t *)base + row * HD + c);
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
#endif
    }
}

/* NG query heads' outputs o (rows MAX_HD apart, each rescaled by corr[i] first) plus the block's n keys' V rows
 * weighted by w[i * wh + j * wk] (head i, key j; any layout of the weights), 16 dims at a time: their 2 NG output
 * vectors stay in registers and each V row's 16 dims are loaded (and converted) once for all of them. V row j: vr[j],
 * float32, where given (prompt tiles: rows widened once a block); else page row rows[j] + hh of v, converted in
 * registers by row16 (decode rows over fp8 pages). */
static inline __attribute__((always_inline)) void accumulate_v8(const void *v, const int64_t *rows, int hh,
                                                                const float *const *vr, int n, const float *w,
                                                                const int wh, const int wk, const float *corr,
                                                                float (*o)[MAX_HD], const int HD, const int fmt,
                                                                const int NG) {
    for (int c = 0; c < HD; c += 16) {
        __m256 x[TILE_PV][2]; /* a fixed size (NG <= TILE_PV): registers once unrolled */
        for (int i = 0; i < NG; i++) {
            const __m256 ci = _mm256_set1_ps(corr[i]);
            x[i][0] = _mm256_mul_ps(_mm256_load_ps(&o[i][c]), ci);
            x[i][1] = _mm256_mul_ps(_mm256_load_ps(&o[i][c + 8]), ci);
        }
        for (int j = 0; j < n; j++) {
            __m256 lo, hi;
            if (vr) {
                lo = _mm256_loadu_ps(vr[j] + c);
                hi = _mm256_loadu_ps(vr[j] + c + 8);
            } else {
                row16(v, rows[j] + hh, c, HD, fmt, &lo, &hi);
            }
            for (int i = 0; i < NG; i++) {
                const __m256 p = _mm256_broadcast_ss(&w[i * wh + j * wk]);
                x[i][0] = _mm256_fmadd_ps(p, lo, x[i][0]);
                x[i][1] = _mm256_fmadd_ps(p, hi, x[i][1]);
            }
        }
        for (int i = 0; i < NG; i++) {
            _mm256_store_ps(&o[i][c], x[i][0]);
            _mm256_store_ps(&o[i][c + 8], x[i][1]);
        }
    }
}

/* KV heads h .. h+NH-1 of decode row t (fp32 or bf16 pages), its NQ = NH x G query heads (head hh's g-th is query
 * hh * G + g), NQ <= DEC_Q. */
static inline __attribute__((always_inline)) void attend_dec8(const Args *a, int t, int h, int NH, const int HD,
                                                              const int fmt) {
    const int d = tile_first(a, t), G = a->G, NQ = NH * G, NV = HD / 8, len = a->lens[d];
    float q[DEC_Q * MAX_HD] __attribute__((aligned(32))); /* in row16's lane order */
    float acc[DEC_Q][MAX_HD] __attribute__((aligned(32)));
    float part[BLOCK][DEC_Q][8] __attribute__((aligned(32))); /* per key and query head: 8 partial sums of its dot */
    float s[DEC_Q][BLOCK] __attribute__((aligned(32)));
    float kmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(32))); /* fp8, per KV head and key: 2^e 2^8 scale */
    float vmul[fmt == 2 ? DEC_Q : 1][BLOCK] __attribute__((aligned(32))); /* 2^e */
    float m[DEC_Q], l[DEC_Q], corr[DEC_Q];
    for (int hh = 0; hh < NH; hh++) {
        float qbuf[MAX_G * MAX_HD];
        const float *qd = load_q(a, d, h + hh, qbuf);
        float *qh = q + hh * G * HD;
        for (int i = 0; i < G * HD; i += 16) /* bf16: each 16 dims' even ones, then the odd ones */
            for (int j = 0; j < 8; j++) {
                qh[i + j] = qd[i + (fmt == 1 ? 2 * j : j)];
                qh[i + 8 + j] = qd[i + (fmt == 1 ? 2 * j + 1 : 8 + j)];
            }
    }
    for (int g = 0; g < NQ; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    }
    const __m256 scale = _mm256_set1_ps(a->scale);
    const float kscale = a->scale * 256.0f; /* fp8: row16's rows are 2^-8 of the values, K's and V's */
    const int64_t *pages = a->table + (int64_t)d * a->MAXP;
    int64_t rows[BLOCK], next[BLOCK], first[BLOCK]; /* head h's page rows (head h + hh's: rows + hh) */
    block_rows(pages, 0, len < BLOCK ? len : BLOCK, a->S, a->KVH, h, next);
    for (int t0 = 0; t0 < len; t0 += BLOCK) {
        const int n = len - t0 < BLOCK ? len - t0 : BLOCK;
        memcpy(rows, next, sizeof(int64_t) * n);
        const int64_t *pf; /* the rows that come next, prefetched while this block's are read */
        const int n_next = rows_after(a, t, h, NH, pages, t0, n, len, next, first, &pf, BLOCK);
        if (fmt == 2) /* the tokens' 2^e (K's times scale and row16's 2^8) */
            block_exponents(a, rows, n, h, NH, kscale, kmul, vmul);
        for (int j = 0; j < n; j++) {
            if (j < n_next) /* a key's at a time (V's in a burst after the scores: 1.06-1.14x the time) */
                prefetch_next_key(a, pf, j, NH, HD, fmt);
            for (int hh = 0; hh < NH; hh++)
                for (int c0 = 0; c0 < HD; c0 += 64) { /* 8 vectors of the row at a time */
                    const int nv = HD - c0 < 64 ? (HD - c0) / 8 : 8;
                    __m256 k[8];
                    for (int c = 0; c < nv; c += 2) row16(a->k, rows[j] + hh, c0 + 8 * c, HD, fmt, &k[c], &k[c + 1]);
                    for (int g = hh * G; g < hh * G + G; g++) {
                        const float *qg = q + g * HD + c0;
                        __m256 x0 = _mm256_mul_ps(_mm256_load_ps(qg), k[0]);
                        __m256 x1 = _mm256_mul_ps(_mm256_load_ps(qg + 8), k[1]);
                        for (int c = 2; c < nv; c += 2) {
                            x0 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c), k[c], x0);
                            x1 = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c + 8), k[c + 1], x1);
                        }
                        __m256 x = _mm256_add_ps(x0, x1);
                        if (c0) x = _mm256_add_ps(x, _mm256_load_ps(part[j][g]));
                        _mm256_store_ps(part[j][g], x);
                    }
                }
        }
        if (fmt != 0) /* the block's V rows from L2 into L1 while the softmax runs (fp32's 24 KB would evict K's) */
            for (int j = 0; j < n; j++) prefetch_rows(a->v, rows[j], NH, HD, fmt, 1);
        const int nb = (n + 7) / 8; /* vectors of 8 keys; lanes past n masked */
        __m256 live[BLOCK / 8];    /* the lanes of keys within the block */
        for (int b = 0; b < nb; b++) live[b] = lanes_below8(n - 8 * b);
        for (int g = 0; g < NQ; g++) {
            __m256 top = _mm256_set1_ps(m[g]);
            for (int b = 0; b < nb; b++) {
                __m256 v[8];
                for (int jj = 0; jj < 8; jj++) v[jj] = _mm256_load_ps(part[8 * b + jj][g]);
                const __m256 mul = fmt == 2 ? _mm256_load_ps(&kmul[g / G][8 * b]) : scale;
                const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(sum8(v), mul), live[b]);
                _mm256_store_ps(&s[g][8 * b], sc);
                top = _mm256_max_ps(top, sc);
            }
            corr[g] = softmax_block8(s[g], nb, top, fmt == 2 ? vmul[g / G] : NULL, &m[g], &l[g]);
        }
        if (fmt == 2) /* fp8: each V row converted once, for up to 4 of its query heads at a time */
            for (int hh = 0; hh < NH; hh++)
                for (int g = hh * G; g < hh * G + G; g += 4) {
                    const float *w = s[g], *cg = corr + g;
                    float(*o)[MAX_HD] = acc + g;
                    switch (hh * G + G - g) {
                    case 1: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 1); break;
                    case 2: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 2); break;
                    case 3: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 3); break;
                    default: accumulate_v8(a->v, rows, hh, NULL, n, w, BLOCK, 1, cg, o, HD, fmt, 4);
                    }
                }
        else /* whole rows per query head: over fp32 and bf16 rows 0.86-0.99x the time of the loop above */
            for (int g = 0; g < NQ; g++)
                for (int c0 = 0; c0 < NV; c0 += 8) { /* 8 vectors of the output in registers */
                    const int nv = NV - c0 < 8 ? NV - c0 : 8;
                    const __m256 cg = _mm256_set1_ps(corr[g]);
                    __m256 o[8];
                    for (int c = 0; c < nv; c++) o[c] = _mm256_mul_ps(_mm256_load_ps(&acc[g][8 * (c0 + c)]), cg);
                    for (int j = 0; j < n; j++) {
                        const __m256 p = _mm256_set1_ps(s[g][j]);
                        for (int c = 0; c < nv; c += 2) {
                            __m256 lo, hi;
                            row16(a->v, rows[j] + g / G, 8 * (c0 + c), HD, fmt, &lo, &hi);
                            o[c] = _mm256_fmadd_ps(p, lo, o[c]);
                            o[c + 1] = _mm256_fmadd_ps(p, hi, o[c + 1]);
                        }
                    }
                    for (int c = 0; c < nv; c++) _mm256_store_ps(&acc[g][8 * (c0 + c)], o[c]);
                }
    }
    for (int g = 0; g < NQ; g++) { /* back in dim order */
        float o[MAX_HD];
        for (int i = 0; i < HD; i += 16)
            for (int j = 0; j < 8; j++) {
                o[i + (fmt == 1 ? 2 * j : j)] = acc[g][i + j];
                o[i + (fmt == 1 ? 2 * j + 1 : 8 + j)] = acc[g][i + 8 + j];
            }
        store_out(a, d, h + g / G, g % G, o, (fmt == 2 ? 256.0f : 1.0f) / l[g]);
    }
}


static const float zero_row[MAX_HD] __attribute__((aligned(32))); /* the K row of a key past a block's end */

/* ---- Prompt tiles on AVX2: a tile's NQ = R x G query heads (up to MAX_G) of one KV head, the heads along the
 * lanes, 8 a vector (NHV vectors), against blocks of BLOCK keys:
 *   scores: S^T [key][head] = K . Q^T, Q transposed once per item (qt [dim][head], heads past NQ zero), so a
 *     score vector is one key's scores for 8 heads: per dim a key's value broadcast times qt's vectors, KB keys
 *     x NHV head vectors of accumulators in registers (`tile_scores`: 6 loads for 8 FMAs at NHV = 4); no
 *     horizontal sums. Lanes past a head's own keys (its row's count, `qlen`) are -inf;
 *   softmax lane by lane, every head at once: a block's maximum, the weights and their sum are vertical
 *     operations over its keys' rows (`tile_softmax`);
 *   values: O [head][dim] += P^T [head][key] . V, 6 heads x 16 dims of outputs in registers over the block's keys
 *     (`tile_values`, by decode rows' `accumulate_v8`: per key 2 loads of V and 6 broadcasts of weights for 12
 *     FMAs), the rescale by the new
 *     maximum folded into loading O.
 * The K and V rows are widened to float32 once a block (`widen_row8`, fp32 pages read in place; fp8 times 2^120),
 * each token's 2^e (fp8) into the scores' multiplier and into the weights after their sum. Sums are float32: a
 * score is one chain of FMAs over HD, the weights' sum per key in order (another order than the decode rows' and
 * the generic code's; tests compare each with the reference).
 * Before (to 2026-12-06): per query head the scores of 8 keys as 8 dot-product chains folded by `sum8` (9 loads
 * for 8 FMAs, then the lanes' tree), the softmax per head, and each head's output over the V rows alone (9 loads
 * for 8 FMAs); the scores took ~8 cycles a (query head, key) where their FMAs need 4. SmolLM2's shape (G = 3, HD =
 * 64, tiles of 10 rows), a 512-row chunk whose keys end at 4,000, 30 layers' own pools, the two copies alternating
 * in one process on a 2-core AMD EPYC VM (Zen 3): bf16 pages 0.71-0.75x the time, fp8 0.65-0.74x, fp32 0.75x;
 * chunks of 100 and 256 rows from key 1 0.68-0.94x (this VM's noise is that wide); in an engine, the attention
 * of a 4,000-token prompt 0.70x, of a 1,000-token one 0.71x, their TTFT 0.81x and 0.92x. The accumulators are
 * fixed-size arrays (a VLA of them stayed in memory: 2x the time), and qt's vectors are pinned in registers (gcc
 * made them memory operands of every FMA: 10 loads for 8 FMAs). The steps of a block switch on NHV each: one copy
 * of the whole tile per NHV compiled this file in 21 s instead of 9. */
#define TILE_HV (MAX_G / 8) /* head vectors of a tile, at most */

/* Scores of keys j0 .. j0+KB-1 (rows kr[]) for the tile's NHV head vectors: st[j] = K_j . qt, times mul[j],
 * -inf in lanes whose head sees fewer than key + 1 keys (qlen); returns them folded into top's maxima (keys
 * from n on are not stored: their rows are zero_row). */
static inline __attribute__((always_inline)) void tile_scores(const float *qt, const float *const *kr, int j0, int n,
                                                             int key0, const float *mul, const __m256 *qlen,
                                                             float (*st)[MAX_G], __m256 *top, const int HD,
                                                             const int NHV, const int KB) {
    __m256 acc[8][TILE_HV]; /* fixed sizes (KB <= 8): registers once unrolled, where a VLA stays in memory */
    for (int k = 0; k < KB; k++)
        for (int v = 0; v < NHV; v++) acc[k][v] = _mm256_setzero_ps();
    for (int c = 0; c < HD; c++) {
        __m256 qv[TILE_HV];
        for (int v = 0; v < NHV; v++) { /* in registers: gcc would reload them as operands of every FMA */
            qv[v] = _mm256_load_ps(qt + c * MAX_G + 8 * v);
            __asm__("" : "+x"(qv[v]));
        }
        for (int k = 0; k < KB; k++) {
            const __m256 x = _mm256_broadcast_ss(kr[j0 + k] + c);
            for (int v = 0; v < NHV; v++) acc[k][v] = _mm256_fmadd_ps(x, qv[v], acc[k][v]);
        }
    }
    for (int k = 0; k < KB && j0 + k < n; k++) {
        const __m256 key = _mm256_set1_ps((float)(key0 + j0 + k)), m = _mm256_set1_ps(mul[j0 + k]);
        for (int v = 0; v < NHV; v++) {
            const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_mul_ps(acc[k][v], m),
                                              _mm256_cmp_ps(key, qlen[v], _CMP_LT_OQ));
            _mm256_store_ps(&st[j0 + k][8 * v], s);
            top[v] = _mm256_max_ps(top[v], s);
        }
    }
}

/* The online softmax of a block's n keys for every head at once (lanes): scores st become weights (times wmul[j],
 * V's 2^e, after their sum, where given); m and l, the heads' running maxima and sums, move on; corr gets each
 * head's rescale of what came before, e^(old m - new m) (0 on the first block). */
static inline __attribute__((always_inline)) void tile_softmax(float (*st)[MAX_G], int n, const __m256 *top,
                                                              const float *wmul, __m256 *m, __m256 *l, float *corr,
                                                              const int NHV) {
    for (int v = 0; v < NHV; v++) {
        const __m256 bm = _mm256_max_ps(m[v], top[v]); /* finite: every head sees key 0 */
        const __m256 cv = exp_nonpositive8(_mm256_sub_ps(m[v], bm));
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m256 w = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(&st[j][8 * v]), bm));
            sum = _mm256_add_ps(sum, w);
            _mm256_store_ps(&st[j][8 * v], wmul ? _mm256_mul_ps(w, _mm256_set1_ps(wmul[j])) : w);
        }
        l[v] = _mm256_fmadd_ps(l[v], cv, sum);
        m[v] = bm;
        _mm256_store_ps(corr + 8 * v, cv);
    }
}

/* A block's scores for NHV head vectors (a constant after the switch), KB keys a pass (registers: KB x NHV
 * accumulators, NHV of qt, the broadcasts). */
static inline __attribute__((always_inline)) void tile_scores_all(const float *qt, const float *const *kr, int n,
                                                                 int key0, const float *mul, const __m256 *qlen,
                                                                 float (*st)[MAX_G], __m256 *top, const int HD,
                                                                 const int NHV) {
    const int KB = NHV == 4 ? 2 : NHV == 3 ? 3 : NHV == 2 ? 4 : 8;
    for (int j0 = 0; j0 < n; j0 += KB) tile_scores(qt, kr, j0, n, key0, mul, qlen, st, top, HD, NHV, KB);
}

/* Outputs of the tile's NQ heads: acc[g] = acc[g] corr[g] + the block's n V rows (vr) weighted by st[key][g], in
 * passes of TILE_PV heads (accumulate_v8: per key 2 loads of V and 6 broadcasts of weights for 12 FMAs). */
static inline __attribute__((always_inline)) void tile_values(float (*acc)[MAX_HD], const float (*st)[MAX_G],
                                                             const float *const *vr, int n, const float *corr,
                                                             int NQ, const int HD) {
    int g0 = 0;
    for (; g0 + TILE_PV <= NQ; g0 += TILE_PV)
        accumulate_v8(NULL, NULL, 0, vr, n, &st[0][g0], 1, MAX_G, corr + g0, acc + g0, HD, 0, TILE_PV);
    const float *w = &st[0][g0], *cg = corr + g0;
    switch (NQ - g0) {
    case 1: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 1); break;
    case 2: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 2); break;
    case 3: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 3); break;
    case 4: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 4); break;
    case 5: accumulate_v8(NULL, NULL, 0, vr, n, w, 1, MAX_G, cg, acc + g0, HD, 0, 5); break;
    default: break;
    }
}

/* One work item: KV head h of tile t (a decode row: attend_dec8). */
static inline __attribute__((always_inline)) void attend_vec8(const Args *a, int t, int h, const int HD,
                                                              const int fmt) {
    const int d = tile_first(a, t), R = tile_first(a, t + 1) - d;
    if (R == 1 && (fmt != 2 || DEC8_FP8) && a->G <= DEC_Q) { /* a decode row: an item of its KV heads, DEC_Q / G */
        const int per = a->item_heads == 1 ? 1 : DEC_Q / a->G;
        if (h % per == 0) attend_dec8(a, t, h, a->KVH - h < per ? a->KVH - h : per, HD, fmt);
        return; /* the other heads of its group: done with the first */
    }
    const int G = a->G, NQ = R * G, NHV = (NQ + 7) / 8;
    const int len = a->lens[d + R - 1]; /* rows ascend: the tile's last row sees the most keys */
    float qt[MAX_HD * MAX_G] __attribute__((aligned(32))); /* [dim][head] */
    float qlf[MAX_G] __attribute__((aligned(32)));
    tile_queries(a, t, h, HD, 8 * NHV, qt, qlf);
    __m256 qlen[TILE_HV], m[TILE_HV], l[TILE_HV];
    for (int v = 0; v < NHV; v++) {
        qlen[v] = _mm256_load_ps(qlf + 8 * v);
        m[v] = _mm256_set1_ps(-INFINITY);
        l[v] = _mm256_setzero_ps();
    }
    float acc[MAX_G][MAX_HD] __attribute__((aligned(32)));
    for (int g = 0; g < NQ; g++)
        for (int i = 0; i < HD; i++) acc[g][i] = 0.0f;
    /* rows HD apart: at MAX_HD's 1 KB stride a block's rows fell into a quarter of a 32 KB L1's sets (0.81-0.86x
     * the time once packed) */
    float kb[BLOCK * MAX_HD] __attribute__((aligned(32)));
    float vb[BLOCK * MAX_HD] __attribute__((aligned(32)));
    float st[BLOCK][MAX_G] __attribute__((aligned(32)));
    float corr[MAX_G] __attribute__((aligned(32)));
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
            kr[j] = widen_row8(a->k, rows[j], kb + j * HD, HD, fmt);
            kmul[j] = (fmt == 2 ? pow2i(a->ke[rows[j]]) : 1.0f) * a->scale;
        }
        for (int j = n; j < BLOCK; j++) kr[j] = zero_row;
        __m256 top[TILE_HV];
        for (int v = 0; v < NHV; v++) top[v] = _mm256_set1_ps(-INFINITY);
        switch (NHV) {
        case 1: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 1); break;
        case 2: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 2); break;
        case 3: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 3); break;
        default: tile_scores_all(qt, kr, n, t0, kmul, qlen, st, top, HD, 4); break;
        }
        for (int j = 0; j < n; j++) {
            if (j < n_next) prefetch_row(a->v, pf[j], HD, fmt);
            vr[j] = widen_row8(a->v, rows[j], vb + j * HD, HD, fmt);
            if (fmt == 2) vmul[j] = pow2i(a->ve[rows[j]]); /* the token's 2^e into its weights */
        }
        switch (NHV) {
        case 1: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 1); break;
        case 2: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 2); break;
        case 3: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 3); break;
        default: tile_softmax(st, n, top, fmt == 2 ? vmul : NULL, m, l, corr, 4); break;
        }
        tile_values(acc, (const float (*)[MAX_G])st, vr, n, corr, NQ, HD);
    }
    float lf[MAX_G] __attribute__((aligned(32)));
    for (int v = 0; v < NHV; v++) _mm256_store_ps(lf + 8 * v, l[v]);
    for (int g = 0; g < NQ; g++) store_out(a, d + g / G, h, g % G, acc[g], 1.0f / lf[g]);
}
#define SPECIALISE(hd, f) static void attend_##hd##_##f(const Args *a, int t, int h) { attend_vec8(a, t, h, hd, f); }
