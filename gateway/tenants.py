"""Tenants and their API keys, in Redis (see `gateway.redis_keys` for the layout).

A tenant is an account: an id (used in ``/accounts/{account_id}/...`` paths), a
name and optional limits (requests per minute, tokens per UTC day; unset means
unlimited). An API key is a bearer token ``es_<43 url-safe chars>`` bound to one
tenant. Tokens are never stored: Redis keeps only their sha256 hex digest, and
that digest *is* the lookup key, so authenticating is one HGET and no token is
ever compared in Python. A key also has a short public id (12 hex chars) that
names it for listing and revocation.

A gateway's store (``tracked=True``) keeps both reads, the token's lookup and its tenant's
record, in `backend.redis_tracking.TrackedReads`: Redis tells the gateway as soon as either
key is written (a key revoked, a quota set), so a cached answer is exact, not a guess with a
time to live, and a request whose token and tenant are held authenticates without touching
Redis at all. A token is tracked only once it has authenticated (its second lookup on): an
unknown or wrong token costs Redis no memory, and is looked up every time.

Otherwise the lookup can overlap the request's own work (`TenantStore.begin`): it is sent at
once, and for a token that authenticated within `tenant_cache_s` the tenant is known
before its answer arrives, so the handler decodes and tokenises meanwhile and awaits
the answer (`PendingAuth.confirm`) before any quota, worker or usage is touched: a
revoked key still fails at once, on its next request. A token not seen recently
(unknown, wrong, revoked) is checked before anything else is done for it, so a
client without a valid key never gets its prompt tokenised.

Writes to one tenant's record go through small Lua scripts so a reader never
sees a half-written tenant. Keys are written index-first and the token lookup
last, and revoked lookup-first, so a token works only while its key fully exists.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import secrets
import time
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from backend.errors import AuthenticationError, InvalidRequest
from backend.redis_lane import retrieve_exception, run_command
from backend.redis_tracking import MISS, TrackedReads
from gateway import redis_keys as rk
from gateway.redis_keys import redis_errors, text

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["Tenant", "ApiKey", "TenantStore", "PendingAuth", "hash_token"]

_TENANT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # safe inside a {hash tag} and a URL path

# KEYS: tenant hash. ARGV: name, created, rpm ("" = unlimited), tpd. Returns 0 when it exists.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'name', ARGV[1], 'created', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'requests_per_minute', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'tokens_per_day', ARGV[4]) end
return 1
"""

# KEYS: tenant hash. ARGV: rpm, tpd ("" = unlimited). Returns 0 when there is no such tenant.
_SET_QUOTAS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local fields = {'requests_per_minute', 'tokens_per_day'}
for i = 1, 2 do
  if ARGV[i] == '' then redis.call('HDEL', KEYS[1], fields[i])
  else redis.call('HSET', KEYS[1], fields[i], ARGV[i]) end
end
return 1
"""


class Tenant(msgspec.Struct, frozen=True):
    """An account and its limits (None = unlimited)."""

    id: str
    name: str
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None


class ApiKey(NamedTuple):
    """A freshly created key; `token` is the secret, known only now (Redis keeps its sha256)."""

    key_id: str
    tenant_id: str
    token: str


def hash_token(token: str) -> str:
    """The sha256 hex digest under which a token is stored."""
    return hashlib.sha256(token.encode()).hexdigest()


def _limit(name: str, value: int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{name} must be a positive integer or None (unlimited), got {value!r}")
    return str(value)


_TENANT_FIELDS = ("name", "requests_per_minute", "tokens_per_day")


def _tenant_from_fields(tenant_id: str, values: list) -> Tenant | None:
    """The tenant from an HMGET of `_TENANT_FIELDS`; None when there is none (every tenant has a name)."""
    return _tenant_from_hash(tenant_id, {f: v for f, v in zip(_TENANT_FIELDS, values, strict=True) if v is not None})


def _tenant_from_hash(tenant_id: str, fields: dict) -> Tenant | None:
    if not fields:
        return None
    f = {text(k): text(v) for k, v in fields.items()}
    rpm, tpd = f.get("requests_per_minute"), f.get("tokens_per_day")
    return Tenant(id=tenant_id, name=f.get("name") or "", requests_per_minute=int(rpm) if rpm else None,
                  tokens_per_day=int(tpd) if tpd else None)


class PendingAuth:
    """A token's lookup in flight (`TenantStore.begin`). `tenant` is set at once when the same token
    authenticated within the store's `tenant_cache_s` (a hint for work that touches nothing shared);
    `confirm` is the lookup's answer, the only one to act on."""

    def __init__(self, lookup: asyncio.Future[Tenant], tenant: Tenant | None) -> None:
        self._lookup, self.tenant = lookup, tenant
        if lookup.done():
            retrieve_exception(lookup)
        else:
            lookup.add_done_callback(retrieve_exception)  # a request that ends early leaves no unretrieved error

    async def confirm(self) -> Tenant:
        """The token's tenant; AuthenticationError (or StoreUnavailable) otherwise."""
        return await self._lookup

    def cache_namespace(self) -> str | None:
        """The namespace of caches of the caller's own work (`backend.piece_cache`): the tenant's id once
        known without waiting (the hint, or the lookup's answer), else None (nothing cached)."""
        if self.tenant is not None:
            return self.tenant.id
        done = self._lookup.done() and not self._lookup.cancelled() and self._lookup.exception() is None
        return self._lookup.result().id if done else None

    async def first_error(self, exc: BaseException) -> BaseException:
        """The error a request that failed with `exc` reports: the lookup's own, if it fails
        (authentication comes first, as if it had been awaited before anything else), else `exc`."""
        try:
            await self._lookup
        except Exception as auth_error:  # noqa: BLE001 - returned, to be rendered in its place
            return auth_error
        return exc


