/* y[M, N] (bfloat16) = x[M, K] . w[N, K]^T for bfloat16 x and w and up to a few dozen rows M: the decode
 * GEMV / small GEMM of bfloat16 linear layers on CPUs with AVX512-BF16 (this file's code), with AVX-512F but no
 * BF16 (gemv_bf16_avx512f.h's), or with AVX2 and FMA (gemv_bf16_avx2.h's), each included below in its place; the
 * pool and entry point here serve all three. Built and loaded by kernels/cpu_gemv.py.
 *
 * At M = 1 a GEMV reads every weight once and does one multiply-add per weight, so it should run at
 * the memory's read rate; torch's bfloat16 GEMM converts to float32 and reached about half of it
 * (7 GB/s on one core where a float32 sum reads 12-16). Here `vdpbf16ps` multiplies 32 bfloat16 pairs
 * and adds them, in pairs, into 16 float32 sums per instruction, straight from the loaded weights: the
 * products are exact (8-bit by 8-bit mantissas) and the sums float32, like torch's bfloat16 GEMM up to
 * summation order (and the pairwise grouping of the instruction). Weight rows are read one after the
 * other (`rows_m`); the K tail is a masked load (zeros).
 *
 * The result is rounded to bfloat16 here (to nearest, ties to even, as torch rounds), so the caller
 * gets torch's output dtype without a float32 buffer and a cast per call.
 *
 * Threads: the process's shared pool (kernels/cpu/pool.c, handed over by the loader through `set_pool`):
 * a call cuts the N rows into chunks (multiples of 4 rows) that the caller and the pool's helpers claim
 * one at a time, so a helper that is asleep, late or preempted costs at most the chunk it holds.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bits.h"
#include "pool.h"

#if !defined(__AVX512BF16__) && !(defined(__AVX2__) && defined(__FMA__))
#error "needs AVX512-BF16, or AVX2 with FMA (this CPU has neither: torch's GEMM runs instead)"
#endif

typedef struct {
    const uint16_t *x, *w;
    uint16_t *y; /* bfloat16 bits */
    int M, N, K, n0, n1;
    const float *xf; /* x widened to float32 (widen_x), [M, XF_COLS(K)]: for the FMA tiles; every call on AVX2 */
    const uint16_t *xp; /* x in the AMX tiles' pair layout (amx_pack_x), or NULL: the AMX tiles are not used */
} Args;

/* Weights are prefetched into L2 this many elements (4 KB) ahead of the loads: on a 2-core Intel Xeon VM
 * (Emerald Rapids, AVX512-BF16) over SmolLM2's 30 layers at 1 row, one thread read 7.1-7.9 GB/s without
 * it and 10.4 with it (1 KB ahead: 8.6; into L1: 9.8), two threads 13.2-14.4 and 18.4. */
#define PF_DIST 2048
#define CHUNK 6 /* x rows the per-row code takes (past it: the tiles below) */
/* x rows past which the AMX tiles take a call (fma = 2) instead of the per-row code: on the AMX Xeon VM over
 * SmolLM2's 121 linears (2 threads) 15.8 / 16.1 / 16.1 / 16.1 ms at 3 / 4 / 5 / 6 rows against the per-row code's
 * 15.6 / 17.0 / 17.6 / 18.2 */
#define AMX_MIN_ROWS 3

/* defined after the copies, on each copy's rows_m and ftile */
static void rows_chunk(const Args *a);                /* at most CHUNK x rows */
static void ftile_blocks(const Args *a, int nfull); /* the FMA tiles over weight rows n0..nfull */

#if !defined(__AVX512BF16__) && defined(__AVX512F__)
#include "gemv_bf16_avx512f.h" /* the same computation in float32 FMAs on 16 lanes */
#elif !defined(__AVX512BF16__)
#include "gemv_bf16_avx2.h" /* the same computation in float32 FMAs on 8 lanes */
#else
#define XF_COLS(K) (((K) + 31) & ~31) /* the FMA tiles' widened x: K rounded up to whole 32-column blocks */
#define WIDEN_ALWAYS 0                /* x is widened for the FMA tiles only */

