"""The one hierarchy of typed errors, shared by every package.

    EdgeServeError                      code 5000  (500)
    ├── InvalidRequest                  code 3000  (400)
    │   ├── InvalidSamplingParams       code 3001  (400)
    │   └── PromptTooLong               code 3006  (413)
    ├── ModelNotFound                   code 5007  (400)
    ├── AuthenticationError             code 10000 (401)
    ├── PermissionDenied                code 10001 (403)
    ├── QuotaExceeded                   code 3036  (429, Retry-After)
    ├── CapacityError                   code 3040  (429)
    ├── RequestCancelled                code 3041  (499)
    ├── ModelLoadError                  code 5010  (500)
    │   ├── UnsupportedArchitecture     code 5011  (500)
    │   └── WeightsError                code 5012  (500)
    ├── KVIntegrityError                code 5040  (500)
    ├── BackendUnavailable              code 5003  (503, Retry-After)
    │   ├── NoCapacity                  code 5006  (503, Retry-After)
    │   ├── EngineStopped               code 5004  (503)
    │   └── Draining                    code 5005  (503, Retry-After)
    ├── RegistryUnavailable             code 5020  (503, Retry-After)
    └── StoreUnavailable                code 5021  (503, Retry-After)

Each class has a stable numeric ``code`` (3000s: the caller's fault or a
temporary refusal, 5000s: ours, except 5007 "no such model", which keeps the
platform's number; 10000s: authentication, as the platform's API uses) and the
HTTP status the gateway maps it to.
Lower layers raise these (``raise ... from exc``); the gateway translates them
once into the Workers envelope or an OpenAI error object.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EdgeServeError",
    "InvalidRequest",
    "InvalidSamplingParams",
    "PromptTooLong",
    "ModelNotFound",
    "AuthenticationError",
    "PermissionDenied",
    "QuotaExceeded",
    "CapacityError",
    "RequestCancelled",
    "ModelLoadError",
    "UnsupportedArchitecture",
    "WeightsError",
    "KVIntegrityError",
    "BackendUnavailable",
    "NoCapacity",
    "EngineStopped",
    "Draining",
    "RegistryUnavailable",
    "StoreUnavailable",
    "error_from_code",
]


class EdgeServeError(Exception):
    """Base of every error edgeserve raises on purpose."""

    code: int = 5000
    http_status: int = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """Wire form: stable code, class name, message and details."""
        return {"code": self.code, "type": type(self).__name__, "message": self.message, **self.details}


class InvalidRequest(EdgeServeError):
    code = 3000
    http_status = 400


class InvalidSamplingParams(InvalidRequest):
    code = 3001


class PromptTooLong(InvalidRequest):
    code = 3006
    http_status = 413


class ModelNotFound(EdgeServeError):
    code = 5007
    http_status = 400


class AuthenticationError(EdgeServeError):
    """No API token, or one that is unknown or revoked."""

    code = 10000
    http_status = 401


class PermissionDenied(EdgeServeError):
    """A valid token used on another tenant's account path."""

    code = 10001
    http_status = 403


class QuotaExceeded(EdgeServeError):
    """A per-tenant quota (requests per minute, tokens per day) is spent.

    details: quota ("requests_per_minute" | "tokens_per_day"), limit, retry_after_s.
    """

    code = 3036
    http_status = 429


class CapacityError(EdgeServeError):
    """Out of capacity: the wait queue is full or the request can never fit."""

    code = 3040
    http_status = 429


class RequestCancelled(EdgeServeError):
    code = 3041
    http_status = 499


class ModelLoadError(EdgeServeError):
    code = 5010


class UnsupportedArchitecture(ModelLoadError):
    code = 5011


class WeightsError(ModelLoadError):
    code = 5012


class KVIntegrityError(EdgeServeError):
    """A request's KV pages changed hands under it: aborted rather than read another's context.

    details: request_id, page (first bad page id), expected_tag, found_tag, cause.
    """

    code = 5040


class BackendUnavailable(EdgeServeError):
    """A worker could not be reached, or its stream broke. Before admission the gateway retries elsewhere."""

    code = 5003
    http_status = 503


class NoCapacity(BackendUnavailable):
    """No live worker (or no complete prefill+decode pair) can serve this model now.

    details: model, retry_after_s."""

    code = 5006


class EngineStopped(BackendUnavailable):
    """The worker's engine thread died: every waiting and running request ends with this at once,
    `/health` fails and the worker leaves the registry."""

    code = 5004


class Draining(BackendUnavailable):
    """The worker (or gateway) is shutting down: it admits nothing new, and requests still running
    when the drain timeout ends get this error. details: retry_after_s."""

    code = 5005


class RegistryUnavailable(EdgeServeError):
    code = 5020
    http_status = 503


class StoreUnavailable(EdgeServeError):
    """The shared state store (Redis) is unreachable or timed out. The message carries no address;
    the detail is logged. details: retry_after_s."""

    code = 5021
    http_status = 503


def _all_subclasses(cls: type[EdgeServeError]) -> list[type[EdgeServeError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_from_code(code: int, message: str, **details: Any) -> EdgeServeError:
    """Rebuild a typed error from its wire form (the most specific class with that code)."""
    for cls in reversed(_all_subclasses(EdgeServeError)):
        if cls.code == code:
            return cls(message, **details)
    return EdgeServeError(message, code_received=code, **details)
