"""Tiny random Llama/Qwen2 checkpoints written by `transformers` (test helper, not a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def write_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialised float32 model of `arch` ("llama" or "qwen2") to `path`."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: randomise them too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def reference_model(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
