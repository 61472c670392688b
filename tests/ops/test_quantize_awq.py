"""`edgeserve quantize --method awq` and `--zero-points` end to end on a tiny Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from backend.config import load_config
from backend.engine import EngineConfig, LLMEngine
from backend.weights import CheckpointReader
from ops.cli import main
from tests.backend.test_weight_formats import _prefill_logits


def _engine(path: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**22,
                                                        gemm_buckets=()))


def test_awq_method_and_zero_points(tiny_chat_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """awq (AWQ scales, then RTN) writes rtn's tensors with other values (norms rescaled) and the model it
    writes computes the dense model's logits about as well as RTN's; --zero-points writes compressed-tensors
    with symmetric false and weight_zero_point, which loads as the zero-point format."""
    common = ["--to", "int4", "--group-size", "32", "--calib-tokens", "512", "--no-progress"]
    for method in ("rtn", "awq"):
        assert main(["quantize", str(tiny_chat_dir), str(tmp_path / method), "--method", method, *common]) == 0
    text = capsys.readouterr().out
    assert re.search(r"method +awq", text) and "AWQ scales" in text
    a, b = CheckpointReader(tmp_path / "rtn"), CheckpointReader(tmp_path / "awq")
    assert list(a.names()) == list(b.names()) and all(a.spec(n) == b.spec(n) for n in a.names())
    differ = {n for n in a.names() if not torch.equal(a.get(n), b.get(n))}
    assert any(n.endswith("layernorm.weight") for n in differ)
    assert all(n.endswith((".weight_packed", ".weight_scale", "layernorm.weight")) for n in differ)
    ids = list(range(100, 300, 3))
    dense = _prefill_logits(_engine(tiny_chat_dir), ids)
    err = {m: (_prefill_logits(_engine(tmp_path / m), ids) - dense).norm().item() for m in ("rtn", "awq")}
    assert err["awq"] < 1.2 * err["rtn"], err
    assert main(["quantize", str(tiny_chat_dir), str(tmp_path / "zp"), "--method", "rtn", "--zero-points",
                 *common]) == 0
    qc = load_config(tmp_path / "zp").quantization
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert any(n.endswith(".weight_zero_point") for n in CheckpointReader(tmp_path / "zp").names())
    engine = _engine(tmp_path / "zp")
    assert type(engine.model.formats["decode"]).__name__ == "CompressedTensorsZeroPointInt4"
    zp_err = (_prefill_logits(engine, ids) - dense).norm().item()
    assert zp_err < 1.5 * err["rtn"], (zp_err, err)
