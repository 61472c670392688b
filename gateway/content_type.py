"""Which request bodies the JSON endpoints accept, by `Content-Type`; others are answered 415.

Every POST the gateway serves takes a JSON body. Accepted:

    (no Content-Type)                      what httpx's `content=` and many scripts send
    application/json (any parameters)      what SDKs and `curl --json` send
    application/x-www-form-urlencoded      what `curl -d '{...}'` sends unless told otherwise

The body is read as JSON whatever the accepted type says (form-encoded fields are not
parsed: `a=b` is malformed JSON, 400). Anything else, such as `text/xml`, `text/plain`
or `multipart/form-data`, is refused with 415 in the API's own error form before any
route runs (`render`), like the header limits of `backend/http_limits.py`. Requests
without a body (GET) are not checked.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from backend.errors import InvalidRequest
from backend.http_limits import ErrorRender

__all__ = ["ACCEPTED_CONTENT_TYPES", "UNSUPPORTED_MEDIA_TYPE", "JsonContentTypeMiddleware", "accepts"]

ACCEPTED_CONTENT_TYPES = ("", "application/json", "application/x-www-form-urlencoded")
UNSUPPORTED_MEDIA_TYPE = 415


def accepts(content_type: str) -> bool:
    """Whether a body sent as `content_type` (a raw header value, parameters allowed) is read as JSON."""
    return content_type.split(";", 1)[0].strip().lower() in ACCEPTED_CONTENT_TYPES


class JsonContentTypeMiddleware:
    """ASGI middleware: 415 for a POST whose `Content-Type` is not one the JSON endpoints accept."""

    def __init__(self, app: ASGIApp, render: ErrorRender) -> None:
        self.app, self.render = app, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            content_type = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), "")
            if not accepts(content_type):
                err = InvalidRequest(f"unsupported Content-Type {content_type[:100]!r}; send the JSON body as "
                                     "application/json")
                await self.render(scope["path"], err, UNSUPPORTED_MEDIA_TYPE)(scope, receive, send)
                return
        await self.app(scope, receive, send)
