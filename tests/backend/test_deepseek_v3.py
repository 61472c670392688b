"""DeepseekV3ForCausalLM (MLA + MoE) against transformers' own, on tiny random checkpoints written by
`save_pretrained`: one-shot prefill, chunked prefill and paged decode (absorbed and not) in float32
over fp32 latent pages, q_lora_rank None and set, YaRN on and off, rope_interleave on and off, greedy
generation, an FP8 block-scaled checkpoint, MTP layers; bf16 / fp8 latent pages against fp32 ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from tests.backend.parity_checks import assert_chunked_prefill_and_decode_match, assert_greedy_equals_generate
from tests.backend.test_model_parity import _our_logits_all_rows
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3
from tests.backend.tiny_models import reference_model, to_fp8_block_checkpoint

ATOL = 1e-4

# each axis of the matrix (q_lora, YaRN, interleave) is covered on and off
CASES = {
    "default": dict(),  # q_lora_rank 48, interleaved rope, no scaling, 2 groups, first layer dense
    "no-q-lora": dict(q_lora_rank=None),
    "yarn": dict(yarn=True),
    "neox-rope": dict(rope_interleave=False),
    "all-off-bias-yarn": dict(q_lora_rank=None, rope_interleave=False, yarn=True, attention_bias=True,
                              first_k_dense_replace=0, n_group=1, norm_topk_prob=False),
}


def _engine(path: Path, **kw) -> LLMEngine:
    cfg = dict(dtype="float32", kv_format="fp32", kv_cache_bytes=2 * 2**20, page_size=16, gemm_buckets=())
    return LLMEngine.from_pretrained(path, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("dsv3") / "m", seed=1)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(tmp_path: Path, case: str) -> None:
    path = write_tiny_deepseek_v3(tmp_path / "m", seed=2, **CASES[case])
    ref = reference_model(path)
    ids = torch.randint(0, 320, (80,)).tolist()  # past YaRN's original 64 positions
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _our_logits_all_rows(_engine(path), ids)
    assert expected.abs().max().item() > 0.3  # logits large enough for the tolerance to mean something
    assert (got - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("case,absorb", [("default", True), ("default", False), ("all-off-bias-yarn", True)])
def test_chunked_prefill_and_paged_decode_match_transformers(tmp_path: Path, case: str, absorb: bool) -> None:
    """Mixed lengths in one batch, chunks of 7 over pages of 16, then decode steps (absorbed or
    expanded): every sampled position's logits equal the reference's and the greedy tokens its argmax."""
    path = write_tiny_deepseek_v3(tmp_path / "m", seed=3, **CASES[case])
    ref = reference_model(path)
    ours = _engine(path, prefill_chunk_size=7, max_num_batched_tokens=16)
    ours.model.mla_absorb = absorb
    assert_chunked_prefill_and_decode_match(ours, ref, ATOL)


def test_greedy_32_tokens_equal_transformers_generate(default_dir: Path) -> None:
    assert_greedy_equals_generate(_engine(default_dir), reference_model(default_dir))


def mean_next_token_kl(model_dir: Path, kv_format: str, prompts: list[list[int]]) -> float:
    """Mean KL(p_fp32 || p_format) of the next-token distributions at every position of `prompts`,
    both scored through the paged path (chunks of 16, so later chunks read earlier keys back from
    the pages of that format)."""
    kls = []
    ref, ours = _engine(model_dir, prefill_chunk_size=16), _engine(model_dir, kv_format=kv_format,
                                                                   prefill_chunk_size=16)
    for ids in prompts:
        p, q = (_all_logprobs(e, ids) for e in (ref, ours))
        kls.append((p.exp() * (p - q)).sum(-1))
    return torch.cat(kls).mean().item()


def _all_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Next-token log-distributions [len - 1, vocab] through chunked prefill over the paged cache."""
    from backend.scheduler import ScheduledBatch
    from backend.sequence import Sequence

    seq = Sequence("kl", list(ids), SamplingParams(max_tokens=1))
    seq.page_ids = engine.allocator.allocate(engine.scheduler.pages_for(len(ids)))
    out = []
    try:
        for start in range(0, len(ids) - 1, 16):
            take = min(16, len(ids) - 1 - start)
            input_ids, meta = engine.runner.prepare(ScheduledBatch([], [(seq, take)], []))
            meta.logits_rows = torch.arange(take)
            out.append(engine.model.forward(input_ids, meta, engine.cache).log_softmax(-1))
            seq.num_computed_tokens += take
    finally:
        engine.allocator.release(seq.page_ids)
    return torch.cat(out)


