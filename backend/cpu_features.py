"""What this CPU can do, and the compute dtype and KV format `auto` means on it.

A worker's default compute dtype follows the host's vector units, not one machine's
benchmark. The rule, from `edgeserve bench engine` / `bench weights` on the three
hosts this project has measured (2 cores each, SmolLM2-135M):

- **AMX (amx_bf16 + amx_tile)**, e.g. Intel Sapphire Rapids and later: oneDNN runs
  bfloat16 GEMMs on the tile units. A 2048-cube GEMM ran at ~976 GFLOP/s in bfloat16
  against ~182 in float32, and an engine step at 32 running requests took 0.55x the
  float32 step's CPU time (same requests, measured in turn). The weights are half the
  bytes, so the bandwidth-bound step at one request does not get slower. -> bfloat16.
- **AVX-512 BF16 without AMX** (AMD EPYC Zen 4): `vdpbf16ps` multiplies bfloat16 pairs
  into float32 sums, which oneDNN's bfloat16 GEMM uses, and the decode GEMV of
  `kernels/cpu_gemv.py` reads bfloat16 weights at close to the memory's rate. End to end
  (`edgeserve bench e2e`, `edgeserve up` through /v1/chat/completions, 2 cores, SmolLM2)
  bfloat16 ran 1.45x float32 at 1 request (22.7 vs 15.6 tok/s), 2.2x at 8 and 1.8x at 32
  (256 vs 140 tok/s) when first measured (2026-12-02); prefill 462 vs 401 tok/s (`bench weights`).
  With the kernels of 2026-12-07 (the same command) 98.5 vs 53.7 tok/s at 1 request (1.83x), 472.9 vs
  240.7 at 8 (1.96x), 748.5 vs 339.3 at 32 (2.21x). -> bfloat16.
- **AVX2 and FMA, no AVX-512** (AMD Zen 2/3, Intel client cores): no bfloat16 multiplies, and torch's
  bfloat16 GEMM is emulated (~1.2 GFLOP/s for a 512^3 GEMM on a 2-core Zen 3 VM, 16 at SmolLM2's shapes).
  But the decode GEMV has an AVX2 copy (`kernels/cpu/gemv_bf16_avx2.h`: bfloat16 weights widened in
  registers, float32 FMAs) that reads half of float32's bytes, and the prompt's GEMMs of >= 128 rows run
  widened to float32 (`backend/gemm_widen.py`), so bfloat16 weights leave no GEMM on the emulated path.
  float32 has C decode steps of its own there too (`kernels/cpu_gemv_f32.py`, up to 128 rows), and
  `edgeserve bench token-profile --dtype D --concurrency C` (2026-12-05, SmolLM2, two alternating runs, ms a
  decode step) read bfloat16 / float32: 11.6-16.5 / 19.8-21.6 at 1 request, 27.2-28.5 / 30.5-34.5 at 8,
  85.6-91.6 / 89.4-90.2 at 32, 170.5-175.0 / 149.5-152.6 at 64. bfloat16 wins where a step reads its weights
  (one request: half the bytes) and holds KV pages in half the memory; float32 catches up at 32 requests and
  leads at 64. -> bfloat16, where that GEMV builds (`bf16_gemv`; without it every bfloat16 linear would run
  the emulated GEMM -> float32).
- **AVX-512 without BF16 units** (Intel Skylake-SP to Ice Lake): bfloat16 GEMMs are emulated, 55-66 GFLOP/s
  against 246-319 in float32 on a 2-core Ice Lake-SP VM. The decode GEMV has an AVX-512F copy there
  (`kernels/cpu/gemv_bf16_avx512f.h`: 16-lane float32 FMAs on weights widened in registers, 170-190 GFLOP/s at
  32-128 rows) and prompts of >= 128 rows run widened, as on AVX2 hosts. `edgeserve bench engine --quick
  --no-llamacpp` on that VM (2026-12-06, one run each), bfloat16 / float32 tok/s: c = 1 54.2 / 26.5 (2.59x /
  1.51x `transformers` one at a time), c = 8 132.7 / 123.3, c = 32 140.5 / 164.4; the c = 32 round in process,
  alternating, with 512-token mixed steps (`cpu_gemv.AVX512_MIXED_STEP_TOKENS`): bfloat16 1.02-1.17x float32's
  time (7 rounds), its prompt steps the difference (each widens every weight again). Twice the tokens at one
  request, half the KV memory, a few percent behind at 32. -> bfloat16, where that GEMV builds (as on AVX2).
- **No AVX2** (older or non-x86 CPUs). -> float32.
- **CUDA**: bfloat16.

SmolLM2's checkpoint is bfloat16, so bfloat16 weights hold it exactly; what bfloat16
compute changes is the rounding of activations (RMSNorm and the softmax still run in
float32, logits are returned in float32). The KV format `auto` stores pages in the
compute dtype (bf16 pages under bfloat16: half of fp32's memory, no cast per step).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

__all__ = ["cpu_flags", "has_amx_bf16", "has_avx512_bf16", "has_avx2_only", "has_avx2_fma", "auto_dtype",
           "auto_kv_format", "resolve_dtype", "resolve_kv_format"]


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_amx_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU has AMX tiles with bfloat16 multiplies (and the kernel enabled them)."""
    have = set(cpu_flags() if flags is None else flags)
    return {"amx_bf16", "amx_tile"} <= have


def has_avx512_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU has AVX-512's bfloat16 dot product (`vdpbf16ps`)."""
    return "avx512_bf16" in (cpu_flags() if flags is None else set(flags))


def has_avx2_only(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU has AVX2 and FMA but no AVX-512 (the AVX2 copy of the decode GEMV, measured there)."""
    have = set(cpu_flags() if flags is None else flags)
    return {"avx2", "fma"} <= have and "avx512f" not in have


def has_avx2_fma(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU has AVX2 and FMA (with or without AVX-512): the decode GEMV's widening copies build."""
    return {"avx2", "fma"} <= set(cpu_flags() if flags is None else flags)


def auto_dtype(device: str = "cpu", flags: Iterable[str] | None = None, bf16_gemv: bool | None = None) -> str:
    """The compute dtype `--dtype auto` means on `device` (see the module docstring for why). `bf16_gemv`:
    whether the decode GEMV runs here (None: build it and ask, which `EDGESERVE_BF16_GEMV=0` answers no);
    it decides on hosts without bfloat16 units only."""
    if device == "cuda":
        return "bfloat16"
    if has_amx_bf16(flags) or has_avx512_bf16(flags):
        return "bfloat16"
    if has_avx2_fma(flags):
        if bf16_gemv is None:
            from backend.linear import bf16_gemv_available

            bf16_gemv = bf16_gemv_available()
        return "bfloat16" if bf16_gemv else "float32"
    return "float32"


def auto_kv_format(dtype: str) -> str:
    """The KV page format `--kv-format auto` means under compute dtype `dtype`: the dtype itself."""
    return "bf16" if dtype == "bfloat16" else "fp32"


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """`dtype` unless it is 'auto', then this host's choice."""
    return auto_dtype(device) if dtype == "auto" else dtype


def resolve_kv_format(kv_format: str, dtype: str) -> str:
    """`kv_format` unless it is 'auto', then the resolved compute dtype's own format."""
    return auto_kv_format(dtype) if kv_format == "auto" else kv_format
