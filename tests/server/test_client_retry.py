"""The HTTP client's bounded retry of 429 + Retry-After (a busy engine), against a scripted transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from kamera_engine import CapacityError, InvalidInputError
from kamera_sdk.server import client as client_mod
from kamera_sdk.server.client import AsyncRemoteWindow, RemoteWindow

URL = "http://kamera.test"
BUSY = {"error": {"type": "CapacityError", "message": "the engine is at capacity"}}
ADDED = {"chunk": "c1", "window": {"session": "s", "policy": "kamera", "chunks": ["c1"], "evicted": [], "tokens": 3}}
STREAM = 'event: token\ndata: {"text": "hi"}\n\nevent: done\ndata: {"tokens": 1, "finish_reason": "stop"}\n\n'


def _script(refusals: int, retry_after: str | None, ok: httpx.Response) -> tuple[Callable, list[str]]:
    """A transport handler that refuses ``refusals`` times, then answers ``ok``; and the paths it saw."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if len(seen) <= refusals:
            headers = {"Retry-After": retry_after} if retry_after is not None else {}
            return httpx.Response(429, json=BUSY, headers=headers)
        return ok

    return handler, seen


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)

    async def fake(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(client_mod.asyncio, "sleep", fake)
    return slept


def _window(handler: Callable, **kw: object) -> RemoteWindow:
    http = httpx.Client(base_url=URL, transport=httpx.MockTransport(handler))
    return RemoteWindow(URL, session_id="s", client=http, **kw)  # type: ignore[arg-type]


def test_a_refused_request_is_sent_again_after_retry_after(waits: list[float]) -> None:
    handler, seen = _script(2, "3", httpx.Response(200, json=ADDED))
    assert _window(handler, retries=2).add_text("hello") == "c1"
    assert len(seen) == 3 and waits == [3.0, 3.0]


def test_retries_are_bounded_and_waits_capped(waits: list[float]) -> None:
    handler, seen = _script(5, "120", httpx.Response(200, json=ADDED))
    with pytest.raises(CapacityError):
        _window(handler, retries=2, max_retry_wait_s=4.0).add_text("hello")
    assert len(seen) == 3 and waits == [4.0, 4.0]


def test_no_retries_by_default_and_none_without_a_hint(waits: list[float]) -> None:
    handler, seen = _script(1, "1", httpx.Response(200, json=ADDED))
    with pytest.raises(CapacityError):
        _window(handler).add_text("hello")
    assert len(seen) == 1
    handler, seen = _script(1, None, httpx.Response(200, json=ADDED))  # not transient: no Retry-After
    with pytest.raises(CapacityError):
        _window(handler, retries=3).add_text("hello")
    assert len(seen) == 1 and waits == []


def test_a_streamed_answer_is_retried_too(waits: list[float]) -> None:
    ok = httpx.Response(200, text=STREAM, headers={"content-type": "text/event-stream"})
    handler, seen = _script(1, "2", ok)
    assert "".join(_window(handler, retries=1).generate("q", max_new_tokens=4, stream=True)) == "hi"
    assert len(seen) == 2 and waits == [2.0]


def test_the_async_window_retries_alike(waits: list[float]) -> None:
    handler, seen = _script(1, "1", httpx.Response(200, json=ADDED))

    async def go() -> str:
        http = httpx.AsyncClient(base_url=URL, transport=httpx.MockTransport(handler))
        async with AsyncRemoteWindow(URL, session_id="s", client=http, retries=1) as win:
            return await win.add_text("hello")

    assert asyncio.run(go()) == "c1"
    assert seen[:2] == ["/v1/sessions/s/chunks"] * 2 and waits == [1.0]


def test_retry_options_are_checked() -> None:
    with pytest.raises(InvalidInputError):
        RemoteWindow(URL, session_id="s", retries=-1)
