/* y[M, N] (bfloat16) = x[M, K] . W[N, K]^T for bfloat16 x and an INT4 group-wise W, on CPUs with
 * AVX512-BF16 (this file's code), with AVX-512F but no BF16 (gemv_int4_avx512f.h's) or with AVX2 and FMA
 * (gemv_int4_avx2.h's), each included below in its place, on the same layout (the row blocks, pool and entry
 * point here serve all three): the decode GEMV / small GEMM of INT4
 * linear layers. Built and loaded by kernels/cpu_gemv_int4.py, which also packs the weights into the layout
 * below at load.
 *
 * The weight is W[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g], q in 0..15, g = k / group (weight_formats.py).
 * Nothing is dequantised: the codes themselves go into `vdpbf16ps`. A code q becomes the bfloat16 value
 * 128 + q by OR-ing its 4 bits into the bits of 128.0 (0x4300: exponent 2^7, so the 7 mantissa bits count
 * whole units). The products (128 + q) * x are exact and the sums float32,
 * so per group, with D = sum (128 + q) x and X = sum x over the group's columns (X once per call),
 *
 *     sum_k W[n, k] x[k] = s D + (z - 136 s) X        (128 from the encoding, 8 the midpoint)
 *
 * exactly up to float32 summation: torch's INT4 GEMM widens each weight to float32 first, which is what
 * this computes in another order. The 136 s X term cancels most of s D; the rounding this leaves is about
 * 2^-24 * 136 * s * sum |x| per group, 2^-14 of the output in bad cases, well under the bfloat16 rounding
 * of the result (2^-9). Each group's two terms are summed before they join the running sum, so that sum
 * never holds the large terms: added in (s D + (z - 136 s) X), the groups round as small values do, and a
 * K split across ranks (tensor parallel) changes the result by float32 rounding only. Added one term at a
 * time, the running sum carried ~136 s X and its rounding: a Kimi-style model's logits moved 6.5e-4 between
 * one process and two expert-parallel ranks on the AVX2 copy (4.4e-7 after; torch's op: 5.0e-7).
 *
 * Lanes run along N, not K: a 512-bit register holds 16 output rows' codes for 2 columns (`vdpbf16ps`
 * adds pairs), multiplied by the same two x values broadcast to every lane, so a tile's sums need no
 * horizontal reduction and a group's scales are one vector of 16 rows' scales. The layout (packed at
 * load by kernels/cpu_gemv_int4.py) is panels of 16 rows: for panel p and columns 8t..8t+7, 64 bytes
 * read as 32 16-bit words, word 2i + e holding row 16p + i's columns 8t + e, 8t + 2 + e, 8t + 4 + e and
 * 8t + 6 + e in its four nibbles (low first). Each nibble, masked or shifted down and OR-ed into 128.0,
 * is then 16 rows by 2 columns in `vdpbf16ps` order: seven simple in-lane instructions per 128 codes (a
 * layout of 4 columns per 32 bytes, zero-extended to words first, ran the same at 1-32 rows). A panel is
 * one contiguous stream of K * 8 bytes and the panels follow each other, so the weight is read front to
 * back. Scales and zeros are [panel, group, 2, 16] bfloat16 (s then z for 16 rows).
 *
 * Tiles: MR <= 8 x rows by one panel, with NA = 2 accumulators of D per row (two chains in flight each)
 * and one of the sum; 1-2 rows take NA = 4 (four chains for a row). Measured on a 2-core AMD EPYC VM
 * (Zen 5 by its flags) over SmolLM2's linears streamed from memory, one thread: 4 panels side by side
 * at 1 row (4 streams) and 2 at 2 rows took 1.3x and 1.4x the time of one panel with 4 chains. Past 8
 * rows, x tiles are balanced (32 rows: 4 x 8) and run panel by panel, so the later tiles find the
 * panel in L1; past MBLOCK rows (a prompt) the rows go in blocks, so x stays in L2.
 * Same harness, against torch's `_weight_int4pack_mm_for_cpu` at g = 32, one thread: 0.82x its time at
 * 1 row, 0.68x at 4, 0.52-0.58x at 8-64, 0.43-0.51x at 64-1,024 (prompt shapes); against the bfloat16
 * GEMV (4 times the bytes): 0.56x at 1 row, 0.95x at 8, 1.1-1.3x at 16-64, before the broadcasts were
 * folded into the products (`dp_pair`: ~0.7x at 8 rows and ~1.0x at 32 since). Tried and dropped, same
 * harness: prefetching 1, 3, 4 or 8 KB ahead instead of 2 (within noise; 3-4 KB with the layout below,
 * 1.4x slower), into L1 (within noise), each group's scales stored after its codes in the one stream
 * (0.85-0.90x at 1-2 rows, 1.04-1.16x at 8-16); at 32 rows, before the fold: tiles of 12 rows with one
 * chain each (INT4 / bf16 time 1.26-1.28, where 8-row tiles with two chains took 1.19-1.21), and each
 * panel decoded once into a buffer that every x tile loads (1.56-1.60: more loads for less decoding, the
 * wrong way; the fold took one instruction per product away instead). At one row a thread reads ~10-15
 * GB/s, where the bfloat16 GEMV reads ~15-20.
 *
 * Threads: the shared pool (kernels/cpu/pool.c): chunks of panels claimed one at a time, as in gemv_bf16.c.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bits.h"
#include "pool.h"

#if !defined(__AVX512BF16__) && !(defined(__AVX2__) && defined(__FMA__))
#error "needs AVX512-BF16, or AVX2 with FMA (this CPU has neither: torch's INT4 GEMM runs instead)"
#endif

#define PANEL 16 /* output rows per panel (one register of float32 sums) */
#define PF_DIST 2048 /* bytes ahead of the loads prefetched into L2 (the first x tile of a panel) */
#define MBLOCK 64    /* x rows per pass over a chunk's panels (64 x 1536 bfloat16: 192 KB; AVX2's float32 xf 384) */

