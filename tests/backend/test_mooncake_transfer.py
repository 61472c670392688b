"""KV transfer on the Mooncake Transfer Engine (TCP on loopback): the prefill worker writes its pages
straight into the decode worker's reserved pages; outputs equal the unified engine's, integrity
faults abort with typed errors, and every failure leaves both pools at their full free count."""

from __future__ import annotations

import contextlib
import ctypes
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from backend.async_engine import AsyncEngine
from backend.decode_coordinator import DecodeCoordinator
from backend.engine import EngineConfig, LLMEngine
from backend.errors import KVIntegrityError
from backend.kv_cache import create_kv_cache
from backend.kv_regions import incompatibility, layer_bytes, layers_runs, pool_layout
from backend.kv_transfer import KVBegin, KVLayer
from backend.mooncake_runtime import MooncakeUnavailable, load
from backend.protocol import ErrorEvent, FinishEvent
from backend.sampling_params import SamplingParams
from backend.worker import create_worker_app
from tests.backend.servers import serve_in_thread
from tests.backend.test_disagg import GREEDY, PROMPT, Breaking, generate, tokens, unified, wait_free
from tests.backend.test_glm_moe_dsa import write_tiny_glm_moe_dsa
from tests.backend.tiny_models import write_tiny_model

try:
    load()
    MOONCAKE = None
except MooncakeUnavailable as exc:
    MOONCAKE = str(exc)
needs_mooncake = pytest.mark.skipif(MOONCAKE is not None, reason=f"Mooncake unavailable: {MOONCAKE}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mooncake") / "m", "llama", seed=21)


def engine(model_dir: Path, kv_format: str, page_size: int = 16) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=2**20, page_size=page_size,
                                                             max_model_len=256, gemm_buckets=(), kv_format=kv_format))


class Recording:
    """The real transport, remembering the frames' headers and the sequence it targeted."""

    def __init__(self, inner) -> None:
        self.inner, self.headers, self.seq = inner, [], None

    def target(self, seq, deadline_s: float):
        self.seq = seq
        return self.inner.target(seq, deadline_s)

    async def fetch(self, url, request):
        async for header, payload in self.inner.fetch(url, request):
            self.headers.append((header, len(payload)))
            yield header, payload


@contextlib.contextmanager
def pair(model_dir: Path, prefill_kv: str = "fp8_e4m3", decode_kv: str = "fp8_e4m3", n_prefill: int = 1,
         wrap=lambda t: t, prefill_page: int = 16, decode_page: int = 16, **coord_kw
         ) -> Iterator[tuple[str, LLMEngine, list[LLMEngine], object]]:
    from backend.mooncake_transfer import MooncakeKVTransport

    prefills = [engine(model_dir, prefill_kv, prefill_page) for _ in range(n_prefill)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(create_worker_app(AsyncEngine(p), "tiny", role="prefill")))
                for p in prefills]
        dec = engine(model_dir, decode_kv, decode_page)
        adec = AsyncEngine(dec)
        transport = wrap(MooncakeKVTransport(dec))
        kw = dict(reserve_timeout_s=1.0, transfer_timeout_s=10.0, wire_format="fp8_e4m3") | coord_kw
        coord = DecodeCoordinator(adec, urls, transport, **kw)
        url = stack.enter_context(serve_in_thread(create_worker_app(adec, "tiny", role="decode", coordinator=coord)))
        yield url, dec, prefills, transport


# ----------------------------------------------------------------------------- byte runs (no library)

def _copy_runs(runs: tuple[list[int], list[int], list[int]]) -> None:
    for s, d, n in zip(*runs):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "bf16"])
