"""The soak's pure parts on synthetic inputs: what counts as a typed 503, metered vs sent, the report."""

from __future__ import annotations

import json

from ops.bench.soak.checks import (
    REPORT_KEYS,
    Fault,
    RequestResult,
    TenantMetering,
    build_report,
    classify_response,
    classify_stream_error,
    in_fault_window,
    leaked_pages,
    metered_vs_sent,
)
from ops.bench.soak.scenario import fault_schedule


def _workers(code: int) -> bytes:
    return json.dumps({"result": None, "success": False, "errors": [{"code": code, "message": "m"}],
                       "messages": []}).encode()


def _openai(code: int) -> bytes:
    return json.dumps({"error": {"message": "m", "type": "server_error", "param": None, "code": str(code),
                                 "edgeserve_code": code}}).encode()


def test_a_503_is_typed_only_with_an_envelope_a_503_code_and_retry_after() -> None:
    retry = {"Retry-After": "1"}
    assert classify_response(503, retry, _workers(5021)) == ("typed_503", 5021)  # StoreUnavailable
    assert classify_response(503, {"retry-after": "3"}, _openai(5006)) == ("typed_503", 5006)  # NoCapacity
    assert classify_response(503, {}, _workers(5021))[0] == "untyped_5xx"  # no Retry-After
    assert classify_response(503, {"Retry-After": "0"}, _workers(5003))[0] == "untyped_5xx"
    assert classify_response(503, retry, b"<html>Service Unavailable</html>")[0] == "untyped_5xx"
    assert classify_response(503, retry, _workers(3040))[0] == "untyped_5xx"  # a 429's code under a 503
    assert classify_response(500, {}, _workers(5000)) == ("untyped_5xx", 5000)  # today's Redis outage
    assert classify_response(502, retry, _workers(5003))[0] == "untyped_5xx"


def test_refusals_and_successes() -> None:
    assert classify_response(429, {"Retry-After": "5"}, _openai(3036)) == ("refused", 3036)
    assert classify_response(400, {}, _workers(3000)) == ("refused", 3000)
    assert classify_response(401, {}, b"") == ("refused", None)
    assert classify_response(200, {}, b'{"result": {}}') == ("ok", None)


def test_in_stream_errors_are_typed_by_their_code() -> None:
    assert classify_stream_error(json.loads(_workers(5003))) == ("typed_503", 5003)
    assert classify_stream_error(json.loads(_openai(5004))) == ("typed_503", 5004)
    assert classify_stream_error(json.loads(_openai(5000))) == ("untyped_5xx", 5000)
    assert classify_stream_error(json.loads(_workers(5040))) == ("untyped_5xx", 5040)  # integrity abort: a 500
    assert classify_stream_error({"error": "boom"}) == ("untyped_5xx", None)
    assert classify_stream_error(json.loads(_workers(3040))) == ("refused", 3040)


def test_fault_windows_bound_where_a_typed_503_is_expected() -> None:
    faults = [Fault("redis_restart", at_s=10.0, recovered_at_s=14.0), Fault("worker_kill", at_s=40.0)]
    during = RequestResult("t", "openai", False, sent=9.0, ended=10.5)
    after_grace = RequestResult("t", "openai", False, sent=20.0, ended=21.0)
    before = RequestResult("t", "openai", False, sent=1.0, ended=2.0)
    never_recovered = RequestResult("t", "openai", False, sent=55.0, ended=56.0)
    assert in_fault_window(during, faults, grace_s=5.0, run_end_s=60.0)
    assert in_fault_window(RequestResult("t", "openai", False, sent=18.5, ended=19.0), faults, 5.0, 60.0)
    assert not in_fault_window(after_grace, faults, grace_s=5.0, run_end_s=60.0)
    assert not in_fault_window(before, faults, grace_s=5.0, run_end_s=60.0)
    assert in_fault_window(never_recovered, faults, grace_s=5.0, run_end_s=60.0)


def _r(tenant: str, rid: str | None, outcome: str = "ok", tokens: int = 0) -> RequestResult:
    return RequestResult(tenant, "openai", True, sent=0.0, ended=1.0, status=200 if rid else None,
                         outcome=outcome, request_id=rid, delivered_tokens=tokens)


