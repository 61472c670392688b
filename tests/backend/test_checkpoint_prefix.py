"""Checkpoints that keep the text model under a prefix (Kimi K2.5/K2.6: `language_model.`, beside a vision
tower): the loader reads plain names under the prefix, skips the rest with one log line, and the model
equals the one loaded from the same tensors stored without the prefix."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.config import load_config
from backend.errors import WeightsError
from backend.layers.loader import WeightLoader
from backend.weights import CheckpointReader
from tests.backend.test_model_parity import _engine, _our_logits_all_rows
from tests.backend.tiny_models import write_tiny_model

EXTRA = {"vision_tower.blocks.0.attn.qkv.weight": (24, 8), "vision_tower.blocks.0.norm.weight": (8,),
         "mm_projector.linear_1.weight": (16, 8)}


def wrap(plain: Path, out: Path, shards: int = 1) -> Path:
    """`plain`'s tensors as `language_model.<name>` beside a vision tower and projector, its config as the
    `text_config` of a wrapper config, in `shards` files with an index when more than one."""
    out.mkdir(parents=True)
    text = json.loads((plain / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"architectures": text["architectures"], "text_config": text,
                                                 "model_type": "kimi_k25"}))
    tensors = {f"language_model.{k}": v for k, v in load_file(next(plain.glob("*.safetensors"))).items()}
    tensors.update({k: torch.randn(shape) for k, shape in EXTRA.items()})
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("plain") / "m", "qwen2", seed=4)


@pytest.mark.parametrize("shards", [1, 3])
def test_wrapped_checkpoint_gives_the_plain_models_logits(plain: Path, tmp_path: Path, shards: int,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    wrapped = wrap(plain, tmp_path / "w", shards)
    assert load_config(wrapped).checkpoint_prefix == "language_model."
    ids = torch.randint(0, 320, (25,)).tolist()
    with caplog.at_level(logging.INFO, logger="backend.weights"):
        got = _our_logits_all_rows(_engine(wrapped), ids)
    lines = [r.getMessage() for r in caplog.records if r.name == "backend.weights"]
    assert lines == ["skipping 3 checkpoint tensors outside 'language_model.' (not the text model): "
                     "mm_projector.*, vision_tower.*"]
    torch.testing.assert_close(got, _our_logits_all_rows(_engine(plain), ids), rtol=0, atol=0)


def test_the_loader_reads_plain_names_under_the_prefix_only(plain: Path, tmp_path: Path) -> None:
    wrapped = wrap(plain, tmp_path / "w")
    loader = WeightLoader(wrapped, load_config(wrapped), torch.float32)
    raw = load_file(next(plain.glob("*.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in loader and "lm_head.weight" in loader
    assert "language_model.lm_head.weight" not in loader and "vision_tower.blocks.0.norm.weight" not in loader
    assert sorted(loader.ckpt.names()) == sorted(raw)
    assert torch.equal(loader.get("lm_head.weight"), raw["lm_head.weight"])
    src, sw = loader.read("model.layers.2.mlp.down_proj", (96, 128))
    assert torch.equal(src.dequantize(sw), raw["model.layers.2.mlp.down_proj.weight"])
    assert loader.ckpt.spec("model.norm.weight").shape == (96,)
    with pytest.raises(WeightsError, match=r"'language_model\.model\.layers\.9\.mlp\.up_proj\.weight' not found"):
        loader.read("model.layers.9.mlp.up_proj")


def test_no_tensor_under_the_prefix_is_a_weights_error(plain: Path) -> None:
    with pytest.raises(WeightsError, match="no tensor .* is under 'language_model.'"):
        CheckpointReader(plain, "language_model.")


def test_a_reader_without_a_prefix_sees_every_tensor(plain: Path, tmp_path: Path) -> None:
    wrapped = wrap(plain, tmp_path / "w")
    names = set(CheckpointReader(wrapped).names())
    assert set(EXTRA) <= names and "language_model.model.norm.weight" in names


def test_kimi_wrapped_deepseek_v3_gives_the_plain_models_logits(tmp_path: Path) -> None:
    """Kimi K2.5/K2.6 (`Kimi_K25ForConditionalGeneration`) is a DeepseekV3 text model under `language_model.`."""
    from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

    plain = write_tiny_deepseek_v3(tmp_path / "m", seed=5)
    wrapped = wrap(plain, tmp_path / "w", shards=2)
    raw = json.loads((wrapped / "config.json").read_text())
    raw["architectures"] = ["Kimi_K25ForConditionalGeneration"]
    (wrapped / "config.json").write_text(json.dumps(raw))
    ids = torch.randint(0, 320, (30,)).tolist()
    torch.testing.assert_close(_our_logits_all_rows(_engine(wrapped), ids),
                               _our_logits_all_rows(_engine(plain), ids), rtol=0, atol=0)
