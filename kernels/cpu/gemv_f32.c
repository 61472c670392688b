/* y[M, N] (float32) = x[M, K] . w[N, K]^T for float32 x and w and up to a few dozen rows M: the decode
 * GEMV / small GEMM of float32 linear layers, the float32 twin of gemv_bf16.c. AVX-512F (this file's code),
 * AVX2 with FMA (gemv_f32_avx2.h's, included below in its place), or plain C on other CPUs (so it builds on
 * every host with a C compiler); the pool and the entry point here serve all three. Built and loaded by
 * kernels/cpu_gemv_f32.py, which has the measured times.
 *
 * Numerics: float32 products and float32 sums (fused multiply-adds), as torch's float32 GEMM; only the
 * summation order differs (16 or 8 lanes, two chains per x row or one per tile output, then a tree of the
 * lanes; the AVX2 tiles' blocks of K, each summed so, then added in order), so a result is within a few float32
 * ulps of sum |x w| of torch's.
 *
 * Up to CHUNK x rows (a decode step of a few requests) a call is bound by reading the weights once: one weight
 * row at a time in memory order (one long stream for the hardware prefetchers), each 32-column step loaded once
 * and multiplied with every x row (from L1), two accumulators per x row, the weights prefetched PF_DIST ahead
 * into L2 as gemv_bf16.c does. The K tail is a masked load (zeros).
 *
 * More rows are compute-bound: tiles of MR = 6 x rows by NR = 4 weight rows (24 accumulators, each fed one FMA
 * per 16 columns; the 4 weight vectors loaded once per step and used by every x row of the tile, each x vector
 * once per step for the 4 weight rows: 10 loads per 24 FMAs), the 6 x 4 sums reduced four at a time (`sum4`).
 * The loops run blocks of FNB weight rows (kept in L2) by x tiles (in L1) by 4 weight rows; the first x tile
 * reads a block from memory and prefetches the next weight rows into L2, the others read it from L2. This is
 * gemv_bf16.c's FMA tiles on weights that need no widening (and x needs none either: nothing is allocated).
 * The last N % NR weight rows run the same tiles (the missing rows repeat one, unstored), so at a given M an
 * output's value depends on its x row, weight row and K alone, not on where the row falls in N: a tensor-
 * parallel shard of the weight gives its outputs bit for bit as the whole weight does.
 * On a 2-core Intel Xeon VM (AVX512-FP16 and AMX: Sapphire Rapids or later; weights from L3), one thread, SmolLM2's
 * four linear shapes at 32 rows: 130-150 GFLOP/s with 6 x 4 tiles, 126-143 with 4 x 4 (0.86-0.89x torch's
 * float32 GEMM's time against 0.86-0.98x); at 8 rows the per-row code took 0.72-0.92x the 4 x 4 tiles' time.
 *
 * Threads: the process's shared pool (kernels/cpu/pool.c, handed over by the loader through `set_pool`):
 * a call cuts the N rows into chunks (multiples of 4 rows) that the caller and the pool's helpers claim
 * one at a time, so a helper that is asleep, late or preempted costs at most the chunk it holds.
 */
#include <stdint.h>

#include "bits.h"
#include "pool.h"

typedef struct {
    const float *x, *w;
    float *y;
    int M, N, K, n0, n1;
    int ld;  /* x's and w's row stride: K, or more for one block of K (`rows`; only the tiles take blocks) */
    int add; /* 1: add the sums to y (a block of K after the first), 0: store them; only copies with KBLK
              * (AVX2's) take blocks, so only their tiles read it */
} Args;

/* Weights are prefetched into L2 this many floats (4 KB) ahead of the per-row loads, as gemv_bf16.c's PF_DIST
 * (the same bytes ahead). */
#define PF_DIST 1024

#if defined(__AVX512F__)
#include <immintrin.h>

#define CHUNK 8 /* x rows the per-row code takes (16 accumulators, 2 weight vectors); past it: the tiles */
#define NR 4    /* weight rows of a tile */
#define MR 6    /* x rows of a tile: 24 accumulators, 4 weight vectors and an x vector of the 32 registers */
#define FNB 64  /* weight rows of a block the x tiles pass over (FNB * K * 4 bytes in L2: 384 KB at K = 1536) */

