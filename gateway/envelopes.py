"""The one place typed errors become HTTP: status, headers, Workers envelope, OpenAI object.

    Workers:  {"result": null, "success": false, "errors": [{"code": 5007, "message": "..."}], "messages": []}
    OpenAI:   {"error": {"message": "...", "type": "invalid_request_error", "param": null,
               "code": "model_not_found", "edgeserve_code": 5007}}     (param: the field at fault, if one is)

HTTP statuses come from the error class (`backend/errors.py`), which is what the
Workers API answers. The OpenAI API answers as OpenAI does, so its official client
raises the matching exception class (`openai_status`): an unknown model is 404
`model_not_found` (Workers: 400, 5007), a prompt plus `max_tokens` over the context
is 400 `context_length_exceeded` (Workers: 413, 3006), while a request body over
the size limit stays 413 `request_too_large` on both (it is a `PromptTooLong`
whose details carry `max_request_bytes`). Refusals made before any handler runs
(unknown route 404, wrong method 405, unsupported media type 415, headers 431)
are rendered with their status given explicitly and name it in the OpenAI `code`.
429s and 503s carry `Retry-After` (seconds); a requests-per-minute refusal also
carries `x-ratelimit-limit-requests` and `x-ratelimit-remaining-requests: 0`.

An exception that is not an `EdgeServeError` is a bug: it is logged with its
traceback and answered as a bare 5000 without details, except a client that hung up while its body was read (Starlette's
`ClientDisconnect`), which is that client's cancel (`RequestCancelled`, 499).

Nothing internal reaches a client (`public_message`): a server-side failure
whose message embeds a lower layer's exception text (a worker's URL, a store's
address) is answered with its class's fixed sentence (`_PUBLIC`); every other
message is passed through `redact`, which replaces URLs, IP addresses, host:port
pairs and socket-address tuples with `[internal]`. The full message is logged.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect

from backend.errors import (
    AuthenticationError,
    BackendUnavailable,
    CapacityError,
    EdgeServeError,
    EngineStopped,
    InvalidRequest,
    KVIntegrityError,
    ModelLoadError,
    ModelNotFound,
    PermissionDenied,
    PromptTooLong,
    QuotaExceeded,
    RegistryUnavailable,
    RequestCancelled,
    StoreUnavailable,
)

__all__ = ["as_typed", "error_headers", "workers_error", "workers_success", "openai_error", "openai_status",
           "redact", "public_message", "is_body_too_large"]

log = logging.getLogger(__name__)

_OPENAI_TYPE: list[tuple[type[EdgeServeError], str, str | None]] = [  # first match wins
    (ModelNotFound, "invalid_request_error", "model_not_found"),
    (InvalidRequest, "invalid_request_error", None),  # its code by status (_OPENAI_STATUS_CODE), if one fits
    (AuthenticationError, "authentication_error", "invalid_api_key"),
    (PermissionDenied, "permission_error", None),
    (QuotaExceeded, "rate_limit_error", "rate_limit_exceeded"),
    (CapacityError, "rate_limit_error", "server_overloaded"),
]
# Codes for refusals known by their status; a prompt over the context is the 400 PromptTooLong.
_OPENAI_STATUS_CODE: dict[int, str] = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large",
                                       415: "unsupported_media_type", 431: "request_header_fields_too_large"}

_INTERNAL = "[internal]"
_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+"  # any URL (credentials included)
    r"|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\](?::\d+)?"  # [IPv6]:port
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?=[\w.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:\d{2,5}\b"  # host:port (a name)
    r"|\(\s*'[^']*'\s*,\s*\d+[^)]*\)"  # a socket address as Python prints it: ('10.0.0.3', 8001)
)
# Server-side failures whose messages carry a lower layer's text: the client gets the class's sentence.
_PUBLIC: dict[type[EdgeServeError], str] = {
    EdgeServeError: "internal error",
    BackendUnavailable: "the worker serving this request is unreachable or its stream broke; retry",
    EngineStopped: "the worker's engine stopped; retry",
    ModelLoadError: "the model could not be loaded",
    KVIntegrityError: "the request's KV cache pages changed owner; it was aborted rather than read another's",
    RegistryUnavailable: "the worker registry is unavailable; retry shortly",
    StoreUnavailable: "the shared state store is unavailable; retry shortly",
}


def redact(text: str) -> str:
    """`text` with URLs, IP addresses, host:port pairs and socket-address tuples replaced by `[internal]`."""
    return _ADDRESS.sub(_INTERNAL, text)


def public_message(exc: EdgeServeError) -> str:
    """The message a client may see: the class's fixed sentence for server-side failures that embed
    lower layers' text, else `exc.message` redacted (the original is logged when it differs)."""
    message = _PUBLIC.get(type(exc)) or redact(exc.message)
    if message != exc.message:
        log.warning("error %d (%s) sent redacted: %s", exc.code, type(exc).__name__, exc.message)
    return message


