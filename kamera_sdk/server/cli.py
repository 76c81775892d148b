"""``kamera serve``: run one engine behind the HTTP API with uvicorn."""

from __future__ import annotations

import ipaddress
import os

from kamera_engine import Engine

from ..console import err

#: Seconds uvicorn waits for requests in flight (streams included) before shutting down.
GRACEFUL_SHUTDOWN_S = 30


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    api_key: str | None = None,
    store: object | None = None,
    log_level: str = "info",
    batch: bool = True,
    kv_budget_bytes: int | None = None,
    step_tokens: int | None = None,
    max_batch_rows: int | None = None,
    max_held_tokens: int | None = None,
) -> int:
    """Serve ``engine`` until interrupted; returns the exit code. ``api_key`` defaults to ``$KAMERA_API_KEY``;
    ``batch``, ``kv_budget_bytes``, ``step_tokens``, ``max_batch_rows`` and ``max_held_tokens`` are ``create_app``'s.

    On SIGINT/SIGTERM uvicorn stops accepting, lets requests in flight finish, then the app's lifespan
    stops the model worker and flushes the store.
    """
    import uvicorn

    from .app import create_app

    api_key = api_key or os.environ.get("KAMERA_API_KEY") or None
    if api_key is None and not _is_loopback(host):
        err.print(f"[yellow]warning:[/] serving on {host} without an API key: anyone who can reach it can use it")
    app = create_app(
        engine,
        api_key=api_key,
        store=store,
        batch=batch,
        kv_budget_bytes=kv_budget_bytes,
        step_tokens=step_tokens,
        max_batch_rows=max_batch_rows,
        max_held_tokens=max_held_tokens,
    )
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on"
    )
    uvicorn.Server(config).run()
    return 0
