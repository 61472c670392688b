"""Serving an MLA model (a tiny random DeepseekV3) over latent KV pages: the integrity faults (a), (b)
and (c) abort on latent pages too, latent rows cross the prefill -> decode wire as raw bytes, and a
unified worker and a disaggregated pair give the unified engine's greedy tokens."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.engine import EngineConfig, LLMEngine
from backend.errors import KVIntegrityError
from backend.fault_injection import free_and_reallocate, stale_page_table
from backend.kv_transfer import FrameReader, KVBegin, KVLayer, LatentRows, decode_layer, encode_frame, encode_layer
from backend.latent_kv_cache import LatentKVCache
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from kernels.latent_kv_store import dequantize_latent_ref, latent_row_bytes, quantize_latent_ref
from tests.backend.servers import serve_in_thread
from tests.backend.test_disagg import GREEDY, generate, pair, tokens, unified, wait_free
from tests.backend.test_integrity import PROMPTS, run
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

PROMPT = [(5 * i) % 300 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("mla") / "m", seed=21)


@pytest.mark.parametrize("fault", [
    lambda e, s: free_and_reallocate(e, s, page_index=0),
    lambda e, s: free_and_reallocate(e, s, page_index=1, new_owner_writes=False),
    stale_page_table,
], ids=["a-freed-and-reused", "a-freed-and-reallocated", "b-stale-table-after-preemption"])
def test_faults_on_latent_pages_abort_only_the_victim(model_dir: Path, fault) -> None:
    _, clean, clean_errors, _ = run(model_dir)  # fp8_e4m3 latent pages
    assert not clean_errors
    engine, seqs, errors, after = run(model_dir, fault)
    assert isinstance(engine.cache, LatentKVCache) and engine.cache.quantised
    victim = seqs[2]
    assert set(errors) == {victim.request_id} and errors[victim.request_id].code == KVIntegrityError.code
    assert after == [] and victim.finish_reason == "error"  # not one token read from the foreign page
    for i, (s, c) in enumerate(zip(seqs, clean)):
        if i != 2:
            assert s.output_ids == c.output_ids and s.finish_reason == "length"
    assert engine.snapshot()["integrity_aborts"] == 1 and len(PROMPTS) == 5


def test_new_owner_writes_land_in_the_latent_page(model_dir: Path) -> None:
    """The control for fault (a): the new owner's random rows really overwrite the victim's page."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(kv_format="bf16", kv_cache_bytes=2**20, gemm_buckets=()))
    seq = engine.add_request(PROMPT, SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    page = seq.page_ids[1]
    before = engine.cache.pages[:, page].clone()
    free_and_reallocate(engine, seq, page_index=1)
    assert not torch.equal(engine.cache.pages[:, page], before)
    assert (engine.cache.pages[:, page] != before).float().mean() > 0.9  # every layer, (nearly) every value


def test_a_latent_transfer_into_a_page_that_changed_hands_is_refused(model_dir: Path) -> None:
    """Fault (c) on latent pages: a reserved page reused between two layers' install_kv."""
    dec = LLMEngine.from_pretrained(model_dir, EngineConfig(kv_format="fp8_e4m3", kv_cache_bytes=2**20,
                                                            gemm_buckets=()))
    seq = dec.new_sequence(PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    assert dec.reserve(seq)
    rows = LatentRows(quantize_latent_ref(torch.randn(37, 32), torch.randn(37, 8), "fp8_e4m3"), "fp8_e4m3", 32, 8)
    dec.install_kv(seq, 0, rows, None)
    slots = dec.runner.slots(seq.page_ids, 0, 37)
    assert torch.equal(dec.cache.read_rows(0, slots).rows, rows.rows)  # installed byte for byte
    free_and_reallocate(dec, seq, page_index=1)
    with pytest.raises(KVIntegrityError) as info:
        dec.install_kv(seq, 1, rows, None)
    assert info.value.details["cause"] == "transfer_target" and info.value.details["page"] == seq.page_ids[1]
    dec.release_reserved(seq)
    assert dec.allocator.num_free == dec.allocator.num_pages - 1


@pytest.mark.parametrize("pool,wire,sent", [("fp8_e4m3", "bf16", "fp8_e4m3"), ("bf16", "fp8_e4m3", "fp8_e4m3"),
                                            ("fp32", "bf16", "bf16"), ("bf16", "bf16", "bf16")])
def test_latent_frames_round_trip_in_any_chunking(pool: str, wire: str, sent: str) -> None:
    """FP8 rows travel as they are whatever the wire; wider rows in the wire format; the DSA indexer's
    rows ride behind them byte for byte."""
    latent, k_pe = torch.randn(29, 136) * 2, torch.randn(29, 8)
    rows = LatentRows(quantize_latent_ref(latent, k_pe, pool), pool, 136, 8,
                      torch.randint(0, 256, (29, 20), dtype=torch.uint8))
    begin = KVBegin("r", 5, 29, 1, 4, 8, wire)
    stream = encode_frame(begin) + encode_layer(0, rows, None, wire)
    reader, frames, rng, i = FrameReader(), [], random.Random(2), 0
    while i < len(stream):
        n = rng.randint(1, 200)
        frames += reader.feed(stream[i:i + n])
        i += n
    assert reader.pending == 0 and [type(h) for h, _ in frames] == [KVBegin, KVLayer]
    header, payload = frames[1]
    assert header.latent_format == sent and header.value_bytes == 29 * latent_row_bytes(136, 8, sent)
    got, v, _, _ = decode_layer(header, payload, begin)
    assert v is None and got.kv_format == sent and torch.equal(got.index_rows, rows.index_rows)
    if sent == pool:
        assert torch.equal(got.rows, rows.rows)
    else:
        values = dequantize_latent_ref(rows.rows, 136, 8, pool, torch.float32)
        assert torch.equal(got.rows, quantize_latent_ref(*values, sent))


def test_unified_worker_streams_the_engines_greedy_tokens(model_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(kv_format="fp8_e4m3", kv_cache_bytes=2**20,
                                                               max_model_len=256, gemm_buckets=()))
    with serve_in_thread(create_worker_app(AsyncEngine(engine), "tiny-mla", role="unified")) as url:
        got = tokens(generate(url, PROMPT, max_tokens=12, **GREEDY))
        stats = httpx.get(f"{url}/stats").json()
        wait_free(engine)
    assert got == unified(model_dir, "fp8_e4m3", PROMPT, max_tokens=12, **GREEDY) and len(set(got)) > 2
    assert stats["kv_format"] == "fp8_e4m3" and stats["kv_bytes_per_token"] == 3 * (32 + 4 + 16)


def test_disaggregated_pair_equals_unified_over_latent_pages(model_dir: Path) -> None:
    """bf16 pools both sides: the decode worker continues exactly where a unified engine would; then
    an fp8 decode pool fed fp8 rows from a bf16 prefill pool generates as many tokens, both pools free."""
    with pair(model_dir, decode_kv="bf16", wire="bf16") as (url, dec, prefills):
        got = tokens(generate(url, PROMPT, max_tokens=10, **GREEDY))
        assert got == unified(model_dir, "bf16", PROMPT, max_tokens=10, **GREEDY)
        wait_free(dec, *prefills)
    with pair(model_dir, decode_kv="fp8_e4m3", wire="fp8_e4m3") as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=10, **GREEDY)
        stats = httpx.get(f"{url}/stats").json()["kv_transfer"]
        wait_free(dec, *prefills)
    assert len(tokens(events)) == 10 and tokens(events)[0] == got[0]  # the first token is the prefill worker's
    assert stats["transfers"] == 1 and stats["tokens"] == 37
