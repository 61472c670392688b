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

/* Row-wise kernels (one output row from one input row, no state across rows: SwiGLU's activation, RMSNorm,
 * RoPE): fn(ctx, r0, r1) over rows [0, rows) of `row_values` values each, cut into at most 4 chunks a thread
 * of at least POOL_ROWS_MIN_VALUES values each (smaller ones cost more to hand out than they save) and run
 * on the pool (the caller claims chunks too, so a late helper costs at most one chunk); a call
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
                             int linger) {
    const int64_t per_row = row_values > 0 ? row_values : 1;
    const int64_t min_chunk = per_row >= POOL_ROWS_MIN_VALUES ? 1 : POOL_ROWS_MIN_VALUES / per_row; /* rows */
    int64_t chunks = rows / min_chunk;
    if (chunks > 4 * (int64_t)threads) chunks = 4 * (int64_t)threads;
    if (run_pool == 0 || threads <= 1 || chunks <= 1) {
        if (rows > 0) fn(ctx, 0, rows);
        return;
    }
    PoolRowsJob job = {fn, ctx, rows, (int)chunks};
    run_pool(pool_rows_chunk, &job, (int)chunks, threads, linger);
}
#endif
#endif
