/* One pool of helper threads for the CPU kernels of a process (the bfloat16 GEMV, paged decode attention),
 * so that the kernels of a decode step share the helpers instead of each keeping or starting its own.
 * Built and loaded by kernels/cpu_build.py, which hands `pool_run` to each kernel that uses it.
 *
 * A call cuts its work into chunks that the caller and the helpers claim one at a time from a shared
 * counter, so a helper that is asleep, late or preempted by another process costs at most the chunk it
 * holds: the caller claims the rest itself (a fixed split would wait for the helper's whole share, which
 * is what made static OpenMP regions lose end to end on a 2-core machine where the worker's HTTP thread
 * and the gateway want a core too). Helpers are started on the first threaded call and kept; they spin
 * for `SPIN_NS` after their last chunk (the next kernel call of a decode step comes within tens of
 * microseconds: the attention right after a layer's QKV projection, the next projection after it), then
 * sleep on a futex, so between decode steps they leave the cores to the rest of the process.
 *
 * One kernel with one pool of its own per kernel would leave the other kernel's helpers spinning on the
 * cores this call wants; a thread started per call (what the attention kernel did) cost more than the
 * work at SmolLM2's sizes (2 threads slower than 1 at 32 sequences of 150 tokens: a new thread per call
 * and its untouched stack).
 */
#define _GNU_SOURCE
#define EDGESERVE_POOL_IMPL
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 16
#define MAX_CHUNKS 0xffff /* the state word keeps chunk counts in 16 bits */
#define SPIN_NS 200000    /* a helper's spin after its last chunk before it sleeps (0.2 ms) */

static struct {
    pthread_mutex_t lock;   /* one threaded call at a time; a second caller runs alone */
    int helpers;            /* started */
    pid_t pid;              /* of the process that started them (a fork child has none) */
    chunk_fn fn;            /* the call: fn(ctx, i) for every chunk i */
    void *ctx;
    _Atomic int linger;     /* whether helpers spin after this call (else they sleep at once) */
    _Atomic uint64_t state; /* generation << 32 | chunks << 16 | next chunk to claim */
    _Atomic int done;       /* chunks finished in this generation */
    _Atomic uint32_t seq;   /* futex word: bumped with every generation */
    _Atomic int sleepers;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim and compute chunks of the current generation until none is left; returns how many. */
static int work(void) {
    int did = 0;
    uint64_t v = atomic_load_explicit(&pool.state, memory_order_acquire);
    for (;;) {
        const int next = (int)(v & 0xffff), chunks = (int)((v >> 16) & 0xffff);
        if (next >= chunks) return did;
        if (!atomic_compare_exchange_weak_explicit(&pool.state, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* v was reloaded */
        /* chunk `next` is ours: the job cannot change until every chunk is done, ours included */
        pool.fn(pool.ctx, next);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        did++;
        v = atomic_load_explicit(&pool.state, memory_order_acquire);
    }
}

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        if (work()) continue;
        int64_t until = now_ns() + (atomic_load_explicit(&pool.linger, memory_order_relaxed) ? SPIN_NS : 0);
        int found = 0;
        while (!found) { /* spin: the next call of a decode step comes soon */
            for (int i = 0; i < 64 && !found; i++) {
                const uint64_t v = atomic_load_explicit(&pool.state, memory_order_relaxed);
                found = (v & 0xffff) < ((v >> 16) & 0xffff);
                CPU_RELAX();
            }
            if (!found && now_ns() > until) break;
        }
        if (found) continue;
        atomic_fetch_add(&pool.sleepers, 1);
        const uint32_t s = atomic_load(&pool.seq);
        const uint64_t v = atomic_load(&pool.state);
        if ((v & 0xffff) >= ((v >> 16) & 0xffff)) /* nothing posted since: sleep until the seq moves */
            syscall(SYS_futex, &pool.seq, FUTEX_WAIT_PRIVATE, s, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleepers, 1);
    }
    return NULL;
}

static void ensure_helpers(int want) {
    if (pool.pid != getpid()) { /* first use, or a fork child: its parent's helpers are not here */
        pool.helpers = 0;
        pool.pid = getpid();
    }
    while (pool.helpers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, helper, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.helpers++;
    }
}

/* fn(ctx, i) for i in 0 .. chunks-1, on the caller and up to `threads - 1` helpers; returns when all are
 * done. One thread, one chunk, or another threaded call in progress (the pool is busy): the caller runs
 * every chunk itself. `linger`: the helpers spin for SPIN_NS afterwards (the caller's next kernel call is
 * near and nothing else wants the cores, e.g. a decode step with torch at one thread); 0: they sleep at
 * once (torch's own OpenMP workers run next). `chunks` above MAX_CHUNKS is the caller's error: -1,
 * nothing run. */
int pool_run(chunk_fn fn, void *ctx, int chunks, int threads, int linger) {
    if (chunks <= 0) return 0;
    if (chunks > MAX_CHUNKS) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&pool.lock) != 0) {
        for (int i = 0; i < chunks; i++) fn(ctx, i);
        return 0;
    }
    ensure_helpers(threads - 1);
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.linger, linger, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const uint64_t gen = (atomic_load_explicit(&pool.state, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&pool.state, gen << 32 | (uint64_t)chunks << 16, memory_order_release);
    atomic_fetch_add(&pool.seq, 1);
    if (atomic_load(&pool.sleepers) > 0) syscall(SYS_futex, &pool.seq, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    work();
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        if (spins < 4096) CPU_RELAX();
        else sched_yield(); /* a helper holding a chunk was preempted: give it the core */
    }
    pthread_mutex_unlock(&pool.lock);
    return 0;
}