typedef struct {
    const uint16_t *x; /* [M, K] bfloat16, K a multiple of 8 */
    const float *xs;   /* [M, G]: sum of x over each group's columns */
    const uint8_t *q;  /* [P, K / 8, 64] packed codes */
    const uint16_t *sz; /* [P, G, 2, 16] bfloat16 scales and zeros */
    uint16_t *y;       /* [M, N] bfloat16 */
    int M, N, K, G, group, p0, p1;
    const float *xf; /* [M, K]: x in float32 (AVX2 only: prepare_x) */
    int amx;         /* run the AMX tiles (amx_rows) */
} Args;

#ifdef __AVX512F__
/* The end of group g in a 16-lane tile (this file's vdpbf16ps copy and gemv_int4_avx512f.h's): for each x row, its
 * NA chains of sum (128 + q) x added up (pairwise), then s D + (z - 136 s) X, the group's two terms formed before
 * they join the row's running sum acc[m]. */
static inline __attribute__((always_inline)) void add_group(const Args *a, int p, int g, int m0, const int MR,
                                                            const int NA, __m512 d[][4], __m512 *acc) {
    const uint16_t *sz = a->sz + ((int64_t)p * a->G + g) * 2 * PANEL;
    const __m512 s = bf16x16_to_float(sz), z = bf16x16_to_float(sz + PANEL);
    const __m512 zs = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, z); /* z - 136 s */
    for (int m = 0; m < MR; m++) {
        const __m512 dm = NA == 4 ? _mm512_add_ps(_mm512_add_ps(d[m][0], d[m][1]), _mm512_add_ps(d[m][2], d[m][3]))
                                  : _mm512_add_ps(d[m][0], d[m][1]);
        const __m512 xg = _mm512_set1_ps(a->xs[(int64_t)(m0 + m) * a->G + g]);
        acc[m] = _mm512_add_ps(acc[m], _mm512_fmadd_ps(dm, s, _mm512_mul_ps(xg, zs))); /* the group's sum first */
    }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX512F__)
