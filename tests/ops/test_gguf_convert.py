"""GGUF -> Hugging Face conversion: weights, RoPE un-permutation, config, tokenizer files.

Two references:
- a tiny random Llama written to GGUF here the way llama.cpp writes one (Q/K rows
  permuted), converted back and compared with the original (no network, any head layout);
- the real SmolLM2 GGUF loaded by transformers' own GGUF loader (dequantise + its
  `reverse_permute_weights`), compared with our converted folder.

Tolerance for the real model: our folder stores BF16, transformers keeps the dequantised
float32. Every weight must equal the reference rounded to BF16 exactly; logits (float32
compute, magnitudes ~40) must agree on the argmax at every position and within 1.0 max
abs (measured ~0.3). Swapping the Q/K row order instead moves logits by ~33 max / ~6.7
mean and flips half the argmaxes, which the last test checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from backend.errors import UnsupportedArchitecture
from ops.gguf_convert import convert_gguf, unpermute_rope_rows
from ops.pull import gguf_path

LOGIT_MAX_ABS = 1.0
TINY_ROPE_THETA = 50000.0  # not the default, so a lost rope_theta shows in the logits
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's convert_hf_to_gguf.py applies to Q and K."""
    w = weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize(("n_heads", "head_dim"), [(9, 64), (3, 64), (4, 16), (1, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads: int, head_dim: int) -> None:
    w = np.random.default_rng().standard_normal((n_heads * head_dim, 24)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w)


# --- a tiny random Llama round trip ---------------------------------------------------------


def _write_tiny_gguf(path: Path, model: Any, *, arch: str = "llama") -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(TINY_ROPE_THETA)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens = ["<|endoftext|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "he"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for hf_name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        elif hf_name == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            name = f"blk.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        if name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if name.endswith("ffn_up.weight"):  # one half-precision tensor, as GGUFs often have
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, rope_theta=TINY_ROPE_THETA, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so a misplaced norm shows
            p.copy_((torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0)).to(torch.float16).float())
    return model


def test_tiny_llama_round_trip(tmp_path: Path, tiny_llama: Any) -> None:
    from transformers import LlamaForCausalLM

    _write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama)
    out = tmp_path / "hf"
    convert_gguf(tmp_path / "tiny.gguf", out, progress=False)

    ours = load_file(out / "model.safetensors")
    expected = tiny_llama.state_dict()
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-6, TINY_ROPE_THETA)

    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = type(tiny_llama)(tiny_llama.config).eval()
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in expected.items()})
    ids = torch.randint(0, 259, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("hehe<|im_end|>").ids == [258, 258, 1]
    assert tok.encode("x 42").tokens == ["x", "Ġ", "4", "2"]  # smollm: every digit alone


def test_unsupported_architecture_is_refused(tmp_path: Path, tiny_llama: Any) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, arch="gptneox")
    with pytest.raises(UnsupportedArchitecture, match="gptneox"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)


# --- the real SmolLM2 GGUF against transformers' GGUF loader --------------------------------


@pytest.fixture(scope="module")
def reference_model(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    source = gguf_path("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_model(smollm2_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[torch.Tensor]:
    tok = HFTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [torch.tensor([tok.encode(p).ids]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_logits(reference_model: Any, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [reference_model(ids).logits for ids in prompts]


@pytest.mark.model
def test_folder_contents(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # <|im_end|>, then <|endoftext|> as llama.cpp does
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["chat_template"].startswith("{% for message in messages %}")
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert "lm_head.weight" not in names and len(names) == 2 + 30 * 9


@pytest.mark.model
def test_weights_equal_transformers_gguf_loader(smollm2_dir: Path, reference_model: Any) -> None:
    ours = load_file(smollm2_dir / "model.safetensors")
    reference = reference_model.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        # Our BF16 must be the reference float32 rounded to nearest: un-permutation included, bit for bit.
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


@pytest.mark.model
def test_logits_match_transformers_gguf_loader(
    our_model: Any, prompts: list[torch.Tensor], reference_logits: list[torch.Tensor]
) -> None:
    for ids, expected in zip(prompts, reference_logits, strict=True):
        with torch.no_grad():
            got = our_model(ids).logits
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        assert (got - expected).abs().max().item() < LOGIT_MAX_ABS


@pytest.mark.model
def test_wrong_rope_permutation_is_caught(
    our_model: Any, prompts: list[torch.Tensor], reference_logits: list[torch.Tensor]
) -> None:
    """Leave llama.cpp's Q/K row order in place: the comparison above must fail by a wide margin."""
    projections = [(layer.self_attn.q_proj.weight, 9) for layer in our_model.model.layers]
    projections += [(layer.self_attn.k_proj.weight, 3) for layer in our_model.model.layers]
    saved = [w.detach().clone() for w, _ in projections]
    try:
        with torch.no_grad():
            for w, n_heads in projections:
                w.copy_(torch.from_numpy(llama_cpp_permute(w.detach().numpy(), n_heads)))
            diff = (our_model(prompts[0]).logits - reference_logits[0]).abs()
    finally:
        with torch.no_grad():
            for (w, _), original in zip(projections, saved, strict=True):
                w.copy_(original)
    assert diff.max().item() > 10 * LOGIT_MAX_ABS
