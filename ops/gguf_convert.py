"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

What comes out (everything `transformers.LlamaForCausalLM` and our own loader read):

    model.safetensors        BF16 weights under Hugging Face Llama names
    config.json              LlamaConfig fields taken from the GGUF metadata
    generation_config.json   bos / eos / pad ids (eos: every end-of-generation token)
    tokenizer.json           byte-level BPE rebuilt from tokenizer.ggml.{tokens,merges,token_type}
    tokenizer_config.json    special token strings and the embedded chat template

Weights. GGUF stores most matrices block-quantised (SmolLM2 ships Q4_1, with the embedding
in Q8_0); `gguf.quants.dequantize` turns each into float32, which we round to nearest-even
BF16. The one non-obvious step is RoPE: llama.cpp's converter permutes the rows of
`attn_q` / `attn_k` inside every head from Hugging Face's "rotate half" layout
(`[x0..x(d/2-1), x(d/2)..x(d-1)]`) to the interleaved pairs GGML's rope kernel wants
(`[x0, x(d/2), x1, x(d/2+1), ...]`). `unpermute_rope_rows` undoes it; K uses the number of
KV heads.

Tensors are dequantised and written one at a time: the safetensors header only needs
names, dtypes and shapes, which the GGUF tensor table already gives, so the file is
streamed and peak memory is one float32 tensor.

Tokenizer. `tokenizer.ggml.model = gpt2` is byte-level BPE; the vocabulary and merges are
already spelled in GPT-2's byte alphabet. What the file only names is the pre-tokenizer
(`tokenizer.ggml.pre`), which we map to the split llama.cpp uses for that name (for
`smollm`: every digit alone, then the GPT-2 regex). Tokens typed CONTROL (3) become special
added tokens, USER_DEFINED (4) plain added tokens, so neither is ever cut into pieces.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from backend.errors import UnsupportedArchitecture, WeightsError

__all__ = ["convert_gguf", "unpermute_rope_rows", "SAFETENSORS_NAME"]

logger = logging.getLogger(__name__)

SAFETENSORS_NAME = "model.safetensors"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp's pre-tokenizer names -> (split regex applied before byte-level, digits alone).
# Each regex is the one llama.cpp's llama-vocab.cpp uses for that name.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"), (_GPT2_SPLIT, True)),
    **dict.fromkeys(("gpt-2", "default", "mpt", "olmo", "jais"), (_GPT2_SPLIT, False)),
    **dict.fromkeys(("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), (_LLAMA3_SPLIT, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2_SPLIT, False)),
}

# Control tokens llama.cpp also treats as end-of-generation, besides the declared EOS.
_END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types
# tokenizer_config.json role -> GGUF key "tokenizer.ggml.<key>_token_id"
_TOKEN_ROLES = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection.

    llama.cpp wrote `w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2)`; this reads the rows
    back as `(n_heads, d/2, 2, in)` and swaps again. `weight`: `[n_heads * head_dim, in]`.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise WeightsError(f"cannot unpermute {rows} rows over {n_heads} heads")
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Write a Hugging Face Llama folder for `gguf_path` into `out_dir` (created if missing).

    Raises `UnsupportedArchitecture` for anything but a dense llama GGUF with a gpt2
    (byte-level BPE) tokenizer, and `WeightsError` for tensors it cannot place.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    meta = _Metadata(reader)
    config = _llama_config(meta, tensor_names={t.name for t in reader.tensors})
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    logger.info("converting %s: %d layers, hidden %d", gguf_path.name, layers, hidden)
    tokenizer, tokenizer_config, eog_ids = _build_tokenizer(meta)  # before the long part: fail fast
    _write_safetensors(out_dir / SAFETENSORS_NAME, reader, config, progress=progress)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eog_ids if len(eog_ids) != 1 else eog_ids[0],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    for name, payload in (
        ("config.json", config),
        ("generation_config.json", generation_config),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out_dir / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class _Metadata:
    """Typed access to GGUF key-value metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise WeightsError(f"GGUF metadata has no {key!r}")
        return self._fields[key].contents()


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _llama_config(meta: _Metadata, tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if meta.get(f"{arch}.expert_count", 0):
        raise UnsupportedArchitecture("mixture-of-experts llama GGUFs are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedArchitecture("GGUF carries rope_freqs (llama3 rope scaling), which we cannot express")
    n_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // n_heads
    )
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "rms_norm_eps": _f32(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": _f32(meta.require(f"{arch}.rope.scaling.factor"))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    return config


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise WeightsError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def _tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout), one tensor at a time."""
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if ".attn_q." in tensor.name:
            weights = unpermute_rope_rows(weights, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weights = unpermute_rope_rows(weights, config["num_key_value_heads"])
        yield _hf_name(tensor.name), weights


def _write_safetensors(path: Path, reader: GGUFReader, config: dict[str, Any], *, progress: bool) -> None:
    """Stream every tensor as BF16 into one safetensors file (header first, then data in order)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        nbytes = 2 * int(np.prod(shape))
        header[_hf_name(tensor.name)] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
    bar = tqdm(total=len(reader.tensors), desc="converting", unit="tensor", disable=not progress)
    with path.open("wb") as out, bar:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name, weights in _tensors(reader, config):
            if list(weights.shape) != header[name]["shape"]:
                raise WeightsError(f"{name}: shape {weights.shape} != {header[name]['shape']}")
            bf16 = torch.from_numpy(np.require(weights, np.float32, ["C", "W"])).to(torch.bfloat16)
            out.write(bf16.view(torch.int16).numpy().tobytes())
            bar.update()


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for `tokenizer.ggml.pre`, followed by the byte-level mapping."""
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedArchitecture(f"GGUF pre-tokenizer {pre!r} is not known; known: {sorted(_PRE_TOKENIZERS)}")
    split, digits_alone = _PRE_TOKENIZERS[pre]
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if digits_alone else []
    if split == _GPT2_SPLIT:  # ByteLevel's built-in regex is exactly this one
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS around the text when the GGUF asks for them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return byte_level
    pieces = ([bos[0]] if bos else []) + ["$A"] + ([eos[0]] if eos else [])
    template = processors.TemplateProcessing(single=" ".join(pieces), special_tokens=[t for t in (bos, eos) if t])
    return processors.Sequence([byte_level, template])


def _build_tokenizer(meta: _Metadata) -> tuple[HFTokenizer, dict[str, Any], list[int]]:
    """Byte-level BPE `tokenizers.Tokenizer`, tokenizer_config.json content, end-of-generation ids."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitecture(f"GGUF tokenizer model {kind!r} is not supported (only byte-level 'gpt2')")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        (tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.require("tokenizer.ggml.merges")]
    tokenizer = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    control = [i for i, kind in enumerate(types) if kind == _TOKEN_CONTROL]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(types)
            if kind == _TOKEN_USER_DEFINED
        ]
    )

    def special(key: str) -> tuple[str, int] | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (tokens[index], int(index)) if index is not None and 0 <= index < len(tokens) else None

    bos, eos = special("bos"), special("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tokenizer.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None)

    eog_ids = [eos[1]] if eos else []
    eog_ids += [i for i in control if tokens[i] in _END_OF_GENERATION and i not in eog_ids]
    arch = meta.require("general.architecture")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{role: (token[0] if (token := special(key)) else None) for role, key in _TOKEN_ROLES.items()},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer, tokenizer_config, eog_ids
