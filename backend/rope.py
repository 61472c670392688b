"""Rotary position embeddings (RoPE) with the common scaling kinds, full or partial.

Checkpoints use the "rotate half" (NeoX) convention (Hugging Face Llama): for a
head vector x whose first R dims rotate (R = D, the head size, except with a
`partial_rotary_factor`: R = int(D * factor), Glm4Moe's 0.5), dimension i < R/2 is
rotated together with dimension i + R/2, and dims R..D-1 pass through unchanged:
    (x_i, x_{i+R/2}) -> (x_i cos - x_{i+R/2} sin, x_{i+R/2} cos + x_i sin),  angle p * f_i.
At load time the q/k projection rows of every head are reordered into
interleaved pairs (i, i + R/2) -> (2i, 2i+1) over its first R rows, the others
staying where they are (`interleave_rope_rows`), so the rotation is one complex
multiply per head: view the first R dims as complex pairs and multiply by
exp(i p f). q.k is unchanged by the reordering because q and k are reordered
alike (a per-head q/k RMSNorm weight is reordered with them; the norm itself does
not care about order); **K pages therefore hold keys in the interleaved layout**.
The frequencies f_i = theta^(-2i/R) are rescaled by the config's `rope_scaling`
(or `rope_parameters`) kind:

- ``default``: unchanged.
- ``linear``: f / factor (position interpolation).
- ``dynamic``: NTK-aware; the base only grows past `max_position_embeddings`,
  which our context limit never exceeds, so inside it this equals ``default``.
- ``llama3``: low frequencies / factor, high unchanged, a smooth ramp between.
- ``yarn``: per-dimension blend of interpolated and extrapolated frequencies,
  and cos/sin multiplied by an attention factor (0.1 ln(factor) + 1 by default).

exp(i p f) (times the attention factor) is computed once in float32 for every
position up to the context limit; the rotation runs in float32. Bfloat16 heads on
the CPU are rotated in one C pass with the same arithmetic (`kernels/cpu_rope.py`:
29 -> 10 us a layer at 32 tokens of SmolLM2), the torch ops elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backend.config import ModelConfig
from backend.errors import UnsupportedArchitecture
from kernels.cpu_rope import rope_bf16

__all__ = ["SUPPORTED_ROPE_TYPES", "rope_inv_freq", "interleave_rope_rows", "RotaryEmbedding"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (float32) and the cos/sin attention factor."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    scaling = cfg.rope_scaling or {}
    kind = _rope_type(scaling)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, scaling, dim, base)
    raise UnsupportedArchitecture(f"rope scaling {kind!r} unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn(cfg: ModelConfig, scaling: dict[str, Any], dim: int, base: float) -> tuple[torch.Tensor, float]:
    original_max = float(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else cfg.max_position_embeddings / original_max

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def interleave_rope_rows(weight: torch.Tensor, num_heads: int, head_dim: int,
                         rotary_dim: int | None = None) -> torch.Tensor:
    """Reorder q/k projection rows (or biases, or a per-head norm weight with num_heads 1) of each
    head: its first `rotary_dim` (default: all) rows from halves to interleaved pairs, the rest kept."""
    rot = rotary_dim or head_dim
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, head_dim, *rest)
    pairs = w[:, :rot].reshape(num_heads, 2, rot // 2, *rest).transpose(1, 2).reshape(num_heads, rot, *rest)
    return torch.cat([pairs, w[:, rot:]], dim=1).reshape(num_heads * head_dim, *rest).contiguous()


class RotaryEmbedding:
    """Precomputed exp(i p f) for every position; `apply` rotates interleaved-pair heads."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        inv_freq, attention_factor = rope_inv_freq(cfg)
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_pos, rotary_dim/2]
        self.freqs = torch.polar(torch.full_like(angles, attention_factor), angles).to(device)  # complex64

    def tables(self, positions: torch.Tensor) -> torch.Tensor:
        """exp(i p f) for the given positions, [T, 1, rotary_dim/2] to broadcast over heads."""
        return self.freqs[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (interleaved pairs over its first rotary_dim dims) by a
        per-token `tables` output; dims past rotary_dim pass through."""
        t, heads, dim = x.shape
        rot = 2 * freqs.shape[-1]
        if x.dtype == torch.bfloat16 and not x.is_cuda:  # one C pass on the CPU (kernels/cpu_rope.py)
            y = rope_bf16(x, freqs)
            if y is not None:
                return y
        if rot < dim:
            return torch.cat([RotaryEmbedding.apply(x[..., :rot], freqs), x[..., rot:]], dim=-1)
        pairs = torch.view_as_complex(x.float().reshape(t, heads, dim // 2, 2))
        return torch.view_as_real(pairs * freqs).reshape(t, heads, dim).to(x.dtype)
