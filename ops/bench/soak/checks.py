"""What the soak test (`edgeserve bench soak`) counts and checks: pure functions over what its clients saw.

**Outcome of one request** (`classify_response`, `classify_stream_error`):

- ``ok``: HTTP 200 and, for a stream, its end (`[DONE]` or the final usage event);
- ``refused``: a 4xx (quota 429, malformed 400, auth 401, too large 413 ...);
- ``typed_503``: HTTP 503 whose body is a well-formed error (the Workers envelope
  ``{"success": false, "errors": [{"code", "message"}]}`` or an OpenAI object with
  ``edgeserve_code``) naming a code whose class is a 503 (`backend.errors`: 5003,
  5004, 5005, 5006, 5020, 5021), with a ``Retry-After`` of whole seconds >= 1; after a
  stream has started, an in-stream error event with such a code;
- ``untyped_5xx``: every other 5xx, and in-stream errors with any other 5000-range code
  (a bare 5000 "internal error" above all).

A typed 503 is expected only while a fault is injected: a request whose lifetime
overlaps a fault's window (injection until recovery, plus a grace) may get one;
outside every window it counts as ``unexpected_503``.

**Metered == sent, per tenant** (`metered_vs_sent`). *Sent* counts the requests the
gateway admitted, as the client sees it: every response carrying
``x-edgeserve-request-id`` (the gateway sets it only once a worker has taken the
request: a 200, a stream that started, or an error after admission). Refusals
(429, 400, 401, 503 before admission) are not metered and not sent. *Metered* is the
tenant's ``requests`` counter in Redis (the usage hashes), read after every worker
is idle and the counters have stopped moving (gateways' journals replayed). A client
that leaves a non-streamed request before its response cannot know whether it was
admitted (``abandoned``); so the rule is ``sent <= metered <= sent + abandoned`` and
every admitted request id appears in the tenant's usage events. Tenants whose
clients never abandon a request therefore need metered == sent exactly.

**Tokens delivered** (client side): a stream that ended normally delivered its final
usage's ``completion_tokens``; a stream cut short (client left, or an error event)
delivered at least one token per content event it received, so that count is used; a
non-streamed 200 delivered its body's ``usage.completion_tokens``. Check: the tenant's
metered ``completion_tokens`` >= tokens delivered.

**Recovery** of a fault: seconds from its injection until a request on the affected
path succeeds again (a worker restart: a request through that worker; a Redis
restart: a request through every gateway).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.errors import error_from_code

__all__ = ["RequestResult", "Fault", "TenantMetering", "classify_response", "classify_stream_error",
           "error_code", "is_503_code", "in_fault_window", "tally", "metered_vs_sent", "missing_ids", "leaked_pages",
           "build_report", "check_targets", "REPORT_KEYS", "OUTCOMES", "REQUEST_LOG_FIELDS",
           "BACKGROUND_FAULTS"]

OUTCOMES = ("ok", "refused", "typed_503", "untyped_5xx", "disconnected", "abandoned", "timeout", "connect_error")
BACKGROUND_FAULTS = ("malformed_requests",)  # injected all along: no window, nothing to recover
REQUEST_LOG_FIELDS = ("sent_s", "ended_s", "tenant", "api", "stream", "status", "outcome", "code", "admitted")
REPORT_KEYS = ("requests", "status_counts", "untyped_5xx", "metered_vs_sent", "leaked_pages", "faults_injected",
               "max_recovery_s")


@dataclass
class RequestResult:
    """One request as its client saw it. Times are seconds since the run started."""

    tenant: str
    api: str  # "openai" | "workers" | "malformed" | "worker" (straight to a worker, outside any tenant)
    stream: bool
    sent: float
    ended: float = 0.0
    status: int | None = None  # HTTP status; None when no response came (abandoned, timeout, connect error)
    outcome: str = "ok"  # one of OUTCOMES
    request_id: str | None = None  # x-edgeserve-request-id: present once the gateway admitted the request
    delivered_tokens: int = 0
    error_code: int | None = None  # the typed error's code, when there was one
    detail: str = ""  # what went wrong, for the report (first 200 characters of a body or exception)
    route: str = ""  # x-edgeserve-route: where the gateway sent it and why

    @property
    def admitted(self) -> bool:
        return self.request_id is not None


@dataclass
class Fault:
    """One injected fault and how long its path took to work again."""

    kind: str  # "worker_kill" | "prefill_kill_mid_transfer" | "redis_restart" | "malformed_requests"
    at_s: float
    recovered_at_s: float | None = None  # None: never recovered (or nothing to recover, for malformed requests)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at_s is None else self.recovered_at_s - self.at_s


@dataclass
class TenantMetering:
    """A tenant's usage as Redis holds it: the counters summed over the run's days, and the events' ids."""

    requests: int = 0
    completion_tokens: int = 0
    request_ids: set[str] = field(default_factory=set)