class TenantStore:
    """Tenants and API keys of every gateway replica, in one Redis."""

    def __init__(self, redis: redis.asyncio.Redis, tenant_cache_s: float = 0.0, *, tracked: bool = False) -> None:
        """`tracked` keeps token lookups and tenant records until Redis says they changed (module
        docstring; where Redis cannot track, as without it). Otherwise `tenant_cache_s` > 0 lets
        `authenticate` reuse a tenant record (name, quotas) for that long, saving a round trip per
        request; the token itself is looked up every time, so a revoked key stops working at once,
        while a quota change takes up to `tenant_cache_s` to apply."""
        self.redis = redis
        self._tracked = TrackedReads(redis) if tracked else None
        self.held_lookups = self.redis_lookups = 0  # tokens answered from the tracked reads / looked up in Redis
        self._tenant_cache_s = tenant_cache_s
        self._tenant_cache: dict[str, tuple[float, Tenant]] = {}
        self._recent: dict[str, tuple[float, str]] = {}  # token hash -> (when it last authenticated, tenant id)
        self._create = redis.register_script(_CREATE)
        self._set_quotas = redis.register_script(_SET_QUOTAS)

    async def create_tenant(self, name: str, *, tenant_id: str | None = None,
                            requests_per_minute: int | None = None,
                            tokens_per_day: int | None = None) -> Tenant:
        """Create a tenant (id: 32 random hex chars by default). InvalidRequest if the id is taken."""
        tenant_id = secrets.token_hex(16) if tenant_id is None else tenant_id
        if not _TENANT_ID.fullmatch(tenant_id):
            raise InvalidRequest("tenant id must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'")
        if not name.strip():
            raise InvalidRequest("tenant name must not be empty")
        rpm, tpd = _limit("requests_per_minute", requests_per_minute), _limit("tokens_per_day", tokens_per_day)
        with redis_errors():
            created = await self._create(keys=[rk.tenant(tenant_id)], args=[name, f"{time.time():.3f}", rpm, tpd])
            if not created:
                raise InvalidRequest(f"tenant {tenant_id} already exists")
            await self.redis.sadd(rk.tenants(), tenant_id)
        return Tenant(tenant_id, name, requests_per_minute, tokens_per_day)

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """The tenant, or None when there is no such id."""
        if not _TENANT_ID.fullmatch(tenant_id):
            return None
        with redis_errors():
            return _tenant_from_hash(tenant_id, await self.redis.hgetall(rk.tenant(tenant_id)))

    async def set_quotas(self, tenant_id: str, *, requests_per_minute: int | None,
                         tokens_per_day: int | None) -> Tenant:
        """Replace both limits (None = unlimited); returns the updated tenant."""
        rpm, tpd = _limit("requests_per_minute", requests_per_minute), _limit("tokens_per_day", tokens_per_day)
        with redis_errors():
            if not _TENANT_ID.fullmatch(tenant_id) or not await self._set_quotas(
                    keys=[rk.tenant(tenant_id)], args=[rpm, tpd]):
                raise InvalidRequest(f"no such tenant: {tenant_id}")
        tenant = await self.get_tenant(tenant_id)
        assert tenant is not None
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, sorted by id."""
        with redis_errors():
            ids = sorted(text(t) for t in await self.redis.smembers(rk.tenants()))
            async with self.redis.pipeline(transaction=False) as pipe:
                for tenant_id in ids:
                    pipe.hgetall(rk.tenant(tenant_id))
                records = await pipe.execute()
        return [t for i, h in zip(ids, records, strict=True) if (t := _tenant_from_hash(i, h)) is not None]

    async def create_key(self, tenant_id: str) -> ApiKey:
        """A new API key for the tenant; the returned token is the only copy of the secret."""
        if await self.get_tenant(tenant_id) is None:
            raise InvalidRequest(f"no such tenant: {tenant_id}")
        token = "es_" + secrets.token_urlsafe(32)
        token_hash, created = hash_token(token), f"{time.time():.3f}"
        with redis_errors():
            kid = secrets.token_hex(6)
            while not await self.redis.hsetnx(rk.key_id(kid), "tenant_id", tenant_id):
                kid = secrets.token_hex(6)  # 48-bit id collision: practically never
            await self.redis.hset(rk.key_id(kid), "token_hash", token_hash)
            await self.redis.sadd(rk.tenant_keys(tenant_id), kid)
            await self.redis.hset(rk.api_key(token_hash),
                                  mapping={"tenant_id": tenant_id, "key_id": kid, "created": created})
        return ApiKey(kid, tenant_id, token)

    async def revoke_key(self, key_id: str) -> bool:
        """Delete the key; False when unknown. Its token stops authenticating at once."""
        with redis_errors():
            record = {text(k): text(v) for k, v in (await self.redis.hgetall(rk.key_id(key_id))).items()}
            if not record:
                return False
            if record.get("token_hash"):
                await self.redis.delete(rk.api_key(record["token_hash"]))
            await self.redis.srem(rk.tenant_keys(record["tenant_id"]), key_id)
            await self.redis.delete(rk.key_id(key_id))
        return True

    async def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <token>`` header; AuthenticationError otherwise."""
        return await self.begin(authorization).confirm()

    def begin(self, authorization: str | None) -> PendingAuth:
        """Send the lookup of an ``Authorization: Bearer <token>`` header now (module docstring); a
        missing or malformed header raises AuthenticationError here."""
        if not authorization or not authorization.strip():
            raise AuthenticationError("missing Authorization header (expected 'Bearer <api token>')")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or len(token.split()) != 1:  # empty, or whitespace inside
            raise AuthenticationError("malformed Authorization header (expected 'Bearer <api token>')")
        token_hash = hash_token(token)
        if self._tracked is not None and (held := self._held(token_hash)) is not None:
            self.held_lookups += 1
            answered = asyncio.get_running_loop().create_future()
            answered.set_result(held)
            return PendingAuth(answered, held)
        hint, recent = None, self._recent.get(token_hash)
        if recent is not None and time.monotonic() - recent[0] < self._tenant_cache_s:
            cached = self._tenant_cache.get(recent[1])
            hint = cached[1] if cached is not None else None
        return PendingAuth(asyncio.ensure_future(self._lookup(token_hash)), hint)

    async def aclose(self) -> None:
        """Close the tracked reads' connection (a gateway's store); the redis client is the caller's."""
        if self._tracked is not None:
            await self._tracked.aclose()

    def _held(self, token_hash: str) -> Tenant | None:
        """The token's tenant when the tracked reads hold both its lookup and the tenant's record."""
        key = rk.api_key(token_hash)
        tenant_id = self._tracked.get(key, ("HGET", key, "tenant_id"))
        if tenant_id is MISS or tenant_id is None:
            return None
        record = rk.tenant(tenant_id)
        tenant = self._tracked.get(record, ("HMGET", record, *_TENANT_FIELDS))
        return None if tenant is MISS else tenant

    async def _lookup(self, token_hash: str) -> Tenant:
        self.redis_lookups += 1
        try:
            with redis_errors():
                key = rk.api_key(token_hash)
                if self._tracked is not None:  # tracked once the token has authenticated (module docstring)
                    tenant_id = await self._tracked.read(key, ("HGET", key, "tenant_id"), parse=text,
                                                         track=token_hash in self._recent)
                else:
                    tenant_id = text(await run_command(self.redis, "HGET", key, "tenant_id"))
            tenant = await self._cached_tenant(tenant_id) if tenant_id else None
        except BaseException:
            self._recent.pop(token_hash, None)
            raise
        if tenant is None:
            self._recent.pop(token_hash, None)
            raise AuthenticationError("invalid or revoked API token")
        if self._tenant_cache_s > 0 or self._tracked is not None:
            if len(self._recent) > 100_000:
                self._recent.clear()
            self._recent[token_hash] = (time.monotonic(), tenant.id)
        return tenant

    async def _cached_tenant(self, tenant_id: str) -> Tenant | None:
        if self._tracked is not None and self._tracked.enabled:
            record = rk.tenant(tenant_id)
            with redis_errors():
                return await self._tracked.read(record, ("HMGET", record, *_TENANT_FIELDS),
                                                parse=functools.partial(_tenant_from_fields, tenant_id))
        now = time.monotonic()
        hit = self._tenant_cache.get(tenant_id)
        if hit is not None and now - hit[0] < self._tenant_cache_s:
            return hit[1]
        tenant = await self.get_tenant(tenant_id)
        if tenant is not None and self._tenant_cache_s > 0:
            if len(self._tenant_cache) > 100_000:
                self._tenant_cache.clear()
            self._tenant_cache[tenant_id] = (now, tenant)
        return tenant
