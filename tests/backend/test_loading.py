"""Model loading failures are typed and name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.config import SUPPORTED_ARCHITECTURES
from backend.engine import EngineConfig, LLMEngine
from backend.errors import ModelLoadError, UnsupportedArchitecture, WeightsError
from tests.backend.tiny_models import write_tiny_model

CFG = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20)


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "m", "llama")


def test_unknown_architecture_is_named_with_the_supported_list(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture) as err:
        LLMEngine.from_pretrained(tiny, CFG)
    assert "MambaForCausalLM" in err.value.message
    assert all(a in err.value.message for a in SUPPORTED_ARCHITECTURES)


def test_missing_config_is_a_load_error(tiny: Path) -> None:
    (tiny / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine.from_pretrained(tiny, CFG)


def test_missing_safetensors_names_the_folder(tiny: Path) -> None:
    for f in tiny.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(WeightsError) as err:
        LLMEngine.from_pretrained(tiny, CFG)
    assert str(tiny) in err.value.message


def test_corrupt_safetensors_names_the_file(tiny: Path) -> None:
    f = next(tiny.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:1000])  # truncated download
    with pytest.raises(WeightsError) as err:
        LLMEngine.from_pretrained(tiny, CFG)
    assert f.name in err.value.message


def test_missing_shard_from_the_index_names_it(tiny: Path) -> None:
    f = next(tiny.glob("*.safetensors"))
    (tiny / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": f.name, "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        LLMEngine.from_pretrained(tiny, CFG)


def test_missing_tensor_is_named(tiny: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = next(tiny.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLMEngine.from_pretrained(tiny, CFG)
