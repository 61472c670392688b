/* Every decoder layer of a step of a dense bfloat16 or float32 model in one call: decode rows, and prompt rows
 * where the step runs every row on one set of weights. The kernels the Python layers call one by one (kernels/cpu/*.c)
 * are called here in the same order on the same values, so the results are bit for bit those of the Python
 * path; what goes is the Python between them: a step of SmolLM2 made ~300 kernel calls from Python (30
 * layers x 10), each with its wrapper's checks, a tensor allocation and a ctypes crossing (6-15 us a call),
 * ~5 ms of a 17 ms step at one decode row. Built and loaded by kernels/cpu_decode_layers.py, which hands in
 * the other kernels' entry points (`Kernels`: each stays its own shared object, with its own tests) and per
 * layer its weights and pages.
 *
 * Per layer, from x = the layer's input norm of the residual rows h [M, hidden]:
 *   qkv = x . Wqkv^T                         [M, (H + 2 KVH) HD]   gemv_bf16, or gemv_int4 (INT4 weights)
 *   q = rope(qkv's q heads), k = rope(k heads)  [M, H, HD], [M, KVH, HD]  rope_bf16 (twice: same arithmetic
 *                                                                   per element as one call over both)
 *   store k and qkv's v heads at `slots`      store_kv_rows (bf16 pages) or store_kv_fp8 (fp8 pages)
 *   o = attention(q, pages)                   [M, H HD]             paged_decode (a decode row alone, prompt
 *                                                                   rows in the caller's tiles)
 *   a = o . Wo^T; h += a; x = post_norm(h)    gemv_bf16, add_rms_norm_bf16
 *   g = x . Wgu^T; s = silu(gate) * up        gemv_bf16, silu_mul_bf16
 *   m = s . Wdown^T                           gemv_bf16
 *   h += m; x = next input_norm(h)            add_rms_norm_bf16; on the last layer m is left in `mlp_out`
 *                                             for the caller (which adds it and runs the final norm)
 * A float32 model (Step.elem 4) runs the float32 twins in the same order: gemv_f32, rope_f32, store_kv_rows of
 * 4-byte elements (or store_kv_fp8 from float32 rows), paged_decode on fp32 pages with float32 queries,
 * add_rms_norm_f32, silu_mul_f32. Those have no Python path calling them one by one (the Python layers run
 * float32 on torch), so a float32 step agrees with the Python layers to float32 rounding, not bit for bit.
 * Threads and chunks of each call are the caller's (the Python wrappers' own rules, computed once per
 * step), so the pool splits every call as the unfused path does.
 */
#include <stdint.h>
#include <time.h>

typedef int (*gemv_fn)(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K, int threads,
                       int chunks, int fma);
typedef int (*gemv_int4_fn)(const uint16_t *x, const uint8_t *q, const uint16_t *sz, uint16_t *y, int M, int N,
                            int K, int group, int threads, int chunks, int amx);
typedef void (*rope_fn)(const uint16_t *x, const float *f, uint16_t *y, int rows, int heads, int dim, int pairs,
                        int64_t row_stride, int threads, int linger);
typedef int (*store_rows_fn)(const char *k, const char *v, int64_t k_stride_t, int64_t k_stride_h,
                             int64_t v_stride_t, int64_t v_stride_h, char *kc, char *vc, const int64_t *slots, int T,
                             int KVH, int HD, int elem, int64_t nslots);
typedef int (*store_fp8_fn)(const void *k, const void *v, int64_t k_stride_t, int64_t k_stride_h,
                            int64_t v_stride_t, int64_t v_stride_h, void *kc, void *vc, int8_t *ke, int8_t *ve,
                            const int64_t *slots, int T, int KVH, int HD, int64_t nslots, int bf16);
typedef int (*attend_fn)(const void *q, const void *k, const void *v, const int8_t *ke, const int8_t *ve,
                         const int64_t *table, const int32_t *lens, const int32_t *tiles, int ntiles, void *out,
                         int D, int KVH, int G, int HD, int S, int MAXP, int fmt, int half, float scale, int threads,
                         int64_t min_threaded_rows, int linger);
typedef void (*add_norm_fn)(uint16_t *h, const uint16_t *a, const uint16_t *w, uint16_t *y, int rows, int n,
                            float eps, int threads, int linger);
typedef void (*silu_fn)(const uint16_t *gate_up, uint16_t *y, int64_t rows, int64_t inter, int threads,
                        int linger);
typedef int (*gemv_f32_fn)(const float *x, const float *w, float *y, int M, int N, int K, int threads, int chunks);
typedef void (*rope_f32_fn)(const float *x, const float *f, float *y, int rows, int heads, int dim, int pairs,
                            int64_t row_stride, int threads, int linger);
