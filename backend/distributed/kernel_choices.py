"""The kernel choices each process times for itself, made once by rank 0 and taken by every rank of its group.

Two CPU paths are chosen by timing the alternatives on a probe, once per process:
`kernels.cpu_gemv_int4.pays` (INT4 linears on the C kernel or on torch's INT4 GEMM) and
`backend.gemm_widen.widening_pays` (bfloat16 GEMMs of many rows widened to float32, or
oneDNN's bfloat16 GEMM). The alternatives sum in other orders and precisions, so two
ranks whose probes came out differently (a follower timed while the machine was busy)
compute their shards with different numerics: a tiny Kimi K2 model's logits came out
7.6e-4 apart from one process's where a follower had taken torch's INT4 GEMM and rank 0
the C kernel, against 5e-7 with both on the same path
(`tests/backend/test_tp_quantised.py`). So when a CPU group forms, rank 0 resolves each
choice (timing it, or as its environment forces it) and broadcasts them, and every
follower sets the matching `EDGESERVE_*` variable before it loads anything, as a user
who forces the choice would. On CUDA none of them applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from backend.distributed.collectives import Collectives

__all__ = ["CHOICES", "agree"]


def _int4_gemv() -> bool:
    from kernels.cpu_gemv_int4 import pays

    return pays()


def _bf16_widen() -> bool:
    from backend.gemm_widen import widening_pays

    return widening_pays()


CHOICES: tuple[tuple[str, Callable[[], bool]], ...] = (("EDGESERVE_INT4_GEMV", _int4_gemv),
                                                        ("EDGESERVE_BF16_WIDEN", _bf16_widen))


def agree(coll: Collectives) -> dict[str, str]:
    """Every rank calls this once, right after joining, before loading: rank 0's choices, as the values of their
    variables ("1" or "0"), set in each follower's environment; returns them."""
    flags = torch.zeros(len(CHOICES), dtype=torch.int64)
    if coll.is_leader:
        flags = torch.tensor([int(choose()) for _, choose in CHOICES], dtype=torch.int64)
    coll.broadcast(flags)
    values = {name: str(int(v)) for (name, _), v in zip(CHOICES, flags.tolist())}
    if not coll.is_leader:
        os.environ.update(values)
    return values
