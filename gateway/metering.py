"""Usage metering: counters per tenant × model × UTC day, and one event per request, exactly once.

When a request ends (finished, cut at its length, cancelled or failed) the gateway
records a `UsageRecord`. One Lua script, touching only the tenant's keys (one hash
slot), does all of it atomically:

1. ``SET metered:<request_id> NX EX 2 days``: if the marker exists the request was
   already metered and nothing changes (retries and duplicate reports are free);
2. ``HINCRBY usage:<day>`` ``<model>|requests`` (+1), ``|prompt_tokens``,
   ``|cached_prompt_tokens`` and ``|completion_tokens``;
3. ``XADD usage-events MAXLEN ~ 1000000`` with every field of the record (as
   strings; ``error_code`` is empty when None): the billing export reads this;
4. settles the quota `Reservation`: ``INCRBY tpd:<day>`` by
   ``prompt + completion - reserved`` (a refund of the unused completion budget),
   only when tokens were reserved and the day's counter still exists.

The usage day is the reservation's day (Redis's clock at admission) when there is
one, otherwise the UTC day of ``ended_at`` (or now). ``cached_prompt_tokens`` is
the part of ``prompt_tokens`` served from the prefix cache, not an addition to it.

A request admitted but never taken by a worker is not metered: `Meter.release`
returns its whole reservation instead, under the same marker, so a request id is
settled exactly once either way.
"""

from __future__ import annotations

import time
from datetime import date, timedelta
from typing import TYPE_CHECKING

import msgspec

from backend.errors import InvalidRequest
from gateway import redis_keys as rk
from gateway.quotas import DAY_KEY_TTL_S, Reservation
from gateway.redis_keys import redis_errors, text, utc_day

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["UsageRecord", "Meter", "METRICS", "MAX_USAGE_DAYS", "EVENTS_MAXLEN"]

METRICS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
MAX_USAGE_DAYS = 93  # longest range one usage() call reads
EVENTS_MAXLEN = 1_000_000  # approximate cap of each tenant's event stream

# KEYS: marker, usage hash, events stream[, tokens-per-day counter].
# ARGV: model, prompt, cached, completion, refund delta, then the event's field/value pairs.
# Returns 1 when recorded, 0 when this request id was already metered.
_RECORD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', MARKER_TTL) then return 0 end
local model = ARGV[1]
redis.call('HINCRBY', KEYS[2], model .. '|requests', 1)
redis.call('HINCRBY', KEYS[2], model .. '|prompt_tokens', ARGV[2])
redis.call('HINCRBY', KEYS[2], model .. '|cached_prompt_tokens', ARGV[3])
redis.call('HINCRBY', KEYS[2], model .. '|completion_tokens', ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 'EVENTS_MAXLEN', '*', unpack(ARGV, 6))
if KEYS[4] and tonumber(ARGV[5]) ~= 0 and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('INCRBY', KEYS[4], ARGV[5])
end
return 1
""".replace("MARKER_TTL", str(DAY_KEY_TTL_S)).replace("EVENTS_MAXLEN", str(EVENTS_MAXLEN))


# KEYS: marker, tokens-per-day counter. ARGV: reserved tokens. Returns 1 when released, 0 when settled before.
_RELEASE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', MARKER_TTL) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DECRBY', KEYS[2], ARGV[1]) end
return 1
""".replace("MARKER_TTL", str(DAY_KEY_TTL_S))


class UsageRecord(msgspec.Struct, frozen=True):
    """What one request used; `finish_reason` is "stop" | "length" | "cancelled" | "error"."""

    request_id: str
    tenant_id: str
    model: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    error_code: int | None = None
    started_at: float = 0.0  # unix seconds
    ended_at: float = 0.0


def _event_fields(usage: UsageRecord) -> list[str]:
    pairs: list[str] = []
    for name in usage.__struct_fields__:
        value = getattr(usage, name)
        pairs += [name, "" if value is None else repr(value) if isinstance(value, float) else str(value)]
    return pairs


