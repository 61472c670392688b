"""`edgeserve quantize --method gptq`: layer-by-layer calibration (ops/calibration.py) writes the INT4
checkpoint RTN would, differing only in values; its forward is the runtime's; a Glm4Moe serves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.config import load_config
from backend.engine import EngineConfig, LLMEngine
from backend.layers.norm import rms_norm
from backend.sampling_params import SamplingParams
from backend.weight_formats import weight_format
from backend.weights import CheckpointReader
from backend.worker import create_worker_app
from ops import quantize
from ops.brown_corpus import fetch_brown
from ops.brown_corpus import corpus_tokens
from ops.calibration import CALIB_GENRES, EVAL_GENRES, LayerCalibrator
from ops.cli import main
from tests.backend.servers import serve_in_thread
from tests.backend.test_disagg import GREEDY, generate, tokens
from tests.backend.test_weight_formats import _prefill_logits
from tests.backend.tiny_models import write_tiny_glm4_moe


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**22,
                                                        gemm_buckets=(), **kw))


@pytest.fixture(scope="module")
def tiny_moe_tok(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Glm4Moe (q/k norm, attention biases, 8 experts, a shared one) with SmolLM2's
    vocabulary and tokenizer, so `edgeserve quantize` calibrates it on real text."""
    path = write_tiny_glm4_moe(tmp_path_factory.mktemp("moe-tok") / "m", seed=3, vocab_size=49152,
                               use_qk_norm=True, attention_bias=True, moe_intermediate_size=64)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def test_calibration_and_evaluation_genres_are_disjoint(smollm2_dir: Path) -> None:
    from backend.tokenizer import Tokenizer

    assert not set(CALIB_GENRES) & set(EVAL_GENRES)
    encode = Tokenizer.from_model_dir(smollm2_dir).encode
    ids, docs = corpus_tokens(encode, 3000, fetch_brown(), CALIB_GENRES)
    held, held_docs = corpus_tokens(encode, 3000, fetch_brown(), EVAL_GENRES)
    assert len(ids) >= 3000 and {d[1] for d in docs} <= set(CALIB_GENRES)
    assert {d[1] for d in held_docs} <= set(EVAL_GENRES) and not set(docs) & set(held_docs)


@pytest.mark.parametrize("act_order,awq", [(False, False), (True, False), (True, True)])
def test_calibrator_forward_is_the_runtime_forward(tiny_moe_tok: Path, tmp_path: Path, act_order: bool,
                                                   awq: bool) -> None:
    """Walking every layer, the calibrator's hidden states (through the quantised layers) give the
    logits that our engine computes from the written checkpoint's dequantised weights, and the
    stored weights are the calibrator's. Covers q/k norm, biases, partial RoPE, routing, shared experts,
    and AWQ's scales folded into the norms (written) and into up_proj's rows."""
    ids = torch.randint(3, 49000, (2, 48))
    fmt = weight_format("int4", 32)
    out = tmp_path / "q"
    report = quantize.quantize_checkpoint(tiny_moe_tok, out, fmt, method="gptq", calib_ids=ids, act_order=act_order,
                                          progress=False, awq=awq)
    cfg = load_config(tiny_moe_tok)
    reader = CheckpointReader(tiny_moe_tok)
    plan = quantize.plan_quantize(reader, cfg, fmt)
    cal = LayerCalibrator(cfg, ids, fmt, reader.get, quantize.DenseWeights(reader, plan), reader.__contains__,
                          act_order, awq=awq)
    written = CheckpointReader(out)
    folded = []
    for _ in range(cfg.num_layers):
        for module, sw in cal.next_layer().items():
            assert all(torch.equal(t, written.get(f"{module}.{s}")) for s, t in sw.tensors.items()), module
        for name, t in cal.tensors.items():
            assert torch.equal(t, written.get(name)) and t.dtype == reader.get(name).dtype, name
            folded.append(name)
    dense_mlps = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert len(folded) == (cfg.num_layers + dense_mlps) * awq  # the norms before q/k/v and a dense MLP
    assert len(cal.stats.awq_alphas) > len(folded) if awq else not cal.stats.awq_alphas
    assert report.calibration.gptq_linears + 3 * len(report.calibration.rtn_experts) == len(plan.linear_modules)
    h = rms_norm(cal.h[1], reader.get("model.norm.weight").float(), cfg.rms_norm_eps)
    ours = h @ reader.get("lm_head.weight").float().t()
    runtime = _prefill_logits(_engine(out, prefill_weights="fp32", decode_weights="fp32"), ids[1].tolist())
    torch.testing.assert_close(ours, runtime, rtol=1e-4, atol=1e-4 * runtime.abs().max().item())