#include "gemv_int4_avx512f.h" /* the same computation in float32 FMAs on 16 lanes */
#elif !defined(__AVX512BF16__)
#include "gemv_int4_avx2.h" /* the same computation in float32 FMAs on 8 lanes */
#else
#define MAXR 8  /* x rows per tile */
#define WIDEN 0 /* x stays bfloat16 (no xf) */

/* xs[m, g] = sum of x[m] over group g's columns (xf unused here) */
static void prepare_x(const uint16_t *x, float *xs, float *xf, int M, int K, int G, int group) {
    (void)xf;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            const int k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
            __m512 s = _mm512_setzero_ps();
            int k = k0;
            for (; k + 16 <= k1; k += 16) s = _mm512_add_ps(s, bf16x16_to_float(x + (int64_t)m * K + k));
            float t = _mm512_reduce_add_ps(s);
            for (; k < k1; k++) t += bf16_to_float(x[(int64_t)m * K + k]);
            xs[(int64_t)m * G + g] = t;
        }
}

typedef int32_t __attribute__((may_alias)) pair_t; /* two bfloat16 values read as one 32-bit word */

/* acc + w . (x[k], x[k + 1] broadcast to every lane), the broadcast folded into the instruction's memory
 * operand (`{1to16}`): GCC compiled `_mm512_set1_epi32` of the pair into a `vpbroadcastd` of its own
 * before every `vdpbf16ps`, two instructions and a register per product step where one does. The same
 * products and sums as the intrinsic (the instruction's two sources multiply pairwise, either order).
 * Outputs bit for bit the same. Over SmolLM2's 30 layers' linears streamed from memory (2-core AMD EPYC
 * VM, one thread, the INT4 and bfloat16 GEMVs alternating in one process, the two builds in alternating
 * processes): INT4 over bfloat16 time 0.87 -> 0.71 at 8 rows, 1.18-1.20 -> 1.01-1.03 at 32 (1.09 -> 1.01
 * with 2 threads), 0.41 -> 0.40 at 1 row. */
static inline __attribute__((always_inline)) __m512 dp_pair(__m512 acc, __m512bh w, const uint16_t *x) {
    __asm__("vdpbf16ps %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const pair_t *)x));
    return acc;
}

/* A 64-byte load of a panel's codes as the four vectors of bfloat16 128 + q (nibble i of every word in out[i]):
 * one shift and two byte shuffles (each word's high byte moved down, `>> 8` on the shuffle port) where three
 * shifts had kept Intel's port 0, which `vdpbf16ps` also needs, busy. The same codes bit for bit; on a 2-core
 * AMX Xeon, one row, a 3072 x 576 weight, two threads, the two builds in alternating processes: 69.3-70.2 ->
 * 61.3-63.3 us a call from memory (80 copies cycled), 53.9-54.7 -> 44.8-46.0 in cache (one copy); a whole c = 1
 * INT4 decode step 6.8 -> 6.1-6.8 ms (noisy), c = 4 even. */
static inline __attribute__((always_inline)) void expand_codes(__m512i v, __m512i out[4]) {
    const __m512i nib = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
    const __m512i hi_byte = _mm512_broadcast_i32x4(_mm_setr_epi8(1, -128, 3, -128, 5, -128, 7, -128, 9, -128, 11,
                                                                 -128, 13, -128, 15, -128));
    const __m512i t = _mm512_srli_epi16(v, 4);
    out[0] = _mm512_ternarylogic_epi32(v, nib, one28, 0xEA); /* v & nib | 128 */
    out[1] = _mm512_ternarylogic_epi32(t, nib, one28, 0xEA);
    out[2] = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(v, hi_byte), nib, one28, 0xEA);
    out[3] = _mm512_ternarylogic_epi32(_mm512_shuffle_epi8(t, hi_byte), nib, one28, 0xEA);
}

