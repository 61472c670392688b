"""KV store on the CPU in one C call (built on first use): the bytes of `kv_store.store_kv_ref`.

Plain pools (fp32, bf16; `store_kv_rows_cpu`): `kernels/cpu/kv_store_rows.c` copies each (token,
KV head) row into its slot, the same bytes as `store_kv_ref`'s two `index_copy_`s. Measured on a
2-core AMD EPYC VM, one thread, SmolLM2's shapes (K and V as views of the fused projection): a
layer's store of 32 tokens 25 -> 10.5 us (~0.45 ms of a 30-layer decode step), of one token 12 ->
10 us; most of what is left is this wrapper's checks and the ctypes call.

FP8 pools (`store_kv_fp8_cpu`):

`store_kv_ref`'s FP8 path is about twenty small torch ops (absolute value, max, frexp,
compare, where, clamp, ldexp, clamp, cast, then four row copies), which at one new
token per request cost ~170 us a layer on a 2-core CPU, ~5 ms of a 30-layer decode step:
the one place where FP8 pages still cost more per step than BF16 pages. `kernels/cpu/
kv_store_fp8.c` does the same arithmetic per (token, KV head) in one pass: the amax, the
exponent from its float32 bits, one exact multiply by 2^-e, the clamp, and round-to-
nearest-even into e4m3 by bit arithmetic, written straight into the pool's rows.

Numerics: identical bytes to `store_kv_ref` (tests compare every byte on fresh random
inputs, with values across the whole float32 range, zeros, subnormals and ties). Build:
plain `-O3 -march=native`, no reassociation or fast-math flag (the rounding is exact
integer work and the amax a max), so what the compiler vectorises cannot change a bit.
A prompt chunk's tokens are shared out (contiguous runs of tokens, the same bytes as one thread; the
helper pool or torch's OpenMP pool, `cpu_threads.run_mode`): SmolLM2's K and V (3 KV heads of 64) from
bfloat16, 2 threads, 2-core AMX Xeon VM, on the helper pool: 2,048 tokens 1.17 -> 0.61 ms, 512 tokens 0.22 ->
0.20 ms (waking the helper costs most of the gain).
Where the kernel cannot be built, or the tensors are not laid out as it reads them,
`store_kv_fp8_cpu` returns False and the caller takes the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["KERNEL", "ROWS_KERNEL", "available", "store_kv_fp8_cpu", "store_kv_rows_cpu", "build_error"]

_INPUTS = {torch.float32: 0, torch.bfloat16: 1}
_MAX_HEAD_DIM = 1024  # the kernel's row buffer (MAX_HD)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, q = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.store_kv_fp8.argtypes = [p, p, q, q, q, q, p, p, p, p, p, i, i, i, q, i]
    lib.store_kv_fp8.restype = ctypes.c_int
    lib.store_kv_fp8_threaded.argtypes = [p, p, q, q, q, q, p, p, p, p, p, i, i, i, q, i, i, i]
    lib.store_kv_fp8_threaded.restype = ctypes.c_int


KERNEL = CKernel("kv_store_fp8.c", (), _declare, "the FP8 KV store runs its torch ops instead", uses_pool=True)


def _declare_rows(lib: ctypes.CDLL) -> None:
    p, i, q = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.store_kv_rows.argtypes = [p, p, q, q, q, q, p, p, p, i, i, i, i, q]
    lib.store_kv_rows.restype = ctypes.c_int


ROWS_KERNEL = CKernel("kv_store_rows.c", (), _declare_rows, "the plain KV store runs index_copy_ instead")


available = KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = KERNEL.build_error  # why not, or None


def store_kv_fp8_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> bool:
    """Quantise k, v [T, kv_heads, head_dim] (float32 or bfloat16, CPU) to FP8 and store them at `slots` [T]
    (int64) of the FP8 pool's k_cache / v_cache [pages, page_size, kv_heads, head_dim] and their
    exponents in k_scale / v_scale [pages, page_size, kv_heads]; the bytes `store_kv_ref` writes.
    False (nothing written) when the kernel is unavailable or a tensor is laid out otherwise;
    IndexError when a slot is outside the pool."""
    fmt = _INPUTS.get(k.dtype)
    if (fmt is None or v.dtype != k.dtype or not k.is_cpu or not v.is_cpu or not k_cache.is_cpu or not slots.is_cpu
            or k.dim() != 3 or v.shape != k.shape
            or k.shape[2] > _MAX_HEAD_DIM or k.stride(2) != 1 or v.stride(2) != 1
            or k_cache.dtype != torch.float8_e4m3fn or k_cache.shape[2:] != k.shape[1:]
            or slots.dtype != torch.int64 or not slots.is_contiguous()
            or not all(t.is_contiguous() for t in (k_cache, v_cache, k_scale, v_scale))):
        return False
    lib = KERNEL.load()
    if lib is None:
        return False
    t, heads, dim = k.shape
    nslots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.store_kv_fp8_threaded(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                                   slots.data_ptr(), t, heads, dim, nslots, fmt, kernel_threads(),
                                   run_mode())
    if rc != 0:
        raise IndexError(f"a KV slot is outside the pool's {nslots} slots")
    return True


def store_kv_rows_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor) -> bool:
    """Store k, v [T, kv_heads, head_dim] at `slots` [T] (int64) of a plain pool's k_cache / v_cache
    [pages, page_size, kv_heads, head_dim] of the same dtype; the bytes `store_kv_ref` writes. False
    (nothing written) when the kernel is unavailable or a tensor is laid out or typed otherwise;
    IndexError when a slot is outside the pool."""
    if (k.dtype != k_cache.dtype or v.dtype != k.dtype or v_cache.dtype != k.dtype or not k.is_cpu or not v.is_cpu
            or not k_cache.is_cpu or not slots.is_cpu or k.dim() != 3 or v.shape != k.shape
            or k_cache.shape[2:] != k.shape[1:]
            or v_cache.shape != k_cache.shape or k.stride(2) != 1 or v.stride(2) != 1
            or slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != k.shape[0]
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return False
    lib = ROWS_KERNEL.load()
    if lib is None:
        return False
    t, heads, dim = k.shape
    e = k.element_size()
    nslots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.store_kv_rows(k.data_ptr(), v.data_ptr(), k.stride(0) * e, k.stride(1) * e, v.stride(0) * e,
                           v.stride(1) * e, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t, heads, dim,
                           e, nslots)
    if rc != 0:
        raise IndexError(f"a KV slot is outside the pool's {nslots} slots")
    return True
