"""Step rows rounded up for oneDNN's bfloat16 GEMMs, so that a new prompt length does not build new kernels.

Torch runs a bfloat16 GEMM on the CPU through oneDNN, which builds a *primitive* (a JIT-compiled
kernel and its blocking plan) for each exact problem shape, M x K x N, and keeps it in an LRU cache
(1,024 entries by default). A prefill step's M is its token count, which changes with nearly every
prompt, so nearly every prefill step builds one primitive per linear shape: measured on a 2-core Xeon
with AMX (oneDNN 3.12, `ONEDNN_VERBOSE=profile_create`), 1.1-3.1 ms each, ~6 ms a step for SmolLM2's
four shapes, while the four GEMMs of one layer at 300 rows run in ~1.5 ms. A lone prompt of 129-500
tokens took 1.11x as long (median, +9 ms) the first time its length was seen as the second.

So a step whose prompt rows run such a GEMM gets zero rows appended, up to a multiple of
`ROW_GRANULE` prompt rows: the GEMMs then meet at most one M per granule (40 for 640 rows), built
once per process and then found in the cache. A zero row stays zero through the dense layers (RMSNorm
of 0 is 0, a linear of 0 is 0 plus bias, the attention leaves pad rows out and gives them zeros,
SiLU(0) * 0 = 0), and a GEMM's row i depends on its input row i only, so the real rows' values are
what they would be at M rows up to the GEMM's summation order, which oneDNN's blocking may choose by M
(the same freedom any batch composition already has). The price is up to `ROW_GRANULE - 1` rows of
extra GEMM work (~2.5% at 300 rows).

Float32 GEMMs (MKL) and the C GEMVs build nothing per shape and are not padded; nor are steps through
the fused C decoder layers, MLA or MoE layers (whose pad rows would be routed to experts).
"""

from __future__ import annotations

import os

import torch

__all__ = ["ROW_GRANULE", "builds_per_rows", "pad_rows"]

ROW_GRANULE = 16  # an AMX tile's rows; EDGESERVE_GEMM_ROW_GRANULE overrides it (1: no padding)


def builds_per_rows(op: object, rows: int) -> bool:
    """Whether a call of `op` (a `backend.linear.Linear`, or anything else: False) with `rows` rows runs
    torch's bfloat16 CPU GEMM, the one that builds a kernel per M."""
    from backend.linear import Linear

    if not isinstance(op, Linear) or op.weight.dtype != torch.bfloat16 or op.weight.device.type != "cpu":
        return False
    return not op.takes_gemv(rows) and not op.widens(rows)


def pad_rows(prompt_rows: int) -> int:
    """Zero rows to append after `prompt_rows` rows so that they make a multiple of the granule."""
    granule = int(os.environ.get("EDGESERVE_GEMM_ROW_GRANULE", ROW_GRANULE))
    return -prompt_rows % max(1, granule)