@pytest.mark.parametrize("kv_format,bound", [("bf16", 1e-5), ("fp8_e4m3", 5e-3)])
def test_latent_page_formats_stay_close_to_fp32(default_dir: Path, kv_format: str, bound: float) -> None:
    """bf16 and fp8_e4m3 latent pages against fp32 pages on the same model: mean KL of next-token
    distributions over a small random prompt set (figures in the test output with -s)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (24, 40, 64, 96)]
    kl = mean_next_token_kl(default_dir, kv_format, prompts)
    print(f"mean KL(fp32 || {kv_format}) = {kl:.3e}")
    assert 0 < kl < bound


def _rewrite(path: Path, change) -> None:
    f = next(path.glob("*.safetensors"))
    save_file(change(load_file(f)), f, metadata={"format": "pt"})


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_tiny_deepseek_v3(tmp_path / "m", seed=4)
    ids = torch.randint(0, 320, (20,)).tolist()
    want = _our_logits_all_rows(_engine(path), ids)

    def add_mtp(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t.update({"model.layers.3." + k[len("model.layers.2."):]: torch.randn_like(v) for k, v in t.items()
                  if k.startswith("model.layers.2.")})
        t["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
        return t

    _rewrite(path, add_mtp)
    with caplog.at_level(logging.INFO, logger="backend.models.deepseek_v3"):
        got = _our_logits_all_rows(_engine(path), ids)
    lines = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.3" in lines[0].getMessage()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp8_block_scaled_checkpoint_matches_transformers_on_the_dequantised_weights(tmp_path: Path) -> None:
    """Every *_proj weight (attention incl. kv_b_proj, experts, dense MLP) as e4m3 with 16x16 block
    scales (kv_a_proj_with_mqa's 40 rows end in a partial block); kv_b_proj is dequantised at load for
    absorption. Reference: transformers on a dense copy holding exactly the dequantised values."""
    path = write_tiny_deepseek_v3(tmp_path / "m", seed=6)
    ref_dir = tmp_path / "dense"
    to_fp8_block_checkpoint(path, ref_dir)
    ref = reference_model(ref_dir)
    ids = torch.randint(0, 320, (40,)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _our_logits_all_rows(_engine(path), ids)
    assert (got - expected).abs().max().item() <= ATOL


def test_quantize_converts_every_mla_linear_and_the_result_loads(default_dir: Path, tmp_path: Path) -> None:
    """`edgeserve quantize` knows the MLA tensors: q_a/q_b, kv_a_proj_with_mqa, kv_b_proj and o_proj come
    out FP8 (kv_b_proj dequantised again at load), norms as stored; the engine then computes exactly
    what a dense checkpoint of the dequantised weights gives."""
    from backend.weight_formats import weight_format
    from backend.weights import CheckpointReader
    from ops import quantize
    from tests.ops.test_quantize import _dequantized_copy

    out = tmp_path / "q"
    quantize.quantize_checkpoint(default_dir, out, weight_format("fp8"), progress=False)
    reader = CheckpointReader(out)
    a = "model.layers.1.self_attn."
    for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert reader.spec(f"{a}{m}.weight").dtype == torch.float8_e4m3fn and f"{a}{m}.weight_scale_inv" in reader
    assert reader.spec(f"{a}kv_a_layernorm.weight").dtype == torch.float32
    ids = torch.randint(0, 320, (30,)).tolist()
    got = _our_logits_all_rows(_engine(out), ids)
    operand = _our_logits_all_rows(_engine(_dequantized_copy(out, tmp_path / "deq")), ids)
    assert (got - operand).abs().max().item() <= 1e-5


def test_kimi_k25_wrapper_serves_its_text_backbone(default_dir: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A Kimi_K25ForConditionalGeneration folder (DeepseekV3 text_config, weights under language_model.,
    a vision tower beside them) gives the plain DeepseekV3 checkpoint's logits exactly."""
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    text = json.loads((default_dir / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    (kimi / "config.json").write_text(json.dumps({"architectures": ["Kimi_K25ForConditionalGeneration"],
                                                  "model_type": "kimi_k25", "text_config": text}))
    tensors = {f"language_model.{k}": v for k, v in load_file(default_dir / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    save_file(tensors, kimi / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 320, (25,)).tolist()
    with caplog.at_level(logging.INFO):
        got = _our_logits_all_rows(_engine(kimi), ids)
    assert any("vision_tower" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, _our_logits_all_rows(_engine(default_dir), ids), rtol=0, atol=0)


def test_prefix_cache_reuses_latent_pages_with_the_same_output(default_dir: Path) -> None:
    engine = _engine(default_dir, prefix_caching=True, kv_format="fp8_e4m3")
    prompt = torch.randint(0, 320, (40,)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = []
    for _ in range(2):
        seqs.append(engine.add_request(prompt, params))
        while engine.has_work():
            engine.step()
    assert seqs[0].num_cached_tokens == 0 and seqs[1].num_cached_tokens == 32  # two full pages of 16 reused
    assert seqs[1].output_ids == seqs[0].output_ids