/* x rows m0..m0+MR-1 by panel p (compile-time MR and NA in each copy) */
static inline __attribute__((always_inline)) void tile(const Args *a, int p, int m0, const int MR, const int NA,
                                                       const int prefetch) {
    const int K = a->K, G = a->G;
    const uint16_t *x = a->x + (int64_t)m0 * K;
    const uint8_t *panel = a->q + (int64_t)p * K * 8;
    __m512 acc[MAXR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const int k0 = g * a->group, k1 = k0 + a->group < K ? k0 + a->group : K;
        __m512 d[MAXR][4]; /* the group's sums of (128 + q) x: NA chains per row */
        for (int m = 0; m < MR; m++)
            for (int i = 0; i < NA; i++) d[m][i] = _mm512_setzero_ps();
        for (int k = k0; k < k1; k += 8) {
            const uint8_t *qp = panel + (int64_t)k * 8;
            if (prefetch) _mm_prefetch((const char *)qp + PF_DIST, _MM_HINT_T1);
            const __m512i v = _mm512_loadu_si512(qp);
            __m512i codes[4];
            expand_codes(v, codes);
            const __m512bh w0 = (__m512bh)codes[0], w1 = (__m512bh)codes[1], w2 = (__m512bh)codes[2],
                           w3 = (__m512bh)codes[3];
            for (int m = 0; m < MR; m++) {
                const uint16_t *xm = x + (int64_t)m * K + k;
                d[m][0] = dp_pair(d[m][0], w0, xm);
                d[m][1] = dp_pair(d[m][1], w1, xm + 2);
                d[m][2 % NA] = dp_pair(d[m][2 % NA], w2, xm + 4);
                d[m][3 % NA] = dp_pair(d[m][3 % NA], w3, xm + 6);
            }
        }
        add_group(a, p, g, m0, MR, NA, d, acc);
    }
    const int n = p * PANEL, left = a->N - n;
    const __mmask16 keep = left >= PANEL ? 0xffff : (__mmask16)((1u << left) - 1);
    for (int m = 0; m < MR; m++)
        _mm256_mask_storeu_epi16(a->y + (int64_t)(m0 + m) * a->N + n, keep, (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

#endif /* __AVX512BF16__ */

#ifdef __AVX512F__ /* the 16-lane copies' tiles, MAXR 8 */
/* panels p0..p1 for x rows m0..m0+MR-1 */
static inline __attribute__((always_inline)) void panels(const Args *a, int m0, const int MR, const int NA,
                                                         const int prefetch) {
    for (int p = a->p0; p < a->p1; p++) tile(a, p, m0, MR, NA, prefetch);
}

/* x rows m0..m0+rows-1 (rows <= MAXR): one specialisation per count */
static void run_rows(const Args *a, int m0, int rows, int prefetch) {
    switch (rows) {
    case 1: panels(a, m0, 1, 4, prefetch); break;
    case 2: panels(a, m0, 2, 4, prefetch); break;
    case 3: panels(a, m0, 3, 2, prefetch); break;
    case 4: panels(a, m0, 4, 2, prefetch); break;
    case 5: panels(a, m0, 5, 2, prefetch); break;
    case 6: panels(a, m0, 6, 2, prefetch); break;
    case 7: panels(a, m0, 7, 2, prefetch); break;
    default: panels(a, m0, 8, 2, prefetch); break;
    }
}
#endif

/* ---- AMX tiles (CPUs with AMX-TILE and AMX-BF16; gemv_bf16.c asks Linux for the tile state) -------------
 *
 * The same D = sum (128 + q) x per group, by `tdpbf16ps`: a panel's codes, expanded as above, are already the
 * rows of the instruction's second operand (row r: 16 weight rows' columns k0 + 2r and k0 + 2r + 1, in pairs),
 * so 32 columns of a panel become a 1 KB tile in an L1 buffer (16 expansions); x rows are the first operand as
 * they lie (32 columns of up to 16 rows, a row stride of K), and the product is D for 16 x rows by the panel's
 * 16 weight rows, in y's own orientation. Per group the D tiles are stored and folded into the running sums as
 * in `tile` (s D + (z - 136 s) X, the group's two terms first). Up to 32 x rows share each expansion (two x and
 * two D tiles); more x rows take further passes. Used for more than AMX_MIN_ROWS x rows with K and the group a
 * multiple of 32. */
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INT4_AMX 1
#define AMX_MIN_ROWS 3 /* from 4 rows: over 4-151 copies of SmolLM2's LM head, gate_up and down (2-core AMX Xeon,
                          * minimum of 15 rounds) AMX took 0.84-0.92x the vdpbf16ps tiles' time at 4 rows, 0.70-0.76x at
                          * 6, and 1.0-1.3x at 3 (kernels/cpu_gemv_int4.py's AMX_MIN_ROWS says the same) */

#include "amx.h"

/* tiles 0-1: D for x rows 0..15 and 16..31 of a pass; 2-3: those x rows; 4: the panel's expanded codes */
static void amx_config(int m0c, int m1c) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    const int rows[5] = {m0c, m1c ? m1c : 1, m0c, m1c ? m1c : 1, 16};
    for (int t = 0; t < 5; t++) cfg.rows[t] = (uint8_t)rows[t], cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static void amx_rows(const Args *a) {
    const int K = a->K, G = a->G;
    const __m512 c136 = _mm512_set1_ps(136.0f);
    __m512i codes[16];
    float d[32][16], acc[32][16];
    for (int mp = 0; mp < a->M; mp += 32) {
        const int m0c = a->M - mp < 16 ? a->M - mp : 16;
        const int m1c = a->M - mp - 16 > 16 ? 16 : (a->M - mp - 16 > 0 ? a->M - mp - 16 : 0), rows = m0c + m1c;
        const uint16_t *x0 = a->x + (int64_t)mp * K, *x1 = x0 + (int64_t)16 * K;
        amx_config(m0c, m1c);
        for (int p = a->p0; p < a->p1; p++) {
            const uint8_t *panel = a->q + (int64_t)p * K * 8;
            for (int m = 0; m < rows; m++) _mm512_storeu_ps(acc[m], _mm512_setzero_ps());
            for (int g = 0; g < G; g++) {
                const int k0 = g * a->group, k1 = k0 + a->group < K ? k0 + a->group : K;
                _tile_zero(0);
                _tile_zero(1);
                for (int k = k0; k < k1; k += 32) {
                    for (int t = 0; t < 4; t++) { /* 8 columns a load: pairs (k + 8t + 2j, + 1), j = 0..3 */
                        const uint8_t *qp = panel + (int64_t)(k + 8 * t) * 8;
                        if (mp == 0) _mm_prefetch((const char *)qp + PF_DIST, _MM_HINT_T1);
                        expand_codes(_mm512_loadu_si512(qp), codes + 4 * t);
                    }
                    _tile_loadd(4, codes, 64);
                    _tile_loadd(2, x0 + k, 2 * K);
                    _tile_dpbf16ps(0, 2, 4);
                    if (m1c) {
                        _tile_loadd(3, x1 + k, 2 * K);
                        _tile_dpbf16ps(1, 3, 4);
                    }
                }
                _tile_stored(0, d[0], 64);
                if (m1c) _tile_stored(1, d[16], 64);
                const uint16_t *sz = a->sz + ((int64_t)p * G + g) * 2 * PANEL;
                const __m512 s = bf16x16_to_float(sz), z = bf16x16_to_float(sz + PANEL);
                const __m512 zs = _mm512_fnmadd_ps(c136, s, z); /* z - 136 s */
                for (int m = 0; m < rows; m++) {
                    const __m512 x = _mm512_set1_ps(a->xs[(int64_t)(mp + m) * G + g]);
                    const __m512 group = _mm512_fmadd_ps(_mm512_loadu_ps(d[m]), s, _mm512_mul_ps(x, zs));
                    _mm512_storeu_ps(acc[m], _mm512_add_ps(_mm512_loadu_ps(acc[m]), group)); /* the group's sum first */
                }
            }
            const int n = p * PANEL, left = a->N - n;
            const __mmask16 keep = left >= PANEL ? 0xffff : (__mmask16)((1u << left) - 1);
            for (int m = 0; m < rows; m++)
                _mm256_mask_storeu_epi16(a->y + (int64_t)(mp + m) * a->N + n, keep,
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc[m])));
        }
    }
    _tile_release();
}
#else
#define INT4_AMX 0
#endif

/* x rows 0..M-1 of `a` over its panels: x tiles of at most MAXR rows (per copy), balanced (AVX-512: 32 rows as
 * 4 x 8, 12 as 6 + 6), panel by panel when there are several, so the later tiles find the panel in L1. */
static void block_rows(const Args *a) {
    const int tiles = (a->M + MAXR - 1) / MAXR;
    if (tiles == 1) {
        run_rows(a, 0, a->M, 1);
        return;
    }
    for (int p = a->p0; p < a->p1; p++) {
        Args b = *a;
        b.p0 = p;
        b.p1 = p + 1;
        for (int t = 0, m0 = 0; t < tiles; t++) {
            const int r = (a->M - m0) / (tiles - t);
            run_rows(&b, m0, r, t == 0);
            m0 += r;
        }
    }
}

/* All x rows over this chunk's panels, MBLOCK rows at a time: a prompt's x would not stay in L2 for every
 * panel (576 x 1536 at 256 rows ran 1.08x torch's INT4 GEMM's time before, 0.5x at 64 rows), while the
 * chunk's panels do between blocks. */
static void rows(const Args *a) {
    for (int m0 = 0; m0 < a->M; m0 += MBLOCK) {
        Args b = *a;
        b.x = a->x + (int64_t)m0 * a->K;
        b.xs = a->xs + (int64_t)m0 * a->G;
        b.xf = a->xf ? a->xf + (int64_t)m0 * a->K : NULL;
        b.y = a->y + (int64_t)m0 * a->N;
        b.M = a->M - m0 < MBLOCK ? a->M - m0 : MBLOCK;
        block_rows(&b);
    }
}

/* ---- threads: the shared pool (kernels/cpu/pool.c, pool.h) ---------------------------------- */

typedef struct {
    Args a;
    int chunk_panels;
} Job;

static void run_panels(const Args *a) {
#if INT4_AMX
    if (a->amx) {
        amx_rows(a);
        return;
    }
#endif
    rows(a);
}

static void run_chunk(void *ctx, int i) {
    const Job *job = (const Job *)ctx;
    Args a = job->a;
    a.p0 = job->chunk_panels * i;
    a.p1 = a.p0 + job->chunk_panels < job->a.p1 ? a.p0 + job->chunk_panels : job->a.p1;
    run_panels(&a);
}

/* x [M, K] bfloat16 (K a multiple of 8), q and sz packed as above for N rows in groups of `group` (a
 * multiple of 8), y [M, N]. amx: 1 to run the AMX tiles where they apply (built, more than AMX_MIN_ROWS rows, K and
 * the group multiples of 32; the caller has had the tile state granted: gemv_bf16.c's `gemv_bf16_amx_ready`).
 * Returns 0, or -1 when the group sums could not be allocated. */
int gemv_int4(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *y, int M, int N, int K, int group,
              int threads, int chunks, int amx) {
    if (M <= 0 || N <= 0) return 0;
    const int G = (K + group - 1) / group, P = (N + PANEL - 1) / PANEL;
    float *xs = malloc(((size_t)M * G + (WIDEN ? (size_t)M * K : 0)) * sizeof(float)); /* then xf */
    if (!xs) return -1;
    float *xf = WIDEN ? xs + (size_t)M * G : NULL;
    prepare_x(x, xs, xf, M, K, G, group);
#if INT4_AMX
    amx = amx && M > AMX_MIN_ROWS && K % 32 == 0 && group % 32 == 0;
#else
    amx = 0;
#endif
    const Args a = {x, xs, q, sz, y, M, N, K, G, group, 0, P, xf, amx};
    if (chunks > P) chunks = P;
    if (chunks > 0xfff) chunks = 0xfff;
    if (run_pool != 0 && chunks > 1) {
        Job job = {a, (P + chunks - 1) / chunks};
        run_pool(run_chunk, &job, (P + job.chunk_panels - 1) / job.chunk_panels, threads, 1);
    } else {
        run_panels(&a);
    }
    free(xs);
    return 0;
}