/* One weight row at a time, in memory order: the hardware prefetchers see one long stream (four
 * rows read side by side were four short ones, and ran at half the rate: 9.9 against 18.5 GB/s on one
 * core over SmolLM2's linears). Each 32-column weight vector is loaded once and multiplied with every
 * x row (from L1); two accumulators per x row (even and odd 32-column steps) keep two chains in flight.
 * `M` is a compile-time constant in each specialisation, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, full = K & ~63, full32 = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full32)) - 1);
    const uint16_t *x = a->x;
    for (int n = a->n0; n < a->n1; n++) {
        const uint16_t *wr = a->w + (int64_t)n * K;
        __m512 a0[CHUNK], a1[CHUNK]; /* M <= CHUNK: 12 accumulators and 2 weight vectors in registers */
        for (int m = 0; m < M; m++) {
            a0[m] = _mm512_setzero_ps();
            a1[m] = _mm512_setzero_ps();
        }
        int k = 0;
        for (; k < full; k += 64) {
            _mm_prefetch((const char *)(wr + k + PF_DIST), _MM_HINT_T1); /* past the end: harmless */
            _mm_prefetch((const char *)(wr + k + PF_DIST + 32), _MM_HINT_T1);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k), w0);
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k + 32), w1);
            }
        }
        if (k < full32) { /* one 32-column step left */
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
            for (int m = 0; m < M; m++)
                a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k), w0);
        }
        if (tail) { /* the last K % 32 columns, masked (zeros past K) */
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full32);
            for (int m = 0; m < M; m++)
                a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (int64_t)m * K + full32),
                                         w0);
        }
        for (int m = 0; m < M; m++)
            a->y[(int64_t)m * a->N + n] = float_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m])));
    }
}

/* More than CHUNK x rows (a decode step of many requests): compute-bound, so the
 * per-row code above (one reduction and one scalar store per output, two multiply chains per x row)
 * is not enough. Tiles of NR = 4 weight rows by MR <= 4 x rows: 16 accumulators, each fed one
 * `vdpbf16ps` per 32 columns (16 independent chains); the weight vectors are loaded once per step
 * and used by every x row of the tile. The 4 x 4 sums of a tile are reduced together (`sum4`: 13
 * vector ops per 4 sums where four `reduce_add`s take ~32) and rounded to bfloat16 four at a time
 * with `vcvtneps2bf16` (to nearest, ties to even, as bits.h's `float_to_bf16`). A block of NR weight rows is read
 * from memory by its first x tile and from L1 by the rest. Each x tile prefetches its share of the
 * block `PF_BLOCKS` further on into L2. Measured on a 2-core AMD EPYC VM (Zen 5 by its flags) over
 * SmolLM2's linears with the weights streamed from memory, alternating with the previous scheme (the
 * whole next block prefetched into L1 during the first x tile: a burst of 72 prefetches, which held a
 * core at 110-135 GFLOP/s where the same calls from L3 ran at 200): 0.54x its time at 8 rows, 0.61-0.75x
 * at 16, 0.73-0.79x at 32 (1 and 2 threads); the same spread into L1 was 1.1-1.7x slower than into L2
 * at 8-24 rows. The FMA tiles below prefetch into L2 too (0.76-0.95x there, same host).
 * On a 2-core Intel Xeon VM (Emerald Rapids) `vdpbf16ps` retires ~0.6 per cycle, 75 GFLOP/s per core
 * (float32 FMAs: 123), which the tiles reach: two threads 145-160 GFLOP/s at 8-32 rows over SmolLM2's
 * linears, 0.59-1.09x the time of torch's bfloat16 GEMM there (at the same ceiling from 64 rows). */
#define NR 4
#define MR 4
#define PF_BLOCKS 2 /* the block the x tiles prefetch is this many blocks ahead */

