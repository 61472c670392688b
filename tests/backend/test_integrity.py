"""KV page integrity: injected page-reuse faults are caught before any token is read from a foreign page."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backend.engine import EngineConfig, LLMEngine
from backend.errors import KVIntegrityError
from backend.fault_injection import free_and_reallocate, stale_page_table
from backend.sampling_params import SamplingParams
from tests.backend.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=33)


PROMPTS = [[3 + i, 7, 9, 11 + i] * (3 + i) for i in range(5)]


def run(tiny_dir: Path, fault=None, victim_index: int = 2, kv_format: str = "fp8_e4m3", device: str = "cpu"):
    """Five requests; after 4 steps optionally inject `fault` on one. Returns (engine, seqs, outputs per seq)."""
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format=kv_format,
                                                              kv_cache_bytes=2**20, device=device))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    errors: dict[str, KVIntegrityError] = {}
    tokens_after_fault: list[int] = []
    step = 0
    while engine.has_work():
        step += 1
        if step == 5 and fault is not None:
            fault(engine, seqs[victim_index])
            before = len(seqs[victim_index].output_ids)
        for out in engine.step():
            if out.error is not None:
                errors[out.seq.request_id] = out.error
    if fault is not None:
        tokens_after_fault = seqs[victim_index].output_ids[before:]
    return engine, seqs, errors, tokens_after_fault


@pytest.mark.parametrize("fault", [
    lambda e, s: free_and_reallocate(e, s, page_index=0),
    lambda e, s: free_and_reallocate(e, s, page_index=1, new_owner_writes=False),
    stale_page_table,
], ids=["freed-and-reused", "freed-and-reallocated", "stale-table-after-preemption"])
def test_fault_is_caught_only_the_victim_aborts_and_others_match_a_clean_run(tiny_dir: Path, fault) -> None:
    _, clean, clean_errors, _ = run(tiny_dir)
    assert not clean_errors
    engine, seqs, errors, after = run(tiny_dir, fault)
    victim = seqs[2]
    assert set(errors) == {victim.request_id}
    err = errors[victim.request_id]
    assert err.code == KVIntegrityError.code and err.details["request_id"] == victim.request_id
    assert err.details["expected_tag"] != err.details["found_tag"]
    assert after == []  # not one token after the fault: the check ran before the step that would read it
    assert victim.finish_reason == "error"
    for i, (s, c) in enumerate(zip(seqs, clean)):
        if i != 2:
            assert s.output_ids == c.output_ids and s.finish_reason == "length"
    assert engine.snapshot()["integrity_aborts"] == 1 and engine.stats["integrity_checks"] > 0
    # the pages the fault handed to other owners are theirs; everything the victim still owned came back
    alive = engine.allocator.num_pages - engine.allocator.num_free
    assert alive == len([p for p in range(engine.allocator.num_pages) if engine.allocator.refcount(p) > 0])
    assert 0 < alive <= 4


@pytest.mark.cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
def test_on_a_gpu_the_tags_live_there_and_the_triton_check_catches_the_fault(tiny_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.integrity

    calls = []
    triton_check = kernels.integrity.check_pages
    monkeypatch.setattr(kernels.integrity, "check_pages", lambda *a: calls.append(a[-1].device) or triton_check(*a))
    engine, seqs, errors, after = run(tiny_dir, lambda e, s: free_and_reallocate(e, s, page_index=0), device="cuda")
    assert engine.allocator.tags.is_cuda
    assert len(calls) == engine.stats["integrity_checks"] and all(d.type == "cuda" for d in calls)  # every step
    assert set(errors) == {seqs[2].request_id} and after == []


def test_tags_change_on_allocation_and_release_not_on_sharing(tiny_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20))
    alloc = engine.allocator
    (page,) = alloc.allocate(1)
    t1 = alloc.tags_of([page])[0]
    alloc.share([page])
    assert alloc.tags_of([page])[0] == t1
    alloc.release([page])
    assert alloc.tags_of([page])[0] == t1  # still referenced
    alloc.release([page])
    assert alloc.tags_of([page])[0] != t1
    assert int(alloc.tags[page]) == alloc.tags_of([page])[0]


def test_check_can_be_switched_off_and_then_misses_the_fault(tiny_dir: Path) -> None:
    """The control: without the check the same fault goes unnoticed (the test above is not vacuous)."""
    import backend.engine as engine_module

    engine = LLMEngine.from_pretrained(tiny_dir, EngineConfig(dtype="float32", kv_format="fp32",
                                                              kv_cache_bytes=2**20, integrity_check=False))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    free_and_reallocate(engine, seqs[2])
    errors = [o for _ in range(30) for o in engine.step() if o.error is not None]
    assert not errors and engine.stats["integrity_checks"] == 0
    assert engine_module.EngineConfig().integrity_check is True  # on by default