static inline __attribute__((always_inline)) void rows_m(const Args *a, const int M) {
    const int K = a->K, full = K & ~31, full16 = K & ~15;
    const __mmask16 tail = (__mmask16)((1u << (K - full16)) - 1);
    const float *x = a->x;
    for (int n = a->n0; n < a->n1; n++) {
        const float *wr = a->w + (int64_t)n * K;
        __m512 a0[CHUNK], a1[CHUNK];
        for (int m = 0; m < M; m++) {
            a0[m] = _mm512_setzero_ps();
            a1[m] = _mm512_setzero_ps();
        }
        int k = 0;
        for (; k < full; k += 32) {
            _mm_prefetch((const char *)(wr + k + PF_DIST), _MM_HINT_T1); /* past the end: harmless */
            _mm_prefetch((const char *)(wr + k + PF_DIST + 16), _MM_HINT_T1);
            const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (int64_t)m * K + k), w0, a0[m]);
                a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (int64_t)m * K + k + 16), w1, a1[m]);
            }
        }
        if (k < full16) { /* one 16-column step left */
            const __m512 w0 = _mm512_loadu_ps(wr + k);
            for (int m = 0; m < M; m++) a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (int64_t)m * K + k), w0, a0[m]);
        }
        if (tail) { /* the last K % 16 columns, masked (zeros past K) */
            const __m512 w0 = _mm512_maskz_loadu_ps(tail, wr + full16);
            for (int m = 0; m < M; m++)
                a1[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + (int64_t)m * K + full16), w0, a1[m]);
        }
        for (int m = 0; m < M; m++) a->y[(int64_t)m * a->N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    }
}

/* rows n..n+3 of w with x rows m0..m0+rows-1 (rows <= MR, a compile-time constant per copy); `prefetch`: the
 * weight rows to bring into L2 meanwhile (one line of each of NR rows per step), or NULL. `valid` (1..NR): the
 * weight rows that exist; the others repeat row n and are not stored, so the last N % NR rows take the same
 * sums as every other row (an output's value does not depend on where its row falls in N: a tensor-parallel
 * shard computes its outputs as the whole weight does) */