def as_typed(exc: BaseException) -> EdgeServeError:
    """`exc` itself when typed; a client gone while its body was read is `RequestCancelled`;
    anything else is a generic internal error (the original is logged with its traceback)."""
    if isinstance(exc, EdgeServeError):
        return exc
    if isinstance(exc, ClientDisconnect):
        log.info("client disconnected before its request body was read")
        return RequestCancelled("client disconnected while sending the request")
    log.error("internal error", exc_info=exc)
    return EdgeServeError("internal error")


def error_headers(exc: EdgeServeError) -> dict[str, str]:
    """`Retry-After` for refusals that pass with time: quota (429), capacity (429) and every 503;
    a requests-per-minute refusal also says its limit and that none are left."""
    headers: dict[str, str] = {}
    if isinstance(exc, (QuotaExceeded, CapacityError)) or exc.http_status == 503:
        headers["Retry-After"] = str(max(1, math.ceil(float(exc.details.get("retry_after_s", 1)))))
    if isinstance(exc, QuotaExceeded) and exc.details.get("quota") == "requests_per_minute" \
            and exc.details.get("limit") is not None:
        headers["x-ratelimit-limit-requests"] = str(exc.details["limit"])
        headers["x-ratelimit-remaining-requests"] = "0"
    return headers


def is_body_too_large(exc: EdgeServeError) -> bool:
    """Whether `exc` refuses a request body over the size limit (not a prompt over the context)."""
    return isinstance(exc, PromptTooLong) and "max_request_bytes" in exc.details


def workers_error(exc: EdgeServeError) -> dict[str, Any]:
    return {"result": None, "success": False, "errors": [{"code": exc.code, "message": public_message(exc)}],
            "messages": []}


def workers_success(result: Any, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Workers success envelope; `messages` are notices about the result (`{"code", "message"}`)."""
    return {"result": result, "success": True, "errors": [], "messages": messages or []}


def openai_status(exc: EdgeServeError) -> int:
    """The HTTP status OpenAI answers `exc` with: 404 for an unknown model, 400 for a prompt over
    the context; otherwise the class's (which the Workers API always uses)."""
    if isinstance(exc, ModelNotFound):
        return 404
    if isinstance(exc, PromptTooLong) and not is_body_too_large(exc):
        return 400
    return exc.http_status


def openai_error(exc: EdgeServeError, status: int | None = None) -> dict[str, Any]:
    """`exc` as an OpenAI error object; `status` is the one it goes out with when that is not
    `openai_status(exc)` (route, method, media-type and header refusals), and names its `code`."""
    status = status or openai_status(exc)
    kind, code = "server_error", None
    for cls, k, c in _OPENAI_TYPE:
        if isinstance(exc, cls):
            kind, code = k, c
            break
    if isinstance(exc, PromptTooLong) and status == 400:
        code = "context_length_exceeded"
    elif kind == "invalid_request_error" and code is None:
        code = _OPENAI_STATUS_CODE.get(status)
    if isinstance(exc, QuotaExceeded) and exc.details.get("quota") == "tokens_per_day":
        code = "insufficient_quota"
    return {"error": {"message": public_message(exc), "type": kind, "param": exc.details.get("field") or None,
                      "code": code or str(exc.code), "edgeserve_code": exc.code}}
