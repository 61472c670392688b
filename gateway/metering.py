"""Usage metering: counters per tenant × model × UTC day, and one event per request, exactly once.

When a request ends (finished, cut at its length, cancelled or failed) the gateway
records a `UsageRecord`. One Lua script, touching only the tenant's keys (one hash
slot), does all of it atomically, for each record it is given:

1. ``SET metered:<request_id> NX EX 8 days``: if the marker exists the request was
   already metered and nothing changes (retries, duplicate reports and journal
   replays are free);
2. ``HINCRBY usage:<day>`` ``<model>|requests`` (+1), ``|prompt_tokens``,
   ``|cached_prompt_tokens`` and ``|completion_tokens`` (summed over the call's new
   records first: one HINCRBY per field and call); the hash expires
   `USAGE_RETENTION_DAYS` (400) days after its day ends: that is how long daily
   usage can be read back;
3. ``XADD usage-events MAXLEN ~ 1000000`` with every field of the record (as
   strings; ``error_code`` is empty when None): the billing export reads this;
4. settles the quota `Reservation`: ``INCRBY tpd:<day>`` by
   ``prompt + completion - reserved`` (a refund of the unused completion budget),
   only when tokens were reserved and the day's counter still exists.

**Records are written in batches** (group commit, `gateway.group_commit`): a record that ends
while no metering write is in flight is written at once; those that end while one is in flight
go together, up to `MAX_BATCH`, as soon as it returns: one script call per tenant (its keys share
a slot), the calls of different tenants side by side. A script call costs ~0.2 ms of gateway CPU
through redis-py's pool (~0.05 ms on the gateway's pipelined connection, `backend/redis_lane.py`, which
these calls use) and 0.04–0.08 ms of Redis's, whatever it carries, and a batch of four already costs a
third of that per record, so under load metering drops from the largest Redis cost of a request to a small
one, while an idle gateway writes each record as soon as its request ends, as before. With
`flush_after_s` > 0 a record instead waits up to that long for others (fewer writes at low rates,
measured slower at c = 1). `record` returns once its record is settled (or journaled), so
`Generation.aclose` means "metered"; no response waits for it (the answer and the stream's last
byte leave before metering). A graceful stop writes what is queued (`aclose`).

The usage day is the reservation's day (Redis's clock at admission) when there is
one, otherwise the UTC day of ``ended_at`` (or now). ``cached_prompt_tokens`` is
the part of ``prompt_tokens`` served from the prefix cache, not an addition to it.

A request admitted but never taken by a worker is not metered: `Meter.release`
returns its whole reservation instead, under the same marker, so a request id is
settled exactly once either way.

**Across Redis outages.** When Redis cannot take a record or a release
(`StoreUnavailable`, or any other store error), the entry goes to this gateway's
local journal (`gateway.usage_journal`: append-only, fsynced) instead of being
lost, and `record`/`release` return as if it were settled. A replay task
(`start`/`aclose`; also started by the first journaled entry) sends the journal
again at start and every `replay_interval_s` while entries remain, through the
same scripts, so a replay of something Redis did take (a reply lost to a timeout)
or a second replay changes nothing; once all are settled the file is truncated.
A replayed record settles its reservation as it would have on time: the day is
the reservation's, and the refund applies only while that day's counter exists.
The marker lives `MARKER_TTL_S` (8 days): an entry replayed later than that after
its request ended could count twice if its first attempt did reach Redis; such
replays are logged as warnings.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from backend.errors import EdgeServeError, InvalidRequest
from backend.redis_lane import run_script
from gateway import redis_keys as rk
from gateway.group_commit import GroupCommit
from gateway.quotas import Reservation
from gateway.redis_keys import redis_errors, text, utc_day
from gateway.usage_journal import UsageJournal, default_journal_dir

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["UsageRecord", "Meter", "METRICS", "MAX_USAGE_DAYS", "EVENTS_MAXLEN", "MARKER_TTL_S",
           "USAGE_RETENTION_DAYS", "FLUSH_AFTER_S", "MAX_BATCH"]

log = logging.getLogger(__name__)

METRICS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
MAX_USAGE_DAYS = 93  # longest range one usage() call reads
EVENTS_MAXLEN = 1_000_000  # approximate cap of each tenant's event stream
MARKER_TTL_S = 8 * 86_400  # a request id stays "metered" this long: journal replays within it are exact
USAGE_RETENTION_DAYS = 400  # a day's usage hash expires this many days after the day ends
FLUSH_AFTER_S = 0.0  # 0: group commit (at once when idle); > 0: a record waits this long for others
MAX_BATCH = 128  # records written together at most

# Any number of records of one tenant.
# KEYS, 4 per record: marker, usage hash, events stream, tokens-per-day counter of the record's day.
# ARGV: F, the event's F field names, then per record: model, prompt, cached, completion,
#       refund delta (0: no reservation to settle), usage hash expiry (unix s), the F event values.
# Returns one 1 (recorded) or 0 (this request id was already metered) per record, in order.
# New records are summed per usage hash and model, and refunds per counter, before they are
# written: one HINCRBY per metric and one EXPIREAT per hash and batch, not per record (each
# redis.call costs ~1.5 us of Redis's time; a record then costs a SET, an XADD and its share).
_RECORD = """
local f = tonumber(ARGV[1])
local event, out = {}, {}
local hashes, sums, expiry = {}, {}, {}  -- usage hashes in first-seen order; per hash: models in order, sums
local counters, refund = {}, {}
for i = 1, f do event[2 * i - 1] = ARGV[1 + i] end
for r = 0, #KEYS / 4 - 1 do
  local k, a = 4 * r, 1 + f + (6 + f) * r
  if redis.call('SET', KEYS[k + 1], '1', 'NX', 'EX', MARKER_TTL) then
    local hash, model = KEYS[k + 2], ARGV[a + 1]
    local per_model = sums[hash]
    if not per_model then
      per_model = {models = {}}
      sums[hash], expiry[hash] = per_model, ARGV[a + 6]
      hashes[#hashes + 1] = hash
    end
    local m = per_model[model]
    if not m then
      m = {0, 0, 0, 0}
      per_model[model] = m
      per_model.models[#per_model.models + 1] = model
    end
    m[1], m[2], m[3], m[4] = m[1] + 1, m[2] + tonumber(ARGV[a + 2]), m[3] + tonumber(ARGV[a + 3]),
                             m[4] + tonumber(ARGV[a + 4])
    for i = 1, f do event[2 * i] = ARGV[a + 6 + i] end
    redis.call('XADD', KEYS[k + 3], 'MAXLEN', '~', 'EVENTS_MAXLEN', '*', unpack(event))
    local delta = tonumber(ARGV[a + 5])
    if delta ~= 0 then
      local counter = KEYS[k + 4]
      if not refund[counter] then
        refund[counter] = 0
        counters[#counters + 1] = counter
      end
      refund[counter] = refund[counter] + delta
    end
    out[r + 1] = 1
  else
    out[r + 1] = 0
  end
end
local metrics = {'|requests', '|prompt_tokens', '|cached_prompt_tokens', '|completion_tokens'}
for _, hash in ipairs(hashes) do
  local per_model = sums[hash]
  for _, model in ipairs(per_model.models) do
    local m = per_model[model]
    for i = 1, 4 do redis.call('HINCRBY', hash, model .. metrics[i], string.format('%d', m[i])) end
  end
  redis.call('EXPIREAT', hash, expiry[hash])
end
for _, counter in ipairs(counters) do
  if refund[counter] ~= 0 and redis.call('EXISTS', counter) == 1 then
    redis.call('INCRBY', counter, string.format('%d', refund[counter]))
  end
end
return out
""".replace("MARKER_TTL", str(MARKER_TTL_S)).replace("EVENTS_MAXLEN", str(EVENTS_MAXLEN))


# KEYS: marker, tokens-per-day counter. ARGV: reserved tokens. Returns 1 when released, 0 when settled before.
_RELEASE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', MARKER_TTL) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DECRBY', KEYS[2], ARGV[1]) end
return 1
""".replace("MARKER_TTL", str(MARKER_TTL_S))


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


_EVENT_FIELDS = UsageRecord.__struct_fields__  # the event stream's fields, in this order


def _event_values(usage: UsageRecord) -> list[str]:
    """The record's fields as the event stream keeps them: strings, floats exact, None as ""."""
    return ["" if value is None else repr(value) if isinstance(value, float) else str(value)
            for value in (getattr(usage, name) for name in _EVENT_FIELDS)]


class _Unsettled(msgspec.Struct, frozen=True):
    """A journal entry: a record to meter (`usage` set), or a reservation to release (`usage` None)."""

    usage: UsageRecord | None
    reservation: Reservation | None
    journaled_at: float


def _journal_key(tenant_id: str, request_id: str) -> str:
    return f"{tenant_id}/{request_id}"


@functools.lru_cache(maxsize=64)
def _usage_expiry(day: str, retention_days: int) -> int:
    """Unix time `retention_days` after the end of UTC `day`."""
    start = datetime.fromisoformat(day).replace(tzinfo=UTC).timestamp()
    return int(start) + (retention_days + 1) * 86_400


def _record_from_event(fields: dict[str, str]) -> UsageRecord:
    ints = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    return UsageRecord(
        request_id=fields["request_id"], tenant_id=fields["tenant_id"], model=fields["model"],
        **{k: int(fields[k]) for k in ints}, finish_reason=fields["finish_reason"],
        error_code=int(fields["error_code"]) if fields.get("error_code") else None,
        started_at=float(fields.get("started_at") or 0.0), ended_at=float(fields.get("ended_at") or 0.0))


class Meter:
    """Exactly-once usage accounting, shared by all gateway replicas, journaled across Redis outages."""

    def __init__(self, redis: redis.asyncio.Redis, journal_path: Path | str | None = None, *,
                 replay_interval_s: float = 2.0, usage_retention_days: int = USAGE_RETENTION_DAYS,
                 flush_after_s: float = FLUSH_AFTER_S) -> None:
        """`journal_path`: this gateway's journal file; by default the first free
        ``gateway-<n>.jsonl`` in ``$EDGESERVE_HOME/journal``. Nothing touches the disk until
        `start` or the first entry Redis cannot take. `flush_after_s`: 0 (default) writes a record at
        once when no write is in flight, else with the next; > 0 makes it wait that long for others
        (module docstring)."""
        self.redis = redis
        self.journal_path = None if journal_path is None else Path(journal_path)
        self.replay_interval_s, self.usage_retention_days = replay_interval_s, usage_retention_days
        self._record = redis.register_script(_RECORD)
        self._batch: GroupCommit[tuple[UsageRecord, Reservation | None], bool] = GroupCommit(
            self._write_batch, linger_s=flush_after_s, max_items=MAX_BATCH)
        self._release = redis.register_script(_RELEASE)
        self._journal: UsageJournal[_Unsettled] | None = None
        self._replayer: asyncio.Task[None] | None = None
        self._replaying = asyncio.Lock()

    async def start(self) -> None:
        """Open the journal (taking over orphaned ones) and replay it now and every `replay_interval_s`.

        A journal that cannot be opened (read-only disk) is logged as an error and the gateway
        runs on: usage Redis cannot take is then logged, not kept."""
        try:
            journal = await self._opened_journal()
            await asyncio.to_thread(journal.adopt_orphans)
        except (OSError, EdgeServeError):
            log.exception("no usage journal: usage recorded while Redis is away will be lost")
            return
        self._ensure_replayer(wait_first=False)

    async def aclose(self) -> None:
        """Write the records queued now, stop replaying and close the journal; what is still pending stays
        in the file for the next start."""
        await self._batch.drain()
        if self._replayer is not None:
            self._replayer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replayer
            self._replayer = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    @property
    def pending(self) -> int:
        """Entries journaled and not yet settled in Redis."""
        return 0 if self._journal is None else len(self._journal)

    async def record(self, usage: UsageRecord, reservation: Reservation | None = None) -> bool:
        """Meter one finished request and settle its reservation; False if it was already metered.
        Returns once its batch is written (module docstring).

        When Redis cannot take it now the record is journaled (True: replay meters it later)."""
        if min(usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) < 0:
            raise InvalidRequest("token counts must not be negative")
        if reservation is not None and (reservation.tenant_id, reservation.request_id) != (
                usage.tenant_id, usage.request_id):
            raise InvalidRequest("the reservation belongs to another request")
        return await self._batch.submit((usage, reservation))

    async def _write_batch(self, batch: list[tuple[UsageRecord, Reservation | None]]) -> list[bool]:
        """One script call per tenant, side by side; a tenant's records Redis cannot take are journaled."""
        by_tenant: dict[str, list[int]] = {}
        for i, (usage, _) in enumerate(batch):
            by_tenant.setdefault(usage.tenant_id, []).append(i)
        groups = list(by_tenant.values())
        replies = await asyncio.gather(*(self._send_records([batch[i] for i in group]) for group in groups),
                                       return_exceptions=True)
        out = [True] * len(batch)
        for group, reply in zip(groups, replies, strict=True):
            if isinstance(reply, EdgeServeError):
                for i in group:
                    usage, reservation = batch[i]
                    await self._journal_entry(usage.tenant_id, usage.request_id,
                                              _Unsettled(usage, reservation, time.time()))
            elif isinstance(reply, BaseException):
                raise reply
            else:
                for i, recorded in zip(group, reply, strict=True):
                    out[i] = recorded
        return out

    async def release(self, reservation: Reservation) -> bool:
        """Return a whole reservation of a request that never ran (nothing is metered); False if settled before.

        When Redis cannot take it now the release is journaled (True)."""
        try:
            return await self._send_release(reservation)
        except EdgeServeError:
            await self._journal_entry(reservation.tenant_id, reservation.request_id,
                                      _Unsettled(None, reservation, time.time()))
            return True

    async def replay(self) -> int:
        """Send every journaled entry to Redis (idempotent); how many settled. Stops at the first Redis error."""
        journal = self._journal
        if journal is None:
            return 0
        settled = 0
        async with self._replaying:
            for key, entry in journal.pending():
                ended = entry.usage.ended_at if entry.usage is not None and entry.usage.ended_at else entry.journaled_at
                if time.time() - ended > MARKER_TTL_S:
                    log.warning("replaying usage entry %s older than its idempotency marker lives", key)
                try:
                    if entry.usage is not None:
                        await self._send_records([(entry.usage, entry.reservation)])
                    elif entry.reservation is not None:
                        await self._send_release(entry.reservation)
                except EdgeServeError:
                    break  # Redis still away: try again next round
                await asyncio.to_thread(journal.settle, key)
                settled += 1
            if settled:
                log.warning("replayed %d journaled usage entries into Redis (%d still pending)", settled, len(journal))
            await asyncio.to_thread(journal.compact)
        return settled

    async def _send_records(self, records: list[tuple[UsageRecord, Reservation | None]]) -> list[bool]:
        """Meter records of one tenant in one script call; whether each was new."""
        keys: list[str] = []
        args: list[str | int] = [len(_EVENT_FIELDS), *_EVENT_FIELDS]
        for usage, reservation in records:
            tenant_id = usage.tenant_id
            day = reservation.day if reservation is not None else utc_day(usage.ended_at or time.time())
            keys += [rk.metered(tenant_id, usage.request_id), rk.usage(tenant_id, day), rk.usage_events(tenant_id),
                     rk.tokens_day(tenant_id, day)]
            refund = 0
            if reservation is not None and reservation.reserved_tokens > 0:
                refund = usage.prompt_tokens + usage.completion_tokens - reservation.reserved_tokens
            args += [usage.model, usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens, refund,
                     _usage_expiry(day, self.usage_retention_days), *_event_values(usage)]
        with redis_errors():
            return [bool(r) for r in await run_script(self.redis, self._record, keys, args)]

    async def _send_release(self, reservation: Reservation) -> bool:
        keys = [rk.metered(reservation.tenant_id, reservation.request_id),
                rk.tokens_day(reservation.tenant_id, reservation.day)]
        with redis_errors():
            return bool(await run_script(self.redis, self._release, keys, [reservation.reserved_tokens]))

    async def _opened_journal(self) -> UsageJournal[_Unsettled]:
        if self._journal is None:
            if self.journal_path is not None:
                self._journal = await asyncio.to_thread(UsageJournal, self.journal_path, _Unsettled)
            else:
                self._journal = await asyncio.to_thread(UsageJournal.open_in, default_journal_dir(), _Unsettled)
            log.info("usage journal: %s (%d entries pending)", self._journal.path, len(self._journal))
        return self._journal

    async def _journal_entry(self, tenant_id: str, request_id: str, entry: _Unsettled) -> None:
        journal = await self._opened_journal()
        await asyncio.to_thread(journal.append, _journal_key(tenant_id, request_id), entry)
        self._ensure_replayer(wait_first=True)  # Redis just failed: give it a moment

    def _ensure_replayer(self, wait_first: bool) -> None:
        if self._replayer is None or self._replayer.done():
            self._replayer = asyncio.create_task(self._replay_loop(wait_first), name="usage-journal-replay")

    async def _replay_loop(self, wait_first: bool) -> None:
        if wait_first:
            await asyncio.sleep(self.replay_interval_s)
        while True:
            if self.pending:
                try:
                    await self.replay()
                except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                    log.exception("usage journal replay failed")
            await asyncio.sleep(self.replay_interval_s)

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
