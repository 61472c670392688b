/* The shared helper pool's interface (kernels/cpu/pool.c). A kernel that runs on it includes this header
 * and calls `run_pool` when it is set; the loader (kernels/cpu_build.py) hands `pool_run` to the kernel's
 * `set_pool` when it loads the kernel. pool.c itself defines EDGESERVE_POOL_IMPL first (it needs only the
 * types). */
#ifndef EDGESERVE_POOL_H
#define EDGESERVE_POOL_H

#include <stdint.h>

typedef void (*chunk_fn)(void *ctx, int chunk);
typedef int (*pool_fn)(chunk_fn fn, void *ctx, int chunks, int threads, int linger);

#ifndef EDGESERVE_POOL_IMPL
static pool_fn run_pool = 0; /* set by the loader (`set_pool`); without it every call runs on its caller */

void set_pool(pool_fn fn) { run_pool = fn; }

/* How a call shares out its chunks: the kernels' `linger` argument (kernels/cpu_threads.py's `run_mode`).
 * RUN_OPENMP runs them as a parallel region on the calling thread's OpenMP pool, which in a worker is torch's
 * own (a kernel built with -fopenmp needs libgomp.so.1, and the loader finds the copy torch loaded under that
 * name): in a step where torch's GEMMs run on all threads, its workers have just finished one and are awake,
 * where the shared pool's helpers sleep between calls and wake late (measured on a 2-core Xeon: SwiGLU's
 * activation of 512 rows of 1536, 2 threads, 276 us on the pool with helpers asleep, 478 on one thread).
 * A kernel built without -fopenmp runs RUN_OPENMP on the pool as RUN_POOL_SLEEP. */
#define RUN_POOL_SLEEP 0  /* the shared pool; its helpers sleep at once after the call (torch's workers run next) */
#define RUN_POOL_LINGER 1 /* the shared pool; its helpers spin a while after it (the C kernels own the cores) */
#define RUN_OPENMP 2      /* the calling thread's OpenMP pool */

/* fn(ctx, i) for i in 0 .. chunks-1 as `how` says, on up to `threads` threads (the caller's among them);
 * returns when all are done: 0, or the pool's -1 for more than its MAX_CHUNKS chunks (nothing run). Chunks
 * are handed out as threads come free, in both pools. */
static inline int run_chunks(chunk_fn fn, void *ctx, int chunks, int threads, int how) {
#ifdef _OPENMP
    if (how == RUN_OPENMP && threads > 1 && chunks > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int i = 0; i < chunks; i++) fn(ctx, i);
        return 0;
    }
#endif
    if (run_pool == 0) {
        for (int i = 0; i < chunks; i++) fn(ctx, i);
        return 0;
    }
    return run_pool(fn, ctx, chunks, threads, how == RUN_POOL_LINGER);
}

/* Row-wise kernels (one output row from one input row, no state across rows: SwiGLU's activation, RMSNorm,
 * RoPE): fn(ctx, r0, r1) over rows [0, rows) of `row_values` values each, cut into at most 4 chunks a thread
 * of at least POOL_ROWS_MIN_VALUES values each (smaller ones cost more to hand out than they save) and run
 * by `run_chunks` as `how` says (the caller claims chunks too, so a late helper costs at most one chunk); a call
 * too small for two chunks, or with no pool, runs on the caller. Chunks are contiguous row ranges, so each
 * row's arithmetic is the one-threaded call's: results do not depend on the thread count. */
#define POOL_ROWS_MIN_VALUES 16384
typedef void (*pool_rows_fn)(void *ctx, int64_t r0, int64_t r1);
typedef struct {
    pool_rows_fn fn;
    void *ctx;
    int64_t rows;
    int chunks;
} PoolRowsJob;

static inline void pool_rows_chunk(void *job, int i) {
    const PoolRowsJob *j = (const PoolRowsJob *)job;
    j->fn(j->ctx, j->rows * i / j->chunks, j->rows * (i + 1) / j->chunks);
}

static inline void pool_rows(pool_rows_fn fn, void *ctx, int64_t rows, int64_t row_values, int threads,
                             int how) {
    const int64_t per_row = row_values > 0 ? row_values : 1;
    const int64_t min_chunk = per_row >= POOL_ROWS_MIN_VALUES ? 1 : POOL_ROWS_MIN_VALUES / per_row; /* rows */
    int64_t chunks = rows / min_chunk;
    if (chunks > 4 * (int64_t)threads) chunks = 4 * (int64_t)threads;
    if (run_pool == 0 || threads <= 1 || chunks <= 1) {
        if (rows > 0) fn(ctx, 0, rows);
        return;
    }
    PoolRowsJob job = {fn, ctx, rows, (int)chunks};
    run_chunks(pool_rows_chunk, &job, (int)chunks, threads, how);
}
#endif
#endif
