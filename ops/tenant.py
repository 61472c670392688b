"""`edgeserve tenant …` and `edgeserve key …`: administer tenants and API keys in Redis.

    edgeserve tenant create NAME [--id ID] [--rpm N] [--tokens-per-day N] [--json]
    edgeserve tenant list                                  (JSON array)
    edgeserve tenant set-quotas TENANT_ID [--rpm N|unlimited] [--tokens-per-day N|unlimited]
    edgeserve tenant usage TENANT_ID [--from DAY] [--to DAY]   (JSON; default: the last 7 UTC days)
    edgeserve key create TENANT_ID [--json]                (the token is shown once, never again)
    edgeserve key revoke KEY_ID

Every command talks to the Redis the gateways use (see `gateway.redis_keys`): the one
``--redis-url`` names, else $REDIS_URL, else the one the running `edgeserve up`
recorded (`ops.cluster_record`), else redis://127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["register", "default_redis_url"]

Command = Callable[[argparse.Namespace, "redis.asyncio.Redis"], Awaitable[int]]
_KEEP: Any = object()  # set-quotas: a limit not given on the command line stays as it is


LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"


def default_redis_url() -> str:
    """$REDIS_URL, else the running `edgeserve up`'s Redis, else the local default."""
    from ops.cluster_record import setting

    return setting(None, "REDIS_URL", "redis_url", LOCAL_REDIS_URL)


def _limit(text: str) -> int | None:
    if text.lower() in ("unlimited", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a limit: {text!r} (a positive integer or 'unlimited')") from None


def _run(command: Command) -> Callable[[argparse.Namespace], int]:
    """Wrap an async command: open the Redis client (bounded waits), run, close.

    An unreachable Redis is reported with its URL, password removed (an admin's
    terminal, not a client's response)."""
    def func(args: argparse.Namespace) -> int:
        from backend.errors import StoreUnavailable
        from backend.redis_client import connect, redact

        args.redis_url = args.redis_url or default_redis_url()

        async def main() -> int:
            async with connect(args.redis_url, socket_timeout_s=5.0) as client:
                return await command(args, client)

        try:
            return asyncio.run(main())
        except StoreUnavailable as exc:
            raise StoreUnavailable(f"Redis at {redact(args.redis_url)} is unreachable", **exc.details) from exc
    return func


async def _tenant_create(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from gateway.tenants import TenantStore

    tenant = await TenantStore(client).create_tenant(args.name, tenant_id=args.id, requests_per_minute=args.rpm,
                                                     tokens_per_day=args.tokens_per_day)
    print(msgspec.json.encode(tenant).decode() if args.json else tenant.id)
    return 0


async def _tenant_list(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from gateway.tenants import TenantStore

    print(json.dumps(msgspec.to_builtins(await TenantStore(client).list_tenants()), indent=2))
    return 0


async def _tenant_set_quotas(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from backend.errors import InvalidRequest
    from gateway.tenants import TenantStore

    store = TenantStore(client)
    current = await store.get_tenant(args.tenant_id)
    if current is None:
        raise InvalidRequest(f"no such tenant: {args.tenant_id}")
    rpm = current.requests_per_minute if args.rpm is _KEEP else args.rpm
    tpd = current.tokens_per_day if args.tokens_per_day is _KEEP else args.tokens_per_day
    tenant = await store.set_quotas(args.tenant_id, requests_per_minute=rpm, tokens_per_day=tpd)
    print(msgspec.json.encode(tenant).decode())
    return 0


async def _tenant_usage(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from gateway.metering import Meter

    end = args.to or datetime.now(UTC).date().isoformat()
    start = args.from_ or _days_before(end, 6)
    usage = await Meter(client).usage(args.tenant_id, start, end)
    print(json.dumps({"tenant_id": args.tenant_id, "from": start, "to": end, "usage": usage}, indent=2))
    return 0


def _days_before(day: str, n: int) -> str:
    """`n` days before 'YYYY-MM-DD' `day` (`day` itself when malformed: Meter.usage then says why)."""
    try:
        return (date.fromisoformat(day) - timedelta(days=n)).isoformat()
    except ValueError:
        return day


async def _key_create(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from gateway.tenants import TenantStore

    key = await TenantStore(client).create_key(args.tenant_id)
    if args.json:
        print(json.dumps(key._asdict()))
    else:
        print(f"key_id: {key.key_id}\ntoken:  {key.token}")
        print("The token is shown only this once; store it now.", file=sys.stderr)
    return 0


async def _key_revoke(args: argparse.Namespace, client: redis.asyncio.Redis) -> int:
    from gateway.tenants import TenantStore

    if not await TenantStore(client).revoke_key(args.key_id):
        print(f"edgeserve: no such key: {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {args.key_id}")
    return 0


def _command(group: argparse._SubParsersAction, name: str, help: str, command: Command) -> argparse.ArgumentParser:
    p = group.add_parser(name, help=help)
    p.add_argument("--redis-url", default=None,
                   help=f"the gateways' Redis (default: $REDIS_URL, else the running `edgeserve up`'s, else "
                        f"{LOCAL_REDIS_URL})")
    p.set_defaults(func=_run(command))
    return p


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `tenant` and `key` subcommands."""
    tenant = subparsers.add_parser("tenant", help="create, list and inspect tenants")
    tenant_cmds = tenant.add_subparsers(dest="tenant_command", required=True)
    create = _command(tenant_cmds, "create", "create a tenant; prints its id", _tenant_create)
    create.add_argument("name")
    create.add_argument("--id", default=None, help="tenant (account) id; default: 32 random hex chars")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tokens-per-day", type=int, default=None, help="tokens per UTC day (default: unlimited)")
    create.add_argument("--json", action="store_true", help="print the tenant as one JSON line")
    _command(tenant_cmds, "list", "list tenants (JSON)", _tenant_list)
    quotas = _command(tenant_cmds, "set-quotas", "change a tenant's limits", _tenant_set_quotas)
    quotas.add_argument("tenant_id")
    quotas.add_argument("--rpm", type=_limit, default=_KEEP, help="N or 'unlimited' (default: keep)")
    quotas.add_argument("--tokens-per-day", type=_limit, default=_KEEP,
                        help="N or 'unlimited' (default: keep)")
    usage = _command(tenant_cmds, "usage", "usage per UTC day and model (JSON)", _tenant_usage)
    usage.add_argument("tenant_id")
    usage.add_argument("--from", dest="from_", default=None, help="first UTC day, YYYY-MM-DD (default: --to - 6)")
    usage.add_argument("--to", default=None, help="last UTC day, YYYY-MM-DD (default: today)")

    key = subparsers.add_parser("key", help="create and revoke API keys")
    key_cmds = key.add_subparsers(dest="key_command", required=True)
    key_create = _command(key_cmds, "create", "create an API key; prints its id and token (shown once)", _key_create)
    key_create.add_argument("tenant_id")
    key_create.add_argument("--json", action="store_true", help="print key_id, tenant_id, token as one JSON line")
    key_revoke = _command(key_cmds, "revoke", "revoke an API key by its id", _key_revoke)
    key_revoke.add_argument("key_id")
