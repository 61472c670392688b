"""Llama-family decoder (Llama, Qwen2, SmolLM2) over a paged KV cache.

Dense GQA attention with RoPE, RMSNorm, SwiGLU MLP, optional tied embeddings and
(Qwen2) q/k/v biases. Compute dtype float32 or bfloat16; RMSNorm runs in float32
and casts back, as the reference does; logits are returned in float32.

For speed at small batch the projections are fused at load time:
q/k/v into one `qkv` matrix [(H + 2 * H_kv) * head_dim, hidden] and gate/up into
one `gate_up` matrix [2 * intermediate, hidden], so one layer is four GEMMs
(`linear.py` dispatches small batches to MKL-packed weights). q/k rows are
reordered for the complex-multiply RoPE (see `rope.py`). Parameters are plain
tensors (no nn.Module) to keep per-step dispatch short.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.attention import StepMetadata, paged_attention
from backend.config import ModelConfig, load_config
from backend.kv_cache import PagedKVCache
from backend.linear import Linear
from backend.rope import RotaryEmbedding, interleave_rope_rows
from backend.weights import CheckpointReader

__all__ = ["LayerWeights", "LlamaModel"]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(H + 2 H_kv) * head_dim, hidden], with the q/k/v biases when the model has them
    o_proj: Linear  # [hidden, H * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class LlamaModel:
    """Weights plus the forward pass of one mixed prefill/decode step."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights], norm: torch.Tensor,
                 lm_head: Linear, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden], shares storage with embed when tied
        self.rope = RotaryEmbedding(cfg, embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._split = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype = torch.float32,
                        gemm_buckets: tuple[int, ...] = (), device: str = "cpu") -> LlamaModel:
        """Load a Hugging Face-format folder (config.json + safetensors).

        gemm_buckets: row counts to pre-pack float32 weights for (see `linear.py`)."""
        cfg = load_config(Path(model_dir))
        ckpt = CheckpointReader(Path(model_dir))

        def get(name: str) -> torch.Tensor:
            return ckpt.get(name).to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_names = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
            rope_rows = (True, True, False)  # q and k rows go to interleaved pairs (see rope.py)

            def fused(suffix: str) -> torch.Tensor:
                parts = [get(f"{n}.{suffix}") for n in qkv_names]
                return torch.cat([interleave_rope_rows(w, h, cfg.head_dim) if r else w
                                  for w, h, r in zip(parts, heads, rope_rows)])

            bias = fused("bias") if cfg.attention_bias and f"{qkv_names[0]}.bias" in ckpt else None
            layers.append(LayerWeights(
                input_norm=get(f"{p}input_layernorm.weight"),
                qkv=Linear(fused("weight"), bias, gemm_buckets),
                o_proj=Linear(get(f"{p}self_attn.o_proj.weight"), None, gemm_buckets),
                post_norm=get(f"{p}post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")]), None,
                               gemm_buckets),
                down=Linear(get(f"{p}mlp.down_proj.weight"), None, gemm_buckets),
            ))
        embed = get("model.embed_tokens.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        lm_head = Linear(embed if tied else get("lm_head.weight"), None, gemm_buckets)
        return cls(cfg, embed, layers, get("model.norm.weight"), lm_head, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights read per decode step (embedding row reads excluded, LM head included)."""
        per_layer = sum(l.input_norm.nbytes + l.post_norm.nbytes + l.qkv.nbytes + l.o_proj.nbytes
                        + l.gate_up.nbytes + l.down.nbytes for l in self.layers)
        return per_layer + self.lm_head.nbytes

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: StepMetadata, cache: PagedKVCache) -> torch.Tensor:
        """Logits [R, vocab] (float32) for rows `meta.logits_rows` of the flat batch input_ids [T]."""
        cfg = self.cfg
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)  # [T, hidden]
        freqs = self.rope.tables(meta.positions)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = _rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)
            qk, v = qkv.split([num_qk_heads * cfg.head_dim, self._split[1]], dim=-1)
            qk = RotaryEmbedding.apply(qk.view(t, num_qk_heads, cfg.head_dim), freqs)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
            cache.store(i, meta.slots, k, v.view(t, cfg.num_kv_heads, cfg.head_dim))
            attn = paged_attention(q, cache, i, meta, self.scale)
            h.add_(layer.o_proj(attn.reshape(t, -1)))
            x = _rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h.add_(layer.down(F.silu(gate).mul_(up)))
        h = _rms_norm(h[meta.logits_rows], self.norm, cfg.rms_norm_eps)
        return self.lm_head(h).float()
