/* The routed experts of an MoE layer in one call, on dense bfloat16 or float32 weights or INT4 ones: every hit
 * expert's SwiGLU MLP over its rows of the sorted tokens (backend/moe_experts.py's layout), what a loop of `Linear`s
 * (or `Int4Linear`s, on bfloat16 activations) computes, without the Python between the calls. Built and loaded by
 * kernels/cpu_moe_experts.py, which hands in the GEMV and SwiGLU entry points (each its own shared object with its
 * own tests), as the fused decode layers take theirs (decode_layers.c).
 *
 * For expert e, owning rows r0 = offsets[e] .. r1 = offsets[e + 1] of xs [S, H] (R = r1 - r0 rows):
 *   h[r0:r1]   = xs[r0:r1] . w13[e]^T      [R, 2I]   gemv (gate rows first, then up rows, as stored; gemv_int4
 *                                                    on the expert's packed panels)
 *   act[r0:r1] = silu(gate) * up           [R, I]    silu_mul
 *   ys[r0:r1]  = act[r0:r1] . w2[e]^T      [R, H]    gemv
 * The same GEMVs on the same values as the loop of `Linear`s (one call per expert and projection, each output
 * whole from one thread's chunk), so whatever the thread count the projections' results are the loop's bit for
 * bit; SwiGLU's activation is the C kernel's (in bfloat16 the loop's too; in float32, and for INT4 experts under
 * float32 compute, the loop runs torch's `F.silu(gate) * up` in float32, so a result agrees with it to the rounding
 * of the activation).
 *
 * Threads: with at least 2 hit experts a thread (a decode step of MoE models routes each token to 6-8 of them),
 * the experts themselves are the chunks of one pool call: the caller and the pool's helpers claim whole experts,
 * most rows first, and run each expert's three calls on their own thread (the inner calls get one thread, which
 * the pool runs in place), so no thread waits for another between an expert's projections. Fewer hit experts run
 * one after another, each call split over the threads as a `Linear` call would be. Memory: the weights of every
 * hit expert are read once, so a call at 32 tokens of a 64-expert layer reads nearly all of them: it is bound by
 * the read bandwidth, where a loop of per-expert GEMMs with torch's dispatch between them was not.
 */
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"

typedef int (*gemv_bf16_fn)(const void *x, const void *w, void *y, int M, int N, int K, int threads, int chunks,
                            int fma);
typedef int (*gemv_f32_fn)(const void *x, const void *w, void *y, int M, int N, int K, int threads, int chunks);
typedef int (*gemv_int4_fn)(const void *x, const void *q, const void *sz, void *y, int M, int N, int K, int group,
                            int threads, int chunks, int amx);
typedef void (*silu_fn)(const void *gate_up, void *y, int64_t rows, int64_t inter, int threads, int how);

typedef struct {
    void *gemv; /* gemv_f32, gemv_bf16 or gemv_int4, as the weights' format */
    void *silu; /* silu_mul_f32 (float32), silu_mul_bf16 (bfloat16 activations), or silu_mul_bf16_once (INT4 in a
                 * float32 model: the activation rounded once, as its loop of `Int4Linear`s rounds it) */
} MoeKernels;

enum { F32, BF16, INT4 };

typedef struct {
    const MoeKernels *k;
    int format, elem;               /* F32 / BF16 / INT4; bytes of an activation (4, 2, 2) */
    const char *xs, *w13, *w2;      /* dense: the stacked weights */
    const void *const *q[2];        /* INT4: per expert, gate_up's and down's packed codes ... */
    const void *const *sz[2];       /* ... and scales and zeros (kernels/cpu_gemv_int4.py's panels) */
    char *h, *act, *ys;
    const int64_t *offsets;
    const int32_t *hits;            /* hit experts, most rows first */
    int H, I, group, fma, how;      /* fma: gemv_bf16's tile code, or gemv_int4's AMX flag */
    int threads, chunks13, chunks2; /* of one expert's calls when the experts run one after another */
    int failed;                     /* a GEMV refused (its x could not be widened): set, never cleared */
} Job;

/* y [M, N] = x . W^T for expert e's gate_up (down = 0: N = 2I, K = H) or down (N = H, K = I) projection */
static int project(const Job *j, int e, int down, const char *x, char *y, int M, int threads, int chunks) {
    const int N = down ? j->H : 2 * j->I, K = down ? j->I : j->H;
    if (j->format == INT4)
        return ((gemv_int4_fn)j->k->gemv)(x, j->q[down][e], j->sz[down][e], y, M, N, K, j->group, threads, chunks,
                                          j->fma);
    const char *w = (down ? j->w2 : j->w13) + (int64_t)e * N * K * j->elem;
    if (j->format == BF16) return ((gemv_bf16_fn)j->k->gemv)(x, w, y, M, N, K, threads, chunks, j->fma);
    return ((gemv_f32_fn)j->k->gemv)(x, w, y, M, N, K, threads, chunks);
}

