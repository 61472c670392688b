"""ops/gpu_engine_check.py, the GPU check's engine step, run here on the CPU: every part but the CUDA-only
GEMV timing goes through the same code, on a tiny model and on random weights written from a skeleton."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from ops import gpu_engine_check


def test_random_checkpoint_has_the_skeletons_shapes_and_loads(tiny_chat_dir: Path, tmp_path: Path) -> None:
    skeleton = gpu_engine_check.write_skeleton(tiny_chat_dir, tmp_path / "skel")
    assert sorted(p.name for p in skeleton.iterdir()) == sorted(
        n for n in gpu_engine_check.SKELETON_FILES if (tiny_chat_dir / n).exists())  # no weights travel
    model = gpu_engine_check.random_checkpoint(skeleton, tmp_path / "model", seed=3)
    cfg = json.loads((model / "config.json").read_text())
    with safe_open(str(model / "model.safetensors"), "pt") as f, \
            safe_open(str(tiny_chat_dir / "model.safetensors"), "pt") as real:
        assert set(f.keys()) == set(real.keys())  # every tensor the real checkpoint has, and no other
        for name in f.keys():
            assert f.get_slice(name).get_shape() == real.get_slice(name).get_shape(), name
        assert f.get_tensor("model.embed_tokens.weight").float().std().item() == pytest.approx(0.02, rel=0.1)
    assert cfg["num_hidden_layers"] >= 1
    result = gpu_engine_check.parity(model, "cpu", tokens=4)  # the engine loads and runs it
    assert result["equal"] and all(len(t) == 4 for t in result["cpu_tokens"])


def test_a_cpu_run_records_every_part_and_fails_on_a_part_that_fails(tiny_chat_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "g.json"
    argv = ["--model", str(tiny_chat_dir), "--device", "cpu", "--parts", "parity,decode,w4a16", "--levels", "1,2",
            "--output-tokens", "4", "--rounds", "1", "--json", str(out)]
    assert gpu_engine_check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["parity"]["equal"] and report["parity"]["first_mismatch"] == [None] * 4
    assert report["parity"]["graphs_equal"] and report["parity"]["graphs_tokens"] == report["parity"]["cpu_tokens"]
    levels = report["decode"]["levels"]
    assert set(levels) == {"1", "2"}
    for level in levels.values():
        tok_s = level["tok_s"]
        assert set(tok_s) == {"bf16", "fp8_kv+int4", "bf16+graphs", "fp8_kv+int4+graphs"}
        assert all(v > 0 for v in tok_s.values())
        assert level["ratio"] == pytest.approx(tok_s["fp8_kv+int4"] / tok_s["bf16"])
        assert level["graphs_over_eager"]["bf16"] == pytest.approx(tok_s["bf16+graphs"] / tok_s["bf16"])
    assert report["w4a16"]["skipped"] == "needs CUDA" and report["provenance"]["commit"]

    def broken(*args, **kwargs):
        raise RuntimeError("no device")

    monkeypatch.setattr(gpu_engine_check, "decode", broken)
    assert gpu_engine_check.main(argv) == 1  # recorded, the other parts still ran
    report = json.loads(out.read_text())
    assert report["decode"]["error"] == "RuntimeError: no device" and report["parity"]["equal"]