def is_503_code(code: int) -> bool:
    """Whether `code` names an error class the gateway answers with 503."""
    return error_from_code(code, "").http_status == 503


def error_code(payload: Any) -> int | None:
    """The typed error code of a Workers envelope or an OpenAI error object; None if it is neither."""
    if not isinstance(payload, Mapping):
        return None
    errors = payload.get("errors")
    if payload.get("success") is False and isinstance(errors, list) and errors and isinstance(errors[0], Mapping):
        code, message = errors[0].get("code"), errors[0].get("message")
        return code if isinstance(code, int) and isinstance(message, str) else None
    err = payload.get("error")
    if isinstance(err, Mapping) and isinstance(err.get("message"), str):
        code = err.get("edgeserve_code")
        return code if isinstance(code, int) else None
    return None


def _retry_after_ok(headers: Mapping[str, str]) -> bool:
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    return value is not None and value.strip().isdigit() and int(value) >= 1


def classify_response(status: int, headers: Mapping[str, str], body: bytes) -> tuple[str, int | None]:
    """(outcome, typed error code or None) of a complete non-200 response, or of a 200's status line."""
    try:
        code = error_code(json.loads(body)) if body else None
    except (ValueError, UnicodeDecodeError):
        code = None
    if status < 400:
        return "ok", code
    if status < 500:
        return "refused", code
    if status == 503 and code is not None and is_503_code(code) and _retry_after_ok(headers):
        return "typed_503", code
    return "untyped_5xx", code


def classify_stream_error(payload: Any) -> tuple[str, int | None]:
    """(outcome, code) of an error event that ended a started stream."""
    code = error_code(payload)
    if code is None:
        return "untyped_5xx", None
    if is_503_code(code):
        return "typed_503", code
    status = error_from_code(code, "").http_status
    return ("refused" if status < 500 else "untyped_5xx"), code


def in_fault_window(result: RequestResult, faults: Sequence[Fault], grace_s: float, run_end_s: float) -> bool:
    """Whether the request's lifetime overlaps a fault's window: [injection, recovery + grace]
    (a fault that never recovered stays open until the run's end). Background faults (malformed
    requests, sent all along) open no window: nothing they do excuses a 503."""
    for f in faults:
        if f.kind in BACKGROUND_FAULTS:
            continue
        end = (f.recovered_at_s if f.recovered_at_s is not None else run_end_s) + grace_s
        if result.sent <= end and result.ended >= f.at_s:
            return True
    return False


