"""`edgeserve bench pd`: the pure helpers (gaps, percentiles, deltas, targets, workloads); no model, no workers."""

from __future__ import annotations

import argparse
import math

import pytest

from ops import bench
from ops.bench import pd as bench_pd
from ops.bench.harness.stats import ratio
from ops.bench.pd import client, measures, phases, workers
from ops.bench.pd.client import RequestRecord
from ops.bench.pd.transport import paired_ratio


def _rec(kind: str, ttft: float, times: list[float], measured: bool = True, error: str | None = None,
         arrivals: list[float] | None = None) -> RequestRecord:
    return RequestRecord(kind, 0.0, 64, measured=measured, ttft_s=None if error else ttft, worker_times=times,
                         arrivals=arrivals if arrivals is not None else times,
                         finish_reason=None if error else "length", error=error)


def test_token_gaps_are_forward_differences() -> None:
    assert measures.token_gaps([1.0, 1.25, 1.75, 2.75]) == [0.25, 0.5, 1.0]
    assert measures.token_gaps([3.0]) == [] and measures.token_gaps([]) == []


def test_latency_stats_ttft_of_requests_sent_in_the_window_gaps_of_tokens_arriving_in_it() -> None:
    inf = math.inf
    records = [
        _rec("short", 0.4, [0.4, 0.5, 0.6, 0.7]),  # gaps 0.1 x 3
        _rec("short", 0.8, [0.8, 0.9, 1.9]),  # gaps 0.1, 1.0 (a stall behind a prefill)
        _rec("short", 9.0, [9.0, 9.2], measured=False),  # sent before the window: its TTFT is not counted
        _rec("short", 5.0, [], error="BackendUnavailable"),  # failed: an error, no TTFT
        _rec("long", 3.0, [3.0, 3.1]),
    ]
    st = measures.latency_stats("short", (records, -inf, inf))
    assert st["requests"] == 2 and st["errors"] == 1 and st["finished"] == 2 and st["gaps"] == 6
    assert st["ttft_p50_s"] == 0.4 and st["ttft_p95_s"] == 0.8
    assert st["tpot_p50_s"] == pytest.approx(0.1) and st["tpot_p95_s"] == pytest.approx(1.0)
    # a window [0.55, 1.0]: tokens arriving at 0.6, 0.7, 0.9 -> gaps 0.1, 0.1, 0.1; the 1.0 s stall lands after it
    inside = measures.latency_stats("short", (records, 0.55, 1.0))
    assert inside["gaps"] == 3 and inside["tpot_p95_s"] == pytest.approx(0.1)
    # pooled over two windows (rounds): each record is cut by its own window
    pooled = measures.latency_stats("short", (records[:1], 0.0, 0.55), (records[1:2], 1.5, 2.0))
    assert pooled["gaps"] == 2 and pooled["tpot_p95_s"] == pytest.approx(1.0) and pooled["requests"] == 2
    long = measures.latency_stats("long", (records, -inf, inf))
    assert long["requests"] == 1 and long["ttft_p50_s"] == 3.0
    empty = measures.latency_stats("short")
    assert empty["requests"] == 0 and math.isnan(empty["tpot_p95_s"])


def test_client_gaps_come_from_arrivals_not_worker_times() -> None:
    # two tokens read in one chunk arrive together: 0 gap on the client clock, 0.2 s on the worker's
    rec = _rec("short", 0.1, [0.1, 0.3, 0.5], arrivals=[10.0, 10.4, 10.4])
    assert measures.window_gaps(rec, 10.2, 11.0) == pytest.approx([0.2, 0.2])
    assert measures.window_gaps(rec, 10.2, 11.0, "client") == pytest.approx([0.4, 0.0])
    assert measures.window_gaps(rec, 10.5, 11.0) == []
    st = measures.latency_stats("short", ([rec], -math.inf, math.inf))
    assert st["tpot_p50_s"] == pytest.approx(0.2) and st["tpot_p95_s"] == pytest.approx(0.2)
    assert st["tpot_client_p50_s"] == pytest.approx(0.0) and st["tpot_client_p95_s"] == pytest.approx(0.4)


def test_window_throughput_counts_only_tokens_inside_the_window() -> None:
    records = [_rec("short", 0.0, [], arrivals=[0.5, 1.0, 2.0, 3.5]), _rec("long", 0.0, [], arrivals=[2.5, 4.1])]
    assert measures.window_tok_s(records, 1.0, 3.0) == pytest.approx(3 / 2.0)  # 1.0, 2.0, 2.5


def test_targets_direction_and_nan() -> None:
    assert measures.check("tpot", 0.8, "<", 1.0)["met"] is True
    assert measures.check("tpot", 1.0, "<", 1.0)["met"] is False  # equal is not lower
    assert measures.check("prefix", 0.3, "<=", 0.3)["met"] is True
    assert measures.check("prefix", 0.31, "<=", 0.3)["met"] is False
    assert measures.check("wire", 1.97, ">=", 1.9)["met"] is True
    assert measures.check("wire", 1.5, ">=", 1.9)["met"] is False
    for rule in ("<", "<=", ">="):
        assert measures.check("x", float("nan"), rule, 1.0)["met"] is False
    assert math.isnan(ratio(1.0, 0.0)) and ratio(3.0, 2.0) == 1.5


