"""backend/layers/mla.py below the model: the Triton decode kernel path (under TRITON_INTERPRET=1)
against the torch path on the same pages, and the DSA key selection hook on both decode paths and on
prefill chunks, checked against what a selection of one key must give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.layers.mla import KeySelection, _decode, mla_attention
from backend.sampling_params import SamplingParams
from backend.scheduler import ScheduledBatch
from tests.backend.tiny_mla_models import write_tiny_deepseek_v3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v3(tmp_path_factory.mktemp("mla") / "m", seed=8)


def _mixed_step(model_dir: Path, kv_format: str) -> tuple[LLMEngine, ScheduledBatch]:
    """An engine whose next step holds two decode rows (contexts 21 and 40) and one prompt chunk of 9."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(kv_format=kv_format, kv_cache_bytes=2**20,
                                                               gemm_buckets=(), prefill_chunk_size=64))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for n in (20, 39):
        engine.add_request(torch.randint(3, 320, (n,)).tolist(), params)
    engine.step()
    engine.add_request(torch.randint(3, 320, (9,)).tolist(), params)
    batch = engine.scheduler.schedule()
    assert len(batch.decode) == 2 and [n for _, n in batch.prefill] == [9]
    return engine, batch


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_decode_kernel_path_matches_the_torch_path(model_dir: Path, kv_format: str) -> None:
    engine, batch = _mixed_step(model_dir, kv_format)
    _, meta = engine.runner.prepare(batch)
    cfg, w = engine.model.cfg, engine.model.phase_layers["decode"][1].mla
    q = torch.randn(2, cfg.num_heads, cfg.qk_head_dim)
    args = (cfg, w, q, engine.cache, 1, meta, cfg.mla_softmax_scale, True, None)
    torch_out, kernel_out = _decode(*args, False), _decode(*args, True)
    assert torch_out.abs().max() > 0.1
    torch.testing.assert_close(kernel_out, torch_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("absorb", [True, False])
def test_key_selection_masks_keys_on_decode_rows_and_prefill_chunks(model_dir: Path, absorb: bool) -> None:
    engine, batch = _mixed_step(model_dir, "fp32")
    _, meta = engine.runner.prepare(batch)
    model, cache = engine.model, engine.cache
    cfg, w = model.cfg, model.phase_layers["prefill"][2].mla
    x = torch.randn(meta.positions.shape[0], cfg.hidden_size)
    freqs = model.rope.tables(meta.positions)
    keys = meta.decode_page_table.shape[1] * cache.page_size
    chunk = meta.prefills[0]
    calls = []

    def run(sel: KeySelection | None) -> torch.Tensor:
        def select(xs: torch.Tensor, qr: torch.Tensor | None) -> KeySelection:
            calls.append((xs.shape, None if qr is None else qr.shape))
            return sel
        return mla_attention(cfg, w, w, x, 0, freqs, cache, 2, meta, absorb, select if sel is not None else None)

    plain = run(None)
    every = KeySelection(torch.ones(2, keys, dtype=torch.bool),
                         [torch.ones(chunk.num_tokens, chunk.context_len, dtype=torch.bool)])
    torch.testing.assert_close(run(every), plain, rtol=0, atol=1e-6)
    assert calls[0] == (x.shape, (x.shape[0], cfg.q_lora_rank))  # called with x and the normed q latent
    # only key 0 selected: every query's attention output is key 0's value, whatever the scores
    first = KeySelection(torch.arange(keys).expand(2, keys) == 0,
                         [torch.arange(chunk.context_len).expand(chunk.num_tokens, -1) == 0])
    got = run(first)
    starts = [meta.decode_page_table[0, 0], meta.decode_page_table[1, 0], chunk.page_table[0, 0]]
    latent0 = torch.stack([cache.read_tokens(2, torch.tensor([int(p) * cache.page_size]))[0][0] for p in starts])
    v0 = w.kv_b(latent0).view(3, cfg.num_heads, -1)[..., cfg.qk_nope_head_dim:]  # [3, H, V]
    want = w.o_proj(v0.reshape(3, -1))
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2:], want[2:].expand(chunk.num_tokens, -1), rtol=1e-5, atol=1e-5)
    assert (plain - got).abs().max() > 0.05  # the selection really changed the output