/* y[m0 + m, n..n+3] = the sums of acc[m][0..3], rounded to bfloat16 (both tile kernels end here) */
static inline __attribute__((always_inline)) void store_tile(const Args *a, __m512 acc[MR][NR], int n, int m0,
                                                             const int rows) {
    for (int m = 0; m < rows; m++) {
        const __m128bh y = _mm_cvtneps_pbh(sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
        _mm_storel_epi64((__m128i *)(a->y + (int64_t)(m0 + m) * a->N + n), (__m128i)y);
    }
}

/* rows n..n+3 of w with x rows m0..m0+rows-1 (rows <= MR, a compile-time constant per copy) */
static inline __attribute__((always_inline)) void tile(const Args *a, int n, int m0, const int rows) {
    const int K = a->K, full32 = K & ~31;
    const __mmask32 tail = (__mmask32)((1ull << (K - full32)) - 1);
    const uint16_t *w = a->w + (int64_t)n * K, *x = a->x + (int64_t)m0 * K;
    __m512 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < full32; k += 32) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (int64_t)j * K + k);
        for (int m = 0; m < rows; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (int64_t)m * K + k);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
    }
    if (tail) {
        __m512bh wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + (int64_t)j * K + full32);
        for (int m = 0; m < rows; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (int64_t)m * K + full32);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
    }
    store_tile(a, acc, n, m0, rows);
}

/* Part `t` of `parts` of the NR weight rows at `block` (contiguous: NR * K values), prefetched into L2. */
static inline void prefetch_part(const uint16_t *block, int K, int t, int parts) {
    if (!block) return;
    const int64_t bytes = (int64_t)NR * K * 2, lo = bytes * t / parts, hi = bytes * (t + 1) / parts;
    for (int64_t b = lo & ~63; b < hi; b += 64) _mm_prefetch((const char *)block + b, _MM_HINT_T1);
}

static void tiles(const Args *a) {
    const int nfull = a->n0 + (a->n1 - a->n0) / NR * NR;
    const int parts = (a->M + MR - 1) / MR; /* x tiles per weight block, each prefetching a share */
    for (int n = a->n0; n < nfull; n += NR) {
        const uint16_t *next = n + (PF_BLOCKS + 1) * NR <= nfull ? a->w + (int64_t)(n + PF_BLOCKS * NR) * a->K
                                                                 : NULL;
        int m = 0, t = 0;
        for (; m + MR <= a->M; m += MR, t++) {
            prefetch_part(next, a->K, t, parts);
            tile(a, n, m, MR);
        }
        if (t < parts) prefetch_part(next, a->K, t, parts); /* the partial tile's share */
        switch (a->M - m) {
        case 1: tile(a, n, m, 1); break;
        case 2: tile(a, n, m, 2); break;
        case 3: tile(a, n, m, 3); break;
        default: break;
        }
    }
    if (nfull < a->n1) { /* the last N % 4 weight rows, by the per-row code in chunks of x rows */
        for (int m0 = 0; m0 < a->M; m0 += CHUNK) {
            Args b = *a;
            b.x = a->x + (int64_t)m0 * a->K;
            b.y = a->y + (int64_t)m0 * a->N;
            b.M = a->M - m0 < CHUNK ? a->M - m0 : CHUNK;
            b.n0 = nfull;
            rows_chunk(&b);
        }
    }
}

#include "gemv_bf16_fma512.h" /* widen_x and ftile: the same tiles in float32 FMAs */

static void fma_tiles(const Args *a) {
    const int nfull = a->n0 + (a->n1 - a->n0) / NR * NR;
    ftile_blocks(a, nfull);
    if (nfull < a->n1) { /* the last N % 4 weight rows, by the per-row code */
        Args b = *a;
        b.n0 = nfull;
        b.xf = NULL;
        tiles(&b);
    }
}

static void rows(const Args *a) {
    if (a->M <= CHUNK)
        rows_chunk(a);
    else if (a->xf)
        fma_tiles(a);
    else
        tiles(a);
}
#endif /* __AVX512BF16__ */

#if WIDEN_ALWAYS
/* The copies without vdpbf16ps (x widened every call): more than CHUNK x rows run their FMA tiles. */
static void rows(const Args *a) {
    if (a->M <= CHUNK) {
        rows_chunk(a);
        return;
    }
    const int nfull = a->n0 + (a->n1 - a->n0) / NR * NR;
    ftile_blocks(a, nfull);
    if (nfull < a->n1) { /* the last N % NR weight rows, by the per-row code in chunks of x rows */
        for (int m0 = 0; m0 < a->M; m0 += CHUNK) {
            Args c = *a;
            c.xf = a->xf + (int64_t)m0 * XF_COLS(a->K);
            c.y = a->y + (int64_t)m0 * a->N;
            c.M = a->M - m0 < CHUNK ? a->M - m0 : CHUNK;
            c.n0 = nfull;
            rows_chunk(&c);
        }
    }
}
#endif

