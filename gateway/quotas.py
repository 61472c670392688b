"""Per-tenant quotas, enforced atomically across every gateway replica by one Lua script.

Two limits, both optional (`Tenant.requests_per_minute`, `Tenant.tokens_per_day`):

* **requests per minute**: an exact sliding window. The tenant's ``rpm`` sorted set
  holds one member per admitted request (``<request_id>:<server µs>``, so a reused
  request id still counts), scored by Redis server time in ms. Members 60 s old or
  older are dropped; with ``n >= limit`` members left the request is refused, and
  Retry-After is the time until the member whose departure makes room (the
  ``(n - limit)``-th oldest; the oldest when ``n == limit``) leaves the window.
* **tokens per UTC day**: a counter per day of tokens used plus reserved. A request
  needs ``prompt_tokens + 1`` tokens left; it reserves ``prompt_tokens + granted``
  with ``granted = min(max_tokens, limit - used - prompt_tokens)``, the completion
  budget the backend must then respect. Metering later settles the reservation
  (returns what the request did not use). Refused: Retry-After = seconds until
  the next UTC midnight. The counter expires two days after its last admission.

An admission also returns what it left (requests in the window, tokens today), for
the response's rate-limit headers (`rate_limit_headers`), without another round trip.

Both checks and both writes run in one script invocation, so concurrent admissions
from any number of replicas serialise in Redis, and a refused request consumes
nothing. The script reads the clock with ``TIME``, so every replica shares Redis's
clock for the window and for the day.

**Which day's key.** The day comes from ``TIME`` inside the script, but Redis Cluster
needs every key named in KEYS up front. The client therefore passes the keys of
three candidate days (its own yesterday, today and tomorrow) with their day
numbers; the script uses the one matching the server's day. If none matches (a
client clock off by more than a day), the script changes nothing and returns the
server's day, and the client retries centred on it. All keys share the tenant's
hash tag, so the script stays in one slot.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

from backend.errors import EdgeServeError, InvalidRequest, QuotaExceeded
from backend.redis_lane import run_script
from gateway import redis_keys as rk
from gateway.redis_keys import day_name, redis_errors, text, utc_day
from gateway.tenants import Tenant

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["Reservation", "Quotas", "has_quotas", "rate_limit_headers", "WINDOW_MS", "DAY_KEY_TTL_S"]

WINDOW_MS = 60_000  # the requests-per-minute window
DAY_KEY_TTL_S = 2 * 86_400  # tokens-per-day counters outlive their day by a day

# KEYS[1] rpm zset, KEYS[2..4] tokens-per-day counters of candidate days.
# ARGV: rpm limit, tpd limit ("" = unlimited), request id, prompt tokens, max tokens,
#       then the candidate day numbers (days since the epoch), in KEYS order.
# Returns {'ok', day, reserved, granted, requests_left, tokens_left} | {'rpm', day, retry_after_s}
#       | {'tpd', day, retry_after_s} | {'day', day} (no candidate is the server's day).
_ADMIT = """
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now_ms = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
local day = math.floor(now_s / 86400)
local rpm_limit, tpd_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local prompt, granted = tonumber(ARGV[4]), tonumber(ARGV[5])

local tpd_key = nil
for i = 2, #KEYS do
  if tonumber(ARGV[4 + i]) == day then tpd_key = KEYS[i] end
end
if tpd_limit and not tpd_key then return {'day', day} end

if rpm_limit then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - WINDOW_MS)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= rpm_limit then
    local entry = redis.call('ZRANGE', KEYS[1], n - rpm_limit, n - rpm_limit, 'WITHSCORES')
    local wait_ms = tonumber(entry[2]) + WINDOW_MS - now_ms
    return {'rpm', day, math.max(1, math.ceil(wait_ms / 1000))}
  end
end

local reserved, requests_left, tokens_left = 0, 0, 0
if tpd_limit then
  local left = tpd_limit - tonumber(redis.call('GET', tpd_key) or '0') - prompt
  if left < 1 then return {'tpd', day, 86400 - now_s % 86400} end
  granted = math.min(granted, left)
  reserved = prompt + granted
  tokens_left = left - granted
end

if rpm_limit then
  redis.call('ZADD', KEYS[1], now_ms, ARGV[3] .. ':' .. t[1] .. string.format('%06d', tonumber(t[2])))
  redis.call('PEXPIRE', KEYS[1], WINDOW_MS + 1000)
  requests_left = rpm_limit - redis.call('ZCARD', KEYS[1])
