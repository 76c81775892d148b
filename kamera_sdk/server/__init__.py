"""The engine server (``kamera serve``) and its httpx client.

``create_app(engine)`` builds the FastAPI app (needs the ``server`` extra); ``RemoteWindow`` and
``AsyncRemoteWindow`` need only httpx. Names are imported lazily so the client works without FastAPI.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .cli import serve
    from .client import AsyncRemoteTextStream, AsyncRemoteWindow, RemoteTextStream, RemoteWindow
    from .errors import (
        AuthenticationError,
        LimitExceededError,
        PayloadTooLargeError,
        RemoteError,
        SessionNotFoundError,
    )

_WHERE = {
    "create_app": ".app",
    "serve": ".cli",
    "AsyncRemoteTextStream": ".client",
    "AsyncRemoteWindow": ".client",
    "RemoteTextStream": ".client",
    "RemoteWindow": ".client",
    "AuthenticationError": ".errors",
    "LimitExceededError": ".errors",
    "PayloadTooLargeError": ".errors",
    "RemoteError": ".errors",
    "SessionNotFoundError": ".errors",
}

__all__ = [
    "AsyncRemoteTextStream",
    "AsyncRemoteWindow",
    "AuthenticationError",
    "LimitExceededError",
    "PayloadTooLargeError",
    "RemoteError",
    "RemoteTextStream",
    "RemoteWindow",
    "SessionNotFoundError",
    "create_app",
    "serve",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(import_module(module, __name__), name)
    except ImportError as exc:
        raise ImportError(f"{name} needs the server extra: pip install 'kamera[server]' ({exc})") from exc
