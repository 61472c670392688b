"""`edgeserve kv-budget`: KV bytes per token and the tokens that fit, from a model config alone.

For one GPU of a tensor-parallel group with `free` bytes left for KV pages, per
KV format: bytes per token (all layers), whole pages of `page_size` tokens that
fit (``pages = free // (page_size * bytes_per_token)``), tokens = pages * page_size,
and the capacity against BF16 (the BF16 bytes over this format's bytes).

**MLA models** (DeepseekV3, Kimi K2.x, GlmMoeDsa) cache one row per token per layer,
the normalised latent (R = kv_lora_rank values) and the roped key (Dr =
qk_rope_head_dim values), the same row on every TP rank (the latent has one head,
so tensor parallelism cannot split it):
- ``fp32`` / ``bf16``: (R + Dr) * 4 / * 2 bytes per layer.
- ``fp8_e4m3`` (ours): R e4m3 bytes + one float32 scale per 128 latent values +
  Dr bfloat16 RoPE values: R + 4 * ceil(R / 128) + 2 * Dr (656 B for R 512, Dr 64).
- ``fp8 per-tensor`` (reference only; not a format we store): all R + Dr values
  as e4m3 under one per-layer scale, vLLM's TritonMLA ``fp8`` (576 B per layer).
DSA models (GLM-5) add their lightning indexer's key cache, always FP8:
index_head_dim e4m3 bytes + one float32 scale per token per layer (GLM-5: 132 * 78
= 10,296 B), in every row. Every layer is counted, as the runtime's cache
allocates it, including layers whose `indexer_types` is "shared" (they reuse an
earlier layer's top-k, so a cache that skipped their keys could hold more).

**GQA models** (Llama, Qwen2, GLM-4.x) store K and V per KV head
(`backend.kv_cache.kv_bytes_per_token`; ``fp8_e4m3`` = head_dim + 1 scale byte per
token and head). The KV heads are split over the TP ranks, so a GPU holds
num_kv_heads / tp of them, or one replica when there are fewer heads than ranks.
GLM-4.6 at TP 8: 92 layers * 2 * 1 head * 128 * 2 B = 47,104 B per token per GPU.

**Kimi K2.6 at TP 8 in 46.8 GiB** (the vLLM recipe's "Available KV cache memory:
46.80 GiB"): BF16 rows are 61 * 1,152 = 70,272 B, so 50,251,117,363 B hold
715,094.4 tokens; in 16-token pages that is 44,693 pages = 715,088 tokens. vLLM
logged 715,072 = 11,173 blocks of 64 tokens (its FlashMLA backend pages by 64 on
Hopper): `--page-size 64` reproduces it exactly; both figures are also within the
rounding of the printed "46.80" (+-0.005 GiB = +-76 tokens).

Our FP8 row is 656 B per layer (61 * 656 = 40,016 B per token: ~1.256M tokens),
1.756x BF16, not 2x: the 4 float32 group scales add 16 B and keeping the 64 RoPE
values in BF16 adds 64 B to the 576 e4m3 bytes a per-tensor format needs
(576 B: 35,136 B per token, ~1.43M tokens, exactly 2x). The public write-up's
~686k -> ~1.37M tokens is that per-tensor 2x (on ~45 GiB free). We pay the 14%
because a single per-tensor scale across a whole layer's latent (defaulting to 1.0
without calibration) is what published reports link to FP8-KV accuracy loss on
these models, and quantising the roped key blurs position; per-128-value scales
computed on write need no calibration.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from backend.config import ModelConfig
from backend.errors import InvalidRequest

__all__ = ["BudgetRow", "KVBudget", "kv_budget", "latent_row_bytes", "indexer_bytes_per_token",
           "gqa_kv_heads_per_gpu", "budget_tokens", "format_table", "budget_to_json", "register", "run",
           "GIB", "PER_TENSOR_FP8"]

GIB = 1 << 30
PER_TENSOR_FP8 = "fp8_per_tensor"  # reference row for MLA: every value e4m3, one scale per layer (vLLM's fp8)
_FORMATS = ("fp32", "bf16", "fp8_e4m3")


class BudgetRow(NamedTuple):
    """One KV format's cost and capacity on one GPU."""

    kv_format: str
    kv_bytes: int  # model KV bytes per token over all layers, on one GPU
    indexer_bytes: int  # DSA indexer key cache bytes per token (0 without an indexer)
    bytes_per_token: int  # kv_bytes + indexer_bytes
    pages: int  # whole pages of page_size tokens that fit
    tokens: int  # pages * page_size
    vs_bf16: float  # capacity against BF16: BF16 bytes_per_token / this bytes_per_token
    note: str


