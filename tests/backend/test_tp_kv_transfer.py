"""KV transfer with tensor-parallel groups (gloo, CPU): rank 0 gathers the whole model's KV heads
from its ranks for a prefill read and scatters each rank's heads for a decode install, so the wire
carries the same layers as from one process. A group of 2 reads the same K/V as one process, and
decoding after installing the same frames gives the same tokens and logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.distributed.group import GroupSpec, start_group
from backend.engine import EngineConfig, LLMEngine
from backend.kv_transfer import FrameReader, KVBegin, decode_layer, encode_layer
from backend.latent_kv_cache import LatentRows
from backend.sampling_params import SamplingParams
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3
from tests.backend.tiny_models import write_tiny_model

PROMPT = [(7 * i) % 300 + 3 for i in range(37)]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _config(kv_format: str, world: int) -> EngineConfig:
    return EngineConfig(dtype="float32", kv_format=kv_format, kv_cache_bytes=2 * 2**20, page_size=16,
                        gemm_buckets=(), num_threads=1, tensor_parallel=world)


def held_kv(eng: LLMEngine) -> tuple[int, list[tuple]]:
    """Prefill PROMPT holding its pages (prefill role); (first token, every layer's read_kv)."""
    eng.add_request(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "held", hold=True)
    while eng.has_work():
        eng.step()
    seq = eng.scheduler.held["held"]
    layers = [eng.read_kv(seq, layer) for layer in range(eng.model.cfg.num_layers)]
    eng.release_held("held")
    return seq.output_ids[0], layers


def decode_from(eng: LLMEngine, first: int, frames: list[tuple]) -> tuple[list[int], torch.Tensor]:
    """Decode role: reserve, install every layer's frame, activate, decode 8 tokens greedily."""
    seq = eng.new_sequence(PROMPT, SamplingParams(max_tokens=8, **GREEDY), "decoded")
    assert eng.reserve(seq)
    for layer, parts in enumerate(frames):
        eng.install_kv(seq, layer, *parts)
    seen = record_sampled_logits(eng)
    eng.activate(seq, first)
    while eng.has_work():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.num_pages
    return seq.output_ids, torch.stack(seen["decoded"])


def wire(layers: list[tuple], wire_format: str, cfg) -> list[tuple]:
    """What a decode worker installs: each layer through the wire encoding and back."""
    begin = KVBegin("r", 0, len(PROMPT), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, wire_format)
    out = []
    for layer, (k, v) in enumerate(layers):
        (header, payload), = FrameReader().feed(encode_layer(layer, k, v, wire_format))
        out.append(decode_layer(header, payload, begin))
    return out


CASES = {
    "gqa-kv-split-fp8-pool-fp8-wire": ("llama", dict(num_attention_heads=8, num_key_value_heads=2), "fp8_e4m3",
                                       "fp8_e4m3"),
    "gqa-kv-replicated-fp32-pool-bf16-wire": ("llama", dict(num_attention_heads=8, num_key_value_heads=1), "fp32",
                                              "bf16"),
    "mla-latent-fp32-pool-bf16-wire": ("deepseek_v3", dict(), "fp32", "bf16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_group_reads_and_installs_the_whole_kv(tmp_path: Path, case: str) -> None:
    arch, overrides, pool, wire_format = CASES[case]
    path = (write_tiny_deepseek_v3(tmp_path / "m", seed=4) if arch == "deepseek_v3"
            else write_tiny_model(tmp_path / "m", arch, seed=4, **overrides))
    one = LLMEngine.from_pretrained(path, _config(pool, 1))
    first, ref_layers = held_kv(one)
    frames = wire(ref_layers, wire_format, one.model.cfg)
    ref_tokens, ref_logits = decode_from(one, first, frames)
    group = start_group(GroupSpec(2, str(path), _config(pool, 2), timeout_s=60))
    try:
        two = LLMEngine.from_pretrained(path, _config(pool, 2), group.coll)
        first2, layers = held_kv(two)
        assert first2 == first
        for (k, v), (rk, rv) in zip(layers, ref_layers):
            if isinstance(k, LatentRows):
                torch.testing.assert_close(k.rows, rk.rows, atol=1e-5, rtol=1e-5)
            else:
                assert k.shape == rk.shape  # every KV head, not rank 0's
                torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
        tokens, logits = decode_from(two, first, frames)
    finally:
        group.shutdown()
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4
