"""The shared worker token: who may call a worker's API.

Gateways and decode workers send `Authorization: Bearer <token>` on every worker
call (generate, cancel, stats, metrics, prefill). The worker compares it in
constant time (`hmac.compare_digest`); a missing or wrong token is a 401 with the
typed `AuthenticationError` body. `/health` stays open: it reveals nothing.

The token comes from `--worker-token` or the environment variable
`EDGESERVE_WORKER_TOKEN` (prefer the environment: argv is visible in `ps`). A
worker without a token serves anyone who can reach it, so `edgeserve serve`
allows that only on a loopback address (with a warning), or anywhere with
`--insecure-no-worker-token` (`check_bind`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from backend.errors import AuthenticationError, InvalidRequest

__all__ = ["TOKEN_ENV", "OPEN_PATHS", "resolve_token", "new_token", "auth_headers", "check_bind",
           "is_loopback", "WorkerAuth"]

TOKEN_ENV = "EDGESERVE_WORKER_TOKEN"
OPEN_PATHS = frozenset({"/health"})


def resolve_token(flag: str | None) -> str | None:
    """The worker token: the flag's value, else $EDGESERVE_WORKER_TOKEN, else None (no token)."""
    token = flag if flag is not None else os.environ.get(TOKEN_ENV)
    return token or None


def new_token() -> str:
    """A fresh random worker token (what `edgeserve up` hands its worker and gateway)."""
    return secrets.token_urlsafe(32)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a worker client sends: `Authorization: Bearer <token>`, or none without a token."""
    return {"authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, insecure: bool = False) -> str | None:
    """Refuse (InvalidRequest) to serve without a token on a non-loopback host unless `insecure`;
    returns a warning to print when the worker runs without one, else None."""
    if token:
        return None
    if not is_loopback(host) and not insecure:
        raise InvalidRequest(f"refusing to serve on {host} without a worker token: anyone who reaches it could "
                             f"read other tenants' cache hits and cancel their requests. Set {TOKEN_ENV} (or "
                             f"--worker-token), or pass --insecure-no-worker-token", field="worker_token")
    return (f"warning: no worker token ({TOKEN_ENV}); any local process can call this worker"
            if is_loopback(host) else
            f"warning: no worker token on {host} (--insecure-no-worker-token): anyone who reaches it can call it")


class WorkerAuth:
    """ASGI middleware: every HTTP request but `OPEN_PATHS` must carry the worker token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(presented, self._expected):
            await self.app(scope, receive, send)
            return
        err = AuthenticationError("missing or wrong worker token" if presented else "missing worker token")
        await JSONResponse({"error": err.to_dict()}, status_code=err.http_status,
                           headers={"www-authenticate": "Bearer"})(scope, receive, send)
