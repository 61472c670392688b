"""Decode steps that run every layer in one C call (`backend/layers/fused_decode.py`) give the Python
layers' results bit for bit, take only the steps and models they can, and lose nothing when they refuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.sampling_params import SamplingParams
from kernels import cpu_decode_layers, cpu_gemv, cpu_gemv_f32, cpu_gemv_int4
from kernels.cpu_decode_layers import DecodeLayers, LayerTensors, Refused
from tests.backend.engine_spy import record_sampled_logits
from tests.backend.tiny_models import write_tiny_model

needs_kernels = pytest.mark.skipif(not cpu_decode_layers.available(),
                                   reason=f"fused decode layers unavailable: {cpu_decode_layers.build_error()}")


@pytest.fixture(autouse=True)
def gemv_takes_whole_prompts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The C GEMV's row limit is chosen per host and process (its tile kernel timed, bfloat16 widening where it
    pays): these tests pin the choice that keeps a 108-row prompt step on the GEMV, as every host can run it."""
    from backend import gemm_widen

    monkeypatch.setenv("EDGESERVE_BF16_WIDEN", "0")
    if cpu_gemv.has_avx512_bf16():
        monkeypatch.setenv("EDGESERVE_GEMV_TILES", "dp")
    for cached in (cpu_gemv.tile_mode, gemm_widen.widening_pays):  # per-process choices: made again, both sides
        cached.cache_clear()
    yield
    for cached in (cpu_gemv.tile_mode, gemm_widen.widening_pays):
        cached.cache_clear()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64, as the attention kernel's vector path takes; 3 query heads a KV head as SmolLM2
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=11, hidden_size=192,
                            num_attention_heads=3, num_key_value_heads=1, intermediate_size=256)


def generate(model_dir: Path, fused: bool, dtype: str = "bfloat16", kv_format: str = "bf16",
             decode_weights: str | None = None) -> tuple[LLMEngine, list[list[int]], list[list[torch.Tensor]]]:
    """Nine prompts of different lengths (steps of up to 9 decode rows: the GEMV's per-row code and its
    tiles), 12 greedy tokens each, the last three arriving while the first six decode (steps of decode and
    prompt rows); the engine, every request's tokens and every sampled step's logits."""
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(dtype=dtype, kv_format=kv_format,
                                                               kv_cache_bytes=4 * 2**20, decode_weights=decode_weights,
                                                               int4_group_size=32))
    engine.model.fused_decode = fused
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request([1, 2 + i, 3, 4 + 7 * i] * (2 + i), params) for i in range(6)]
    seen = record_sampled_logits(engine)
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request([1, 2 + i, 3, 4 + 7 * i] * (2 + i), params) for i in range(6, 9)]
    while engine.has_work():
        engine.step()
    return engine, [s.output_ids for s in seqs], [seen[s.request_id] for s in seqs]


@needs_kernels
@pytest.mark.parametrize("kv_format,decode_weights", [("bf16", None), ("fp8_e4m3", None), ("fp8_e4m3", "int4")])
def test_fused_steps_equal_the_python_layers_bit_for_bit(tiny_dir: Path, kv_format: str,
                                                         decode_weights: str | None) -> None:
    if decode_weights == "int4" and not cpu_gemv_int4.pays():
        pytest.skip("INT4 linears run torch's INT4 GEMM on this host, which the fused call does not take")
    fused, tokens, logits = generate(tiny_dir, True, kv_format=kv_format, decode_weights=decode_weights)
    plain, tokens_ref, logits_ref = generate(tiny_dir, False, kv_format=kv_format, decode_weights=decode_weights)
    assert plain.model.fused_steps == 0
    # every step took the fused call: the decode steps, the steps of decode and prompt rows and the first
    # prompt step (108 rows, within the GEMV's); with INT4 decode weights, whose prompt rows run the bf16
    # prefill weights, the mixed steps as two calls (prompt rows, then decode rows)
    phases = fused.model.steps_by_phase
    assert fused.model.fused_steps == sum(phases.values()) and phases["mixed"] >= 1 and phases["prefill"] >= 1
    assert phases["decode"] >= 11
    two_formats = fused.model.phase_layers["decode"] is not fused.model.phase_layers["prefill"]
    assert two_formats == (decode_weights == "int4")
    assert tokens == tokens_ref
    for ours, ref in zip(logits, logits_ref):
        assert len(ours) == len(ref) == 12
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
    # the KV pages the steps wrote (and the FP8 exponents) are the same bytes
    assert torch.equal(fused.cache.pages.view(torch.uint8), plain.cache.pages.view(torch.uint8))
    if kv_format == "fp8_e4m3":
        assert torch.equal(fused.cache.scales, plain.cache.scales)