class KVBudget(NamedTuple):
    """The report for one model, TP degree, page size and free-memory figure."""

    model: str
    architecture: str
    attention: str  # "MLA", "MLA+DSA" or "GQA"
    tp: int
    page_size: int
    free_bytes: int
    kv_heads_per_gpu: int  # 1 for MLA (one latent row, replicated on every rank)
    rows: tuple[BudgetRow, ...]


def latent_row_bytes(kv_lora_rank: int, rope_dim: int, kv_format: str) -> int:
    """Bytes of one latent row (one token, one layer) in `kv_format`: the stored formats as
    `kernels.latent_kv_store` lays them out, plus the per-tensor FP8 reference (R + Dr)."""
    from kernels.latent_kv_store import latent_row_bytes as stored_row_bytes

    if kv_format == PER_TENSOR_FP8:
        return kv_lora_rank + rope_dim
    return stored_row_bytes(kv_lora_rank, rope_dim, kv_format)


def indexer_bytes_per_token(cfg: ModelConfig) -> int:
    """DSA indexer key cache per token: (index_head_dim e4m3 + a float32 scale) per layer."""
    if not cfg.index_topk:
        return 0
    return cfg.num_layers * (cfg.index_head_dim + 4)


def gqa_kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank stores: num_kv_heads / tp, or one replica when there are fewer heads than ranks."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise InvalidRequest(f"{num_kv_heads} KV heads do not split over tp {tp} ranks")
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise InvalidRequest(f"tp {tp} is not a multiple of the {num_kv_heads} KV heads to replicate")
    return 1


def _fp8_storable(cfg: ModelConfig) -> bool:
    """Whether an fp8_e4m3 latent row exists for these dims (aligned scale and rope views)."""
    return cfg.kv_lora_rank % 4 == 0 and cfg.qk_rope_head_dim % 2 == 0


def _row(fmt: str, kv_bytes: int, indexer: int, free_bytes: int, page_size: int, bf16_bytes: int,
         note: str) -> BudgetRow:
    per_token = kv_bytes + indexer
    pages = free_bytes // (page_size * per_token)
    return BudgetRow(fmt, kv_bytes, indexer, per_token, pages, pages * page_size, bf16_bytes / per_token, note)