typedef void (*add_norm_f32_fn)(float *h, const float *a, const float *w, float *y, int rows, int n, float eps,
                                int threads, int linger);
typedef void (*silu_f32_fn)(const float *gate_up, float *y, int64_t rows, int64_t inter, int threads, int linger);

typedef struct {
    gemv_fn gemv;
    gemv_int4_fn gemv_int4; /* NULL where that kernel does not build (then no layer is INT4) */
    rope_fn rope;
    store_rows_fn store_rows;
    store_fp8_fn store_fp8;
    attend_fn attend;
    add_norm_fn add_norm;
    silu_fn silu;
    /* float32 models (NULL where those kernels do not build: then no model is float32 here) */
    gemv_f32_fn gemv_f32;
    rope_f32_fn rope_f32;
    add_norm_f32_fn add_norm_f32;
    silu_f32_fn silu_f32;
} Kernels;

enum { QKV, O, GATE_UP, DOWN, LINEARS };

typedef struct {
    const void *w[LINEARS];            /* qkv, o, gate_up, down: [N, K] of the step's element, or INT4 panels' codes */
    const uint16_t *sz[LINEARS];       /* INT4: the panels' scales and zeros; NULL for bfloat16 */
    const void *post_norm, *next_norm; /* [hidden] elements; next_norm: the next layer's input norm (NULL: last) */
    void *k_pages, *v_pages;                  /* [P, S, KVH, HD] of the step's element, or fp8 bytes */
    int8_t *k_exps, *v_exps;                  /* fp8 pages: [P, S, KVH] exponents; NULL for bf16 pages */
} Layer;

typedef struct {
    int M, hidden, H, KVH, HD, pairs, inter; /* the step's rows, model dims; pairs: rotary pairs a head */
    int threads[LINEARS], chunks[LINEARS], fma[LINEARS], group[LINEARS]; /* group: INT4's group size */
    int row_threads, linger;     /* the row-wise kernels' and the attention's threads; pool linger */
    int64_t attend_min_rows;     /* the attention's threshold for threads (its wrapper's) */
    float eps, scale;
    int fp8;                     /* pages: 0 the step's element, 1 fp8_e4m3 with exponents */
    const float *freqs;          /* [M, pairs] (cos, sin) pairs */
    const int64_t *slots;        /* [M] */
    int64_t nslots;
    const int64_t *table;        /* [M, maxp] */
    const int32_t *lens;         /* [M] */
    const int32_t *tiles;        /* [ntiles + 1] the attention's tiles (prompt rows), or NULL: every row alone */
    int ntiles;
    int maxp, page_size;
    void *h, *x;                 /* [M, hidden]: the residual rows (updated in place), the normed rows */
    void *qkv, *q, *k, *attn;    /* [M, (H + 2 KVH) HD], [M, H, HD], [M, KVH, HD], [M, H HD] */
    void *branch, *gate_up, *act, *mlp_out; /* [M, hidden], [M, 2 inter], [M, inter], [M, hidden] */
    double *seconds;             /* NULL, or 6 accumulators: gemv, attention, rope, kv store, norms, silu */
    int elem;                    /* bytes of the rows' and weights' element: 2 bfloat16, 4 float32 */
} Step;

enum { T_GEMV, T_ATTEND, T_ROPE, T_STORE, T_NORM, T_SILU };

