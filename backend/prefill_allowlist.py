"""Which prefill workers a decode worker may fetch KV from (so `prefill_url` cannot aim it anywhere).

A URL is allowed when it is one of the decode worker's own `--prefill-worker` URLs,
or the URL of a live worker of role `prefill` registered for its model in Redis
(`registration.py`: the members set, then each member's record, read-only). URLs
compare after dropping a trailing slash. Nothing is ever fetched from a URL this
refuses: the check runs before any connection.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from redis.exceptions import RedisError

from backend.errors import StoreUnavailable
from backend.redis_client import connect
from backend.registration import WorkerRecord, members_key, record_key

__all__ = ["PrefillAllowlist"]

_record = msgspec.json.Decoder(WorkerRecord)


def _norm(url: str) -> str:
    return url.rstrip("/")


class PrefillAllowlist:
    def __init__(self, static_urls: Sequence[str] = (), redis_url: str | None = None,
                 model: str | None = None, timeout_s: float = 2.0) -> None:
        if (redis_url is None) != (model is None):
            raise ValueError("reading the registry needs both redis_url and model")
        self.static = frozenset(_norm(u) for u in static_urls)
        self.model = model
        self._redis = (connect(redis_url, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
                       if redis_url is not None else None)

    async def allows(self, url: str) -> bool:
        """True when `url` is a configured or a live registered prefill worker of this model.
        Raises StoreUnavailable when only the registry could tell and Redis does not answer."""
        url = _norm(url)
        if url in self.static:
            return True
        if self._redis is None or self.model is None:
            return False
        try:
            ids = await self._redis.smembers(members_key(self.model))
            keys = [record_key(self.model, wid.decode()) for wid in sorted(ids)]
            raw = await self._redis.mget(keys) if keys else []
        except RedisError as exc:
            raise StoreUnavailable("the worker registry did not answer; cannot check the prefill worker",
                                   retry_after_s=1) from exc
        for blob in raw:
            if blob is None:  # expired: not live
                continue
            try:
                rec = _record.decode(blob)
            except msgspec.DecodeError:
                continue
            if rec.role == "prefill" and rec.model == self.model and _norm(rec.url) == url:
                return True
        return False

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
