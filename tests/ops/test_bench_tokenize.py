"""`edgeserve bench tokenize` on SmolLM2's tokenizer, a short run: its workloads and figures, and the ids it
compares (a run stops when the piece-by-piece ids differ from the whole prompt's)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.tokenizer import Tokenizer
from ops.bench.tokenize import conversation, run


def test_bench_tokenize_quick_report(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokenize.json"
    assert run(argparse.Namespace(model=str(smollm2_dir), turns=4, repeats=1, quick=True, json_path=str(out))) == 0
    report = json.loads(out.read_text())
    for workload in ("conversation", "single", "repeat"):
        row = report[workload]
        assert row["whole_ms"] > 0 and row["cached_ms"] > 0
        assert row["whole_over_cached"] == row["whole_ms"] / row["cached_ms"]
    last = report["conversation"]["last_turn"]
    assert report["conversation"]["turns"] == 4
    assert last["tokens"] == len(Tokenizer.from_model_dir(smollm2_dir).encode_chat(conversation(4)))
    assert set(report["headline"]) == {"conversation_last_turn_x", "single_turn_x", "repeat_x"}
    assert report["provenance"]["commit"]


def test_conversation_alternates_roles_after_a_system_prompt() -> None:
    chat = conversation(5, seed=3)
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert conversation(5, seed=3) == chat and conversation(5, seed=4) != chat
    assert all(60 <= len(m["content"].split()) <= 140 for m in chat[1:])


def test_a_tokenizer_without_a_piece_cache_is_reported_skipped(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as BackendTokenizer, models, pre_tokenizers

    backend = BackendTokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()  # a piece's ids could depend on its place: no cache
    model = tmp_path / "m"
    model.mkdir()
    backend.save(str(model / "tokenizer.json"))
    (model / "config.json").write_text("{}")
    out = tmp_path / "tokenize.json"
    assert run(argparse.Namespace(model=str(model), turns=2, repeats=1, quick=True, json_path=str(out))) == 0
    assert "no PieceCache" in json.loads(out.read_text())["skipped"]["all"]