def tally(results: Iterable[RequestResult]) -> dict[str, dict[str, Any]]:
    """Per tenant, client side: admitted request ids, abandoned requests, tokens delivered."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        t = out.setdefault(r.tenant, {"admitted_ids": set(), "abandoned": 0, "delivered_tokens": 0})
        if r.admitted:
            t["admitted_ids"].add(r.request_id)
        if r.outcome == "abandoned":
            t["abandoned"] += 1
        t["delivered_tokens"] += r.delivered_tokens
    return out


def metered_vs_sent(results: Iterable[RequestResult], metered: Mapping[str, TenantMetering]) -> dict[str, dict]:
    """Per tenant: sent (admitted), abandoned, metered, admitted ids missing from the usage events,
    tokens delivered and metered, and whether both rules hold (see the module docstring)."""
    client = tally(results)
    out: dict[str, dict[str, Any]] = {}
    for tenant in sorted(set(client) | set(metered)):
        c = client.get(tenant, {"admitted_ids": set(), "abandoned": 0, "delivered_tokens": 0})
        m = metered.get(tenant, TenantMetering())
        sent = len(c["admitted_ids"])
        missing = len(c["admitted_ids"] - m.request_ids)
        out[tenant] = {
            "sent": sent, "abandoned": c["abandoned"], "metered": m.requests, "missing_ids": missing,
            "delivered_tokens": c["delivered_tokens"], "metered_completion_tokens": m.completion_tokens,
            "ok": missing == 0 and sent <= m.requests <= sent + c["abandoned"],
            "tokens_ok": m.completion_tokens >= c["delivered_tokens"],
        }
    return out


def missing_ids(results: Iterable[RequestResult], metered: Mapping[str, TenantMetering]) -> dict[str, set[str]]:
    """Per tenant: admitted request ids without a usage event."""
    return {t: c["admitted_ids"] - metered.get(t, TenantMetering()).request_ids for t, c in tally(results).items()}


def leaked_pages(snap: Mapping[str, Any]) -> int:
    """Pages an idle worker does not have back: total - free - evictable (cached blocks nobody reads)."""
    evictable = snap.get("pages_evictable", (snap.get("prefix_cache") or {}).get("blocks", 0)) or 0
    return max(0, int(snap["pages_total"]) - int(snap["pages_free"]) - int(evictable))


def build_report(results: Sequence[RequestResult], faults: Sequence[Fault], metered: Mapping[str, TenantMetering],
                 final_stats: Mapping[str, Mapping[str, Any]], *, grace_s: float, run_end_s: float,
                 request_timeout_s: float) -> dict[str, Any]:
    """The soak's JSON body (the `REPORT_KEYS` and the detail behind them) and its `targets`."""
    status_counts = Counter(r.outcome for r in results)
    untyped = [r for r in results if r.outcome == "untyped_5xx"]
    unexpected = [r for r in results if r.outcome == "typed_503"
                  and not in_fault_window(r, faults, grace_s, run_end_s)]
    recoveries = [f.recovery_s for f in faults if f.kind not in BACKGROUND_FAULTS]
    by_worker = {name: leaked_pages(s) for name, s in final_stats.items()}
    busy = {name: {k: s.get(k, 0) for k in ("running", "waiting", "held")} for name, s in final_stats.items()
            if any(s.get(k, 0) for k in ("running", "waiting", "held"))}
    examples = lambda rs: [{"tenant": r.tenant, "api": r.api, "stream": r.stream, "status": r.status,  # noqa: E731
                            "outcome": r.outcome, "code": r.error_code, "request_id": r.request_id,
                            "route": r.route,
                            "at_s": round(r.sent, 1),
                            "ended_s": round(r.ended, 1), "detail": r.detail} for r in rs[:10]]
    report: dict[str, Any] = {
        "requests": len(results),
        "status_counts": dict(sorted(status_counts.items())),
        "http_status_counts": dict(sorted(Counter(str(r.status) for r in results).items())),
        "untyped_5xx": len(untyped),
        "unexpected_503": len(unexpected),
        "timed_out": status_counts.get("timeout", 0),
        "metered_vs_sent": metered_vs_sent(results, metered),
        "leaked_pages": sum(by_worker.values()),
        "leaked_pages_by_worker": by_worker,
        "workers_not_idle": busy,
        "faults_injected": [{"kind": f.kind, "at_s": round(f.at_s, 2),
                             "recovered_at_s": None if f.recovered_at_s is None else round(f.recovered_at_s, 2),
                             "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 2),
                             "detail": f.detail} for f in faults],
        "max_recovery_s": None if any(x is None for x in recoveries) or not recoveries else round(max(recoveries), 2),
        "missing_examples": {t: examples([r for r in results if r.tenant == t and r.request_id in ids])
                             for t, ids in missing_ids(results, metered).items() if ids},
        "untyped_5xx_examples": examples(untyped),
        "unexpected_503_examples": examples(unexpected),
        "request_timeout_s": request_timeout_s,
        "request_log_fields": REQUEST_LOG_FIELDS,
        "request_log": [[round(r.sent, 2), round(r.ended, 2), r.tenant, r.api, r.stream, r.status, r.outcome,
                         r.error_code, r.admitted] for r in results],
    }
    report["targets"] = check_targets(report)
    return report


def check_targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each check of the soak, with its value and whether it was met."""
    mvs = report["metered_vs_sent"]
    checks = [
        ("untyped_5xx == 0", report["untyped_5xx"], report["untyped_5xx"] == 0),
        ("typed 503s only during faults (unexpected_503 == 0)", report["unexpected_503"],
         report["unexpected_503"] == 0),
        ("metered == sent for every tenant", [t for t, v in mvs.items() if not v["ok"]],
         all(v["ok"] for v in mvs.values())),
        ("completion tokens metered >= delivered for every tenant", [t for t, v in mvs.items() if not v["tokens_ok"]],
         all(v["tokens_ok"] for v in mvs.values())),
        ("leaked_pages == 0", report["leaked_pages"], report["leaked_pages"] == 0),
        ("every worker idle (running, waiting, held 0)", sorted(report["workers_not_idle"]),
         not report["workers_not_idle"]),
        ("no request waiting past its timeout", report["timed_out"], report["timed_out"] == 0),
        ("every fault recovered", report["max_recovery_s"], report["max_recovery_s"] is not None),
    ]
    return [{"name": name, "value": value, "met": bool(met)} for name, value, met in checks]
