/* Store of new tokens' K and V into a paged KV cache of a plain format (fp32, bf16: the pool's own dtype,
 * no conversion) on the CPU: one row copy per (token, KV head), the bytes kernels/kv_store.py's
 * `store_kv_ref` writes with two `index_copy_`s (25 us a layer for 32 tokens of SmolLM2 on a 2-core CPU,
 * 10.5 through this file). Built and loaded by kernels/cpu_kv_store.py.
 *
 * Layouts:
 *   k, v        [T, KVH, HD] rows of HD contiguous elements of `elem` bytes, strides in bytes
 *   kc, vc      [NSLOTS, KVH, HD] (the pool's pages flattened: slot = page * S + offset)
 *   slots       [T] int64
 * Returns 0, or -1 (nothing written) when a slot is outside [0, NSLOTS).
 */
#include <stdint.h>
#include <string.h>

int store_kv_rows(const char *k, const char *v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
                  int64_t v_stride_h, char *kc, char *vc, const int64_t *slots, int T, int KVH, int HD, int elem,
                  int64_t nslots) {
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= nslots)
            return -1;
    const int64_t row = (int64_t)HD * elem;
    for (int t = 0; t < T; t++) {
        const int64_t at = slots[t] * KVH;
        for (int h = 0; h < KVH; h++) {
            memcpy(kc + (at + h) * row, k + t * k_stride_t + h * k_stride_h, (size_t)row);
            memcpy(vc + (at + h) * row, v + t * v_stride_t + h * v_stride_h, (size_t)row);
        }
    }
    return 0;
}