/* Expert e's three calls on `threads` threads (1: this one) */
static int expert(const Job *j, int e, int threads, int chunks13, int chunks2) {
    const int64_t r0 = j->offsets[e], rows = j->offsets[e + 1] - r0, H = j->H, I = j->I, el = j->elem;
    char *h = j->h + r0 * 2 * I * el, *act = j->act + r0 * I * el;
    if (project(j, e, 0, j->xs + r0 * H * el, h, (int)rows, threads, chunks13)) return -1;
    ((silu_fn)j->k->silu)(h, act, rows, I, threads, j->how);
    return project(j, e, 1, act, j->ys + r0 * H * el, (int)rows, threads, chunks2);
}

static void run_expert(void *ctx, int i) {
    Job *j = (Job *)ctx;
    if (expert(j, j->hits[i], 1, 1, 1)) __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

/* The hit experts of `j` (its hits array filled here) as the header says; 0, or -1 */
static int run(Job *j, int E) {
    int32_t *hits = malloc((size_t)(E > 0 ? E : 1) * sizeof(int32_t));
    if (!hits) return -1;
    int n = 0;
    for (int e = 0; e < E; e++) { /* the hit experts by rows, most first (expert order among equals) */
        const int64_t rows = j->offsets[e + 1] - j->offsets[e];
        if (rows <= 0) continue;
        int i = n++;
        for (; i > 0 && j->offsets[hits[i - 1] + 1] - j->offsets[hits[i - 1]] < rows; i--) hits[i] = hits[i - 1];
        hits[i] = e;
    }
    j->hits = hits;
    int rc = 0;
    if (j->threads > 1 && n >= 2 * j->threads) {
        rc = run_chunks(run_expert, j, n, j->threads, j->how);
        rc = rc ? rc : (j->failed ? -1 : 0);
    } else {
        for (int i = 0; i < n && rc == 0; i++) rc = expert(j, hits[i], j->threads, j->chunks13, j->chunks2);
    }
    free(hits);
    return rc;
}

/* ys [S, H] = each hit expert's SwiGLU MLP on its rows of xs [S, H] (S = offsets[E]), with h [S, 2I] and act [S, I]
 * as scratch, all of `elem` bytes an element (2: bfloat16, 4: float32), w13 [E, 2I, H] and w2 [E, H, I] contiguous.
 * `fma`: gemv_bf16's tile code (ignored in float32); `how`: the pool.h run mode; `threads`, `chunks13`, `chunks2`:
 * the threads of the call and the chunks of one expert's gate_up and down calls when they are split. Rows of
 * experts with none are not touched. Returns 0, or -1 (a GEMV could not allocate; ys then partly unwritten). */
int moe_experts(const MoeKernels *k, int elem, const void *xs, const void *w13, const void *w2,
                const int64_t *offsets, int E, int H, int I, void *h, void *act, void *ys, int fma, int how,
                int threads, int chunks13, int chunks2) {
    Job j = {.k = k, .format = elem == 2 ? BF16 : F32, .elem = elem, .xs = xs, .w13 = w13, .w2 = w2, .h = h,
             .act = act, .ys = ys, .offsets = offsets, .H = H, .I = I, .fma = fma, .how = how, .threads = threads,
             .chunks13 = chunks13, .chunks2 = chunks2};
    return run(&j, E);
}

/* The same for INT4 experts: bfloat16 xs, h, act and ys; per expert e, gate_up's panels q13[e] / sz13[e] and down's
 * q2[e] / sz2[e] in gemv_int4's layout with `group` columns a group (H and I multiples of 8, the GEMV's column
 * step); `amx`: gemv_int4's flag. */
int moe_experts_int4(const MoeKernels *k, const void *xs, const void *const *q13, const void *const *sz13,
                     const void *const *q2, const void *const *sz2, const int64_t *offsets, int E, int H, int I,
                     int group, void *h, void *act, void *ys, int amx, int how, int threads, int chunks13,
                     int chunks2) {
    Job j = {.k = k, .format = INT4, .elem = 2, .xs = xs, .q = {q13, q2}, .sz = {sz13, sz2}, .h = h, .act = act,
             .ys = ys, .offsets = offsets, .H = H, .I = I, .group = group, .fma = amx, .how = how,
             .threads = threads, .chunks13 = chunks13, .chunks2 = chunks2};
    return run(&j, E);
}
