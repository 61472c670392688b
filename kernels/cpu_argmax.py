"""Row-wise argmax of float32 or bfloat16 logits in C (`kernels/cpu/argmax.c`, built on first use): greedy
sampling.

`torch.argmax(dim=-1)` on the CPU read the logits at ~3 GB/s on one thread: 1.1-1.9 ms of a
c = 32 decode step of SmolLM2 (32 rows of 49,152) on a 2-core AMD EPYC VM. The kernel gives
the same answer (the first index of the maximum; a NaN counts as the maximum, its first
index) from two vector passes over each row. bfloat16 logits (a bfloat16 model's LM head output)
are read as they are, so a greedy step needs no float32 copy of them: 32 x 49,152 bf16 logits
0.13 ms, against 0.24 ms for the float32 copy and its argmax (one thread, same VM); the answer
is the float32 copy's, the widening being exact.
None where it cannot run (no C compiler, not a contiguous 2-D float32 or bfloat16 CPU tensor,
no columns): the caller keeps torch's argmax.

Grammar masks (`backend/grammar.py`'s int32 words, one bit a token): `argmax_rows(logits, words)` answers
as torch's argmax after the sampler's masked_fill of the forbidden tokens, without that masked copy (each
loaded vector is blended with -inf under its bits), and `mask_fill_rows` writes the -inf into float32 rows
in place for rows that are sampled. torch's bit unpacking and masked_fill took 11-13 ms for 32 rows of
49,152 on a 2-core AMD EPYC VM (AVX2), ~10% of a c = 32 decode step under a JSON schema.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["available", "build_error", "argmax_rows", "mask_fill_rows"]


def _declare(lib: ctypes.CDLL) -> None:
    lib.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.argmax_rows.restype = None
    lib.mask_fill_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    lib.mask_fill_rows.restype = None


_KERNEL = CKernel("argmax.c", (), _declare, "greedy sampling runs torch.argmax", uses_pool=True)


available = _KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = _KERNEL.build_error  # why not, or None


def _words_fit(words: torch.Tensor, rows: int, vocab: int) -> bool:
    return (words.dtype == torch.int32 and words.is_cpu and words.is_contiguous()
            and tuple(words.shape) == (rows, (vocab + 31) // 32))


def argmax_rows(logits: torch.Tensor, words: torch.Tensor | None = None) -> torch.Tensor | None:
    """`logits.argmax(dim=-1)` (int64 [B]) for float32 or bfloat16 logits [B, V] on the CPU, or None
    when the kernel cannot run this case. With `words` (int32 [B, ceil(V / 32)], contiguous; bit i of
    word w set when token 32 w + i is allowed) every forbidden token counts as -inf."""
    if (logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or not logits.is_cpu
            or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    if words is not None and not _words_fit(words, *logits.shape):
        return None
    lib = _KERNEL.load()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        lib.argmax_rows(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
                        int(logits.dtype == torch.bfloat16), None if words is None else words.data_ptr(),
                        kernel_threads(), run_mode())
    return out


def mask_fill_rows(logits: torch.Tensor, words: torch.Tensor) -> bool:
    """Set every token `words` forbids (int32 [B, ceil(V / 32)], as `argmax_rows`) to -inf in float32
    logits [B, V], in place; False (nothing written) when the kernel cannot run this case."""
    if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu or not logits.is_contiguous()
            or not _words_fit(words, *logits.shape)):
        return False
    lib = _KERNEL.load()
    if lib is None:
        return False
    if logits.numel():
        lib.mask_fill_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], words.data_ptr())
    return True