static double now_s(const Step *s) {
    if (!s->seconds) return 0.0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void charge(const Step *s, int what, double *since) {
    if (!s->seconds) return;
    const double t = now_s(s);
    s->seconds[what] += t - *since;
    *since = t;
}

/* y [M, N] = x [M, K] . W^T for linear `which` of layer L, float32, bfloat16 or INT4 (the kernel of its format) */
static int linear(const Kernels *kn, const Step *s, const Layer *L, int which, const void *x, void *y, int N, int K) {
    if (s->elem == 4)
        return kn->gemv_f32((const float *)x, (const float *)L->w[which], (float *)y, s->M, N, K, s->threads[which],
                            s->chunks[which]);
    if (L->sz[which])
        return kn->gemv_int4(x, (const uint8_t *)L->w[which], L->sz[which], y, s->M, N, K, s->group[which],
                             s->threads[which], s->chunks[which], s->fma[which]); /* fma: 1 for INT4's AMX tiles */
    return kn->gemv((const uint16_t *)x, (const uint16_t *)L->w[which], (uint16_t *)y, s->M, N, K, s->threads[which],
                    s->chunks[which], s->fma[which]);
}

/* The element-wise kernels of the step's element type */
static void rope(const Kernels *kn, const Step *s, const void *x, void *y, int heads, int64_t row_stride) {
    if (s->elem == 4)
        kn->rope_f32((const float *)x, s->freqs, (float *)y, s->M, heads, s->HD, s->pairs, row_stride,
                     s->row_threads, s->linger);
    else
        kn->rope((const uint16_t *)x, s->freqs, (uint16_t *)y, s->M, heads, s->HD, s->pairs, row_stride,
                 s->row_threads, s->linger);
}

static void add_norm(const Kernels *kn, const Step *s, const void *a, const void *w) {
    if (s->elem == 4)
        kn->add_norm_f32((float *)s->h, (const float *)a, (const float *)w, (float *)s->x, s->M, s->hidden, s->eps,
                         s->row_threads, s->linger);
    else
        kn->add_norm((uint16_t *)s->h, (const uint16_t *)a, (const uint16_t *)w, (uint16_t *)s->x, s->M, s->hidden,
                     s->eps, s->row_threads, s->linger);
}

static void silu(const Kernels *kn, const Step *s) {
    if (s->elem == 4)
        kn->silu_f32((const float *)s->gate_up, (float *)s->act, s->M, s->inter, s->row_threads, s->linger);
    else
        kn->silu((const uint16_t *)s->gate_up, (uint16_t *)s->act, s->M, s->inter, s->row_threads, s->linger);
}

/* Returns 0; -1 when a GEMV could not allocate its widened input, -2 when a slot is outside the pool,
 * -3 when the attention refused the shapes or tiles. The last two happen at layer 0 if at all (every layer
 * gets the same slots, shapes and tiles), before h or x changed: the caller can run the step another way. */
int decode_layers(const Kernels *kn, const Layer *layers, int nlayers, const Step *s) {
    const int M = s->M, hidden = s->hidden, HD = s->HD, H = s->H, KVH = s->KVH, E = s->elem;
    const int qkv_n = (H + 2 * KVH) * HD;
    const int64_t row_bytes = (int64_t)qkv_n * E;
    if ((E != 2 && E != 4) || (E == 4 && !(kn->gemv_f32 && kn->rope_f32 && kn->add_norm_f32 && kn->silu_f32)))
        return -3;
    double t = now_s(s);
    for (int i = 0; i < nlayers; i++) {
        const Layer *L = &layers[i];
        if (linear(kn, s, L, QKV, s->x, s->qkv, qkv_n, hidden)) return -1;
        charge(s, T_GEMV, &t);
        const char *qkv = (const char *)s->qkv;
        rope(kn, s, qkv, s->q, H, qkv_n);
        rope(kn, s, qkv + (int64_t)H * HD * E, s->k, KVH, qkv_n);
        charge(s, T_ROPE, &t);
        const char *v = qkv + (int64_t)(H + KVH) * HD * E;
        int rc;
        if (s->fp8)
            rc = kn->store_fp8(s->k, v, (int64_t)KVH * HD, HD, qkv_n, HD, L->k_pages, L->v_pages, L->k_exps, L->v_exps,
                               s->slots, M, KVH, HD, s->nslots, E == 2);
        else
            rc = kn->store_rows((const char *)s->k, v, (int64_t)KVH * HD * E, (int64_t)HD * E, row_bytes,
                                (int64_t)HD * E, L->k_pages, L->v_pages, s->slots, M, KVH, HD, E, s->nslots);
        if (rc) return -2;
        charge(s, T_STORE, &t);
        if (kn->attend(s->q, L->k_pages, L->v_pages, L->k_exps, L->v_exps, s->table, s->lens, s->tiles, s->ntiles,
                       s->attn, M, KVH, H / KVH, HD, s->page_size, s->maxp, s->fp8 ? 2 : (E == 2 ? 1 : 0), E == 2,
                       s->scale, s->row_threads, s->attend_min_rows, s->linger))
            return -3;
        charge(s, T_ATTEND, &t);
        if (linear(kn, s, L, O, s->attn, s->branch, hidden, H * HD)) return -1;
        charge(s, T_GEMV, &t);
        add_norm(kn, s, s->branch, L->post_norm);
        charge(s, T_NORM, &t);
        if (linear(kn, s, L, GATE_UP, s->x, s->gate_up, 2 * s->inter, hidden)) return -1;
        charge(s, T_GEMV, &t);
        silu(kn, s);
        charge(s, T_SILU, &t);
        if (linear(kn, s, L, DOWN, s->act, s->mlp_out, hidden, s->inter)) return -1;
        charge(s, T_GEMV, &t);
        if (L->next_norm) {
            add_norm(kn, s, s->mlp_out, L->next_norm);
            charge(s, T_NORM, &t);
        }
    }
    return 0;
}
