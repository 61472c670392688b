"""Tiny random Llama/Qwen2/Glm4Moe checkpoints written by `transformers` (test helper, not a test)."""

from __future__ import annotations

from collections.abc import Callable
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


GLM4_MOE_TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=1.5, use_qk_norm=False, attention_bias=False, max_position_embeddings=512,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=0)


def write_tiny_glm4_moe(path: Path, seed: int = 0, partial_rotary_factor: float = 0.5, mtp_layers: int = 0,
                        **overrides: Any) -> Path:
    """Save a random float32 `Glm4MoeForCausalLM` (hidden 64, 8 experts; `GLM4_MOE_TINY` with
    `overrides`) to `path`. Weights are scaled up from transformers' 0.02 init so the router's
    choices are decisive and the experts matter; the correction bias is small and positive.
    `mtp_layers` appends that many random layers' tensors as `model.layers.{num_hidden_layers + j}.*`
    (how real checkpoints store multi-token prediction), which the reference ignores."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    kwargs = {**GLM4_MOE_TINY, **overrides}
    cfg = transformers.Glm4MoeConfig(**kwargs)
    cfg.rope_parameters = {**(cfg.rope_parameters or {}), "partial_rotary_factor": partial_rotary_factor}
    model = transformers.Glm4MoeForCausalLM(cfg)
    make_decisive(model)
    model.eval().save_pretrained(path, safe_serialization=True)
    if mtp_layers:
        f = next(Path(path).glob("*.safetensors"))
        tensors = load_file(f)
        last = f"model.layers.{kwargs['num_hidden_layers'] - 1}."
        for j in range(mtp_layers):
            extra = f"model.layers.{kwargs['num_hidden_layers'] + j}."
            tensors.update({extra + k[len(last):]: torch.randn_like(v) for k, v in tensors.items()
                            if k.startswith(last)})
            tensors[extra + "eh_proj.weight"] = torch.randn(kwargs["hidden_size"], 2 * kwargs["hidden_size"])
        save_file(tensors, f, metadata={"format": "pt"})
    return path


def reference_model(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def make_decisive(model: Any, attention_std: float | None = None) -> None:
    """Scale a random MoE model up from transformers' 0.02 init, in place: norms and biases jittered,
    the router's weights wide (its choices decisive), experts and MLPs at std 0.15, attention at
    `attention_std` when given (MLA models), the correction bias small and positive (so the masked
    fill of the group router never matters)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name or "mlp" in name:
                p.normal_(0.0, 0.15)
            elif attention_std is not None and "self_attn" in name:
                p.normal_(0.0, attention_std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.05)


def to_fp8_block_checkpoint(path: Path, ref_dir: Path, quantised: Callable[[str], bool] | None = None,
                            block: int = 16) -> None:
    """Rewrite the model folder `path` as a DeepSeek-style FP8 block-scaled checkpoint, in place:
    every tensor `quantised(name)` picks (default: each layer's `*_proj.weight`) becomes e4m3 with
    `block` x `block` `weight_scale_inv` scales (weights x3 first, so scales are not all 1), and
    `quantization_config` says so. `ref_dir` gets a dense copy holding exactly the dequantised
    values (the reference a dense implementation must match)."""
    import json

    from safetensors.torch import load_file, save_file

    from backend.weight_formats import Fp8Format

    if quantised is None:
        def quantised(name: str) -> bool:
            return name.startswith("model.layers.") and name.endswith("_proj.weight")
    fmt = Fp8Format((block, block))
    f = next(Path(path).glob("*.safetensors"))
    fp8, dense = {}, {}
    for name, w in load_file(f).items():
        if quantised(name):
            sw = fmt.quantize(w * 3.0)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = (sw.tensors["weight"],
                                                                           sw.tensors["weight_scale_inv"])
            dense[name] = fmt.dequantize(sw)
        else:
            fp8[name] = dense[name] = w
    save_file(fp8, f, metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    Path(ref_dir).mkdir(parents=True)
    (Path(ref_dir) / "config.json").write_text(json.dumps(cfg))
    save_file(dense, Path(ref_dir) / "model.safetensors", metadata={"format": "pt"})
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
