"""The one place typed errors become HTTP: status, headers, Workers envelope, OpenAI object.

    Workers:  {"result": null, "success": false, "errors": [{"code": 5007, "message": "..."}], "messages": []}
    OpenAI:   {"error": {"message": "...", "type": "invalid_request_error", "param": "model",
               "code": "model_not_found", "edgeserve_code": 5007}}

HTTP statuses come from the error class (`backend/errors.py`); 429s carry
`Retry-After` (seconds). An exception that is not an `EdgeServeError` is a bug:
it is logged with its traceback and answered as a bare 5000 without details.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from backend.errors import (
    AuthenticationError,
    CapacityError,
    EdgeServeError,
    InvalidRequest,
    ModelNotFound,
    PermissionDenied,
    PromptTooLong,
    QuotaExceeded,
)

__all__ = ["as_typed", "error_headers", "workers_error", "workers_success", "openai_error"]

log = logging.getLogger(__name__)

_OPENAI_TYPE: list[tuple[type[EdgeServeError], str, str | None]] = [  # first match wins
    (ModelNotFound, "invalid_request_error", "model_not_found"),
    (PromptTooLong, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequest, "invalid_request_error", None),
    (AuthenticationError, "authentication_error", "invalid_api_key"),
    (PermissionDenied, "permission_error", None),
    (QuotaExceeded, "rate_limit_error", "rate_limit_exceeded"),
    (CapacityError, "rate_limit_error", "server_overloaded"),
]


def as_typed(exc: BaseException) -> EdgeServeError:
    """`exc` itself when typed; otherwise a generic internal error (the original is logged)."""
    if isinstance(exc, EdgeServeError):
        return exc
    log.error("internal error", exc_info=exc)
    return EdgeServeError("internal error")


def error_headers(exc: EdgeServeError) -> dict[str, str]:
    """`Retry-After` for refusals that pass with time: quota (429), capacity (429) and every 503."""
    if isinstance(exc, (QuotaExceeded, CapacityError)) or exc.http_status == 503:
        return {"Retry-After": str(max(1, math.ceil(float(exc.details.get("retry_after_s", 1)))))}
    return {}


def workers_error(exc: EdgeServeError) -> dict[str, Any]:
    return {"result": None, "success": False, "errors": [{"code": exc.code, "message": exc.message}],
            "messages": []}


def workers_success(result: Any) -> dict[str, Any]:
    return {"result": result, "success": True, "errors": [], "messages": []}


def openai_error(exc: EdgeServeError) -> dict[str, Any]:
    kind, code = "server_error", None
    for cls, k, c in _OPENAI_TYPE:
        if isinstance(exc, cls):
            kind, code = k, c
            break
    if isinstance(exc, QuotaExceeded) and exc.details.get("quota") == "tokens_per_day":
        code = "insufficient_quota"
    return {"error": {"message": exc.message, "type": kind, "param": exc.details.get("field"),
                      "code": code or str(exc.code), "edgeserve_code": exc.code}}
