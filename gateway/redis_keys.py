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
    edgeserve:{t:<id>}:usage:<YYYY-MM-DD>      hash   "<model>|<metric>" -> int
    edgeserve:{t:<id>}:usage-events            stream one entry per metered request
    edgeserve:{t:<id>}:metered:<request_id>    string idempotency marker (2-day expiry)

Stores accept clients with or without ``decode_responses``; `text` reads either.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import redis

from backend.errors import EdgeServeError

__all__ = [
    "PREFIX", "api_key", "key_id", "tenant", "tenant_keys", "tenants", "rpm_window",
    "tokens_day", "usage", "usage_events", "metered", "utc_day", "text", "redis_errors",
]

PREFIX = "edgeserve"


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
    moment = datetime.now(UTC) if ts is None else datetime.fromtimestamp(ts, UTC)
    return moment.strftime("%Y-%m-%d")


def text(value: bytes | str | None) -> str | None:
    """A Redis reply as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


@contextmanager
def redis_errors() -> Iterator[None]:
    """Translate redis-py errors into the project's hierarchy (EdgeServeError, code 5000)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise EdgeServeError(f"redis unavailable: {exc}") from exc
    except redis.RedisError as exc:
        raise EdgeServeError(f"redis error: {exc}") from exc
