"""`edgeserve bench tp --quick` on a tiny Llama (6 query / 3 KV heads): the JSON keys the issue names,
per-rank bytes that split the model, and the collectives a decode step makes at TP 3."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.config import load_config
from ops.bench.tp import run
from tests.backend.tiny_models import write_tiny_model


def test_bench_tp_quick_report(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", "llama", num_attention_heads=6, num_key_value_heads=3,
                             intermediate_size=192, tie_word_embeddings=True)
    out = tmp_path / "tp.json"
    assert run(argparse.Namespace(model=str(model), threads=1, degrees="1,3", quick=True, json_path=str(out))) == 0
    report = json.loads(out.read_text())
    one, three = report["rank_weight_bytes"]["1"], report["rank_weight_bytes"]["3"]
    assert len(one) == 1 and len(three) == 3
    layers = load_config(model).num_layers
    replicated = (2 * layers + 1) * 96 * 4
    assert sum(three) == one[0] + 2 * replicated  # each rank reads the replicated norms, a slice of the rest
    assert set(report["step_ms"]["3"]) == {"1", "32"} and all(v > 0 for v in report["step_ms"]["3"].values())
    # per decode step: the step's header and payload broadcasts, 2 all-reduces per layer + the embedding's,
    # one logits gather
    assert report["collectives_per_step"]["3"] == {"1": 2 + 2 * layers + 1 + 1, "32": 2 + 2 * layers + 1 + 1}
    assert report["collectives_per_step"]["1"] == {"1": 0, "32": 0}