static void rows_chunk(const Args *a) { /* a specialisation of rows_m per count */
    switch (a->M) {
    case 1: rows_m(a, 1); break;
    case 2: rows_m(a, 2); break;
    case 3: rows_m(a, 3); break;
    case 4: rows_m(a, 4); break;
    case 5: rows_m(a, 5); break;
    default: rows_m(a, 6); break;
    }
}

/* The FMA tiles over weight rows n0..nfull (a multiple of NR): blocks of FNB weight rows (kept in L2) by x
 * tiles of MR rows by NR weight rows; the first x tile reads a block from memory and prefetches ahead. */
static void ftile_blocks(const Args *a, int nfull) {
    for (int b = a->n0; b < nfull; b += FNB) {
        const int bend = b + FNB < nfull ? b + FNB : nfull;
        int m = 0;
        for (; m + MR <= a->M; m += MR) /* the first x tile reads the block from memory: prefetch ahead */
            for (int n = b; n < bend; n += NR)
                ftile(a, n, m, MR, m == 0 && n + 2 * NR <= nfull ? a->w + (int64_t)(n + NR) * a->K : NULL);
        for (int n = b; n < bend; n += NR) {
            switch (a->M - m) {
            case 1: ftile(a, n, m, 1, NULL); break;
            case 2: ftile(a, n, m, 2, NULL); break;
            case 3: ftile(a, n, m, 3, NULL); break;
            default: break;
            }
        }
    }
}

/* ---- AMX tiles (Sapphire Rapids and later: AMX-TILE and AMX-BF16) ----------------------------------------
 *
 * `tdpbf16ps` multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into a 16 x 16 float32 tile (exact products,
 * float32 sums in pairs, as `vdpbf16ps`): 16 K of multiply-adds per instruction where `vdpbf16ps` does 512, so
 * past a few x rows the weights' read rate is the only bound left. The computation is transposed to read the
 * weights as they lie: C'[n, m] = sum_k w[n, k] x[m, k], with A' = 16 weight rows x 32 columns loaded
 * straight from w (a row stride of K), and B' = x's 16 rows (at most) x 32 columns in the pair layout the
 * instruction wants (row r of a block: x[m][k0 + 2r], x[m][k0 + 2r + 1] for each m), built once per call
 * (`amx_pack_x`: K x 16 x 2 bytes a block of 16 x rows, from L1/L2 after). A weight block of AMX_NB = 32 rows
 * (two A' tiles) runs with up to two B' tiles (32 x rows) into four C' tiles; more x rows run further passes
 * over the block (from L2). The next block's rows are prefetched into L2 while one is computed. C' is stored
 * transposed into y, rounded to bfloat16 (to nearest, ties to even, as the other tiles). Used for K a multiple
 * of 32 and weight rows in whole blocks of 16; the rest of a call's rows go to the vdpbf16ps tiles.
 * The first block of a chunk is prefetched into L1 before the loop (nothing earlier to hide it behind).
 * Measured on a 2-core Intel Xeon VM with AMX (Sapphire Rapids class) over SmolLM2's 121 linears, 2 threads
 * (`edgeserve bench cpu-kernels --sections linear`): 13.8 / 16.3 / 23.8 / 39.4 ms at 8 / 32 / 64 / 128 rows,
 * where the FMA tiles took 18.6 / 44.4 / 82.0 at 8 / 32 / 64 and torch's bfloat16 GEMM (oneDNN's AMX kernels)
 * 23.6 / 25.2 / 30.8 / 45.2; a whole c = 32 decode step 24.5 ms against 55.6 on the FMA tiles
 * (`edgeserve bench token-profile`). Storing C' column by column with a gather (instead of 256 scalar roundings
 * a tile) took 32 rows from 19.4 to 17.9 ms; 16-row blocks and prefetching two blocks ahead changed nothing.
 * Linux hands a process the AMX tile state only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`,
 * `gemv_bf16_amx_ready`); each thread loads the tile configuration for its own chunk and releases it after. */
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define GEMV_AMX 1
#define AMX_NB 32 /* weight rows a block: two A' tiles */
#define AMX_MB 32 /* x rows a pass: two B' tiles */