@needs_kernels
@pytest.mark.skipif(not (cpu_gemv.available() and cpu_gemv.amx_available()), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("decode_weights", [None, "int4"])
def test_fused_steps_on_the_amx_tiles_equal_the_python_layers_bit_for_bit(tiny_dir: Path, decode_weights: str | None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused call hands the AMX tiles' code to the bfloat16 and INT4 GEMVs as the linears do: the same bits."""
    if decode_weights == "int4" and not cpu_gemv_int4.pays():
        pytest.skip("INT4 linears run torch's INT4 GEMM on this host, which the fused call does not take")
    monkeypatch.setenv("EDGESERVE_GEMV_TILES", "amx")
    cpu_gemv.tile_mode.cache_clear()
    fused, tokens, logits = generate(tiny_dir, True, decode_weights=decode_weights)
    plain, tokens_ref, logits_ref = generate(tiny_dir, False, decode_weights=decode_weights)
    assert fused.model.fused_steps == sum(fused.model.steps_by_phase.values()) and plain.model.fused_steps == 0
    assert tokens == tokens_ref
    assert all(torch.equal(a, b) for ours, ref in zip(logits, logits_ref) for a, b in zip(ours, ref))
    assert torch.equal(fused.cache.pages.view(torch.uint8), plain.cache.pages.view(torch.uint8))


needs_float32 = pytest.mark.skipif(not cpu_decode_layers.float32_available(),
                                   reason="the float32 kernels of the fused decode layers do not build here")


@needs_kernels
@needs_float32
@pytest.mark.parametrize("kv_format", ["fp32", "fp8_e4m3"])
def test_float32_fused_steps_agree_with_the_python_layers(tiny_dir: Path, kv_format: str) -> None:
    """A float32 model's decode steps run the kernels' float32 twins in one call: the Python layers run torch's
    float32 ops, so the two agree to float32 rounding (same greedy tokens, logits and pages within it), and
    steps past the float32 GEMV's rows keep the Python layers (the 108-row prompt step and the 114-row step of
    decode and prompt rows: past 32 rows on AVX-512, within the AVX2 copy's 128)."""
    fused, tokens, logits = generate(tiny_dir, True, dtype="float32", kv_format=kv_format)
    plain, tokens_ref, logits_ref = generate(tiny_dir, False, dtype="float32", kv_format=kv_format)
    assert plain.model.fused_steps == 0
    phases = fused.model.steps_by_phase
    # steps of up to 9 decode rows: all within the float32 GEMV's rows (32 on AVX-512, 128 AVX2), some in plain C (8)
    assert phases["decode"] >= 11
    assert fused.model.fused_steps >= (phases["decode"] if cpu_gemv_f32.max_rows() >= 9 else 1)
    assert (fused.model.fused_steps < sum(phases.values())) == (cpu_gemv_f32.max_rows() < 114)
    assert tokens == tokens_ref
    for ours, ref in zip(logits, logits_ref):
        assert len(ours) == len(ref) == 12
        for a, b in zip(ours, ref):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if kv_format == "fp32":
        torch.testing.assert_close(fused.cache.pages, plain.cache.pages, rtol=1e-4, atol=1e-5)
    else:  # a value at a rounding boundary of FP8 may take the neighbouring code: nearly all bytes agree
        same = fused.cache.pages.view(torch.uint8) == plain.cache.pages.view(torch.uint8)
        assert same.float().mean() > 0.99


@needs_kernels
def test_a_refused_prompt_call_leaves_a_two_format_step_untouched(tiny_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over two formats runs its prompt rows' call first, the one call the attention kernel may refuse
    (tiles): refused there, the step runs the Python layers from the state it found, and every logit and
    page byte is still the plain run's (a decode call first would have added its rows' layers twice)."""
    if not cpu_gemv_int4.pays():
        pytest.skip("INT4 linears run torch's INT4 GEMM on this host, which the fused call does not take")
    real, refused = DecodeLayers.run, []

    def refuse_tiles(self, h, x, freqs, slots, table, lens, scale, tiles=None):  # noqa: ANN001, ANN202
        if tiles is not None:
            refused.append(h.shape[0])
            raise Refused("refused for the test")
        return real(self, h, x, freqs, slots, table, lens, scale, tiles)

    monkeypatch.setattr(DecodeLayers, "run", refuse_tiles)
    fused, tokens, logits = generate(tiny_dir, True, kv_format="fp8_e4m3", decode_weights="int4")
    monkeypatch.undo()
    plain, tokens_ref, logits_ref = generate(tiny_dir, False, kv_format="fp8_e4m3", decode_weights="int4")
    phases = fused.model.steps_by_phase
    assert len(refused) == phases["mixed"] + phases["prefill"] and fused.model.fused_steps == phases["decode"]
    assert tokens == tokens_ref
    assert all(torch.equal(a, b) for ours, ref in zip(logits, logits_ref) for a, b in zip(ours, ref))
    assert torch.equal(fused.cache.pages.view(torch.uint8), plain.cache.pages.view(torch.uint8))


@needs_kernels
def test_models_the_fused_call_does_not_take_run_the_python_layers(tmp_path: Path) -> None:
    biased = write_tiny_model(tmp_path / "qwen2", "qwen2", seed=3, hidden_size=192, num_attention_heads=3,
                              num_key_value_heads=1)  # q/k/v biases
    engine, tokens, _ = generate(biased, True)
    assert engine.model.fused_steps == 0 and engine.model.steps_by_phase["decode"] > 0
    assert all(len(t) == 12 for t in tokens)
    engine, _, _ = generate(biased, True, dtype="float32", kv_format="fp32")  # float32 compute, biases still
    assert engine.model.fused_steps == 0


def test_the_environment_switch_turns_it_off(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESERVE_FUSED_DECODE", "0")
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="bfloat16", kv_format="bf16",
                                                              kv_cache_bytes=2**20))
    assert engine.model.fused_decode is False
    monkeypatch.setenv("EDGESERVE_FUSED_DECODE", "1")
    assert LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="bfloat16", kv_format="bf16",
                                                            kv_cache_bytes=2**20)).model.fused_decode is True


def random_layers(n: int, hidden: int, heads: int, kv_heads: int, hd: int, inter: int, pages: int,
                  page_size: int) -> list[LayerTensors]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.05).to(torch.bfloat16)

    return [LayerTensors(w((heads + 2 * kv_heads) * hd, hidden), w(hidden, heads * hd), w(2 * inter, hidden),
                         w(hidden, inter), 1 + w(hidden), 1 + w(hidden) if i + 1 < n else None,
                         torch.zeros(pages, page_size, kv_heads, hd, dtype=torch.bfloat16),
                         torch.zeros(pages, page_size, kv_heads, hd, dtype=torch.bfloat16)) for i in range(n)]


@needs_kernels
def test_a_slot_outside_the_pool_raises_before_anything_changes() -> None:
    layers = random_layers(2, 64, 2, 1, 64, 96, pages=4, page_size=16)
    fused = DecodeLayers(layers, 2, 1, 64, 1e-5)
    h = torch.randn(2, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    before = h.clone()
    freqs = torch.polar(torch.ones(2, 1, 32), torch.randn(2, 1, 32))
    table = torch.tensor([[0], [1]], dtype=torch.int64)
    with pytest.raises(IndexError):
        fused.run(h, x, freqs, torch.tensor([3, 64], dtype=torch.int64), table, torch.tensor([4, 1]), 0.125)
    assert torch.equal(h, before)  # the residual stream is untouched
    assert all(not layer.k_pages.any() and not layer.v_pages.any() for layer in layers)  # nothing stored


def test_shapes_beyond_the_attention_kernel_are_refused_at_build() -> None:
    with pytest.raises(ValueError):
        DecodeLayers(random_layers(1, 64, 2, 1, 512, 96, pages=2, page_size=16), 2, 1, 512, 1e-5)


@needs_kernels
def test_step_tensors_of_the_wrong_shape_are_refused_before_the_c_call() -> None:
    fused = DecodeLayers(random_layers(1, 64, 2, 1, 64, 96, pages=4, page_size=16), 2, 1, 64, 1e-5)
    h, x = torch.randn(2, 64).to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16)
    before = h.clone()
    freqs = torch.polar(torch.ones(2, 1, 32), torch.randn(2, 1, 32))
    slots, table, lens = torch.tensor([0, 16]), torch.tensor([[0], [1]]), torch.tensor([1, 1])
    for bad in (dict(x=x[:1]), dict(freqs=freqs[:1]), dict(slots=slots[:1]), dict(table=table[:1]),
                dict(h=h.float())):
        args = dict(h=h, x=x, freqs=freqs, slots=slots, table=table) | bad
        with pytest.raises(ValueError):
            fused.run(args["h"], args["x"], args["freqs"], args["slots"], args["table"], lens, 0.125)
    assert torch.equal(h, before)
    fused.run(h, x, freqs, slots, table, lens, 0.125)  # the same step with its own tensors runs
    assert not torch.equal(h, before)
