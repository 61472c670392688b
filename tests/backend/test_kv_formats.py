"""KV formats through the engine: FP8 pages are written, read back dequantised, and close to FP32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.kv_cache import create_kv_cache
from backend.sampling_params import SamplingParams
from kernels.kv_store import dequantize_fp8_ref, quantize_fp8_ref
from tests.backend.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=21)


def engine(path: Path, kv_format: str) -> LLMEngine:
    return LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format=kv_format, kv_cache_bytes=2**20))


def test_fp8_gather_returns_the_dequantised_stored_values(tiny_dir: Path) -> None:
    e = engine(tiny_dir, "fp8_e4m3")
    g = e.cache.geometry
    k = torch.randn(5, g.num_kv_heads, g.head_dim) * torch.tensor([1e-3, 1.0, 30.0, 0.2, 5.0]).view(5, 1, 1)
    v = torch.randn(5, g.num_kv_heads, g.head_dim)
    slots = torch.tensor([3 * 16 + 2, 3 * 16 + 3, 7 * 16, 1, 7 * 16 + 15])
    e.cache.store(1, slots, k, v)
    got_k, got_v = e.cache.gather(1, torch.tensor([[3, 7, 0]]))
    flat_k, flat_v = got_k[0], got_v[0]  # positions in page-table order: page 3, page 7, page 0
    pos = torch.tensor([2, 3, 16, 32 + 1, 16 + 15])
    torch.testing.assert_close(flat_k[pos], dequantize_fp8_ref(*quantize_fp8_ref(k)), rtol=0, atol=0)
    torch.testing.assert_close(flat_v[pos], dequantize_fp8_ref(*quantize_fp8_ref(v)), rtol=0, atol=0)
    rel = ((flat_k[pos] - k).abs() / k.abs().amax(-1, keepdim=True)).max().item()
    assert 0 < rel <= 2**-4  # quantised (not a copy) and within e4m3's precision of each token's range
    assert e.cache.layer(0).k_scale is not None and int(e.cache.layer(0).k_scale.min()) == -64  # layer 0 untouched


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("tokens", [16, 37, 5])
def test_fp8_pages_read_and_written_as_stored_match_token_by_token_slots(tiny_dir: Path, tokens: int,
                                                                         device: str) -> None:
    """`read_stored` / `write_stored` move whole page rows (a last partial page as a slice of its row): on fresh
    random bytes under scattered pages they equal the token-by-token slot path (`write_tokens`, indexing by slot),
    leave every other page and layer untouched, and read back what was written."""
    cfg = engine(tiny_dir, "fp32").model.cfg
    a, b = (create_kv_cache(cfg, "fp8_e4m3", 2**20, 16, torch.float32, device) for _ in range(2))
    g = a.geometry
    gen = torch.Generator().manual_seed(tokens)
    pages = torch.randperm(g.num_pages, generator=gen)[:-(-tokens // g.page_size)].tolist()
    k, v = (torch.randint(0, 256, (tokens, g.num_kv_heads, g.head_dim), dtype=torch.uint8, generator=gen)
            .view(torch.float8_e4m3fn) for _ in range(2))
    ke, ve = (torch.randint(-40, 10, (tokens, g.num_kv_heads), dtype=torch.int8, generator=gen) for _ in range(2))
    slots = torch.tensor([pages[t // g.page_size] * g.page_size + t % g.page_size for t in range(tokens)],
                         device=device)
    a.write_tokens(1, slots, k, v, ke, ve)
    b.write_stored(1, pages, k, v, ke, ve)
    assert torch.equal(a.pages.view(torch.uint8), b.pages.view(torch.uint8))
    assert torch.equal(a.scales, b.scales)
    got = b.read_stored(1, pages, tokens)
    assert all(torch.equal(x.view(torch.uint8).cpu(), y.view(torch.uint8)) for x, y in zip(got, (k, v, ke, ve)))


def test_fp8_kv_stays_close_to_fp32_kv(tiny_dir: Path) -> None:
    ids = torch.randint(0, 320, (120,)).tolist()
    ref = engine(tiny_dir, "fp32").score(ids)
    fp8 = engine(tiny_dir, "fp8_e4m3")
    got = fp8.score(ids)
    diff = (got - ref).abs()
    assert diff.max().item() > 0  # the format is really in use
    assert diff.mean().item() < 0.01 and diff.max().item() < 0.1
    assert abs(got.mean().item() - ref.mean().item()) < 0.005  # perplexity within ~0.5%
    assert fp8.allocator.num_free == fp8.allocator.num_pages


def test_fp8_engine_serves_and_frees_pages(tiny_dir: Path) -> None:
    e = engine(tiny_dir, "fp8_e4m3")
    seqs = [e.add_request([3 + i, 4, 5], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            for i in range(4)]
    while e.has_work():
        e.step()
    assert all(len(s.output_ids) == 20 for s in seqs)
    assert e.snapshot()["kv_format"] == "fp8_e4m3" and e.snapshot()["kv_bytes_per_token"] == 3 * 2 * 2 * (16 + 1)
    assert e.allocator.num_free == e.allocator.num_pages