#include "amx.h"

/* x rows [mb, mb + 16) (fewer at the end) in the pair layout, per 32-column block: xp[kb][r][m][2] */
static void amx_pack_x(const uint16_t *x, uint16_t *xp, int M, int K) {
    const int mgroups = (M + 15) / 16;
    for (int g = 0; g < mgroups; g++) {
        const int m0 = 16 * g, mc = M - m0 < 16 ? M - m0 : 16;
        uint32_t *dst = (uint32_t *)(xp + (int64_t)g * K * 16); /* K / 32 blocks of 16 x 16 pairs */
        for (int kb = 0; kb < K / 32; kb++)
            for (int r = 0; r < 16; r++)
                for (int m = 0; m < 16; m++)
                    dst[((int64_t)kb * 16 + r) * 16 + m] =
                        m < mc ? *(const uint32_t *)(x + (int64_t)(m0 + m) * K + 32 * kb + 2 * r) : 0u;
    }
}

static void amx_config(int m0c, int m1c) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.colsb[0] = cfg.colsb[2] = cfg.colsb[6] = (uint16_t)(4 * m0c); /* C' tiles and B' of x rows 0..15 */
    cfg.colsb[1] = cfg.colsb[3] = cfg.colsb[7] = (uint16_t)(4 * (m1c ? m1c : 1)); /* ... of x rows 16..31 */
    _tile_loadconfig(&cfg);
}