end
if reserved > 0 then
  redis.call('INCRBY', tpd_key, reserved)
  redis.call('EXPIRE', tpd_key, DAY_TTL)
end
return {'ok', day, reserved, granted, requests_left, tokens_left}
""".replace("WINDOW_MS", str(WINDOW_MS)).replace("DAY_TTL", str(DAY_KEY_TTL_S))


class Reservation(NamedTuple):
    """What an admitted request holds until metering settles it."""

    tenant_id: str
    request_id: str
    day: str  # UTC day (Redis clock) the tokens were reserved against
    reserved_tokens: int  # reserved against tokens_per_day (0 when unlimited)
    max_tokens: int  # completion budget granted: min(requested, left today - prompt_tokens)
    # What the admission left, from the same script run (None where the tenant has no such limit):
    requests_left: int | None = None  # admissions left in the current 60 s window
    tokens_left: int | None = None  # tokens left today once this reservation is taken


def has_quotas(tenant: Tenant) -> bool:
    """Whether `tenant` has a limit to enforce (admission then takes a Redis round trip)."""
    return tenant.requests_per_minute is not None or tenant.tokens_per_day is not None


class Quotas:
    """Admission against a tenant's limits, shared by all gateway replicas."""

    def __init__(self, redis: redis.asyncio.Redis) -> None:
        self.redis = redis
        self._admit = redis.register_script(_ADMIT)

    async def admit(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int) -> Reservation:
        """Admit one request or raise QuotaExceeded (quota, limit, retry_after_s); a refusal consumes nothing."""
        if prompt_tokens < 0 or max_tokens < 0:
            raise InvalidRequest("prompt_tokens and max_tokens must not be negative")
        if not has_quotas(tenant):
            # Nothing to enforce: no round trip (metering still counts, by the local clock's day).
            return Reservation(tenant.id, request_id, utc_day(), 0, max_tokens)
        rpm = "" if tenant.requests_per_minute is None else str(tenant.requests_per_minute)
        tpd = "" if tenant.tokens_per_day is None else str(tenant.tokens_per_day)
        centre = int(time.time() // 86_400)
        for _ in range(3):
            days = [centre - 1, centre, centre + 1]
            keys = [rk.rpm_window(tenant.id), *(rk.tokens_day(tenant.id, day_name(d)) for d in days)]
            with redis_errors():
                reply = await run_script(self.redis, self._admit, keys,
                                         [rpm, tpd, request_id, prompt_tokens, max_tokens, *days])
            status, day = text(reply[0]), int(reply[1])
            if status == "ok":
                return Reservation(tenant.id, request_id, day_name(day), int(reply[2]), int(reply[3]),
                                   None if tenant.requests_per_minute is None else int(reply[4]),
                                   None if tenant.tokens_per_day is None else int(reply[5]))
            if status == "rpm":
                raise QuotaExceeded(f"tenant {tenant.id} is over its limit of {rpm} requests per minute",
                                    quota="requests_per_minute", limit=tenant.requests_per_minute,
                                    retry_after_s=int(reply[2]))
            if status == "tpd":
                raise QuotaExceeded(f"tenant {tenant.id} has too few of its {tpd} tokens per day left "
                                    f"for a {prompt_tokens}-token prompt", quota="tokens_per_day",
                                    limit=tenant.tokens_per_day, retry_after_s=int(reply[2]))
            centre = day  # this client's clock is over a day off Redis's: retry on Redis's day
        raise EdgeServeError("quota admission did not settle on a UTC day (Redis clock jumping?)")


def rate_limit_headers(tenant: Tenant, reservation: Reservation | None) -> dict[str, str]:
    """OpenAI's rate-limit headers for an admitted request, for the limits `tenant` has:
    `x-ratelimit-limit-requests` / `x-ratelimit-remaining-requests` (per minute) and
    `x-ratelimit-limit-tokens` / `x-ratelimit-remaining-tokens` (per UTC day, this request's
    reservation taken). Empty for a tenant without quotas."""
    headers: dict[str, str] = {}
    if reservation is None:
        return headers
    if tenant.requests_per_minute is not None and reservation.requests_left is not None:
        headers["x-ratelimit-limit-requests"] = str(tenant.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(reservation.requests_left)
    if tenant.tokens_per_day is not None and reservation.tokens_left is not None:
        headers["x-ratelimit-limit-tokens"] = str(tenant.tokens_per_day)
        headers["x-ratelimit-remaining-tokens"] = str(reservation.tokens_left)
    return headers
