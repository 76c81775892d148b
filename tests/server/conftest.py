"""A real server on loopback: the default model behind ``create_app``, run by uvicorn in a thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from kamera_engine import Engine
from kamera_sdk.server import create_app

API_KEY = "test-key"
MAX_BODY = 64 * 1024
MAX_NEW_TOKENS = 64
MAX_SESSION_TOKENS = 2048


@dataclass(frozen=True)
class LiveServer:
    url: str
    api_key: str
    app: FastAPI

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@contextmanager
def run_server(app: FastAPI, api_key: str) -> Iterator[LiveServer]:
    """Serve ``app`` on a free 127.0.0.1 port until the block ends (lifespan shutdown included)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", api_key, app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def make_app(engine: Engine, **overrides: Any) -> FastAPI:
    options: dict[str, Any] = dict(
        api_key=API_KEY,
        max_body_bytes=MAX_BODY,
        max_new_tokens_limit=MAX_NEW_TOKENS,
        max_session_tokens=MAX_SESSION_TOKENS,
    )
    return create_app(engine, **{**options, **overrides})


@pytest.fixture(scope="session")
def live(default_engine: Engine) -> Iterator[LiveServer]:
    """One server for the test session (API key ``test-key``, 64 KiB bodies, 64 new tokens at most)."""
    with run_server(make_app(default_engine), API_KEY) as server:
        yield server