static inline __attribute__((always_inline)) void ftile(const Args *a, int n, int m0, const int rows,
                                                        const float *prefetch, const int valid) {
    const int K = a->K, ld = a->ld, full16 = K & ~15;
    const __mmask16 tail = (__mmask16)((1u << (K - full16)) - 1);
    const float *x = a->x + (int64_t)m0 * ld, *wr[NR];
    for (int j = 0; j < NR; j++) wr[j] = a->w + (int64_t)(n + (j < valid ? j : 0)) * ld;
    __m512 acc[MR][NR];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = _mm512_setzero_ps();
    for (int k = 0; k < full16; k += 16) {
        if (prefetch)
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(prefetch + (int64_t)j * ld + k), _MM_HINT_T1);
        __m512 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_ps(wr[j] + k);
        for (int m = 0; m < rows; m++) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)m * ld + k);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    if (tail) {
        __m512 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_ps(tail, wr[j] + full16);
        for (int m = 0; m < rows; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x + (int64_t)m * ld + full16);
            for (int j = 0; j < NR; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float *yr = a->y + (int64_t)(m0 + m) * a->N + n;
        const __m128 s = sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
        if (valid == NR) {
            _mm_storeu_ps(yr, s);
        } else {
            float t[4];
            _mm_storeu_ps(t, s);
            for (int j = 0; j < valid; j++) yr[j] = t[j];
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "gemv_f32_avx2.h" /* the same computation on 8 lanes */
#else
/* Plain C (no AVX2 and FMA): one output at a time, four partial sums (the compiler keeps them in order, as
 * it must without -ffast-math, so each is one chain). Correct everywhere; not tuned. */
#define CHUNK 1

static void rows(const Args *a) {
    const int K = a->K;
    for (int n = a->n0; n < a->n1; n++) {
        const float *wr = a->w + (int64_t)n * K;
        for (int m = 0; m < a->M; m++) {
            const float *xr = a->x + (int64_t)m * K;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int k = 0;
            for (; k + 4 <= K; k += 4)
                for (int i = 0; i < 4; i++) s[i] = __builtin_fmaf(xr[k + i], wr[k + i], s[i]);
            for (; k < K; k++) s[0] = __builtin_fmaf(xr[k], wr[k], s[0]);
            a->y[(int64_t)m * a->N + n] = (s[0] + s[1]) + (s[2] + s[3]);
        }
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
static void rows_chunk(const Args *a) { /* a specialisation of rows_m per count, M <= CHUNK */
    switch (a->M) {
    case 1: rows_m(a, 1); break;
    case 2: rows_m(a, 2); break;
    case 3: rows_m(a, 3); break;
    case 4: rows_m(a, 4); break;
    case 5: rows_m(a, 5); break;
#if CHUNK > 6
    case 6: rows_m(a, 6); break;
    case 7: rows_m(a, 7); break;
#endif
    default: rows_m(a, CHUNK); break;
    }
}

/* The last M % MR x rows (from m) against weight rows n..n+valid-1: a tile of as many rows. (Measured on an AVX2
 * host: splitting the last full tile with one or two rows left, 6 + 1 as 4 + 3 or 6 + 2 as 4 + 4, took 1.4x the
 * time at 7 and 8 rows and 1.05x at 32: a tile's fixed costs outweigh the short tile's idle FMA slots.) */
static inline void last_rows(const Args *a, int n, int m, int valid) {
    switch (a->M - m) {
    case 1: ftile(a, n, m, 1, NULL, valid); break;
    case 2: ftile(a, n, m, 2, NULL, valid); break;
    case 3: ftile(a, n, m, 3, NULL, valid); break;
#if MR > 4
    case 4: ftile(a, n, m, 4, NULL, valid); break;
    case 5: ftile(a, n, m, 5, NULL, valid); break;
#endif
    default: break;
    }
}

/* The tiles over weight rows n0..nfull (a multiple of NR): blocks of FNB weight rows (kept in L2) by x tiles of
 * MR rows by NR weight rows; the first x tile reads a block from memory and prefetches the next NR rows. */
static void ftile_blocks(const Args *a, int nfull) {
    for (int b = a->n0; b < nfull; b += FNB) {
        const int bend = b + FNB < nfull ? b + FNB : nfull;
        int m = 0;
        for (; m + MR <= a->M; m += MR)
            for (int n = b; n < bend; n += NR)
                ftile(a, n, m, MR, m == 0 && n + 2 * NR <= nfull ? a->w + (int64_t)(n + NR) * a->ld : NULL, NR);
        for (int n = b; n < bend; n += NR) last_rows(a, n, m, NR);
    }
}

/* The tiles of weight rows n..n+valid-1 (valid < NR: the last N % NR rows) over every x row */
static void tail_tiles(const Args *a, int n, int valid) {
    int m = 0;
    for (; m + MR <= a->M; m += MR) ftile(a, n, m, MR, NULL, valid);
    last_rows(a, n, m, valid);
}

/* Every tile over all of the call's K columns (or one block of them: `rows`) */
static void tiles(const Args *a) {
    const int nfull = a->n0 + (a->n1 - a->n0) / NR * NR;
    ftile_blocks(a, nfull);
    if (nfull < a->n1) tail_tiles(a, nfull, a->n1 - nfull); /* the last N % NR weight rows: the same tiles */
}

static void rows(const Args *a) {
    if (a->M <= CHUNK) {
        rows_chunk(a);
        return;
    }
#ifdef KBLK
    if (a->K > KBLK && a->M >= WIDE_ROWS) { /* blocks of at most KBLK columns (multiples of 8), in order: the first
                                              * stores its sums, the others add theirs */
        const int blocks = (a->K + KBLK - 1) / KBLK, len = ((a->K + blocks - 1) / blocks + 7) & ~7;
        for (int k0 = 0; k0 < a->K; k0 += len) {
            Args b = *a;
            b.x += k0;
            b.w += k0;
            b.K = k0 + len < a->K ? len : a->K - k0;
            b.add = k0 > 0;
            tiles(&b);
        }
        return;
    }
#endif
    tiles(a);
}
#endif

/* ---- threads: the shared pool (kernels/cpu/pool.c, pool.h) ---------------------------------- */

typedef struct {
    Args a;         /* the whole call */
    int chunk_rows; /* chunk i is weight rows chunk_rows * i .. */
} Job;

static void run_chunk(void *ctx, int i) {
    const Job *job = (const Job *)ctx;
    Args a = job->a;
    a.n0 = job->chunk_rows * i;
    a.n1 = a.n0 + job->chunk_rows < a.N ? a.n0 + job->chunk_rows : a.N;
    rows(&a);
}

/* y = x . w^T on `threads` threads (the caller and pool helpers; 1: the caller alone), the N rows cut into at
 * most `chunks` chunks of whole 4-row blocks. Allocates nothing: returns 0, or -1 only if the pool refuses the
 * job (more chunks than it counts; not reachable with the cap below), with y then unwritten. */
int gemv_f32(const float *x, const float *w, float *y, int M, int N, int K, int threads, int chunks) {
    if (M <= 0 || N <= 0) return 0; /* nothing to compute: the per-row code would read and write CHUNK rows */
    const int blocks = (N + 3) / 4;
    if (chunks > blocks) chunks = blocks;
    if (chunks > 0xfff) chunks = 0xfff;
    if (chunks < 1) chunks = 1;
    if (run_pool != 0) { /* one thread or one chunk: the pool runs them on this thread */
        Job job = {{x, w, y, M, N, K, 0, N, K, 0}, 0};
        job.chunk_rows = 4 * ((blocks + chunks - 1) / chunks);
        return run_pool(run_chunk, &job, (N + job.chunk_rows - 1) / job.chunk_rows, threads, 1) ? -1 : 0;
    }
    const Args a = {x, w, y, M, N, K, 0, N, K, 0};
    rows(&a);
    return 0;
}
