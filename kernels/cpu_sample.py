"""Temperature sampling of logit rows in C (`kernels/cpu/sample.c`, built on first use): the softmax's CDF
inverted with one uniform a row, in three passes over the row and no copy of it.

`backend/sampler.py` draws each sampled row's token with it: a row without penalties from the logits as
the LM head left them (float32 or bfloat16; the temperature, the grammar's mask words, top-k and top-p
applied inside), a row with penalties from the float32 row torch prepared (temperature, top-k and top-p
already applied). The probabilities are those of softmax(x / T) up to float32 rounding within each word
of 32 tokens (their sums are added in double; see the C file). torch's path for 32 rows of 49,152
(float32 copy, division, softmax, a float64 running sum, searchsorted) took ~20 ms on a 2-core AMD EPYC
VM; its top-p sorts the whole row (~80 ms more), the kernel one narrow bucket of it.
Rows are shared out (`pool_rows` in `kernels/cpu/pool.h`: the helper pool or torch's OpenMP pool), a row to a thread;
a row's draw does not depend on which thread makes it.
None where it cannot run (no C compiler, not a contiguous 2-D float32 or bfloat16 CPU tensor, no
columns): the caller keeps torch's path.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import CKernel
from kernels.cpu_threads import kernel_threads, run_mode

__all__ = ["available", "build_error", "sample_rows"]


def _declare(lib: ctypes.CDLL) -> None:
    lib.sample_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int]
    lib.sample_rows.restype = ctypes.c_int


_KERNEL = CKernel("sample.c", (), _declare, "sampling runs torch's softmax and running sum", uses_pool=True)


available = _KERNEL.available  # whether it builds and loads here (builds it on the first call)
build_error = _KERNEL.build_error  # why not, or None


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, uniforms: torch.Tensor,
                words: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None) -> torch.Tensor | None:
    """One token id per row (int64 [B]) of float32 or bfloat16 logits [B, V] on the CPU, drawn with
    probability softmax(logits / T) by the row's uniform: `inv_temperature` float32 [B] (1 / T),
    `uniforms` float64 [B] in [0, 1), `words` None or int32 [B, ceil(V / 32)] grammar mask words (bit i
    of word w set when token 32 w + i is allowed), `top_k` None or int32 [B] (0: off), `top_p` None or
    float32 [B] (1: off), cut as `backend/sampler.py`'s torch path cuts them. None when the kernel
    cannot run this case."""
    rows = logits.shape[0] if logits.dim() == 2 else -1
    if (rows < 0 or logits.dtype not in (torch.float32, torch.bfloat16) or not logits.is_cpu
            or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    for t, dtype in ((inv_temperature, torch.float32), (uniforms, torch.float64), (top_k, torch.int32),
                     (top_p, torch.float32)):
        if t is not None and (t.dtype != dtype or tuple(t.shape) != (rows,) or not t.is_cpu
                              or not t.is_contiguous()):
            return None
    if words is not None and (words.dtype != torch.int32 or not words.is_cpu or not words.is_contiguous()
                              or tuple(words.shape) != (rows, (logits.shape[1] + 31) // 32)):
        return None
    lib = _KERNEL.load()
    if lib is None:
        return None
    out = torch.empty(rows, dtype=torch.int64)
    if rows and lib.sample_rows(logits.data_ptr(), out.data_ptr(), rows, logits.shape[1],
                                int(logits.dtype == torch.bfloat16), inv_temperature.data_ptr(),
                                uniforms.data_ptr(), *(None if t is None else t.data_ptr()
                                                       for t in (words, top_k, top_p)),
                                kernel_threads(), run_mode()) != 0:
        raise MemoryError("sample_rows: out of memory")
    return out