def test_metered_vs_sent_counts_admitted_requests_and_allows_only_abandoned_extras() -> None:
    results = [_r("a", "1", tokens=5), _r("a", "2", "disconnected", 2), _r("a", None, "refused"),
               _r("b", "3", tokens=4), _r("b", None, "abandoned"),
               _r("c", "4", tokens=3), _r("c", "5", tokens=3),
               _r("d", "6", tokens=8)]
    metered = {"a": TenantMetering(2, 7, {"1", "2"}),  # exact
               "b": TenantMetering(2, 9, {"3", "x"}),  # one abandoned request was admitted after all
               "c": TenantMetering(1, 3, {"4"}),  # a Redis outage lost request 5's record
               "d": TenantMetering(2, 7, {"6", "y"}),  # double-metered, and fewer tokens than delivered
               "e": TenantMetering(0, 0, set())}
    out = metered_vs_sent(results, metered)
    assert out["a"] == {"sent": 2, "abandoned": 0, "metered": 2, "missing_ids": 0, "delivered_tokens": 7,
                        "metered_completion_tokens": 7, "ok": True, "tokens_ok": True}
    assert out["b"]["ok"] and out["b"]["abandoned"] == 1
    assert not out["c"]["ok"] and out["c"]["missing_ids"] == 1 and out["c"]["tokens_ok"] is False
    assert not out["d"]["ok"] and not out["d"]["tokens_ok"]
    assert out["e"]["ok"] and out["e"]["sent"] == 0


def test_leaked_pages_counts_evictable_cached_pages_as_free() -> None:
    assert leaked_pages({"pages_total": 91, "pages_free": 80, "pages_evictable": 11}) == 0
    assert leaked_pages({"pages_total": 91, "pages_free": 80, "pages_evictable": 9}) == 2
    assert leaked_pages({"pages_total": 91, "pages_free": 85, "prefix_cache": {"blocks": 6}}) == 0


def _report(results: list[RequestResult], faults: list[Fault], stats: dict | None = None) -> dict:
    metered = {"a": TenantMetering(1, 5, {"1"})}
    stats = stats or {"unified": {"running": 0, "waiting": 0, "held": 0, "pages_total": 10, "pages_free": 10,
                                  "pages_evictable": 0}}
    return build_report(results, faults, metered, stats, grace_s=5.0, run_end_s=100.0, request_timeout_s=60.0)


def test_report_has_the_promised_keys_is_json_and_meets_its_targets_on_a_clean_run() -> None:
    faults = [Fault("worker_kill", 10.0, 25.0), Fault("redis_restart", 50.0, 53.5),
              Fault("malformed_requests", 0.0, None, {"count": 40})]
    typed = RequestResult("a", "openai", False, sent=51.0, ended=51.1, status=503, outcome="typed_503",
                          error_code=5021)
    report = _report([_r("a", "1", tokens=5), typed], faults)
    assert set(REPORT_KEYS) <= set(report)
    json.dumps(report)  # serialisable as written
    assert report["requests"] == 2 and report["status_counts"] == {"ok": 1, "typed_503": 1}
    assert report["untyped_5xx"] == 0 and report["unexpected_503"] == 0 and report["leaked_pages"] == 0
    assert report["max_recovery_s"] == 15.0  # the worker kill; malformed requests have nothing to recover
    assert report["metered_vs_sent"]["a"]["ok"]
    assert all(t["met"] for t in report["targets"]), report["targets"]


def test_targets_miss_on_untyped_5xx_late_503_leaks_timeouts_and_unrecovered_faults() -> None:
    untyped = RequestResult("a", "openai", False, sent=5.0, ended=5.1, status=500, outcome="untyped_5xx",
                            error_code=5000)
    late = RequestResult("a", "openai", False, sent=80.0, ended=80.1, status=503, outcome="typed_503")
    timeout = RequestResult("a", "workers", True, sent=3.0, ended=63.0, outcome="timeout")
    leaky = {"unified": {"running": 0, "waiting": 1, "held": 0, "pages_total": 10, "pages_free": 7,
                         "pages_evictable": 1}}
    report = _report([_r("a", "1", tokens=5), untyped, late, timeout], [Fault("redis_restart", 50.0, None)], leaky)
    missed = {t["name"] for t in report["targets"] if not t["met"]}
    assert report["untyped_5xx"] == 1 and report["unexpected_503"] == 0  # 80 s is inside an unrecovered fault
    assert report["leaked_pages"] == 2 and report["workers_not_idle"] == {"unified": {"running": 0, "waiting": 1,
                                                                                       "held": 0}}
    assert report["max_recovery_s"] is None and report["timed_out"] == 1
    assert missed == {"untyped_5xx == 0", "leaked_pages == 0", "every worker idle (running, waiting, held 0)",
                      "no request waiting past its timeout", "every fault recovered"}
    recovered = _report([late], [Fault("redis_restart", 50.0, 55.0), Fault("malformed_requests", 0.0, None)])
    assert recovered["unexpected_503"] == 1
    assert not next(t for t in recovered["targets"] if t["name"].startswith("typed 503s"))["met"]


def test_fault_schedule_spreads_every_kind_over_the_run() -> None:
    quick = fault_schedule(90.0)
    assert [k for _, k in quick] == ["worker_kill", "redis_restart", "prefill_kill_mid_transfer"]
    assert 0 < quick[0][0] < quick[1][0] < quick[2][0] < 90.0
    long = fault_schedule(600.0)
    assert len(long) == 12 and long[-1][0] < 600.0
