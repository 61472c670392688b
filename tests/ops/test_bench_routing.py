"""`edgeserve bench routing`: the pure helpers (workload, hit rate, load balance, targets); no model, no workers."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from ops import bench
from ops.bench import routing as bench_routing
from ops.bench.routing import fleet, load, measures
from ops.bench.routing.measures import TurnResult, summarize
from ops.bench.routing.workload import make_workload, turn_messages

WORKERS = ["w1", "w2", "w3", "w4"]


def _docs(n: int) -> list[str]:
    return [" ".join(f"Document{d} speaks of example{d}x{i} matters at length." for i in range(80)) for d in range(n)]


def _res(worker: str, prompt: int, cached: int, turn: int = 0, ttft: float | None = 0.5, completion: int = 16,
         error: str | None = None) -> TurnResult:
    return TurnResult(0, 0, turn, worker, 0.0, ttft, 1.0, prompt, cached, completion, error=error)


def test_workload_is_deterministic_and_complete() -> None:
    a = make_workload(_docs(4), tenants=3, conversations=2, turns=4, seed=7, system_words=50)
    assert a == make_workload(_docs(4), tenants=3, conversations=2, turns=4, seed=7, system_words=50)
    assert a != make_workload(_docs(4), tenants=3, conversations=2, turns=4, seed=8, system_words=50)
    assert sorted((c.tenant, c.index) for c in a) == [(t, c) for t in range(3) for c in range(2)]
    assert all(len(c.turns) == 4 for c in a)
    # one system prompt per tenant, shared by its conversations, different between tenants
    systems = {c.tenant: c.system for c in a}
    assert all(c.system == systems[c.tenant] for c in a) and len(set(systems.values())) == 3
    assert len(systems[0].split("\n\n", 1)[1].split()) == 50  # the document part is system_words long
    with pytest.raises(ValueError):
        make_workload(_docs(2), tenants=3, conversations=1, turns=1, seed=0)


def test_each_turn_extends_the_previous_one() -> None:
    conv = make_workload(_docs(2), tenants=2, conversations=3, turns=4, seed=1)[0]
    previous = None
    for k in range(4):
        msgs = turn_messages(conv, k)
        assert len(msgs) == 2 + 2 * k
        assert msgs[0] == {"role": "system", "content": conv.system}
        assert msgs[-1] == {"role": "user", "content": conv.turns[k][0]}
        if previous is not None:  # previous turn's messages, then its answer, then the new question
            assert msgs[:len(previous)] == previous
            assert msgs[len(previous)] == {"role": "assistant", "content": conv.turns[k - 1][1]}
        previous = msgs
    assert len({q for q, _ in conv.turns}) > 1  # the questions vary


def test_hit_rate_is_token_weighted_and_skips_errors() -> None:
    results = [_res("w1", 1000, 900), _res("w2", 100, 0), _res("w3", 500, 500, error="HTTP 503")]
    assert measures.hit_rate(results) == pytest.approx(900 / 1100)  # a mean of ratios would be 0.45
    assert measures.hit_rate([]) == 0.0


def test_ceiling_hit_rate_counts_whole_blocks_per_tenant() -> None:
    a = list(range(100, 140))  # 40 tokens: 2 full blocks of 16
    b = a + list(range(500, 520))  # a, then 20 more: 3 full blocks
    # tenant 0: a (cold), then b (a's 2 blocks cached: 32); tenant 1 sends b: salted apart, cold;
    # tenant 0 sends a again: its 2 blocks are cached, but a worker keeps >= 1 token to compute: (40-1)//16 = 2
    prompts = [(0, a), (0, b), (1, b), (0, a)]
    assert measures.ceiling_hit_rate(prompts) == pytest.approx((32 + 0 + 32) / (40 + 60 + 60 + 40))
    assert measures.ceiling_hit_rate([(0, a[:32]), (0, a[:32])]) == pytest.approx(16 / 64)  # (32-1)//16 = 1
    assert measures.ceiling_hit_rate([]) == 0.0


def test_max_over_mean_counts_idle_workers() -> None:
    assert measures.max_over_mean({"w1": 6, "w2": 2}, WORKERS) == pytest.approx(3.0)  # mean 2, not 4
    assert measures.max_over_mean({w: 5 for w in WORKERS}, WORKERS) == 1.0
    assert measures.max_over_mean({}, WORKERS) == 0.0


def test_summarize() -> None:
    results = [_res("w1", 400, 0, turn=0, ttft=2.0), _res("w1", 450, 400, turn=1, ttft=0.2),
               _res("w2", 400, 0, turn=0, ttft=1.0), _res("w3", 450, 0, turn=1, ttft=0.5, completion=10),
               _res("w4", 400, 0, turn=0, error="boom")]
    s = summarize("prefix", results, WORKERS, wall_s=2.0)
    assert (s.requests, s.errors) == (5, 1)
    assert s.requests_per_worker == {"w1": 2, "w2": 1, "w3": 1, "w4": 0}
    assert s.computed_tokens_per_worker == {"w1": 450, "w2": 400, "w3": 450, "w4": 0}
    assert s.max_over_mean_load == pytest.approx(2 / 1.0)
    assert s.hit_rate == pytest.approx(400 / 1700)
    assert s.hit_rate_by_turn == {0: 0.0, 1: pytest.approx(400 / 900)}
    assert s.ttft_p50_s == 1.0 and s.ttft_p95_s == 2.0  # nearest rank over 0.2, 0.5, 1.0, 2.0 (failed one left out)
    assert s.requests_per_s == 2.0 and s.output_tok_s == (16 * 3 + 10) / 2.0


def test_same_worker_rate_follows_each_conversation() -> None:
    def at(tenant: int, conv: int, turn: int, worker: str, error: str | None = None) -> TurnResult:
        return TurnResult(tenant, conv, turn, worker, 0.0, 0.1, 1.0, 100, 0, 16, error=error)

    results = [at(0, 0, 0, "w1"), at(0, 0, 1, "w1"), at(0, 0, 2, "w2"),  # stayed, moved
               at(0, 1, 0, "w2"), at(0, 1, 1, "w1"),  # moved (tenant 0 conversation 0 was on w1: a different one)
               at(1, 0, 0, "w3"), at(1, 0, 1, "w3"),  # stayed
               at(2, 0, 0, "w4", error="HTTP 503"), at(2, 0, 1, "w4")]  # previous turn failed: not a stay
    assert measures.same_worker_rate(results) == pytest.approx(2 / 5)
    assert measures.same_worker_rate(results[:1]) == 0.0


def test_overlap_agreement_compares_the_route_reason_with_cached_tokens() -> None:
    reason = "region local; policy prefix: {} cached blocks of 30 on w1, cost 96 tokens"
    results = [_res("w1", 500, 432), _res("w1", 500, 0), _res("w2", 500, 448), _res("w3", 500, 0)]
    for r, n in zip(results, [27, 0, 27, None]):
        r.route = reason.format(n) if n is not None else "region local; policy round-robin"
    assert measures.overlap_agreement(results) == pytest.approx(2 / 3)  # 448 tokens = 28 blocks, not 27
    assert math.isnan(measures.overlap_agreement(results[3:]))


def _summary(policy: str, hit: float, ttft: float, balance: float) -> measures.PolicySummary:
    return measures.PolicySummary(policy, 10, 0, 1.0, hit, ttft, 2 * ttft, ttft, 1.0, 16.0, {}, {}, balance,
                                       balance, {}, 0.5, 1.0)


def test_targets() -> None:
    good = {"prefix": _summary("prefix", 0.8, 0.5, 1.2), "round-robin": _summary("round-robin", 0.4, 0.9, 1.0),
            "least-loaded": _summary("least-loaded", 0.3, 0.7, 1.0)}
    assert [c["met"] for c in measures.check_targets(good)] == [True, True, True]
    bad = {**good, "prefix": _summary("prefix", 0.79, 0.7, 1.51)}  # just under 2x; ties a baseline; too uneven
    checks = measures.check_targets(bad)
    assert [c["met"] for c in checks] == [False, False, False]
    assert checks[0]["threshold"] == pytest.approx(0.8) and checks[1]["threshold"] == 0.7
    assert [c["met"] for c in measures.check_targets({"prefix": good["prefix"]})] == [True]  # baselines absent


def test_registered_with_the_bench_command() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "routing", "--quick", "--json", "out.json"])
    assert args.func.__wrapped__ is bench_routing.run and args.quick and args.json_path == "out.json"
    assert args.users == 8 and math.isclose(args.max_tokens, 16) and args.turn_order == "interleaved"
    assert args.tenants is None and args.conversations is None  # quick: 16 x 1, full: 8 x 3


def _played(order: str, users: int, conversations: int = 3, turns: int = 2) -> list[tuple[str, int, int]]:
    """`load.play_turns` over a workload whose turns each take 10 ms: (what, the conversation's place in the
    workload, turn) for every start and end, in the order they happened."""
    workload = make_workload(_docs(conversations), tenants=conversations, conversations=1, turns=turns, seed=1,
                             system_words=20)
    events: list[tuple[str, int, int]] = []

    async def play(conv, k: int) -> None:
        events.append(("start", workload.index(conv), k))
        await asyncio.sleep(0.01)
        events.append(("end", workload.index(conv), k))

    asyncio.run(load.play_turns(workload, users, play, order))
    return events


@pytest.mark.parametrize("order", load.TURN_ORDERS)
def test_every_turn_plays_once_after_the_turn_before_it_and_never_more_than_users_at_once(order: str) -> None:
    events = _played(order, users=2, conversations=5, turns=3)
    starts = [(c, k) for what, c, k in events if what == "start"]
    assert sorted(starts) == [(c, k) for c in range(5) for k in range(3)]
    at = {event: i for i, event in enumerate(events)}
    assert all(at[("end", c, k - 1)] < at[("start", c, k)] for c in range(5) for k in range(1, 3))
    running = peak = 0
    for what, *_ in events:
        running += 1 if what == "start" else -1
        peak = max(peak, running)
    assert peak == 2


def test_interleaved_turns_queue_behind_other_conversations_and_back_to_back_ones_do_not() -> None:
    def starts(order: str) -> list[tuple[int, int]]:
        return [(c, k) for what, c, k in _played(order, users=2) if what == "start"]

    # 3 conversations, 2 users: the third conversation's first turn waited from the start, so it goes before
    # any conversation's second turn; back to back, each user plays its conversation's turns first
    inter, b2b = starts("interleaved"), starts("back-to-back")
    first_second_turn = min(inter.index((c, 1)) for c in range(3))
    assert inter.index((2, 0)) < first_second_turn
    assert b2b.index((2, 0)) > min(b2b.index((c, 1)) for c in range(2))
    with pytest.raises(ValueError, match="turn order"):
        asyncio.run(load.play_turns([], 1, None, "shuffled"))


def test_rounds_rotate_the_policy_order() -> None:
    order = measures.round_order(bench_routing.POLICIES, 3)
    assert order == [["prefix", "round-robin", "least-loaded"], ["round-robin", "least-loaded", "prefix"],
                     ["least-loaded", "prefix", "round-robin"]]
    for position in range(3):  # every policy once in every position
        assert sorted(o[position] for o in order) == sorted(bench_routing.POLICIES)
    assert measures.round_order(["prefix", "round-robin"], 3) == [["prefix", "round-robin"],
                                                                        ["round-robin", "prefix"],
                                                                        ["prefix", "round-robin"]]


def test_same_worker_rate_keeps_rounds_apart() -> None:
    def at(rnd: int, turn: int, worker: str) -> TurnResult:
        return TurnResult(0, 0, turn, worker, 0.0, 0.1, 1.0, 100, 0, 16, round=rnd)

    # the same conversation in two rounds: round 0 stays on w1, round 1 on w2; pooled, neither round's
    # turn 1 may be compared with the other round's turn 0
    results = [at(0, 0, "w1"), at(0, 1, "w1"), at(1, 0, "w2"), at(1, 1, "w2")]
    assert measures.same_worker_rate(results) == 1.0
    assert measures.same_worker_rate([at(0, 0, "w1"), at(1, 1, "w1")]) == 0.0  # no previous turn in round 1


def test_targets_by_round() -> None:
    good = {"prefix": _summary("prefix", 0.8, 0.5, 1.2), "round-robin": _summary("round-robin", 0.4, 0.9, 1.0)}
    slow = {"prefix": _summary("prefix", 0.8, 1.0, 1.2), "round-robin": _summary("round-robin", 0.4, 0.9, 1.0)}
    held = measures.targets_by_round([good, slow, good])
    assert held == {"hit rate prefix >= 2x round-robin": [True, True, True],
                    "TTFT p50 prefix < both baselines": [True, False, True],
                    "prefix: no worker > 1.5x mean load (requests)": [True, True, True]}


def test_refuses_to_start_workers_without_the_memory_they_need(monkeypatch) -> None:
    logged: list[str] = []
    monkeypatch.setattr(fleet, "WORKER_RSS_GIB", 1e6)  # more than any machine has
    with pytest.raises(SystemExit, match="--allow-low-memory"):
        fleet.check_memory(False, logged.append)
    fleet.check_memory(True, logged.append)
    assert len(logged) == 1 and "GiB of memory available" in logged[0]
    monkeypatch.setattr(fleet, "WORKER_RSS_GIB", 0.0)
    fleet.check_memory(False, logged.append)  # enough: nothing said
    assert len(logged) == 1
