"""gpupool's one error hierarchy, and the one place HTTP status codes are chosen.

Every error a client can see derives from `GpupoolError` and renders as OpenAI's shape:
`{"error": {"message", "type", "code", "param"}}` (plus `retryable` / `retry_after_seconds`
for capacity errors), or, on the Anthropic Messages API, as Anthropic's
(`anthropic_payload`, `anthropic_status`). Nothing else in the router picks a status code.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import orjson

__all__ = [
    "BadRequest",
    "CapacityExceeded",
    "ClassNotAllowed",
    "DeadlineExceeded",
    "EngineFailure",
    "Forbidden",
    "GpupoolError",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoHealthyInstance",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "RunStopped",
    "StoreUnavailable",
    "Unauthorized",
    "anthropic_body",
    "anthropic_payload",
    "anthropic_status",
    "error_for_status",
    "retry_after_seconds",
]


class GpupoolError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, code: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def payload(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.type, "code": self.code, "param": self.param}

    def body(self) -> bytes:
        return orjson.dumps({"error": self.payload()})

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class BadRequest(GpupoolError):
    """Malformed JSON, a missing or mistyped field, an unknown class."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(GpupoolError):
    status = 401
    type = "authentication_error"


class Forbidden(GpupoolError):
    status = 403
    type = "permission_error"


class ClassNotAllowed(Forbidden):
    pass


class NotFound(GpupoolError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    pass


class MethodNotAllowed(GpupoolError):
    """The path exists, the method does not; `allow` lists the methods it takes."""

    status = 405
    type = "invalid_request_error"

    def __init__(self, message: str, code: str, *, allow: str | None = None) -> None:
        super().__init__(message, code)
        self.allow = allow

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [] if not self.allow else [(b"allow", self.allow.encode())]


class RequestTimeout(GpupoolError):
    """The client took longer than `router.body_read_timeout_s` to send its body."""

    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(GpupoolError):
    """The body is over `router.max_body_bytes`."""

    status = 413
    type = "invalid_request_error"


class _Retryable(GpupoolError):
    """An error the client may retry after `retry_after_s` (`Retry-After`, whole seconds)."""

    def __init__(self, message: str, code: str, *, retry_after_s: float) -> None:
        super().__init__(message, code)
        self.retry_after_s = retry_after_s

    def payload(self) -> dict[str, Any]:
        seconds = retry_after_seconds(self.retry_after_s)
        return {**super().payload(), "retryable": True, "retry_after_seconds": seconds}

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(retry_after_seconds(self.retry_after_s)).encode())]


class CapacityExceeded(_Retryable):
    """Admission refused: queue full or the deadline cannot be met. Retryable."""

    status = 429
    type = "capacity_exceeded"


class RateLimited(CapacityExceeded):
    """A tenant's own limit (token_rate, request_rate, tenant_concurrency, cost_cap). Retryable:
    `Retry-After` (whole seconds, rounded up: the limit has room by then) and OpenAI's
    `retry-after-ms`, which the official clients read first."""

    type = "rate_limit_error"

    def headers(self) -> list[tuple[bytes, bytes]]:
        seconds = retry_after_seconds(self.retry_after_s)
        ms = max(1, math.ceil(self.retry_after_s * 1000))
        return [(b"retry-after", str(seconds).encode()), (b"retry-after-ms", str(ms).encode())]


class RunStopped(Forbidden):
    """A run guard stopped the agent run (run_steps, run_tokens, run_gpu_seconds, run_duration,
    run_loop): not retryable as it is; the message says why, for the agent framework to show."""

    type = "run_stopped"

    def payload(self) -> dict[str, Any]:
        return {**super().payload(), "retryable": False}


class EngineFailure(GpupoolError):
    """The engine failed (refused after retries, died mid-request, answered 5xx)."""

    status = 502
    type = "engine_error"


class NoHealthyInstance(GpupoolError):
    status = 503
    type = "service_unavailable"


class StoreUnavailable(_Retryable):
    """The shared store holding the tenant's budgets cannot be reached and
    `store.budgets_on_outage` is `closed`. Retryable: `Retry-After` says when to try again."""

    status = 503
    type = "service_unavailable"


class DeadlineExceeded(GpupoolError):
    """The request's deadline (x-gpupool-deadline-ms or the class timeout) passed upstream."""

    status = 504
    type = "timeout_error"


def retry_after_seconds(retry_after_s: float) -> int:
    """`Retry-After` in whole seconds: rounded up (the capacity is expected by then, not a
    moment after), at least 1; a non-finite wait reads as 1."""
    if not math.isfinite(retry_after_s):
        return 1
    return max(1, math.ceil(retry_after_s))


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); `overloaded`
# (529) is what gpupool answers on /v1/messages where it would answer 429 `queue_full`.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_OVERLOADED_CODES = frozenset({"queue_full", "shed"})


def anthropic_status(err: GpupoolError) -> int:
    """The status `err` answers with on the Anthropic Messages API: gpupool's own, except a
    full queue, which is 529 `overloaded_error` there."""
    return 529 if err.status == 429 and err.code in _OVERLOADED_CODES else err.status


def anthropic_payload(err: GpupoolError) -> dict[str, Any]:
    """`err` in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, plus
    gpupool's `code` (and `retry_after_seconds` for capacity errors) beside them."""
    status = anthropic_status(err)
    inner: dict[str, Any] = {
        "type": _ANTHROPIC_TYPES.get(status, "api_error"),
        "message": err.message,
        "code": err.code,
    }
    if isinstance(err, _Retryable):
        inner["retry_after_seconds"] = retry_after_seconds(err.retry_after_s)
    return {"type": "error", "error": inner}


def anthropic_body(err: GpupoolError) -> bytes:
    return orjson.dumps(anthropic_payload(err))


def error_for_status(status: int, message: str, code: str) -> GpupoolError:
    """The error for a status the web framework chose itself (routing: an unknown path, a method
    a path does not take): the class of that status, else a client or internal error."""
    for cls in (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed):
        if cls.status == status:
            return cls(message, code)
    return BadRequest(message, code) if 400 <= status < 500 else GpupoolError(message, code)