/* Weight rows n0..n1 (whole blocks of 16) with every x row: tiles 0-3 C', 4-5 A', 6-7 B'. */
static void amx_tiles(const Args *a, const uint16_t *xp, int n0, int n1) {
    const int K = a->K, KB = K / 32, M = a->M;
    float c[4][16][16];
    for (int j = 0; j < AMX_NB && n0 + j < n1; j++) /* the first block: no block before it to hide this behind */
        for (int k = 0; k < K; k += 32) _mm_prefetch((const char *)(a->w + (int64_t)(n0 + j) * K + k), _MM_HINT_T0);
    for (int mp = 0; mp < M; mp += AMX_MB) { /* a pass: up to 32 x rows */
        const int m0c = M - mp < 16 ? M - mp : 16, m1c = M - mp - 16 > 16 ? 16 : (M - mp - 16 > 0 ? M - mp - 16 : 0);
        amx_config(m0c, m1c);
        const uint16_t *xp0 = xp + (int64_t)(mp / 16) * K * 16, *xp1 = xp0 + (int64_t)K * 16;
        for (int n = n0; n < n1; n += AMX_NB) {
            const int two = AMX_NB == 32 && n + 16 < n1; /* a second A' tile */
            const uint16_t *w0 = a->w + (int64_t)n * K, *w1 = w0 + (int64_t)16 * K;
            const uint16_t *next = n + AMX_NB < n1 && mp == 0 ? w0 + (int64_t)AMX_NB * K : NULL;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kb = 0; kb < KB; kb++) {
                if (next) /* the next block, a line of each of its rows per 32 columns */
                    for (int j = 0; j < AMX_NB; j++)
                        _mm_prefetch((const char *)(next + (int64_t)j * K + 32 * kb), _MM_HINT_T1);
                _tile_loadd(4, w0 + 32 * kb, 2 * K);
                _tile_loadd(6, xp0 + (int64_t)kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (m1c) {
                    _tile_loadd(7, xp1 + (int64_t)kb * 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, w1 + 32 * kb, 2 * K);
                    _tile_dpbf16ps(2, 5, 6);
                    if (m1c) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            if (m1c) _tile_stored(1, c[1], 64);
            if (two) {
                _tile_stored(2, c[2], 64);
                if (m1c) _tile_stored(3, c[3], 64);
            }
            const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                                                     240); /* C' row offsets of one column, in floats */
            for (int h = 0; h < 1 + two; h++) /* C'[n][m] -> y[m][n]: a column gathered, rounded, stored */
                for (int g = 0; g < 1 + (m1c > 0); g++) {
                    const int mc = g ? m1c : m0c;
                    const float *t = &c[2 * h + g][0][0];
                    for (int m = 0; m < mc; m++) {
                        const __m512 col = _mm512_i32gather_ps(column, t + m, 4);
                        _mm256_storeu_si256((__m256i *)(a->y + (int64_t)(mp + 16 * g + m) * a->N + n + 16 * h),
                                            (__m256i)_mm512_cvtneps_pbh(col));
                    }
                }
        }
    }
    _tile_release();
}

/* Whether this process may use the AMX tiles: asks Linux for the tile state once (1: granted). */
int gemv_bf16_amx_ready(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}
#else
#define GEMV_AMX 0
int gemv_bf16_amx_ready(void) { return 0; }
#endif

/* ---- threads: the shared pool (kernels/cpu/pool.c, pool.h) ---------------------------------- */

typedef struct {
    Args a;         /* the whole call */
    int chunk_rows; /* chunk i is weight rows chunk_rows * i .. */
} Job;

/* Rows a.n0..a.n1: the AMX tiles over their whole blocks of 16 when x is packed for them, the rest as `rows`. */
static void run_rows(Args a) {
#if GEMV_AMX
    if (a.xp) {
        const int whole = a.n0 + (a.n1 - a.n0) / 16 * 16;
        if (whole > a.n0) amx_tiles(&a, a.xp, a.n0, whole);
        a.n0 = whole;
        if (a.n0 >= a.n1) return;
    }
#endif
    rows(&a);
}

static void run_chunk(void *ctx, int i) {
    const Job *job = (const Job *)ctx;
    Args a = job->a;
    a.n0 = job->chunk_rows * i;
    a.n1 = a.n0 + job->chunk_rows < a.N ? a.n0 + job->chunk_rows : a.N;
    run_rows(a);
}

/* fma: 1 for the float32-FMA tiles (more than CHUNK rows only), 2 for the AMX tiles (more than AMX_MIN_ROWS rows, K
 * a multiple of 32, where built and granted: `gemv_bf16_amx_ready`), 0 for the vdpbf16ps ones (AVX2 builds have only
 * FMAs and ignore it). Returns 0, or -1 when the widened or packed x could not be allocated (nothing computed). */
int gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K, int threads, int chunks,
              int fma) {
    if (M <= 0 || N <= 0) return 0; /* nothing to compute: the per-row code would read and write 6 rows */
    const int amx = GEMV_AMX && fma == 2 && M > AMX_MIN_ROWS && K % 32 == 0 && gemv_bf16_amx_ready();
    const int unit = amx ? 16 : 4; /* chunks are whole blocks of this many weight rows */
    const int blocks = (N + unit - 1) / unit;
    float *xf = NULL;
    uint16_t *xp = NULL;
    if (WIDEN_ALWAYS || (fma == 1 && M > CHUNK)) {
        const size_t bytes = ((size_t)M * XF_COLS(K) * sizeof(float) + 63) & ~(size_t)63;
        xf = aligned_alloc(64, bytes);
        if (!xf) return -1;
        widen_x(x, xf, M, K);
    }
#if GEMV_AMX
    if (amx) {
        const size_t bytes = ((size_t)((M + 15) / 16) * K * 16 * sizeof(uint16_t) + 63) & ~(size_t)63;
        xp = aligned_alloc(64, bytes);
        if (!xp) return -1;
        amx_pack_x(x, xp, M, K);
    }
#endif
    if (chunks > blocks) chunks = blocks;
    if (chunks > 0xfff) chunks = 0xfff;
    if (run_pool != 0) { /* one thread or one chunk: the pool runs them on this thread */
        Job job = {{x, w, y, M, N, K, 0, N, xf, xp}, 0};
        job.chunk_rows = unit * ((blocks + chunks - 1) / chunks);
        run_pool(run_chunk, &job, (N + job.chunk_rows - 1) / job.chunk_rows, threads, 1);
    } else {
        const Args a = {x, w, y, M, N, K, 0, N, xf, xp};
        run_rows(a);
    }
    free(xf);
    free(xp);
    return 0;
}
