"""`edgeserve quantize --plan CONFIG --to int4`: a checkpoint's bytes before and after, from its config alone.

**What is counted** (`config_tensors`): every tensor a checkpoint of the config holds,
derived from the config (no weights are read): the embedding and LM head, per layer
its norms, attention (GQA q/k/v/o and their biases; or MLA's q_a/q_b (or q),
kv_a_proj_with_mqa, kv_b_proj, o, and GLM-5's DSA indexer wq_b, wk, k_norm,
weights_proj on its "full" layers), a dense SwiGLU MLP or a MoE block (router
`mlp.gate` [E, H] with its float32 `e_score_correction_bias`, every routed expert,
the shared experts), and the multi-token-prediction (MTP) layers stored as
``model.layers.{num_hidden_layers + j}``: one more MoE decoder layer plus eh_proj
[H, 2H], enorm, hnorm and shared_head.norm. The MTP layer's embedding and head are
taken as the model's: DeepSeek-V3 stores copies there (its 685B parameters are
671B + a 14B MTP module holding its own 0.93B embedding and head), but GLM-5's
figures below fit only without them (with them the FP8 total would be 707.8 GiB).
Tensors fall into the classes of `CLASSES`.

**Bytes per tensor.** Source ``bf16``: 2 B per value (the correction bias 4 B, as
shipped). Source ``fp8`` (the public FP8 checkpoints: GLM-5-FP8, DeepSeek-V3): the
linears of `backend/models/checkpoint_layout.py` (attention, kv_b_proj, the
indexer's wq_b and wk, MLPs, experts) e4m3, 1 B per weight plus a float32
scale_inv per 128 x 128 block; the embedding, LM head, router, norms, the indexer's
weights_proj and eh_proj stay BF16. Target ``int4`` as compressed-tensors
pack-quantized (`backend/compressed_tensors.py`): weight_packed 0.5 B per weight,
weight_scale one bfloat16 per g weights (the scale dtype Kimi's release ships) and
a 16 B weight_shape: 0.5 + 2/g B per weight (0.5625 at g 32); scheme ``edgeserve``
(our `Int4Format`) adds a bfloat16 zero per group: 0.5 + 4/g; ``compressed-tensors-zp``
(`--zero-points`) a 4-bit integer zero point per group, packed along N: 0.5 + 2.5/g. A linear is
converted unless the ignore list (`ops/quantize_ignore.py`) names it; an ignored
linear is written as BF16 (``keep="bf16"``, the default: a pack-quantized
checkpoint holds packed INT4 and plain float weights, so an FP8 linear it leaves
out is dequantised) or as stored (``keep="source"``, FP8 beside INT4, a mixed
checkpoint our reader does not take). MTP layers are converted like the others
(``mtp="quantize"``), copied as stored (``"source"``, what `edgeserve quantize`
does today) or left out (``"drop"``). Embeddings, norms and routers are never
converted.

**Per GPU at tensor parallel N**, as vLLM lays the model out: split 1/N are the
embedding and LM head (vocab-parallel), the per-head projections (MLA q_b_proj or
q_proj, kv_b_proj, o_proj; GQA q/o, and k/v over min(N, KV heads)), the dense
MLPs, the shared experts and the routed experts (each expert's intermediate
split, or whole experts spread by expert parallelism: 1/N of the bytes either
way). Replicated on every GPU: norms, routers, MLA's q_a_proj and
kv_a_proj_with_mqa (`ReplicatedLinear`), the DSA indexer and eh_proj. Scales go
with their weights; each tensor's share is rounded up to a byte.

**GLM-5 against the public write-up** (705 GB FP8 -> 421 GB INT4, ~88 -> ~52 GB
per GPU at TP 8), from ``ops/model_configs.py`` "glm-5" (its config carries no
quantization_config, so the FP8 source is named):
``plan_sizes(cfg, "int4", 32, 8, KIMI_IGNORE, source="fp8")``:

    FP8   751,749,169,152 e4m3 B + 183,540,096 B of scales + 2 x 2,114,950,400 BF16 values
          + 4 x 19,456 float32 = 756,162,687,872 B = 756.16 GB = 704.23 GiB
    INT4  734,439,407,616 routed-expert weights x 0.5625 B + 16 B x 58,368 weight_shapes
          + 19,424,731,392 other values x 2 B + 38,912 B (float32 biases)
          = 451,972,602,368 B = 451.97 GB = 420.93 GiB
    TP 8  96.64 GB = 90.00 GiB -> 60.36 GB = 56.22 GiB per GPU

- Units: the write-up's "GB" are GiB (2^30 B): 704.23 and 420.93 GiB are its 705
  and 421 (756 and 452 decimal GB). Its 705 is 0.1% above ours (`du -h` rounds up;
  the safetensors headers add a few MB).
- What stays unquantised: the 421 is Kimi's layout (preset ``kimi``): only the
  routed experts (97.4% of the 753.86B values, MTP layer included) in INT4;
  attention, the indexer, the shared experts, the first 3 layers' dense MLPs,
  embedding, head and routers in BF16. The default list (attention, shared and
  dense MLPs INT4 as well) gives 429.80 GB = 400.28 GiB.
- Ignored linears are BF16, not FP8: the 17.31B FP8 weights left out of INT4 take
  2 B each instead of 1 (and drop their scales): +17.3 GB (``keep="source"``:
  404.82 GiB).
- Scale dtype: bfloat16 per group of 32 is 0.0625 B per weight, 45.9 GB of the
  experts' 413.12 GB. float32 scales, or our Int4Format's bfloat16 scale and zero,
  double that: 497.87 GB = 463.68 GiB. Group 128: 388.87 GiB.
- The MTP layer: 10.03 GB of the FP8 total, 6.01 GB converted. Copied as FP8 the
  total is 424.67 GiB, dropped 415.33 GiB: the write-up converted it.
- The indexer: 79 layers (78 and the MTP layer, all "full") of wq_b, wk and
  weights_proj, 0.74B values, 1.48 GB in BF16, replicated.
- Per GPU: the write-up's ~88 -> ~52 is the total over 8 (704.23 / 8 = 88.03,
  420.93 / 8 = 52.62 GiB). Each GPU also holds a whole copy of the replicated
  tensors (q_a_proj and kv_a_proj_with_mqa 1.27B values, the indexer 0.74B, routers
  0.12B, eh_proj 0.08B): 2.42 GB as FP8, 4.42 GB in BF16, of which 7/8 is extra on
  each GPU: +2.12 GB and +3.87 GB, hence 90.00 -> 56.22 GiB.

Cross-check on another model: Kimi K2.6's text model (``kimi-k2.6``, source
``bf16``, preset ``kimi``) plans to 594.2 GB, which matches the size reported for
Kimi's own INT4 release of the same architecture (K2-Thinking, ~594 GB).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from backend.config import ModelConfig
from backend.errors import InvalidRequest
from backend.models.checkpoint_layout import checkpoint_layout
from backend.weight_formats import FP8_BLOCK, INT4_GROUP_SIZES
from ops.quantize_ignore import DEFAULT_IGNORE, ignore_matcher, validate_patterns

__all__ = ["CLASSES", "PlannedTensor", "ClassRow", "PlanReport", "config_tensors", "plan_sizes", "format_plan",
           "plan_to_json", "print_plan", "GB", "GIB"]

GB, GIB = 10**9, 2**30
CLASSES = ("embeddings", "lm_head", "attention", "mla_kv_b_indexer", "dense_mlp", "routed_experts",
           "shared_experts", "router", "norms", "other")
SOURCES = ("bf16", "fp8")
TARGETS = ("int4", "fp8")
SCHEMES = ("compressed-tensors", "compressed-tensors-zp", "edgeserve")  # INT4 layouts: pack-quantized (symmetric,
# or with integer zero points: --zero-points) or Int4Format
KEEPS = ("bf16", "source")  # what an ignored linear is written as
MTP_MODES = ("quantize", "source", "drop")


class PlannedTensor(NamedTuple):
    """One tensor a checkpoint of the config holds, known from the config alone."""

    name: str
    cls: str  # one of CLASSES
    shape: tuple[int, ...]
    linear: bool  # a linear weight the target format can take (else: always kept as stored)
    fp8: bool  # stored e4m3 + block scales in the public FP8 checkpoints
    split: int  # ways it is divided at the plan's tensor parallel degree (1: replicated)
    mtp: bool  # part of a multi-token-prediction layer (model.layers.{num_hidden_layers + j})

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ClassRow(NamedTuple):
    """Bytes of one tensor class, whole model and on one GPU."""

    cls: str
    tensors: int
    params: int
    target_params: int  # parameters stored in the target format (the rest kept)
    source_bytes: int
    target_bytes: int
    source_per_gpu: int
    target_per_gpu: int
    tp_rule: str  # "split", "replicated" or "mixed"


class PlanReport(NamedTuple):
    """`plan_sizes`' answer: per-class rows and totals, with every choice that shaped them."""

    model: str
    architecture: str
    source: str  # "bf16" or "fp8"
    target: str  # "int4" or "fp8"
    scheme: str
    group_size: int
    scale_dtype: str  # of the target's INT4 scales
    tp: int
    ignore: tuple[str, ...]
    keep: str
    mtp: str
    rows: tuple[ClassRow, ...]
    mtp_source_bytes: int  # of the totals, what the multi-token-prediction layers take
    mtp_target_bytes: int

    @property
    def source_bytes(self) -> int:
        return sum(r.source_bytes for r in self.rows)

    @property
    def target_bytes(self) -> int:
        return sum(r.target_bytes for r in self.rows)

    @property
    def source_per_gpu(self) -> int:
        return sum(r.source_per_gpu for r in self.rows)

    @property
    def target_per_gpu(self) -> int:
        return sum(r.target_per_gpu for r in self.rows)

    @property
    def params(self) -> int:
        return sum(r.params for r in self.rows)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _attention(cfg: ModelConfig, p: str, tp: int, layer: int) -> Iterator[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, class, split) of one layer's attention tensors."""
    h, a = cfg.hidden_size, f"{p}self_attn."
    if not cfg.is_mla:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kv_split = min(tp, cfg.num_kv_heads)  # replicated once TP exceeds the KV heads
        for n, rows, split in (("q_proj", q, tp), ("k_proj", kv, kv_split), ("v_proj", kv, kv_split)):
            yield f"{a}{n}.weight", (rows, h), "attention", split
            if cfg.attention_bias:
                yield f"{a}{n}.bias", (rows,), "attention", split
        yield f"{a}o_proj.weight", (h, q), "attention", tp
        if cfg.use_qk_norm:
            yield f"{a}q_norm.weight", (cfg.head_dim,), "norms", 1
            yield f"{a}k_norm.weight", (cfg.head_dim,), "norms", 1
        return
    nh, qk = cfg.num_heads, cfg.qk_head_dim
    if cfg.q_lora_rank:
        yield f"{a}q_a_proj.weight", (cfg.q_lora_rank, h), "attention", 1  # replicated in vLLM
        yield f"{a}q_a_layernorm.weight", (cfg.q_lora_rank,), "norms", 1
        yield f"{a}q_b_proj.weight", (nh * qk, cfg.q_lora_rank), "attention", tp
    else:
        yield f"{a}q_proj.weight", (nh * qk, h), "attention", tp
    yield f"{a}kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), "attention", 1
    yield f"{a}kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norms", 1
    yield f"{a}kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), \
        "mla_kv_b_indexer", tp
    yield f"{a}o_proj.weight", (h, nh * cfg.v_head_dim), "attention", tp
    if cfg.index_topk and (layer >= cfg.num_layers or cfg.indexer_types[layer] == "full"):
        x, d = f"{a}indexer.", cfg.index_head_dim  # replicated on every GPU in vLLM
        yield f"{x}wq_b.weight", (cfg.index_n_heads * d, cfg.q_lora_rank or h), "mla_kv_b_indexer", 1
        yield f"{x}wk.weight", (d, h), "mla_kv_b_indexer", 1
        yield f"{x}k_norm.weight", (d,), "norms", 1
        yield f"{x}k_norm.bias", (d,), "norms", 1
        yield f"{x}weights_proj.weight", (cfg.index_n_heads, h), "mla_kv_b_indexer", 1


