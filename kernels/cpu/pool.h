/* The shared helper pool's interface (kernels/cpu/pool.c). A kernel that runs on it includes this header
 * and calls `run_pool` when it is set; the loader (kernels/cpu_build.py) hands `pool_run` to the kernel's
 * `set_pool` when it loads the kernel. pool.c itself defines EDGESERVE_POOL_IMPL first (it needs only the
 * types). */
#ifndef EDGESERVE_POOL_H
#define EDGESERVE_POOL_H

typedef void (*chunk_fn)(void *ctx, int chunk);
typedef int (*pool_fn)(chunk_fn fn, void *ctx, int chunks, int threads, int linger);

#ifndef EDGESERVE_POOL_IMPL
static pool_fn run_pool = 0; /* set by the loader (`set_pool`); without it every call runs on its caller */

void set_pool(pool_fn fn) { run_pool = fn; }
#endif
#endif
