"""The gateway's Redis layout: every key name in one place, and the one translation of Redis errors.

Gateways are stateless; tenants, API keys, quota windows and usage all live in Redis
under the ``edgeserve:`` namespace. Every per-tenant key carries the hash tag
``{t:<tenant_id>}``, so in Redis Cluster all of one tenant's keys sit in one slot and
a single Lua script may touch them together (the quota and metering scripts do).
Only the key-lookup indexes (``apikey``, ``keyid``) and the tenant list are global.

    edgeserve:apikey:<sha256 hex>              hash   tenant_id, key_id, created
    edgeserve:keyid:<key_id>                   hash   tenant_id, token_hash
    edgeserve:tenants                          set    tenant ids
    edgeserve:{t:<id>}:tenant                  hash   name, requests_per_minute, tokens_per_day, created
    edgeserve:{t:<id>}:keys                    set    key ids
    edgeserve:{t:<id>}:rpm                     zset   admitted requests, scored by Redis time (ms)
    edgeserve:{t:<id>}:tpd:<YYYY-MM-DD>        int    tokens used + reserved that UTC day
    edgeserve:{t:<id>}:usage:<YYYY-MM-DD>      hash   "<model>|<metric>" -> int (kept 400 days after the day)
    edgeserve:{t:<id>}:usage-events            stream one entry per metered request (capped, ~1M)
    edgeserve:{t:<id>}:metered:<request_id>    string idempotency marker (8-day expiry)

Every key expires or is capped except the tenants, their keys and the indexes.

Stores accept clients with or without ``decode_responses``; `text` reads either.

Every Redis call goes through `redis_errors`, the one translation into the typed
hierarchy: Redis unreachable, timed out, loading, read-only or out of memory is
`StoreUnavailable` (503, Retry-After `STORE_RETRY_AFTER_S`), whose message names no
host, port or password; the detail goes to the log once per outage (`OutageLog`).
Any other Redis error is a bug here: a bare 5000 "internal store error", logged.
Clients come from `backend.redis_client.connect` (1 s connect and reply timeouts),
so a stopped or hung Redis turns into that 503 within about a second.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date

import redis
from redis import exceptions as rx

from backend.errors import EdgeServeError, StoreUnavailable
from backend.redis_client import OutageLog

__all__ = [
    "PREFIX", "api_key", "key_id", "tenant", "tenant_keys", "tenants", "rpm_window",
    "tokens_day", "usage", "usage_events", "metered", "utc_day", "day_name", "text", "redis_errors",
    "STORE_UNAVAILABLE_ERRORS", "STORE_RETRY_AFTER_S", "store_outage",
]

PREFIX = "edgeserve"
STORE_RETRY_AFTER_S = 2
# Redis is away or refusing writes for a while (not our bug): retrying later can work.
STORE_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    rx.ConnectionError, rx.TimeoutError, rx.ReadOnlyError, rx.OutOfMemoryError, rx.MasterDownError,
    rx.TryAgainError, rx.ClusterDownError, ConnectionError, TimeoutError)

log = logging.getLogger(__name__)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
store_outage = OutageLog(log, "Redis (tenants, quotas, usage, registry)")


def _t(tenant_id: str) -> str:
    return f"{PREFIX}:{{t:{tenant_id}}}"


def api_key(token_hash: str) -> str:
    """Lookup of an API token by its sha256 hex digest."""
    return f"{PREFIX}:apikey:{token_hash}"


def key_id(key_id: str) -> str:
    """Record of one API key by its public id (what revocation names)."""
    return f"{PREFIX}:keyid:{key_id}"


def tenant(tenant_id: str) -> str:
    """The tenant's record: name, limits, creation time."""
    return f"{_t(tenant_id)}:tenant"


def tenant_keys(tenant_id: str) -> str:
    """Set of the tenant's key ids."""
    return f"{_t(tenant_id)}:keys"


def tenants() -> str:
    """Set of every tenant id."""
    return f"{PREFIX}:tenants"


def rpm_window(tenant_id: str) -> str:
    """Sliding one-minute window of admitted requests."""
    return f"{_t(tenant_id)}:rpm"


def tokens_day(tenant_id: str, day: str) -> str:
    """Tokens used plus reserved by the tenant on UTC `day`."""
    return f"{_t(tenant_id)}:tpd:{day}"


def usage(tenant_id: str, day: str) -> str:
    """Usage counters per model on UTC `day`."""
    return f"{_t(tenant_id)}:usage:{day}"


def usage_events(tenant_id: str) -> str:
    """Stream of per-request usage events (billing export)."""
    return f"{_t(tenant_id)}:usage-events"


def metered(tenant_id: str, request_id: str) -> str:
    """Marker that `request_id` has been metered (exactly-once)."""
    return f"{_t(tenant_id)}:metered:{request_id}"


def utc_day(ts: float | None = None) -> str:
    """'YYYY-MM-DD' of unix time `ts` (now by default) in UTC."""
    return day_name(int((time.time() if ts is None else ts) // 86_400))


@functools.lru_cache(maxsize=64)
def day_name(day: int) -> str:
    """'YYYY-MM-DD' of UTC day number `day` (days since 1970-01-01). Date arithmetic, not `strftime`,
    which asks the C library for the time zone (a stat of /etc/localtime) on every call."""
    return date.fromordinal(_EPOCH_ORDINAL + day).isoformat()


def text(value: bytes | str | None) -> str | None:
    """A Redis reply as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def redis_errors() -> Iterator[None]:
    """Translate redis-py errors into the typed hierarchy: StoreUnavailable (503) or a bare 5000.

    Neither message carries Redis's address or the driver's text; that is logged
    (an outage once, at its start)."""
    try:
        yield
    except STORE_UNAVAILABLE_ERRORS as exc:
        store_outage.failed(exc)
        raise StoreUnavailable("the tenant and usage store is unavailable; retry shortly",
                               retry_after_s=STORE_RETRY_AFTER_S) from exc
    except redis.RedisError as exc:
        log.error("Redis command failed", exc_info=exc)
        raise EdgeServeError("internal store error") from exc
    store_outage.ok()
