"""Bfloat16 weights packed once for oneDNN, for the GEMMs of prompt steps.

torch's bfloat16 GEMM on the CPU (oneDNN) takes the weight as it lies, [N, K] row-major, and
reorders it into its own blocked layout (K pairs interleaved for AMX and `vdpbf16ps`) on every
call. At a prompt step's row counts that reorder is a large part of the call: SmolLM2's 120
layer GEMMs (30 layers' own weights) at 208 rows took 37 ms from the plain weights and 25 ms from
weights packed beforehand (`torch.ops.mkldnn._reorder_linear_weight`, run by
`torch.ops.mkldnn._linear_pointwise`), 1.25-1.5x from 129 to 300 rows, even from 512 rows up
(2-core Xeon with AMX, oneDNN 3.12); lone prompts of 130-500 tokens reached their first token
1.12x sooner, of 400-512 as soon, of 900-1,100 (512-row steps) 1.6% later: calls of `MIN_ROWS`
up to `MAX_ROWS` rows take the pack. The sums are float32 sums of the same products as the plain GEMM's, rounded once to
bfloat16; oneDNN may block a shape's sums otherwise (seen: one of 24 shapes, one bfloat16 step apart).

A pack is a second copy of the weight (its bytes again; the decode GEMV in C keeps reading the
plain one). A served engine packs its prompt weights when its thread starts
(`DecoderModel.pack_prompt_weights`: SmolLM2's 202 MB in 0.12 s); otherwise a linear packs at its first
GEMM on torch's bfloat16 path that takes the pack (the first long prompt then paid ~0.27 s). Within a
budget for the process: `EDGESERVE_PREFILL_PACK=auto` (default) packs while the packs
take at most a quarter of the memory available when the first one is made, `1` without a limit,
`0` never. A linear over the budget keeps the plain GEMM.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

__all__ = ["available", "pack", "packed_linear", "budget_bytes", "packed_bytes", "takes", "MIN_ROWS", "MAX_ROWS",
           "use_packs"]

_lock = threading.Lock()
_budget: int | None = None  # bytes the packs may take, set at the first ask
_packed = 0  # bytes packed so far in this process


use_packs = True  # process-wide: False runs every linear from its plain weight (`bench prefill` compares both)
MIN_ROWS = 16  # calls of fewer rows keep the plain GEMM (decode rows where no C GEMV runs: not measured packed)
MAX_ROWS = 400  # and calls of this many or more: from 400 rows the two measured even, at 1,024-token prompts
#                 (512-row steps) the packs 1.6% slower in the engine


def takes(rows: int) -> bool:
    """Whether a bfloat16 GEMM of `rows` rows runs from the weight's pack (where it has one)."""
    return use_packs and MIN_ROWS <= rows < MAX_ROWS


def available() -> bool:
    """Whether this torch has oneDNN's packed linear ops (x86 builds with mkldnn) and the CPU computes bfloat16
    natively (AVX512-BF16 or AMX; elsewhere torch's bfloat16 GEMMs are emulated and prompt GEMMs widened)."""
    from backend.cpu_features import has_amx_bf16, has_avx512_bf16

    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise") and (has_avx512_bf16() or has_amx_bf16()))


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo in bytes; 0 when unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def budget_bytes() -> int:
    """Bytes the process's packs may take (`EDGESERVE_PREFILL_PACK`, read at the first ask)."""
    global _budget
    if _budget is None:
        mode = os.environ.get("EDGESERVE_PREFILL_PACK", "auto")
        _budget = 0 if mode == "0" else (1 << 62) if mode == "1" else mem_available_bytes() // 4
    return _budget


def packed_bytes() -> int:
    """Bytes packed so far in this process."""
    return _packed


def _release(nbytes: int) -> None:
    global _packed
    with _lock:
        _packed -= nbytes


def pack(weight: torch.Tensor, owner: object) -> torch.Tensor | None:
    """`weight` [N, K] (bfloat16, CPU) in oneDNN's layout, or None where packing is unavailable or the
    budget is spent. The pack's bytes count against the budget until `owner` (what holds the pack) is
    collected."""
    global _packed
    if not available():
        return None
    with _lock:
        if _packed + weight.nbytes > budget_bytes():
            return None
        _packed += weight.nbytes
    weakref.finalize(owner, _release, weight.nbytes)
    return torch.ops.mkldnn._reorder_linear_weight(weight, 256)  # 256: a prompt step's rows, a layout hint


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) from W's pack, in x's dtype (bfloat16)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
