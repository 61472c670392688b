"""Continuous batching, chunked prefill, page-reserving admission and page release."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from backend.engine import EngineConfig, LLMEngine
from backend.errors import CapacityError, InvalidSamplingParams, PromptTooLong
from backend.sampling_params import SamplingParams
from backend.sequence import SequenceStatus
from tests.backend.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=7)


def make_engine(path: Path, num_pages: int, **kw) -> LLMEngine:
    probe = LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=2**20))
    per_page = probe.cache.bytes_per_token * 16
    cfg = EngineConfig(dtype="float32", kv_format="fp32", kv_cache_bytes=num_pages * per_page, page_size=16, **kw)
    return LLMEngine.from_pretrained(path, cfg)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_pool_is_sized_from_the_byte_budget(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=37)
    assert e.allocator.num_pages == 37
    # 3 layers * K,V * 2 kv heads * head_dim 16 * 4 bytes
    assert e.cache.bytes_per_token == 3 * 2 * 2 * 16 * 4


def test_admission_reserves_pages_and_the_next_request_waits(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=10)
    # each request needs ceil((20 + 12) / 16) = 2 pages: five fit, the sixth waits
    seqs = [e.add_request(list(range(3, 23)), SamplingParams(max_tokens=12, **GREEDY)) for _ in range(6)]
    e.step()
    assert [s.status for s in seqs].count(SequenceStatus.RUNNING) == 5
    assert seqs[5].status is SequenceStatus.WAITING and e.allocator.num_free == 0
    while seqs[0].status is not SequenceStatus.FINISHED:
        e.step()
    e.step()
    assert seqs[5].status is SequenceStatus.RUNNING
    while e.has_work():
        e.step()
    assert all(len(s.output_ids) == 12 and s.finish_reason == "length" for s in seqs)
    assert e.allocator.num_free == 10


def test_refusals_are_typed_and_queue_nothing(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=4, max_waiting=2, max_model_len=100)
    with pytest.raises(PromptTooLong):
        e.add_request(list(range(100)), SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLong):
        e.add_request(list(range(50)), SamplingParams(max_tokens=60))
    with pytest.raises(CapacityError):  # 90 tokens = 6 pages > the 4-page pool: can never fit
        e.add_request(list(range(50)), SamplingParams(max_tokens=40))
    with pytest.raises(InvalidSamplingParams):
        e.add_request([1, 2], SamplingParams(top_p=0.0))
    e.add_request([1, 2], SamplingParams(max_tokens=3))
    e.add_request([1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(CapacityError):
        e.add_request([1, 2], SamplingParams(max_tokens=3))
    assert e.scheduler.num_waiting == 2


def test_long_prompt_is_chunked_and_decodes_keep_running(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=64, prefill_chunk_size=8, max_num_batched_tokens=16)
    short = e.add_request([5, 6, 7], SamplingParams(max_tokens=40, **GREEDY))
    e.step()  # short prompt prefilled, first token out
    assert len(short.output_ids) == 1
    long = e.add_request(list(range(3, 83)), SamplingParams(max_tokens=2, **GREEDY))
    steps = 0
    while long.is_prefilling:
        before = len(short.output_ids)
        batch_tokens = e.scheduler.config.max_num_batched_tokens
        e.step()
        steps += 1
        assert len(short.output_ids) == before + 1, "a running decode stalled behind a prefill"
        assert long.num_computed_tokens <= steps * min(8, batch_tokens)
    assert steps == 10  # 80 prompt tokens in chunks of 8


def test_queued_prefill_counts_only_prompt_tokens_left(tiny_dir: Path) -> None:
    """The routing load a worker publishes: prompt tokens admitted or waiting but not computed. A decoding request
    has computed more tokens than its prompt holds; it adds nothing (it had taken its output tokens off the sum, so
    a worker busy decoding published less queued prefill work than it had, down to negative)."""
    e = make_engine(tiny_dir, num_pages=64, prefill_chunk_size=8, max_num_batched_tokens=16)
    decoding = e.add_request([5, 6, 7], SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(12):
        e.step()
    assert not decoding.is_prefilling and decoding.num_computed_tokens > decoding.num_prompt_tokens
    assert e.scheduler.queued_prefill_tokens() == 0
    long = e.add_request(list(range(3, 83)), SamplingParams(max_tokens=2, **GREEDY))
    assert e.scheduler.queued_prefill_tokens() == 80  # waiting
    e.step()
    assert long.is_prefilling and e.scheduler.queued_prefill_tokens() == 80 - long.num_computed_tokens > 0


def test_a_waiting_prompt_counts_only_what_the_prefix_cache_does_not_hold(tiny_dir: Path) -> None:
    """A waiting request's queued prefill is its prompt less the leading blocks cached when it was queued (what
    admission will take rather than compute, and what the router counts for it); a request scoring its prompt
    computes all."""
    e = make_engine(tiny_dir, num_pages=64, prefix_caching=True)
    first = e.add_request(list(range(3, 53)), SamplingParams(max_tokens=1, **GREEDY))  # 50 tokens: 3 full blocks
    while e.has_work():
        e.step()
    assert first.finish_reason == "length" and e.scheduler.queued_prefill_tokens() == 0
    e.add_request(list(range(3, 53)) + [60, 61, 62, 63, 64], SamplingParams(max_tokens=2, **GREEDY))
    assert e.scheduler.queued_prefill_tokens() == 55 - 3 * 16
    e.add_request(list(range(3, 37)), SamplingParams(max_tokens=2, **GREEDY))  # 34 tokens: its 2 blocks cached
    assert e.scheduler.queued_prefill_tokens() == 55 - 3 * 16 + 34 - 2 * 16
    e.add_request(list(range(3, 35)), SamplingParams(max_tokens=2, **GREEDY))  # 32: the last block is computed
    assert e.scheduler.queued_prefill_tokens() == 55 - 3 * 16 + 34 - 2 * 16 + 32 - 16
    e.add_request(list(range(3, 53)), SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))
    assert e.scheduler.queued_prefill_tokens() == 55 - 3 * 16 + 34 - 2 * 16 + 32 - 16 + 50
    e.step()  # all admitted, and their 75 tokens left computed in one step
    assert not e.scheduler.waiting and e.scheduler.queued_prefill_tokens() == 0


def test_a_lone_prompt_takes_the_whole_budget_and_a_second_arrival_restores_chunks(tiny_dir: Path) -> None:
    """With no other sequence running or waiting a prompt is prefilled in steps of the whole budget, not in
    `prefill_chunk_size` chunks; once a second request arrives, both are chunked from the next step, and the
    result is the same tokens as chunked all along."""
    e = make_engine(tiny_dir, num_pages=64, prefill_chunk_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    lone = e.add_request(list(range(3, 83)), SamplingParams(max_tokens=4, **GREEDY))
    e.step()
    assert lone.num_computed_tokens == 32  # the budget, not a chunk of 8
    other = e.add_request(list(range(5, 45)), SamplingParams(max_tokens=4, **GREEDY))
    e.step()  # two sequences now: a chunk of 8 each
    assert (lone.num_computed_tokens, other.num_computed_tokens) == (40, 8)
    while e.has_work():
        e.step()
    chunked = make_engine(tiny_dir, num_pages=64, prefill_chunk_size=8, max_num_batched_tokens=8, max_num_seqs=4)
    ref = chunked.add_request(list(range(3, 83)), SamplingParams(max_tokens=4, **GREEDY))
    while chunked.has_work():
        chunked.step()
    assert lone.output_ids == ref.output_ids


def test_steps_with_decode_rows_are_capped_at_mixed_step_tokens(tiny_dir: Path) -> None:
    """With `mixed_step_tokens`, a prompt arriving among running decodes is cut so the step holds at most that
    many tokens (the rest goes in the next steps, which decode too); a step with no decode rows keeps the full
    budget, and where the cap leaves prompts less than MIN_MIXED_PROMPT_TOKENS it does not apply."""
    from backend.scheduler import MIN_MIXED_PROMPT_TOKENS

    cap = MIN_MIXED_PROMPT_TOKENS + 8
    e = make_engine(tiny_dir, num_pages=256, max_num_batched_tokens=256, prefill_chunk_size=256,
                    mixed_step_tokens=cap)
    first = e.add_request(list(range(3, 203)), SamplingParams(max_tokens=40, **GREEDY))
    e.step()  # no decode rows: the whole budget, the 200-token prompt at once
    assert not first.is_prefilling and len(first.output_ids) == 1
    second = e.add_request(list(range(5, 105)), SamplingParams(max_tokens=40, **GREEDY))
    done = []
    while second.is_prefilling:
        before = second.num_computed_tokens
        e.step()
        done.append(second.num_computed_tokens - before)
    assert done == [cap - 1, cap - 1, 100 - 2 * (cap - 1)]  # beside one decode row (`first`) each time
    shorts = [e.add_request([7, 8, 9], SamplingParams(max_tokens=40, **GREEDY)) for _ in range(cap - MIN_MIXED_PROMPT_TOKENS - 1)]
    e.step()  # the short prompts fit the capped step beside the 2 decode rows
    assert not any(s.is_prefilling for s in shorts)
    assert cap - (2 + len(shorts)) < MIN_MIXED_PROMPT_TOKENS
    third = e.add_request(list(range(9, 159)), SamplingParams(max_tokens=4, **GREEDY))
    e.step()  # so many decode rows leave less than MIN_MIXED_PROMPT_TOKENS under the cap: not capped
    assert not third.is_prefilling
    uncapped = make_engine(tiny_dir, num_pages=64, max_num_batched_tokens=64, prefill_chunk_size=64,
                           mixed_step_tokens=0)
    assert uncapped.scheduler.config.mixed_step_tokens is None  # 0: no cap (float32 here: no auto cap either)


def test_abort_returns_pages_at_the_next_step(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=8)
    running = e.add_request(list(range(3, 30)), SamplingParams(max_tokens=30, **GREEDY))
    e.step()
    waiting = e.add_request(list(range(3, 40)), SamplingParams(max_tokens=60, **GREEDY))
    e.step()
    assert waiting.status is SequenceStatus.WAITING and e.allocator.num_free < 8
    e.abort(running.request_id)
    e.abort(waiting.request_id)
    outs = e.step()
    assert {o.seq.request_id for o in outs if o.finished} == {running.request_id, waiting.request_id}
    assert running.finish_reason == waiting.finish_reason == "cancelled"
    assert e.allocator.num_free == 8 and not e.has_work()


def test_stop_token_ids_end_the_request(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=16)
    probe = e.add_request([9, 10, 11], SamplingParams(max_tokens=8, **GREEDY))
    while e.has_work():
        e.step()
    third = probe.output_ids[2]
    first_at = probe.output_ids.index(third)
    s = e.add_request([9, 10, 11], SamplingParams(max_tokens=8, stop_token_ids=[third], **GREEDY))
    while e.has_work():
        e.step()
    assert s.output_ids == probe.output_ids[: first_at + 1]
    assert s.finish_reason == "stop" and s.stop_reason == third


def test_a_tenants_flood_does_not_queue_another_tenants_request_behind_it(tiny_dir: Path) -> None:
    """Admission is first come first served within a tenant, and between tenants the one with the fewest running
    sequences goes first: a request from a tenant with nothing running takes the next free slot, ahead of a
    flood that arrived before it. With `fair_tenants` off it waits for the whole flood."""
    order = {}
    for fair in (True, False):
        e = make_engine(tiny_dir, num_pages=64, max_num_seqs=2)
        e.scheduler.config = dataclasses.replace(e.scheduler.config, fair_tenants=fair)
        flood = [e.add_request([3 + i] * 10, SamplingParams(max_tokens=3, **GREEDY), cache_salt="flood")
                 for i in range(6)]
        light = e.add_request([90] * 10, SamplingParams(max_tokens=3, **GREEDY), cache_salt="light")
        admitted = []
        while e.has_work():
            e.step()
            admitted += [s for s in (*flood, light) if s.status is not SequenceStatus.WAITING and s not in admitted]
        order[fair] = [flood.index(s) if s is not light else "light" for s in admitted]
        assert all(len(s.output_ids) == 3 for s in (*flood, light)) and e.allocator.num_free == 64
    assert order[True] == [0, "light", 1, 2, 3, 4, 5]  # the second slot: the flood holds one, light none
    assert order[False] == [0, 1, 2, 3, 4, 5, "light"]


def test_between_tenants_the_fewest_running_first_then_the_earlier_arrival(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=64, max_num_seqs=3)
    params = SamplingParams(max_tokens=2, **GREEDY)
    a = [e.add_request([5] * 8, params, cache_salt="a") for _ in range(3)]
    b = [e.add_request([6] * 8, params, cache_salt="b") for _ in range(2)]
    c = e.add_request([7] * 8, params, cache_salt="c")
    e.step()  # all at 0 running: a's oldest (the earliest arrival), then b's and c's (0 running each, in arrival order)
    assert [s.status is SequenceStatus.RUNNING for s in (*a, *b, c)] == [True, False, False, True, False, True]
    none = [e.add_request([8] * 8, params) for _ in range(2)]  # requests without a tenant are one tenant ("")
    assert {s.tenant for s in none} == {""} and a[0].tenant == "a"
    while e.has_work():
        e.step()
    assert all(len(s.output_ids) == 2 for s in (*a, *b, c, *none))


def test_one_tenant_may_hold_three_quarters_of_the_wait_queue(tiny_dir: Path) -> None:
    e = make_engine(tiny_dir, num_pages=64, max_waiting=8, max_num_seqs=1)
    assert e.scheduler.tenant_waiting_limit == 6
    params = SamplingParams(max_tokens=1, **GREEDY)
    for _ in range(6):
        e.add_request([5] * 8, params, cache_salt="flood")
    with pytest.raises(CapacityError, match="share") as info:
        e.add_request([5] * 8, params, cache_salt="flood")
    assert info.value.http_status == 429 and info.value.details["tenant_waiting_limit"] == 6
    e.add_request([6] * 8, params, cache_salt="other")  # the others still find room
    e.add_request([7] * 8, params)  # requests without a tenant are not limited by a share
    with pytest.raises(CapacityError, match="wait queue full"):
        e.add_request([6] * 8, params, cache_salt="other")
    assert e.scheduler.num_waiting == 8
    e.step()  # one admitted (max_num_seqs 1): the flood's oldest, so it may queue one more
    e.add_request([5] * 8, params, cache_salt="flood")
    while e.has_work():
        e.step()
    assert e.allocator.num_free == 64


def test_tenants_with_as_many_running_take_turns(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One running slot: whenever it frees, both tenants have nothing running, and the one admitted least
    recently goes next (round robin), not the one whose oldest request arrived first."""
    import backend.scheduler as sched

    monkeypatch.setattr(sched, "MAX_TENANTS_REMEMBERED", 3)
    e = make_engine(tiny_dir, num_pages=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=2, **GREEDY)
    a = [e.add_request([5] * 8, params, cache_salt="a") for _ in range(3)]
    b = [e.add_request([6] * 8, params, cache_salt="b") for _ in range(2)]
    admitted = []
    while e.has_work():
        e.step()
        admitted += [s for s in (*a, *b) if s.status is not SequenceStatus.WAITING and s not in admitted]
    assert admitted == [a[0], b[0], a[1], b[1], a[2]]
    for t in ("c", "d", "e"):  # a fourth tenant remembered: those with nothing queued or running are forgotten
        e.add_request([7] * 8, params, cache_salt=t)
        e.step()
    assert set(e.scheduler._last_admitted) <= {"d", "e"}
    while e.has_work():
        e.step()
