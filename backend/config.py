"""Model configuration read from a Hugging Face `config.json`.

One flat config for every registered architecture (`backend/models/`): the dense
GQA decoder fields, plus partial rotary and per-head q/k norm (Glm4Moe), the
mixture-of-experts fields (zero / off for dense models), the multi-head latent
attention fields (DeepseekV3, Kimi K2.x, GlmMoeDsa; `kv_lora_rank` 0 = not MLA) and
the DeepSeek sparse attention indexer fields (GlmMoeDsa; `index_topk` 0 = no indexer).

MLA models follow transformers: `head_dim` is `qk_rope_head_dim` (the RoPE table is
sized from it), `num_kv_heads` is `num_heads` (unused: the latent KV has one head),
and the softmax scale is `qk_head_dim ** -0.5`, times yarn_mscale(factor,
mscale_all_dim) squared when `rope_scaling` is not default (`mla_softmax_scale`).
Kimi K2.5/K2.6 (`Kimi_K25ForConditionalGeneration`) wrap a DeepseekV3 text config in
`text_config`; it is read from there, its `quantization_config` looked for at both
levels, and `checkpoint_prefix` says its weights live under `language_model.`. Only the fields the
runtime needs are kept; everything is checked here once so the model code can
trust it. A field config.json omits takes the default of the family's own
Hugging Face config class (the registry's `config_defaults`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError, UnsupportedArchitecture
from backend.models import ARCHITECTURES

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "load_config"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))  # config.json `architectures[0]`


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder (Llama, Qwen2, SmolLM2, Glm4Moe; MLA: DeepseekV3, Kimi K2.x, GlmMoeDsa)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization: dict[str, Any] | None = None  # config.json's quantization_config (see weight_formats.py)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of a head only
    use_qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    # mixture of experts (num_experts 0: every layer is a dense SwiGLU MLP of intermediate_size)
    num_experts: int = 0  # routed experts per MoE layer (n_routed_experts)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # per routed expert; the shared MLP has this times n_shared_experts
    n_shared_experts: int = 0
    n_group: int = 1  # expert groups; the top `topk_group` groups are kept before the top-k
    topk_group: int = 1
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0  # layers below this index use the dense MLP
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last layer (not run)
    # multi-head latent attention (kv_lora_rank 0: GQA)
    q_lora_rank: int | None = None  # None: a plain q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int = 0  # latent width R; the KV cache holds [latent R | roped key qk_rope_head_dim] per token
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # MLA RoPE pairs (x0,x1),(x2,x3)... as stored; False: halves (NeoX)
    # DeepSeek sparse attention (GlmMoeDsa; index_topk 0: dense attention)
    index_topk: int = 0  # keys each query attends to, chosen by the lightning indexer
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer: "full" (computes its top-k) or "shared" (reuses the last)
    indexer_rope_interleave: bool = True
    checkpoint_prefix: str = ""  # prepended to every tensor name ("language_model." for Kimi K2.5/K2.6)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; as transformers, int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Query/key width of one MLA head (nope + rope)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent KV cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under a non-default rope_scaling."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling or {}
        if str(scaling.get("rope_type") or scaling.get("type") or "default") != "default":
            factor, m_all = float(scaling.get("factor") or 1.0), scaling.get("mscale_all_dim")
            if m_all and factor > 1:
                mscale = 0.1 * float(m_all) * math.log(factor) + 1.0
                scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate a parsed config.json; an unknown `architectures[0]` names the supported ones."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"unsupported architecture {arch or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                architectures=archs,
                supported=list(SUPPORTED_ARCHITECTURES),
            )
        prefix = ""
        if isinstance(raw.get("text_config"), dict):  # Kimi K2.5/K2.6: a DeepseekV3 text backbone
            text = raw["text_config"]
            quant = raw.get("quantization_config") or text.get("quantization_config")
            raw = {**text, "architectures": archs, "quantization_config": quant,
                   "eos_token_id": text.get("eos_token_id", raw.get("eos_token_id")),
                   "bos_token_id": text.get("bos_token_id", raw.get("bos_token_id"))}
            prefix = "language_model."
        explicit_no_q_lora = "q_lora_rank" in raw and raw["q_lora_rank"] is None
        raw = {**ARCHITECTURES[arch].config_defaults, **{k: v for k, v in raw.items() if v is not None}}
        if explicit_no_q_lora:
            raw["q_lora_rank"] = None
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            rope_params = raw.get("rope_parameters") or {}
            rope_theta = raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
            rope_scaling = raw.get("rope_scaling")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            kv_lora_rank = int(raw.get("kv_lora_rank") or 0)
            num_layers = int(raw["num_hidden_layers"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=num_heads if kv_lora_rank else int(raw.get("num_key_value_heads") or num_heads),
                head_dim=(int(raw["qk_rope_head_dim"]) if kv_lora_rank
                          else int(raw.get("head_dim") or hidden // num_heads)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                quantization=raw.get("quantization_config") or None,
                partial_rotary_factor=float(rope_params.get("partial_rotary_factor")
                                            or raw.get("partial_rotary_factor") or 1.0),
                use_qk_norm=bool(raw.get("use_qk_norm", False)),
                num_experts=int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                n_shared_experts=int(raw.get("n_shared_experts") or 0),
                n_group=int(raw.get("n_group") or 1),
                topk_group=int(raw.get("topk_group") or 1),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0),
                q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") is not None else None,
                kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=int(raw.get("qk_nope_head_dim") or 0),
                qk_rope_head_dim=int(raw.get("qk_rope_head_dim") or 0),
                v_head_dim=int(raw.get("v_head_dim") or 0),
                rope_interleave=bool(raw.get("rope_interleave", True)),
                index_topk=int(raw.get("index_topk") or 0),
                index_head_dim=int(raw.get("index_head_dim") or 0),
                index_n_heads=int(raw.get("index_n_heads") or 0),
                indexer_types=_indexer_types(raw, num_layers) if raw.get("index_topk") else (),
                indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", True)),
                checkpoint_prefix=prefix,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {num_heads} not divisible by "
                                 f"num_key_value_heads {cfg.num_kv_heads}")
        if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
            raise ModelLoadError(f"partial_rotary_factor {cfg.partial_rotary_factor} gives a rotary dim of "
                                 f"{cfg.rotary_dim} for head_dim {cfg.head_dim} (must be even, 2..head_dim)")
        if cfg.num_experts and (cfg.num_experts % cfg.n_group or cfg.topk_group > cfg.n_group
                                or not 0 < cfg.num_experts_per_tok <= cfg.num_experts):
            raise ModelLoadError(f"bad MoE routing: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, "
                                 f"n_group {cfg.n_group}, topk_group {cfg.topk_group}")
        if cfg.is_mla and not (cfg.qk_nope_head_dim > 0 and cfg.qk_rope_head_dim % 2 == 0 < cfg.qk_rope_head_dim
                               and cfg.v_head_dim > 0):
            raise ModelLoadError(f"bad MLA dims: qk_nope_head_dim {cfg.qk_nope_head_dim}, qk_rope_head_dim "
                                 f"{cfg.qk_rope_head_dim} (even), v_head_dim {cfg.v_head_dim}")
        if cfg.index_topk and (len(cfg.indexer_types) != cfg.num_layers or cfg.indexer_types[0] != "full"
                               or set(cfg.indexer_types) - {"full", "shared"}):
            raise ModelLoadError(f"indexer_types must give 'full' or 'shared' per layer, the first 'full': "
                                 f"{list(cfg.indexer_types)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"hidden_act {raw.get('hidden_act')!r} unsupported (silu only)")
        return cfg


def _indexer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """GlmMoeDsa's per-layer indexer mode, as its transformers config derives it: `indexer_types`,
    else the `index_topk_pattern` letters (F full, S shared), else `index_topk_freq` /
    `index_skip_topk_offset` (defaults 1 / 2: every layer full)."""
    if raw.get("indexer_types"):
        return tuple(str(t) for t in raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def load_config(model_dir: Path) -> ModelConfig:
    """Read and validate `model_dir/config.json`."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"no config.json in {model_dir}", path=str(path)) from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path=str(path)) from exc
    return ModelConfig.from_dict(raw)
