"""Disaggregated prefill and decode on loopback: exact outputs, FP8 on the wire, and every fault
leaving both pools at their full free count."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.engine import EngineConfig, LLMEngine
from backend.errors import BackendUnavailable, KVIntegrityError
from backend.fault_injection import free_and_reallocate
from backend.kv_transfer import (FrameReader, HttpKVTransport, KVBegin, KVLayer, PrefillRequest, decode_layer,
                                 encode_frame, encode_layer)
from backend.protocol import ErrorEvent, FinishEvent, GenerateRequest, TokenEvent
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from backend.worker_client import WorkerClient
from kernels.kv_store import quantize_fp8_ref
from tests.backend.servers import serve_in_thread
from tests.backend.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("disagg") / "m", "llama", seed=21)


def engine(model_dir: Path, kv_format: str, **kw) -> LLMEngine:
    cfg = dict(kv_cache_bytes=2**20, page_size=16, max_model_len=256, gemm_buckets=(), kv_format=kv_format)
    cfg.update(kw)
    return LLMEngine.from_pretrained(model_dir, EngineConfig(**cfg))


def all_free(e: LLMEngine) -> bool:
    return e.allocator.num_free == e.allocator.num_pages and not e.has_work() and not e.scheduler.held


def wait_free(*engines: LLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(all_free(e) for e in engines):
        assert time.monotonic() < deadline, [e.snapshot() for e in engines]
        time.sleep(0.02)


class Breaking:
    """Fault injection: the real HTTP transport, cut after `after` layer frames (prefill 'dies')."""

    def __init__(self, after: int, times: int = 1, inner=None) -> None:
        self.inner, self.after, self.times = inner or HttpKVTransport(), after, times

    def target(self, seq, deadline_s: float):
        return self.inner.target(seq, deadline_s)

    async def fetch(self, url: str, request: PrefillRequest) -> AsyncIterator:
        frames = self.inner.fetch(url, request)
        async with contextlib.aclosing(frames):
            layers = 0
            async for header, payload in frames:
                if isinstance(header, KVLayer):
                    layers += 1
                    if layers > self.after and self.times > 0:
                        self.times -= 1
                        raise BackendUnavailable("injected: prefill worker died mid-transfer")
                yield header, payload


@contextlib.contextmanager
def pair(model_dir: Path, decode_kv: str = "fp8_e4m3", wire: str = "fp8_e4m3", n_prefill: int = 1,
         transport=None, prefill_kv: str = "bf16", **decode_kw) -> Iterator[tuple[str, LLMEngine, list[LLMEngine]]]:
    prefills = [engine(model_dir, prefill_kv) for _ in range(n_prefill)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_worker_app(AsyncEngine(p), "tiny", role="prefill")))
                for p in prefills]
        dec = engine(model_dir, decode_kv, **decode_kw)
        adec = AsyncEngine(dec)
        coord = DecodeCoordinator(adec, urls, transport or HttpKVTransport(), wire_format=wire,
                                  reserve_timeout_s=1.0, transfer_timeout_s=10.0)
        url = stack.enter_context(serve_in_thread(create_worker_app(adec, "tiny", role="decode", coordinator=coord)))
        yield url, dec, prefills


def generate(url: str, prompt: list[int], **params) -> list:
    async def go():
        client = WorkerClient(url)
        try:
            return [ev async for ev in client.generate(GenerateRequest(prompt, SamplingParams(**params)))]
        finally:
            await client.aclose()

    return asyncio.run(go())


def tokens(events: list) -> list[int]:
    return [t for ev in events if isinstance(ev, TokenEvent) for t in ev.token_ids]


def unified(model_dir: Path, kv_format: str, prompt: list[int], **params) -> list[int]:
    e = engine(model_dir, kv_format)
    seq = e.add_request(prompt, SamplingParams(**params))
    while e.has_work():
        e.step()
    return seq.output_ids


PROMPT = [(5 * i) % 300 + 3 for i in range(37)]


def test_wire_frames_round_trip_in_any_chunking() -> None:
    k, v = torch.randn(37, 3, 32) * 3, torch.randn(37, 3, 32) / 7
    begin = KVBegin("r", 5, 37, 1, 3, 32, "fp8_e4m3")
    stream = encode_frame(begin) + encode_layer(0, k, v, "fp8_e4m3")
    reader, frames, rng, i = FrameReader(), [], random.Random(1), 0
    while i < len(stream):
        n = rng.randint(1, 300)
        frames += reader.feed(stream[i:i + n])
        i += n
    assert reader.pending == 0 and [type(h) for h, _ in frames] == [KVBegin, KVLayer]
    kq, vq, ke, ve = decode_layer(frames[1][0], frames[1][1], begin)
    (rk, rke), (rv, rve) = quantize_fp8_ref(k), quantize_fp8_ref(v)
    assert torch.equal(kq.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(ke, rke)
    assert torch.equal(vq.view(torch.uint8), rv.view(torch.uint8)) and torch.equal(ve, rve)
    bf = msgspec.structs.replace(begin, wire_format="bf16")
    (h, p), = FrameReader().feed(encode_layer(0, k, v, "bf16"))
    kb, vb, _, _ = decode_layer(h, p, bf)
    assert torch.equal(kb, k.to(torch.bfloat16)) and torch.equal(vb, v.to(torch.bfloat16))
    assert h.payload_bytes / frames[1][0].payload_bytes == pytest.approx(2 * 32 / 33)


def test_disaggregated_greedy_equals_unified_and_fp8_halves_the_wire(model_dir: Path) -> None:
    with pair(model_dir, decode_kv="bf16", wire="bf16") as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=12, **GREEDY)
        assert tokens(events) == unified(model_dir, "bf16", PROMPT, max_tokens=12, **GREEDY)
        fin = events[-1]
        assert isinstance(fin, FinishEvent) and (fin.prompt_tokens, fin.completion_tokens) == (37, 12)
        bf16_bytes = httpx.get(f"{url}/stats").json()["kv_transfer"]["bytes_per_token"]
        wait_free(dec, *prefills)
    with pair(model_dir) as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=12, **GREEDY)
        assert len(tokens(events)) == 12 and tokens(events)[0] == unified(model_dir, "bf16", PROMPT, max_tokens=1,
                                                                          **GREEDY)[0]
        stats = httpx.get(f"{url}/stats").json()["kv_transfer"]
        wait_free(dec, *prefills)
    assert stats["transfers"] == 1 and stats["tokens"] == 37
    head_dim = 16  # the tiny model's; FP8 sends head_dim + 1 bytes per (token, head), BF16 2 * head_dim
    assert bf16_bytes / stats["bytes_per_token"] == pytest.approx(2 * head_dim / (head_dim + 1), rel=0.03)


def test_fp8_pages_cross_an_fp8_wire_as_stored(model_dir: Path) -> None:
    """An FP8 prefill pool's frames carry its pages' bytes and exponents as stored, not dequantised and
    quantised again (which moves the same values, a row whose largest value is 224 * 2**e as 448 * 2**(e-1)):
    the decode pool holds the prefill pool's bytes, and served tokens are the unified FP8 engine's."""
    from backend.prefill_server import _layer_frame

    pre, dec = engine(model_dir, "fp8_e4m3"), engine(model_dir, "fp8_e4m3")
    held = pre.add_request(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "p", hold=True)
    while pre.has_work():
        pre.step()
    target = dec.new_sequence(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "d")
    assert dec.reserve(target)
    cfg = pre.model.cfg
    begin = KVBegin("p", 0, len(PROMPT), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "fp8_e4m3")
    requantised = 0
    for layer in range(cfg.num_layers):
        (h, payload), = FrameReader().feed(_layer_frame(pre, held, layer, "fp8_e4m3"))
        dec.install_kv(target, layer, *decode_layer(h, payload, begin))
        sent = pre.cache.read_stored(layer, held.page_ids, len(PROMPT))
        got = dec.cache.read_stored(layer, target.page_ids, len(PROMPT))
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(sent, got))
        k, v = pre.read_kv(held, layer)
        requantised += int((quantize_fp8_ref(k)[1] != sent[2]).sum()) + int((quantize_fp8_ref(v)[1] != sent[3]).sum())
    assert requantised > 0  # the premise: the old path's bytes differ, so the equality above can fail
    pre.release_held("p")
    dec.release_reserved(target)
    with pair(model_dir, prefill_kv="fp8_e4m3") as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=12, **GREEDY)
        assert tokens(events) == unified(model_dir, "fp8_e4m3", PROMPT, max_tokens=12, **GREEDY)
        wait_free(dec, *prefills)


def test_a_transferred_requests_first_token_goes_out_before_the_next_batch_runs(model_dir: Path) -> None:
    """The first token (sampled by the prefill worker) comes out of the step that takes the activation, which
    runs no batch, so it reaches the client a decode step sooner; the next step decodes it with the others."""
    e = engine(model_dir, "fp8_e4m3")
    other = e.add_request(PROMPT[:20], SamplingParams(max_tokens=8, **GREEDY), "other")
    e.step()
    seq = e.new_sequence(PROMPT, SamplingParams(max_tokens=4, **GREEDY), "moved")
    assert e.reserve(seq)
    e.activate(seq, first_token=7)
    before = len(other.output_ids)
    outputs = e.step()
    assert [(o.seq.request_id, o.new_token, o.finished) for o in outputs] == [("moved", 7, False)]
    assert len(other.output_ids) == before and seq.output_ids == [7]
    outputs = e.step()
    assert sorted(o.seq.request_id for o in outputs) == ["moved", "other"] and len(seq.output_ids) == 2
    while e.has_work():
        e.step()
    assert e.allocator.num_free == e.allocator.num_pages


def test_seeded_sampling_continues_the_prefill_workers_generator(model_dir: Path) -> None:
    params = dict(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    with pair(model_dir, decode_kv="bf16", wire="bf16") as (url, dec, prefills):
        assert tokens(generate(url, PROMPT, **params)) == unified(model_dir, "bf16", PROMPT, **params)


def test_prefill_dying_mid_transfer_is_retried_on_the_next_prefill_worker(model_dir: Path) -> None:
    with pair(model_dir, n_prefill=2, transport=Breaking(after=1)) as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert isinstance(events[-1], FinishEvent) and len(tokens(events)) == 5
        wait_free(dec, *prefills)


def test_prefill_dying_with_no_other_worker_fails_typed_and_frees_both_pools(model_dir: Path) -> None:
    with pair(model_dir, transport=Breaking(after=1, times=5)) as (url, dec, prefills):
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent) and events[-1].code == 5003
        wait_free(dec, *prefills)
        assert httpx.get(f"{url}/stats").json()["kv_transfer"]["failed"] >= 1


def test_a_decode_worker_leaving_mid_transfer_frees_the_prefill_side(model_dir: Path) -> None:
    pre = engine(model_dir, "bf16")
    with serve_in_thread(create_worker_app(AsyncEngine(pre), "tiny", role="prefill")) as url:
        body = msgspec.json.encode(PrefillRequest(PROMPT, SamplingParams(max_tokens=4, **GREEDY), "r1"))
        with httpx.stream("POST", f"{url}/v1/prefill", content=body) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw(64))  # the transfer has started; then the reader goes away
        wait_free(pre)


def test_a_full_decode_pool_refuses_after_the_reservation_timeout(model_dir: Path) -> None:
    with pair(model_dir) as (url, dec, prefills):
        taken = dec.allocator.allocate(dec.allocator.num_pages - 2)  # someone else holds all but 2 pages
        started = time.monotonic()
        events = generate(url, PROMPT, max_tokens=20, **GREEDY)  # needs 4 pages
        assert time.monotonic() - started >= 1.0  # it waited for pages, up to the reservation timeout
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent) and events[-1].code == 3040
        assert all(all_free(p) for p in prefills)  # nothing was sent: no prefill ran
        dec.allocator.release(taken)
        assert len(tokens(generate(url, PROMPT, max_tokens=20, **GREEDY))) == 20  # and then it fits
        wait_free(dec, *prefills)


def test_a_transfer_into_a_page_that_changed_hands_is_refused(model_dir: Path) -> None:
    dec = engine(model_dir, "fp8_e4m3")
    seq = dec.new_sequence(PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    assert dec.reserve(seq)
    k = torch.randn(len(PROMPT), 2, 16)
    dec.install_kv(seq, 0, k, k)
    free_and_reallocate(dec, seq, page_index=1)  # fault (c): the reserved page is reused under the transfer
    with pytest.raises(KVIntegrityError) as info:
        dec.install_kv(seq, 1, k, k)
    assert info.value.details["cause"] == "transfer_target" and info.value.details["page"] == seq.page_ids[1]
    dec.release_reserved(seq)
    assert dec.allocator.num_free == dec.allocator.num_pages - 1  # only the page someone else now owns is in use


def test_an_abort_racing_the_last_prefill_step_still_frees_the_held_pages(model_dir: Path) -> None:
    pre = engine(model_dir, "bf16")
    seq = pre.add_request(PROMPT, SamplingParams(max_tokens=1, **GREEDY), "r-race", hold=True)
    while pre.has_work():
        pre.step()  # the prefill finishes into `held` ...
    assert pre.scheduler.held and pre.allocator.num_free < pre.allocator.num_pages
    assert not pre.release_held("other")
    pre.abort("r-race")  # ... while its reader is already gone and asked for an abort
    pre.step()
    assert all_free(pre) and seq.page_ids == []