def _mlp(cfg: ModelConfig, p: str, tp: int, layer: int) -> Iterator[tuple[str, tuple[int, ...], str, int]]:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        i = cfg.intermediate_size
        yield from ((f"{p}mlp.{n}_proj.weight", s, "dense_mlp", tp) for n, s in
                    (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))))
        return
    i, e = cfg.moe_intermediate_size, cfg.num_experts
    yield f"{p}mlp.gate.weight", (e, h), "router", 1
    yield f"{p}mlp.gate.e_score_correction_bias", (e,), "router", 1
    for j in range(e):  # split over TP (or spread by expert parallelism): 1/tp per GPU either way
        x = f"{p}mlp.experts.{j}."
        yield from ((f"{x}{n}_proj.weight", s, "routed_experts", tp) for n, s in
                    (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))))
    if cfg.n_shared_experts:
        i *= cfg.n_shared_experts
        yield from ((f"{p}mlp.shared_experts.{n}_proj.weight", s, "shared_experts", tp) for n, s in
                    (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))))


def config_tensors(cfg: ModelConfig, tp: int = 8) -> list[PlannedTensor]:
    """Every tensor of `cfg`'s checkpoint (MTP layers included), with its class and TP split."""
    linears = set(checkpoint_layout(cfg).linears)
    kinds = {m.split(".", 3)[3] for m in linears if m.startswith("model.layers.")}  # "mlp.experts.0.up_proj", ...
    h, v = cfg.hidden_size, cfg.vocab_size
    raw: list[tuple[str, tuple[int, ...], str, int]] = [("model.embed_tokens.weight", (v, h), "embeddings", tp)]
    n_mtp = cfg.num_nextn_predict_layers
    for layer in range(cfg.num_layers + n_mtp):
        p = f"model.layers.{layer}."
        raw += [(f"{p}input_layernorm.weight", (h,), "norms", 1),
                (f"{p}post_attention_layernorm.weight", (h,), "norms", 1)]
        raw += _attention(cfg, p, tp, layer)
        raw += _mlp(cfg, p, tp, layer)
        if layer >= cfg.num_layers:  # DeepSeek-style MTP block; embedding and head shared with the model
            raw += [(f"{p}eh_proj.weight", (h, 2 * h), "other", 1), (f"{p}enorm.weight", (h,), "norms", 1),
                    (f"{p}hnorm.weight", (h,), "norms", 1), (f"{p}shared_head.norm.weight", (h,), "norms", 1)]
    raw.append(("model.norm.weight", (h,), "norms", 1))
    if not cfg.tie_word_embeddings:
        raw.append(("lm_head.weight", (v, h), "lm_head", tp))
    out = []
    for name, shape, cls, split in raw:
        module = name.rsplit(".", 1)[0]
        mtp = name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers
        in_layout = module in linears or (mtp and module.split(".", 3)[3] in kinds)
        linear = name.endswith(".weight") and (in_layout or module == "lm_head" or module.endswith("eh_proj"))
        out.append(PlannedTensor(name, cls, shape, linear, linear and in_layout, split, mtp))
    return out