def test_a_paired_target_is_judged_on_its_interval() -> None:
    assert measures.check_paired("t", {"median": 2.6, "ci95": [2.2, 2.9]}, ">=", 2.0)["verdict"] == "met"
    straddles = measures.check_paired("t", {"median": 2.3, "ci95": [1.8, 2.9]}, ">=", 2.0)
    assert straddles["verdict"] == "unresolved" and straddles["met"] is False and straddles["value"] == 2.3
    assert measures.check_paired("t", {"median": 1.5, "ci95": [1.2, 1.9]}, ">=", 2.0)["verdict"] == "missed"
    assert measures.check_paired("t", {"median": 0.2, "ci95": [0.1, 0.3]}, "<=", 0.3)["met"] is True
    nan = float("nan")
    assert measures.check_paired("t", {"median": nan, "ci95": [nan, nan]}, ">=", 2.0)["met"] is False


def test_transport_ratios_pair_request_i_of_each_transport() -> None:
    """A request that failed on one side drops its pair; the others stay matched by index, not position."""
    http = [{"i": 0, "transfer_ms": 80.0}, {"i": 1, "transfer_ms": 90.0}, {"i": 2, "transfer_ms": 100.0}]
    mooncake = [{"i": 0, "transfer_ms": 40.0}, {"i": 2, "transfer_ms": 50.0}]  # request 1 failed
    r = paired_ratio(http, mooncake)
    assert r["median"] == pytest.approx(2.0) and r["pairs"] == 2 and r["ci95"] == pytest.approx([2.0, 2.0])
    assert paired_ratio(http, [])["pairs"] == 0


def test_transfer_delta_and_hit_rate_use_differences_not_totals() -> None:
    before = {"transfers": 10, "failed": 1, "bytes": 1_000_000, "tokens": 100, "seconds": 2.0, "bytes_per_token": 1e4}
    after = {"transfers": 12, "failed": 1, "bytes": 1_000_000 + 2 * 512 * 11700, "tokens": 100 + 2 * 512,
             "seconds": 2.5, "bytes_per_token": 0.0}
    d = client.transfer_delta(before, after)
    assert d["transfers"] == 2 and d["failed"] == 0 and d["tokens"] == 1024
    assert d["bytes_per_token"] == pytest.approx(11700) and d["seconds"] == pytest.approx(0.5)
    assert math.isnan(client.transfer_delta(before, before)["bytes_per_token"])
    # warm-up queried 200 tokens with no hits; the run 1000 tokens with 800 hits -> 0.8, not 800 / 1200
    assert client.hit_rate_delta({"hit_tokens": 0, "query_tokens": 200},
                                   {"hit_tokens": 800, "query_tokens": 1200}) == pytest.approx(0.8)


def test_shared_prefix_prompts() -> None:
    prompts = phases.shared_prefix_prompts(40, 1024, 32, 0.9, seed=3)
    assert len(prompts) == 40 and all(len(p) == 1056 for p, _ in prompts)
    shared = [p for p, s in prompts if s]
    own = [p for p, s in prompts if not s]
    assert len(shared) == 36 and len(own) == 4
    assert all(p[:1024] == shared[0][:1024] for p in shared)
    assert len({tuple(p[1024:]) for p in shared}) == 36  # suffixes are unique
    assert all(p[:1024] != shared[0][:1024] for p in own) and len({tuple(p[:1024]) for p in own}) == 4
    assert all(100 <= t < 40000 for p, _ in prompts for t in p)
    assert prompts == phases.shared_prefix_prompts(40, 1024, 32, 0.9, seed=3)  # seeded


def test_round_order_alternates_the_first_mover() -> None:
    assert phases.round_order(1) == ["unified", "disaggregated"]
    assert phases.round_order(2) == ["unified", "disaggregated", "disaggregated", "unified"]
    assert phases.round_order(3)[4:] == ["unified", "disaggregated"]


def test_is_idle_allows_only_prefix_cache_pages() -> None:
    snap = {"running": 0, "waiting": 0, "held": 0, "pages_used": 0, "prefix_cache": None}
    assert client.is_idle(snap)
    assert not client.is_idle({**snap, "pages_used": 3})  # pages not returned
    assert not client.is_idle({**snap, "held": 1})
    assert client.is_idle({**snap, "pages_used": 64, "prefix_cache": {"blocks": 64}})
    assert not client.is_idle({**snap, "pages_used": 65, "prefix_cache": {"blocks": 64}})


def test_registered() -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "pd", "--quick", "--json", "/tmp/x.json"])
    assert args.func.__wrapped__ is bench_pd.run and args.json_path == "/tmp/x.json" and args.quick
    assert "--prefill-worker" not in workers.worker_specs("m")["decode"]  # added with the URL at start
    assert workers.worker_specs("m")["decode_bf16"][-1] == "bf16"