def test_gptq_and_rtn_checkpoints_differ_only_in_values_and_gptq_is_closer(tiny_chat_dir: Path,
                                                                          tmp_path: Path) -> None:
    """Same tensors, dtypes, shapes, order and config; the INT4 values differ; on held-out text
    (genres J-R) GPTQ's logits are closer to the dense model's than RTN's."""
    fmt = weight_format("int4", 32)
    rtn = quantize.quantize_checkpoint(tiny_chat_dir, tmp_path / "rtn", fmt, method="rtn", progress=False)
    # plain GPTQ: on random weights the clip search (tuned on SmolLM2, BENCHMARKS.md) can lose to RTN
    gptq = quantize.quantize_checkpoint(tiny_chat_dir, tmp_path / "gptq", fmt, method="gptq", calib_tokens=1024,
                                        act_order=False, clip=False, progress=False)
    assert (rtn.method, gptq.method) == ("rtn", "gptq") and gptq.calibration.tokens == 1024
    assert gptq.peak_rss_bytes > 0 and gptq.quantize_s > 0
    a, b = CheckpointReader(tmp_path / "rtn"), CheckpointReader(tmp_path / "gptq")
    assert list(a.names()) == list(b.names())
    assert (tmp_path / "rtn" / "config.json").read_text() == (tmp_path / "gptq" / "config.json").read_text()
    differ = [n for n in a.names() if not torch.equal(a.get(n), b.get(n))]
    assert all(a.spec(n) == b.spec(n) for n in a.names())
    assert differ and all(n.endswith((".qweight", ".scales", ".zeros")) for n in differ)
    from backend.tokenizer import Tokenizer

    held, _ = corpus_tokens(Tokenizer.from_model_dir(tiny_chat_dir).encode, 200, fetch_brown(), EVAL_GENRES)
    dense = _prefill_logits(_engine(tiny_chat_dir), held[:200])
    err = {m: (_prefill_logits(_engine(tmp_path / m), held[:200]) - dense).norm().item() for m in ("rtn", "gptq")}
    assert err["gptq"] < 0.9 * err["rtn"], err  # measured 0.74x


def test_tiny_glm4_moe_quantised_with_gptq_loads_and_serves(tiny_moe_tok: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI end to end (default method for int4 is gptq): the report counts calibration, the
    checkpoint loads as INT4 and a unified worker streams the engine's greedy tokens."""
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_moe_tok), str(out), "--to", "int4", "--group-size", "32",
                 "--calib-tokens", "1024", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "method                 gptq" in text and "1,024 tokens" in text and "peak RSS" in text
    engine = _engine(out)
    assert repr(engine.model.formats["decode"]) == "int4(g32)"
    prompt = [(7 * i) % 40000 + 3 for i in range(21)]
    with serve_in_thread(create_worker_app(AsyncEngine(engine), "tiny-glm", role="unified")) as url:
        got = tokens(generate(url, prompt, max_tokens=8, **GREEDY))
    offline = _engine(out)
    seq = offline.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY))
    while offline.has_work():
        offline.step()
    assert got == seq.output_ids and len(got) == 8


def test_cli_output_format_compressed_tensors_for_gptq_and_rtn(tiny_chat_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The default INT4 layout is compressed-tensors pack-quantized where the group size divides every
    in_features (g32 on hidden 96), edgeserve otherwise (g128, with a note). Pack-quantized GPTQ and RTN
    checkpoints differ only in values, load in our engine and GPTQ stays closer to the dense model."""
    from backend.compressed_tensors import PackQuantizedWriter

    common = ["--to", "int4", "--group-size", "32", "--calib-tokens", "512", "--no-progress"]
    for method in ("gptq", "rtn"):
        plain = ["--no-act-order", "--no-clip", "--no-awq"] if method == "gptq" else []  # see the test above
        assert main(["quantize", str(tiny_chat_dir), str(tmp_path / method), "--method", method, *common,
                     *plain]) == 0
    assert main(["quantize", str(tiny_chat_dir), str(tmp_path / "g128"), "--to", "int4", "--method", "rtn",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "groups of 128 do not divide" in text
    assert load_config(tmp_path / "g128").quantization["quant_method"] == "edgeserve_int4"
    qc = load_config(tmp_path / "gptq").quantization
    assert qc == load_config(tmp_path / "rtn").quantization and qc["format"] == "pack-quantized"
    a, b = CheckpointReader(tmp_path / "rtn"), CheckpointReader(tmp_path / "gptq")
    assert list(a.names()) == list(b.names()) and all(a.spec(n) == b.spec(n) for n in a.names())
    differ = [n for n in a.names() if not torch.equal(a.get(n), b.get(n))]
    assert differ and all(n.endswith((".weight_packed", ".weight_scale")) for n in differ)
    module = "model.layers.1.mlp.down_proj"  # rtn is the writer's own rounding
    want = PackQuantizedWriter(32).quantize(CheckpointReader(tiny_chat_dir).get(f"{module}.weight"))
    assert all(torch.equal(a.get(f"{module}.{s}"), t) for s, t in want.tensors.items())
    from backend.tokenizer import Tokenizer

    held, _ = corpus_tokens(Tokenizer.from_model_dir(tiny_chat_dir).encode, 200, fetch_brown(), EVAL_GENRES)
    dense = _prefill_logits(_engine(tiny_chat_dir), held[:200])  # held-out text: an id ramp is not what GPTQ fits
    err = {m: (_prefill_logits(_engine(tmp_path / m), held[:200]) - dense).norm().item() for m in ("rtn", "gptq")}
    assert err["gptq"] < 0.95 * err["rtn"], err


def test_plan_flag_prints_the_size_plan(capsys: pytest.CaptureFixture[str], tiny_chat_dir: Path) -> None:
    assert main(["quantize", "--plan", str(tiny_chat_dir / "config.json"), "--to", "int4", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "-> INT4 g32" in out and "TP 8" in out and "\ntotal " in out