def _fp8_bytes(shape: tuple[int, ...]) -> int:
    n, k = shape
    return n * k + 4 * _ceil(n, FP8_BLOCK) * _ceil(k, FP8_BLOCK)  # e4m3 + float32 scale_inv per 128x128


def _int4_bytes(shape: tuple[int, ...], group: int, scheme: str) -> int:
    n, k = shape
    if scheme.startswith("compressed-tensors"):  # weight_packed int32 [N, K/8], weight_scale bf16 [N, K/g], shape
        zero_points = 4 * _ceil(n, 8) * (k // group) if scheme.endswith("-zp") else 0  # int32 [N/8, K/g]
        return 4 * n * _ceil(k, 8) + 2 * n * (k // group) + 16 + zero_points
    return n * k // 2 + 2 * 2 * n * _ceil(k, group)  # qweight, bf16 scales and zeros


def _dense_bytes(t: PlannedTensor) -> int:
    return t.numel * (4 if t.name.endswith("e_score_correction_bias") else 2)  # kept float32, as shipped


def plan_sizes(cfg: ModelConfig, to: str = "int4", group_size: int = 32, tp: int = 8,
               ignore: Sequence[str] = DEFAULT_IGNORE, *, source: str | None = None,
               scheme: str = "compressed-tensors", keep: str = "bf16", mtp: str = "quantize",
               model: str = "") -> PlanReport:
    """Bytes per tensor class of `cfg`'s checkpoint in its source format and after `edgeserve quantize
    --to <to>`, whole and per GPU at tensor parallel `tp`, from the config alone (module docstring).

    source: "bf16" or "fp8" (default: what cfg.quantization says). scheme: the INT4 layout,
    "compressed-tensors" (pack-quantized, bf16 scales) or "edgeserve" (Int4Format: bf16 scales and
    zeros). keep: an ignored linear written as "bf16" (what a pack-quantized checkpoint holds) or as
    its "source" format. mtp: MTP layers "quantize"d like the others, copied as "source", or "drop"ped."""
    qc = cfg.quantization or {}
    if source is None:
        source = {None: "bf16", "fp8": "fp8"}.get(qc.get("quant_method"), "")
        if not source:
            raise InvalidRequest(f"the config's weights are stored as {qc.get('quant_method')!r}; plan from the "
                                 f"original: source 'bf16' or 'fp8'", quant_method=qc.get("quant_method"))
    for value, allowed, what in ((source, SOURCES, "source"), (to, TARGETS, "target"), (scheme, SCHEMES, "scheme"),
                                 (keep, KEEPS, "keep"), (mtp, MTP_MODES, "mtp")):
        if value not in allowed:
            raise InvalidRequest(f"unknown {what} {value!r}; known: {', '.join(allowed)}", **{what: value})
    if to == source:
        raise InvalidRequest(f"the source is already {source}; nothing to convert")
    if to == "int4" and group_size not in INT4_GROUP_SIZES:
        raise InvalidRequest(f"INT4 group size {group_size} is not supported; choose one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}", group_size=group_size)
    if tp < 1:
        raise InvalidRequest(f"tensor parallel degree must be >= 1, got {tp}")
    ignore = validate_patterns(ignore)
    ignored = ignore_matcher(ignore, cfg.checkpoint_prefix)
    tensors = config_tensors(cfg, tp)
    acc: dict[str, list[int]] = {c: [0] * 7 for c in CLASSES}
    splits: dict[str, set[bool]] = {c: set() for c in CLASSES}
    mtp_src = mtp_tgt = 0
    for t in tensors:
        src = _fp8_bytes(t.shape) if source == "fp8" and t.fp8 else _dense_bytes(t)
        converted = t.linear and not (t.mtp and mtp != "quantize") and not ignored(t.name.rsplit(".", 1)[0])
        if converted and to == "int4":
            if t.shape[1] % group_size and scheme.startswith("compressed-tensors"):
                raise InvalidRequest(f"{t.name}: in_features {t.shape[1]} is not a multiple of the group size "
                                     f"{group_size}; add it to the ignore list or choose another group size",
                                     tensor=t.name)
            tgt = _int4_bytes(t.shape, group_size, scheme)
        elif converted:
            tgt = _fp8_bytes(t.shape)
        elif t.mtp and mtp == "drop":
            tgt = 0
        else:
            tgt = src if keep == "source" or not t.linear or (t.mtp and mtp == "source") else _dense_bytes(t)
        row = acc[t.cls]
        for i, value in enumerate((1, t.numel, t.numel if converted else 0, src, tgt,
                                   _ceil(src, t.split), _ceil(tgt, t.split))):
            row[i] += value
        splits[t.cls].add(t.split > 1)
        if t.mtp:
            mtp_src, mtp_tgt = mtp_src + src, mtp_tgt + tgt
    rows = tuple(ClassRow(c, *acc[c], {frozenset({True}): "split", frozenset({False}): "replicated"}.get(
        frozenset(splits[c]), "mixed")) for c in CLASSES if acc[c][0])
    return PlanReport(model or cfg.architecture, cfg.architecture, source, to, scheme if to == "int4" else "fp8",
                      group_size if to == "int4" else FP8_BLOCK, "bfloat16" if to == "int4" else "float32", tp,
                      ignore, keep, mtp, rows, mtp_src, mtp_tgt)


def _size(n: int) -> str:
    return f"{n / GB:,.2f}"


def format_plan(report: PlanReport) -> str:
    """The printed plan: one line per tensor class, then totals in GB (10^9 B) and GiB (2^30 B)."""
    r = report
    tgt = (f"INT4 g{r.group_size} ({r.scheme}; {r.scale_dtype} scales)" if r.target == "int4"
           else "FP8 e4m3 (float32 scale per 128x128)")
    src = "FP8 e4m3 (float32 scale_inv per 128x128)" if r.source == "fp8" else "BF16"
    lines = [f"{r.model} ({r.architecture}): {src} -> {tgt}; ignored linears kept as {r.keep}, MTP layers: {r.mtp}",
             f"ignore: {', '.join(r.ignore) or '(none)'}"]
    head = (f"{'class':<17} {'tensors':>8} {'params (B)':>11} {'% target':>8} {'source GB':>10} {'target GB':>10} "
            f"{'src/GPU GB':>10} {'tgt/GPU GB':>10}  TP {r.tp}")
    lines += [head, "-" * len(head)]
    for c in r.rows:
        pct = 100 * c.target_params / c.params if c.params else 0.0
        lines.append(f"{c.cls:<17} {c.tensors:>8,} {c.params / 1e9:>11.3f} {pct:>7.1f}% {_size(c.source_bytes):>10} "
                     f"{_size(c.target_bytes):>10} {_size(c.source_per_gpu):>10} {_size(c.target_per_gpu):>10}  "
                     f"{c.tp_rule}")
    lines.append("-" * len(head))
    lines.append(f"{'total':<17} {sum(c.tensors for c in r.rows):>8,} {r.params / 1e9:>11.3f} {'':>8} "
                 f"{_size(r.source_bytes):>10} {_size(r.target_bytes):>10} {_size(r.source_per_gpu):>10} "
                 f"{_size(r.target_per_gpu):>10}")
    lines.append(f"{'total (GiB)':<17} {'':>8} {'':>11} {'':>8} {r.source_bytes / GIB:>10,.2f} "
                 f"{r.target_bytes / GIB:>10,.2f} {r.source_per_gpu / GIB:>10,.2f} {r.target_per_gpu / GIB:>10,.2f}")
    if r.mtp_source_bytes:
        lines.append(f"of which MTP layers: {_size(r.mtp_source_bytes)} -> {_size(r.mtp_target_bytes)} GB")
    lines.append(f"ratio {r.target_bytes / r.source_bytes:.3f}")
    return "\n".join(lines)


def plan_to_json(report: PlanReport) -> dict[str, Any]:
    """The plan as JSON-ready dicts, with its totals in bytes, GB and GiB."""
    out = {**report._asdict(), "ignore": list(report.ignore), "rows": [row._asdict() for row in report.rows],
           "params": report.params}
    for key in ("source_bytes", "target_bytes", "source_per_gpu", "target_per_gpu"):
        value = getattr(report, key)
        out[key], out[f"{key}_gb"], out[f"{key}_gib"] = value, value / GB, value / GIB
    return out


def print_plan(config: str | Path, to: str = "int4", group_size: int = 32, tp: int = 8,
               ignore: Sequence[str] = DEFAULT_IGNORE, json_path: str | Path | None = None,
               **options: str) -> PlanReport:
    """`edgeserve quantize --plan CONFIG`: plan a config.json path (or folder, or a known model name
    of `ops/model_configs.py`), print `format_plan`, and write `plan_to_json` to `json_path` if given.
    `options` go to `plan_sizes` (source, scheme, keep, mtp)."""
    from ops.model_configs import load_model_config

    label, cfg = load_model_config(config)
    report = plan_sizes(cfg, to, group_size, tp, ignore, model=label, **options)
    print(format_plan(report))
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan_to_json(report), indent=2) + "\n")
        print(f"wrote {path}")
    return report