@pytest.mark.parametrize("src_ps,dst_ps", [(16, 16), (16, 8), (8, 32)])
@pytest.mark.parametrize("at_once", [False, True], ids=["per_layer", "layers_1_on_at_once"])
def test_byte_runs_copy_exactly_the_prompts_tokens(model_dir: Path, fmt: str, src_ps: int, dst_ps: int,
                                                   at_once: bool) -> None:
    cfg = engine(model_dir, "fp32").model.cfg
    rng = random.Random(src_ps * 100 + dst_ps)
    src = create_kv_cache(cfg, fmt, 2**18, src_ps, torch.float32)
    dst = create_kv_cache(cfg, fmt, 2**18, dst_ps, torch.float32)
    T = 45
    src_pages = rng.sample(range(src.num_pages), -(-T // src_ps))
    dst_pages = sorted(rng.sample(range(dst.num_pages), -(-T // dst_ps)))  # partly consecutive: merged runs
    slots = lambda pages, ps: torch.tensor([pages[t // ps] * ps + t % ps for t in range(T)])  # noqa: E731
    for layer in range(cfg.num_layers):
        src.store(layer, slots(src_pages, src_ps), torch.randn(T, cfg.num_kv_heads, cfg.head_dim) * 3,
                  torch.randn(T, cfg.num_kv_heads, cfg.head_dim))
    poison = dst.pages.view(torch.uint8)
    poison.fill_(0x55)
    before = dst.pages.clone()
    if at_once:  # layer 0 alone, the others from runs cut once at layer 1 and moved by the layer strides
        _copy_runs(layers_runs(pool_layout(src), src_pages, pool_layout(dst), dst_pages, range(1), T))
        runs = layers_runs(pool_layout(src), src_pages, pool_layout(dst), dst_pages, range(1, cfg.num_layers), T)
        _copy_runs(runs)
        assert sum(runs[2]) == layer_bytes(pool_layout(src), T) * (cfg.num_layers - 1)
    else:
        for layer in range(cfg.num_layers):
            _copy_runs(layers_runs(pool_layout(src), src_pages, pool_layout(dst), dst_pages, range(layer, layer + 1),
                                   T))
    for layer in range(cfg.num_layers):
        got = dst.read_tokens(layer, slots(dst_pages, dst_ps))
        want = src.read_tokens(layer, slots(src_pages, src_ps))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    written = torch.zeros(dst.num_pages * dst_ps, dtype=torch.bool)
    written[slots(dst_pages, dst_ps)] = True  # nothing but the prompt's own slots changed
    flat_now, flat_before = dst.pages.view(torch.uint8), before.view(torch.uint8)
    per_slot = flat_now.view(cfg.num_layers, 2, -1, cfg.num_kv_heads * cfg.head_dim * dst.pages.element_size())
    per_slot_before = flat_before.view_as(per_slot)
    assert torch.equal(per_slot[:, :, ~written], per_slot_before[:, :, ~written])


def test_consecutive_pages_merge_into_one_run_per_part(model_dir: Path) -> None:
    cfg = engine(model_dir, "fp32").model.cfg
    a = pool_layout(create_kv_cache(cfg, "fp8_e4m3", 2**18, 16, torch.float32))
    b = pool_layout(create_kv_cache(cfg, "fp8_e4m3", 2**18, 16, torch.float32))
    src, dst, lens = layers_runs(a, [3, 4, 5], b, [7, 8, 9], range(1, 2), 40)
    assert len(src) == 4  # K values, V values, K scales, V scales: one run each
    assert sum(lens) == 40 * 2 * cfg.num_kv_heads * (cfg.head_dim + 1)


def test_incompatible_pools_are_named(model_dir: Path) -> None:
    cfg = engine(model_dir, "fp32").model.cfg
    fp8 = pool_layout(create_kv_cache(cfg, "fp8_e4m3", 2**18, 16, torch.float32))
    bf16 = pool_layout(create_kv_cache(cfg, "bf16", 2**18, 16, torch.float32))
    assert incompatibility(fp8, pool_layout(create_kv_cache(cfg, "fp8_e4m3", 2**19, 32, torch.float32))) is None
    assert "formats differ" in incompatibility(bf16, fp8)


# ----------------------------------------------------------------------------- served on loopback

@needs_mooncake
@pytest.mark.parametrize("kv,pages,batch_layers", [("fp8_e4m3", (16, 16), None), ("bf16", (16, 8), None),
                                                   ("fp8_e4m3", (16, 16), 2)])
def test_direct_transfer_gives_the_unified_greedy_tokens(model_dir: Path, kv: str, pages: tuple[int, int],
                                                         batch_layers: int | None, monkeypatch) -> None:
    """One batched write carries every layer of a short prompt, or as many whole layers as fit in the write
    budget (`batch_layers` layers' bytes here); either way each layer lands once and the tokens are unified's."""
    from backend import mooncake_transfer
    from backend.mooncake_runtime import TransferEngineHandle

    writes: list[int] = []
    real_write = TransferEngineHandle.write

    def counting(self, peer, src, dst, lengths) -> None:
        writes.append(sum(lengths))
        real_write(self, peer, src, dst, lengths)

    monkeypatch.setattr(TransferEngineHandle, "write", counting)
    with pair(model_dir, kv, kv, wrap=Recording, prefill_page=pages[0], decode_page=pages[1]) as \
            (url, dec, prefills, rec):
        cfg = dec.model.cfg
        per_layer = len(PROMPT) * 2 * cfg.num_kv_heads * cfg.head_dim * (2 if kv == "bf16" else 1) + \
            (len(PROMPT) * 2 * cfg.num_kv_heads if kv == "fp8_e4m3" else 0)
        if batch_layers is not None:
            monkeypatch.setattr(mooncake_transfer, "WRITE_BATCH_BYTES", batch_layers * per_layer)
        events = generate(url, PROMPT, max_tokens=12, **GREEDY)
        assert tokens(events) == unified(model_dir, kv, PROMPT, max_tokens=12, **GREEDY)
        assert isinstance(events[-1], FinishEvent)
        begin = next(h for h, _ in rec.headers if isinstance(h, KVBegin))
        layers = [(h, n) for h, n in rec.headers if isinstance(h, KVLayer)]
        assert begin.direct and [h.layer for h, _ in layers] == list(range(cfg.num_layers))
        assert all(n == 0 and h.direct_bytes == per_layer for h, n in layers)  # no payload: bytes went direct
        batch = batch_layers or cfg.num_layers
        assert writes == [per_layer * min(batch, cfg.num_layers - i) for i in range(0, cfg.num_layers, batch)]
        stats = httpx.get(f"{url}/stats").json()["kv_transfer"]
        assert stats["transfers"] == stats["direct"] == 1 and stats["tokens"] == len(PROMPT)
        assert 0 < stats["layer_seconds"] < stats["seconds"]  # the layers' movement, not the prefill's compute
        wait_free(dec, *prefills)


@needs_mooncake
def test_a_pool_of_another_format_falls_back_to_frames(model_dir: Path) -> None:
    with pair(model_dir, prefill_kv="bf16", decode_kv="fp8_e4m3", wrap=Recording) as (url, dec, prefills, rec):
        events = generate(url, PROMPT, max_tokens=6, **GREEDY)
        assert tokens(events)[0] == unified(model_dir, "bf16", PROMPT, max_tokens=1, **GREEDY)[0]
        assert len(tokens(events)) == 6
        begin = next(h for h, _ in rec.headers if isinstance(h, KVBegin))
        assert not begin.direct and all(n > 0 for h, n in rec.headers if isinstance(h, KVLayer))
        wait_free(dec, *prefills)


@needs_mooncake
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_latent_pages_and_indexer_keys_go_direct(tmp_path: Path, arch: str) -> None:
    from tests.backend.tiny_mla_models import write_tiny_deepseek_v3

    d = (write_tiny_deepseek_v3(tmp_path / "m", seed=3) if arch == "deepseek_v3"
         else write_tiny_glm_moe_dsa(tmp_path / "m", seed=1))
    prompt = PROMPT[:29]
    with pair(d, wrap=Recording) as (url, dec, prefills, rec):
        events = generate(url, prompt, max_tokens=10, **GREEDY)
        assert tokens(events) == unified(d, "fp8_e4m3", prompt, max_tokens=10, **GREEDY)
        assert next(h for h, _ in rec.headers if isinstance(h, KVBegin)).direct
        names = [r.name for r in rec.inner.layout.regions]
        assert names == (["latent"] if arch == "deepseek_v3" else ["latent", "index"])
        wait_free(dec, *prefills)


class Reallocating(Recording):
    """Integrity fault (c) on a direct transfer: once layer 0's frame has come, the decode worker's reserved
    page 1 is released under the request and taken by someone else, with layer 1 written into it (in the same
    batched write as layer 0, or in the next one: the check at layer 1's frame finds it either way)."""

    def __init__(self, inner, dec: LLMEngine) -> None:
        super().__init__(inner)
        self.dec, self.page = dec, None

    async def fetch(self, url, request):
        from backend.fault_injection import free_and_reallocate

        async for header, payload in super().fetch(url, request):
            if isinstance(header, KVLayer) and header.layer == 0:
                self.page = free_and_reallocate(self.dec, self.seq, page_index=1, new_owner_writes=False)
            yield header, payload


@needs_mooncake
def test_a_direct_write_into_a_reallocated_page_aborts_typed(model_dir: Path) -> None:
    with contextlib.ExitStack() as stack:
        from backend.mooncake_transfer import MooncakeKVTransport

        pre = engine(model_dir, "fp8_e4m3")
        purl = stack.enter_context(serve_in_thread(create_worker_app(AsyncEngine(pre), "tiny", role="prefill")))
        dec = engine(model_dir, "fp8_e4m3")
        adec = AsyncEngine(dec)
        transport = Reallocating(MooncakeKVTransport(dec), dec)
        coord = DecodeCoordinator(adec, [purl], transport, reserve_timeout_s=1.0, transfer_timeout_s=2.0,
                                  direct_grace_s=0.2)
        url = stack.enter_context(serve_in_thread(create_worker_app(adec, "tiny", role="decode", coordinator=coord)))
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent)
        assert events[-1].type == "KVIntegrityError" and str(transport.page) in events[-1].message
        assert dec.integrity.overwritten.get(transport.page) == dec.allocator.tags_of([transport.page])[0]
        dec.allocator.release([transport.page])  # the anonymous new owner leaves
        wait_free(dec, pre, timeout=5.0)


def test_the_new_owner_of_an_overwritten_page_is_ended_at_its_next_step(model_dir: Path) -> None:
    dec = engine(model_dir, "fp8_e4m3")
    victim = dec.new_sequence(PROMPT, SamplingParams(max_tokens=4, **GREEDY), "victim")
    assert dec.reserve(victim)
    page = victim.page_ids[0]
    dec.allocator.release([page])  # released under the reservation (a double release elsewhere) ...
    free = dec.allocator._free  # ... and first in line for the next owner (test-only reach)
    free.remove(page)
    free.appendleft(page)
    other = dec.add_request(PROMPT[:20], SamplingParams(max_tokens=8, **GREEDY), "other")
    dec.step()
    assert page in other.page_ids and not other.finish_reason
    with pytest.raises(KVIntegrityError) as info:  # the direct write landed, then the check ran
        dec.check_transfer_target(victim, written=True)
    assert info.value.details["cause"] == "transfer_target"
    outputs = dec.step()
    assert other.finish_reason == "error"
    err = next(o.error for o in outputs if o.seq is other)
    assert isinstance(err, KVIntegrityError) and err.details["cause"] == "overwritten"
    assert dec.stats["integrity_aborts_by_cause"]["overwritten"] == 1
    dec.release_reserved(victim)
    assert dec.allocator.num_free == dec.allocator.num_pages


@needs_mooncake
def test_a_direct_transfer_cut_mid_way_is_not_retried_and_frees_both_pools_after_the_deadline(
        model_dir: Path) -> None:
    with pair(model_dir, n_prefill=2, wrap=lambda t: Breaking(after=1, inner=t), transfer_timeout_s=1.0,
              direct_grace_s=0.3) as (url, dec, prefills, _):
        started = time.monotonic()
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent) and events[-1].code == 5003
        assert sum(p.stats["prompt_tokens"] for p in prefills) == len(PROMPT)  # one prefill worker, no retry
        assert dec.allocator.num_free < dec.allocator.num_pages  # quarantined until the deadline
        wait_free(dec, *prefills, timeout=5.0)
        assert time.monotonic() - started >= 1.0


@needs_mooncake
def test_a_refused_write_ends_typed_and_frees_both_pools(model_dir: Path) -> None:
    class WrongPeer(Recording):
        def target(self, seq, deadline_s):
            t = super().target(seq, deadline_s)
            return type(t)("127.0.0.1:1", t.layout, t.page_ids, t.deadline_s)  # nobody listens there

    with pair(model_dir, wrap=WrongPeer, transfer_timeout_s=1.0, direct_grace_s=0.2) as (url, dec, prefills, _):
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent)
        assert events[-1].type == "BackendUnavailable" and "Mooncake write" in events[-1].message
        wait_free(dec, *prefills, timeout=5.0)


@needs_mooncake
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_pools_go_direct(model_dir: Path) -> None:
    """GPU pools on both sides (the CUDA build of Mooncake reads and writes device memory)."""
    from backend.mooncake_transfer import MooncakeKVTransport

    def cuda_engine() -> LLMEngine:
        return LLMEngine.from_pretrained(model_dir, EngineConfig(kv_cache_bytes=2**20, page_size=16, max_model_len=256,
                                                                 gemm_buckets=(), kv_format="fp8_e4m3", device="cuda"))

    pre, dec = cuda_engine(), cuda_engine()
    with contextlib.ExitStack() as stack:
        purl = stack.enter_context(serve_in_thread(create_worker_app(AsyncEngine(pre), "tiny", role="prefill")))
        try:
            transport = Recording(MooncakeKVTransport(dec))
        except MooncakeUnavailable as exc:  # the non-CUDA build cannot register device memory
            pytest.skip(f"this Mooncake build cannot register GPU memory: {exc}")
        coord = DecodeCoordinator(AsyncEngine(dec), [purl], transport, reserve_timeout_s=1.0, transfer_timeout_s=10.0)
        url = stack.enter_context(serve_in_thread(create_worker_app(coord.engine, "tiny", role="decode",
                                                                    coordinator=coord)))
        events = generate(url, PROMPT, max_tokens=8, **GREEDY)
        ref = cuda_engine()
        want = ref.add_request(PROMPT, SamplingParams(max_tokens=8, **GREEDY))
        while ref.has_work():
            ref.step()
        assert tokens(events) == want.output_ids
        assert next(h for h, _ in transport.headers if isinstance(h, KVBegin)).direct
        wait_free(dec, pre)


class Late(Recording):
    """`target_s`: the target's deadline is shortened to this (the prefill worker refuses to start a
    layer write after it); `stall_s`: the first frame is held that long (the decode side times out)."""

    def __init__(self, inner, target_s: float | None = None, stall_s: float = 0.0) -> None:
        super().__init__(inner)
        self.target_s, self.stall_s = target_s, stall_s

    def target(self, seq, deadline_s):
        t = super().target(seq, deadline_s)
        return t if self.target_s is None else type(t)(t.session_id, t.layout, t.page_ids, self.target_s)

    async def fetch(self, url, request):
        import asyncio

        first = True
        async for header, payload in super().fetch(url, request):
            if first:
                await asyncio.sleep(self.stall_s)
                first = False
            yield header, payload


@needs_mooncake
@pytest.mark.parametrize("late", [dict(target_s=0.0), dict(stall_s=1.5)], ids=["prefill_deadline", "decode_timeout"])
def test_a_late_direct_transfer_fails_typed_and_frees_both_pools_after_its_deadline(model_dir: Path, late) -> None:
    """prefill_deadline: the prefill worker starts no layer write after the target's deadline;
    decode_timeout: the decode worker gives up after transfer_timeout_s. Either way a typed error,
    no retry, and the decode pages come back only once no write can still land."""
    with pair(model_dir, n_prefill=2, wrap=lambda t: Late(t, **late), transfer_timeout_s=1.0,
              direct_grace_s=0.3) as (url, dec, prefills, _):
        started = time.monotonic()
        events = generate(url, PROMPT, max_tokens=5, **GREEDY)
        assert tokens(events) == [] and isinstance(events[-1], ErrorEvent) and events[-1].code == 5003
        assert ("deadline" if "target_s" in late else "timed out") in events[-1].message
        assert sum(p.stats["prompt_tokens"] for p in prefills) == len(PROMPT)  # not retried
        wait_free(dec, *prefills, timeout=5.0)
        if "stall_s" in late:
            assert time.monotonic() - started >= 1.0 + 0.3  # deadline + grace
        assert httpx.get(f"{url}/stats").json()["kv_transfer"]["direct"] == 0
