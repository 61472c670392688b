"""The kernel choices each process times for itself, made once by rank 0 and taken by every rank of its group.

Three CPU paths are chosen by timing the alternatives on a probe, once per process:
`kernels.cpu_gemv_int4.pays` (INT4 linears on the C kernel or on torch's INT4 GEMM),
`backend.gemm_widen.widening_pays` (bfloat16 GEMMs of many rows widened to float32, or
oneDNN's bfloat16 GEMM) and `kernels.cpu_gemv.tile_mode` (where the CPU has AVX512-BF16:
the bfloat16 GEMV's tiles, `vdpbf16ps`, FMAs or AMX, which also set up to how many rows a
linear runs the GEMV). The alternatives sum in other orders and precisions, so two ranks
whose probes came out differently (a follower timed while the machine was busy) compute
their shards with different numerics: a tiny Kimi K2 model's logits came out 7.6e-4 apart
from one process's where a follower had taken torch's INT4 GEMM and rank 0 the C kernel,
against 5e-7 with both on the same path (`tests/backend/test_tp_quantised.py`). So when a
CPU group forms, rank 0 resolves each choice (timing it, or as its environment forces it)
and broadcasts them, and every follower sets the matching `EDGESERVE_*` variable before it
loads anything, as a user who forces the choice would. On CUDA none of them applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from backend.distributed.collectives import Collectives

__all__ = ["CHOICES", "agree"]


def _int4_gemv() -> str:
    from kernels.cpu_gemv_int4 import pays

    return "1" if pays() else "0"


def _bf16_widen() -> str:
    from backend.gemm_widen import widening_pays

    return "1" if widening_pays() else "0"


def _gemv_tiles() -> str:
    from kernels import cpu_gemv

    return cpu_gemv.tile_mode() if cpu_gemv.available() else ""


# (variable, rank 0's answer, the answers a follower sets: another answer, e.g. a CPU without AVX512-BF16, whose
# tiles are not a choice, leaves the variable alone)
CHOICES: tuple[tuple[str, Callable[[], str], tuple[str, ...]], ...] = (
    ("EDGESERVE_INT4_GEMV", _int4_gemv, ("0", "1")),
    ("EDGESERVE_BF16_WIDEN", _bf16_widen, ("0", "1")),
    ("EDGESERVE_GEMV_TILES", _gemv_tiles, ("dp", "fma", "amx")))


def agree(coll: Collectives) -> dict[str, str]:
    """Every rank calls this once, right after joining, before loading: rank 0's answers are set in each
    follower's environment (those it can set); returns the variables set (on rank 0: its answers)."""
    codes = torch.full((len(CHOICES),), -1, dtype=torch.int64)
    if coll.is_leader:
        for i, (_, choose, values) in enumerate(CHOICES):
            answer = choose()
            codes[i] = values.index(answer) if answer in values else -1
    coll.broadcast(codes)
    chosen = {name: values[c] for (name, _, values), c in zip(CHOICES, codes.tolist()) if c >= 0}
    if not coll.is_leader:
        os.environ.update(chosen)
    return chosen
