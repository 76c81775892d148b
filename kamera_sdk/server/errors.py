"""Errors of the engine server and its client, and how Kamera errors map to HTTP statuses.

The server adds a few errors to Kamera's tree (``kamera_engine.errors``)::

    KameraError
    ├── InvalidInputError                  422 (400 for a body that is not JSON, 415 for another media type)
    │   ├── MediaError                     422
    │   └── PayloadTooLargeError           413  a body or image over the server's limit
    ├── ChunkNotFoundError                 404
    ├── WindowOperationError               409
    ├── CapacityError                      429  the engine's KV budget or queue is full (with Retry-After)
    └── RemoteError                        the server or the way to it (status 0: no HTTP answer)
        ├── AuthenticationError            401  missing or wrong API key
        ├── SessionNotFoundError           404  unknown (or deleted) session id
        └── LimitExceededError             429  too many sessions, or tokens held (max_held_tokens)

Every error response has the body ``{"error": {"type": <class name>, "message": <text>}}``; the
client raises the class named by ``type`` again, so remote code catches the same exceptions as local.
Anything else that fails is an ``InternalError`` (500) whose message is only a reference: the
exception and its traceback go to the ``kamera.server`` log under that reference.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

from kamera_engine import errors as _engine_errors
from kamera_engine.errors import (
    CapacityError,
    ChunkNotFoundError,
    InvalidInputError,
    KameraError,
    ModelLoadError,
    StoreError,
    UnsupportedModelError,
    WindowOperationError,
)


class RemoteError(KameraError):
    """An error reported by a Kamera server, or met on the way to it (``status == 0``)."""

    status: int = 500

    def __init__(self, message: str, *, status: int | None = None, type_name: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.type_name = type_name or type(self).__name__


class AuthenticationError(RemoteError):
    """The request carried no API key, or the wrong one."""

    status = 401


class SessionNotFoundError(RemoteError):
    """The session id is unknown to the server (never created, deleted, or expired)."""

    status = 404


class LimitExceededError(RemoteError):
    """A server limit other than size was reached (e.g. the number of open sessions)."""

    status = 429


class PayloadTooLargeError(InvalidInputError, RemoteError):
    """A request body or an image is larger than the server accepts."""

    status = 413


#: HTTP status per error class; the most specific class in an exception's MRO wins.
STATUS: dict[type[Exception], int] = {
    PayloadTooLargeError: 413,
    InvalidInputError: 422,
    ChunkNotFoundError: 404,
    WindowOperationError: 409,
    AuthenticationError: 401,
    SessionNotFoundError: 404,
    LimitExceededError: 429,
    CapacityError: 429,
    UnsupportedModelError: 422,
    StoreError: 503,
    ModelLoadError: 500,
    KameraError: 500,
}


def status_for(exc: BaseException) -> int:
    """The HTTP status for ``exc`` (500 for anything Kamera did not raise on purpose)."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_headers(exc: BaseException) -> dict[str, str] | None:
    """Headers an error response carries: ``Retry-After`` (whole seconds) when the engine is at capacity."""
    retry = getattr(exc, "retry_after_s", None) if isinstance(exc, CapacityError) else None
    return {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else None


def error_body(type_name: str, message: str) -> dict[str, Any]:
    """The JSON body of every error response."""
    return {"error": {"type": type_name, "message": message}}


def exception_body(exc: BaseException) -> dict[str, Any]:
    """The body for ``exc``: Kamera's own errors say what was wrong; anything else is logged with its
    traceback under a reference, and only the reference is sent (internals stay in the server's log)."""
    if isinstance(exc, KameraError):
        return error_body(type(exc).__name__, str(exc))
    ref = uuid.uuid4().hex[:12]
    logging.getLogger("kamera.server").error("internal error %s", ref, exc_info=exc)
    return error_body("InternalError", f"internal error {ref} (the server log has the details)")


def _known_errors() -> dict[str, type[KameraError]]:
    known: dict[str, type[KameraError]] = {}
    for name in _engine_errors.__all__:
        cls = getattr(_engine_errors, name)
        if isinstance(cls, type) and issubclass(cls, KameraError):
            known[name] = cls
    for cls in (RemoteError, AuthenticationError, SessionNotFoundError, LimitExceededError, PayloadTooLargeError):
        known[cls.__name__] = cls
    return known


#: Error class per ``type`` name, for the client to raise what the server raised.
KNOWN_ERRORS = _known_errors()


def error_from_response(status: int, body: Any) -> KameraError:
    """Rebuild the exception an error response describes (a ``RemoteError`` when the type is unknown)."""
    type_name, message = "RemoteError", f"HTTP {status}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        type_name = str(body["error"].get("type", type_name))
        message = str(body["error"].get("message", message))
    elif isinstance(body, str) and body:
        message = f"HTTP {status}: {body[:500]}"
    cls = KNOWN_ERRORS.get(type_name)
    if cls is None:
        return RemoteError(message, status=status, type_name=type_name)
    if issubclass(cls, RemoteError):
        return cls(message, status=status, type_name=type_name)
    return cls(message)


__all__ = [
    "KNOWN_ERRORS",
    "AuthenticationError",
    "LimitExceededError",
    "PayloadTooLargeError",
    "RemoteError",
    "SessionNotFoundError",
    "error_body",
    "error_from_response",
    "error_headers",
    "exception_body",
    "status_for",
]