def _record_from_event(fields: dict[str, str]) -> UsageRecord:
    ints = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    return UsageRecord(
        request_id=fields["request_id"], tenant_id=fields["tenant_id"], model=fields["model"],
        **{k: int(fields[k]) for k in ints}, finish_reason=fields["finish_reason"],
        error_code=int(fields["error_code"]) if fields.get("error_code") else None,
        started_at=float(fields.get("started_at") or 0.0), ended_at=float(fields.get("ended_at") or 0.0))


class Meter:
    """Exactly-once usage accounting, shared by all gateway replicas."""

    def __init__(self, redis: redis.asyncio.Redis) -> None:
        self.redis = redis
        self._record = redis.register_script(_RECORD)
        self._release = redis.register_script(_RELEASE)

    async def record(self, usage: UsageRecord, reservation: Reservation | None = None) -> bool:
        """Meter one finished request and settle its reservation; False if it was already metered."""
        if min(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) < 0:
            raise InvalidRequest("token counts must not be negative")
        if reservation is not None and (reservation.tenant_id, reservation.request_id) != (
                usage.tenant_id, usage.request_id):
            raise InvalidRequest("the reservation belongs to another request")
        tenant_id = usage.tenant_id
        day = reservation.day if reservation is not None else utc_day(usage.ended_at or time.time())
        keys = [rk.metered(tenant_id, usage.request_id), rk.usage(tenant_id, day), rk.usage_events(tenant_id)]
        refund = 0
        if reservation is not None and reservation.reserved_tokens > 0:
            keys.append(rk.tokens_day(tenant_id, day))
            refund = usage.prompt_tokens + usage.completion_tokens - reservation.reserved_tokens
        args = [usage.model, usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens, refund,
                *_event_fields(usage)]
        with redis_errors():
            return bool(await self._record(keys=keys, args=args))

    async def release(self, reservation: Reservation) -> bool:
        """Return a whole reservation of a request that never ran (nothing is metered); False if settled before."""
        keys = [rk.metered(reservation.tenant_id, reservation.request_id),
                rk.tokens_day(reservation.tenant_id, reservation.day)]
        with redis_errors():
            return bool(await self._release(keys=keys, args=[reservation.reserved_tokens]))

    async def usage(self, tenant_id: str, start_day: str, end_day: str) -> dict[str, dict[str, dict[str, int]]]:
        """{day: {model: {metric: count}}} for the days in [start_day, end_day] that have usage."""
        try:
            start, end = date.fromisoformat(start_day), date.fromisoformat(end_day)
        except ValueError as exc:
            raise InvalidRequest(f"days must be YYYY-MM-DD: {exc}") from exc
        if start > end:
            raise InvalidRequest(f"start day {start_day} is after end day {end_day}")
        if (end - start).days + 1 > MAX_USAGE_DAYS:
            raise InvalidRequest(f"usage ranges span at most {MAX_USAGE_DAYS} days")
        days = [(start + timedelta(days=i)).isoformat() for i in range((end - start).days + 1)]
        with redis_errors():
            async with self.redis.pipeline(transaction=False) as pipe:
                for day in days:
                    pipe.hgetall(rk.usage(tenant_id, day))
                hashes = await pipe.execute()
        out: dict[str, dict[str, dict[str, int]]] = {}
        for day, fields in zip(days, hashes, strict=True):
            for field, value in fields.items():
                model, _, metric = text(field).rpartition("|")
                per_model = out.setdefault(day, {}).setdefault(model, dict.fromkeys(METRICS, 0))
                per_model[metric] = int(value)
        return out

    async def events(self, tenant_id: str, count: int = 100) -> list[UsageRecord]:
        """The tenant's latest `count` usage events, newest last."""
        with redis_errors():
            entries = await self.redis.xrevrange(rk.usage_events(tenant_id), count=count)
        return [_record_from_event({text(k): text(v) for k, v in fields.items()})
                for _, fields in reversed(entries)]
