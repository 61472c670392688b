"""Model configuration read from a Hugging Face `config.json`.

Only the fields the Llama-family runtime needs are kept; everything is checked
here once so the model code can trust it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.errors import ModelLoadError, UnsupportedArchitecture

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "load_config"]

# architectures name in config.json -> attention projections carry a bias
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a dense GQA decoder (Llama, Qwen2, SmolLM2)."""

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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate a parsed config.json; unknown architectures name the supported ones."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitecture(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
                architectures=archs,
                supported=sorted(SUPPORTED_ARCHITECTURES),
            )
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
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                quantization=raw.get("quantization_config") or None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad field: {exc}") from exc
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {num_heads} not divisible by "
                                 f"num_key_value_heads {cfg.num_kv_heads}")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"hidden_act {raw.get('hidden_act')!r} unsupported (silu only)")
        return cfg


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