def kv_budget(cfg: ModelConfig, free_bytes: int, tp: int = 8, page_size: int = 16, model: str = "") -> KVBudget:
    """Bytes per token per KV format on one GPU of a `tp`-way group, and the tokens `free_bytes` hold."""
    if tp < 1 or page_size < 1 or free_bytes < 1:
        raise InvalidRequest(f"tp ({tp}), page size ({page_size}) and free memory ({free_bytes} B) must be > 0")
    rows: list[BudgetRow] = []
    if cfg.is_mla:
        indexer = indexer_bytes_per_token(cfg)
        attention, heads = ("MLA+DSA" if indexer else "MLA"), 1
        per_layer = {fmt: latent_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, fmt)
                     for fmt in (*_FORMATS, PER_TENSOR_FP8)
                     if fmt != "fp8_e4m3" or _fp8_storable(cfg)}
        bf16 = cfg.num_layers * per_layer["bf16"] + indexer
        notes = {"fp32": "", "bf16": "",
                 "fp8_e4m3": "e4m3 latent + fp32 scale per 128 + bf16 rope",
                 PER_TENSOR_FP8: "reference: all e4m3, one scale per layer (vLLM fp8)"}
        for fmt, row_bytes in per_layer.items():
            rows.append(_row(fmt, cfg.num_layers * row_bytes, indexer, free_bytes, page_size, bf16,
                             f"{row_bytes} B/layer" + (f"; {notes[fmt]}" if notes[fmt] else "")))
    else:
        from backend.kv_cache import kv_bytes_per_token

        attention, heads = "GQA", gqa_kv_heads_per_gpu(cfg.num_kv_heads, tp)
        per_gpu = replace(cfg, num_kv_heads=heads)
        bf16 = kv_bytes_per_token(per_gpu, "bf16")
        for fmt in _FORMATS:
            note = f"{heads} of {cfg.num_kv_heads} KV heads" + ("; 1 scale byte per head" if fmt == "fp8_e4m3"
                                                                 else "")
            rows.append(_row(fmt, kv_bytes_per_token(per_gpu, fmt), 0, free_bytes, page_size, bf16, note))
    return KVBudget(model or cfg.architecture, cfg.architecture, attention, tp, page_size, free_bytes, heads,
                    tuple(rows))


def budget_tokens(budget: KVBudget) -> dict[str, int]:
    """{format: tokens that fit} of a report."""
    return {row.kv_format: row.tokens for row in budget.rows}


def budget_to_json(budget: KVBudget) -> dict[str, Any]:
    """The report as JSON-ready dicts (free memory also in GiB)."""
    head = budget._asdict()
    head["rows"] = [row._asdict() for row in budget.rows]
    head["free_gib"] = budget.free_bytes / GIB
    head["tokens"] = budget_tokens(budget)
    return head


def format_table(budget: KVBudget) -> str:
    """The printed report: one line per format."""
    lines = [f"{budget.model} ({budget.architecture}, {budget.attention}) at TP {budget.tp}: "
             f"{budget.free_bytes / GIB:.2f} GiB free per GPU, pages of {budget.page_size} tokens"]
    if budget.attention.startswith("MLA"):
        lines.append("latent KV rows are replicated on every TP rank")
    header = f"{'format':<15} {'KV B/token':>11} {'indexer':>8} {'total B':>9} {'tokens':>11} {'x bf16':>7}  note"
    lines += [header, "-" * len(header)]
    for r in budget.rows:
        lines.append(f"{r.kv_format:<15} {r.kv_bytes:>11,} {r.indexer_bytes:>8,} {r.bytes_per_token:>9,} "
                     f"{r.tokens:>11,} {r.vs_bf16:>7.3f}  {r.note}")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `edgeserve kv-budget CONFIG_OR_NAME [--free-gib] [--tp] [--page-size] [--json]`."""
    from ops.model_configs import KNOWN_CONFIGS

    parser = subparsers.add_parser(
        "kv-budget", help="KV bytes per token per format and the tokens that fit, from a config alone",
        description="Print, per KV format, the bytes one token's KV takes on one GPU and how many tokens fit "
                    "in the free memory. No model weights are read.")
    parser.add_argument("config", metavar="CONFIG_OR_NAME",
                        help=f"a config.json (or its folder), or one of: {', '.join(KNOWN_CONFIGS)}")
    parser.add_argument("--free-gib", type=float, default=46.8, help="GiB free for KV pages on each GPU")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (GPUs per replica)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the report as JSON here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `kv-budget` command: print the table (and write JSON if asked)."""
    from ops.model_configs import load_model_config

    if not args.free_gib > 0:
        raise InvalidRequest(f"--free-gib must be > 0 (got {args.free_gib})")
    label, cfg = load_model_config(args.config)
    budget = kv_budget(cfg, int(args.free_gib * GIB), tp=args.tp, page_size=args.page_size, model=label)
    print(format_table(budget))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(budget_to_json(budget), indent=2))
        print(f"wrote {path}")
    return 0
