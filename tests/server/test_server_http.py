"""The HTTP surface with plain httpx: malformed requests, auth, limits, isolation, the OpenAI endpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from kamera_engine import Engine, InvalidInputError
from kamera_sdk import ContextWindow
from kamera_sdk.server.chat import turn_format
from kamera_sdk.server.errors import LimitExceededError
from tests.server.conftest import MAX_BODY, LiveServer, make_app

pytestmark = pytest.mark.slow


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, headers=live.headers, timeout=120) as client:
        yield client


def session(http: httpx.Client, **options: Any) -> str:
    r = http.post("/v1/sessions", json=options)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def error(r: httpx.Response, status: int, type_name: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == type_name, body
    return str(body["message"])


def test_health_needs_no_key_and_everything_else_does(live: LiveServer) -> None:
    r = httpx.get(f"{live.url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": "SmolLM2-135M-Instruct"}
    error(httpx.post(f"{live.url}/v1/sessions", json={}), 401, "AuthenticationError")
    r = httpx.post(f"{live.url}/v1/sessions", json={}, headers={"Authorization": "Bearer wrong"})
    error(r, 401, "AuthenticationError")
    assert r.headers["www-authenticate"] == "Bearer"
    error(httpx.get(f"{live.url}/v1/models", headers={"Authorization": live.api_key}), 401, "AuthenticationError")
    r = httpx.get(f"{live.url}/v1/models", headers=live.headers)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_malformed_requests(http: httpx.Client) -> None:
    sid = session(http)
    bad_json = http.post(
        f"/v1/sessions/{sid}/chunks", content=b'{"text": "x"', headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in error(bad_json, 400, "InvalidInputError")
    form = http.post(f"/v1/sessions/{sid}/chunks", content=b'{"text": "x"}', headers={"content-type": "text/plain"})
    assert "content-type: application/json (got text/plain)" in error(form, 415, "InvalidInputError")
    assert error(http.post(f"/v1/sessions/{sid}/chunks", json=["x"]), 422, "InvalidInputError")  # JSON, wrong shape
    assert "colour" in error(http.post("/v1/sessions", json={"colour": "red"}), 422, "InvalidInputError")
    assert "rank" in error(http.post("/v1/sessions", json={"rank": 0}), 422, "InvalidInputError")
    msg = error(http.post(f"/v1/sessions/{sid}/chunks", json={"text": "a", "token_ids": [1]}), 422, "InvalidInputError")
    assert "exactly one" in msg
    error(http.post(f"/v1/sessions/{sid}/chunks", json={}), 422, "InvalidInputError")
    error(http.post(f"/v1/sessions/{sid}/slide", json={"n": "many"}), 422, "InvalidInputError")
    msg = error(
        http.post(f"/v1/sessions/{sid}/generate", json={"prompt": "hi", "max_new_tokens": 65}), 422, "InvalidInputError"
    )
    assert "limit of 64" in msg
    error(http.post(f"/v1/sessions/{sid}/generate", json={"prompt": "hi", "top_p": 0}), 422, "InvalidInputError")
    error(http.get("/v1/nothing-here"), 404, "NotFound")
    error(http.put(f"/v1/sessions/{sid}"), 405, "MethodNotAllowed")
    image = http.post(f"/v1/sessions/{sid}/chunks", json={"image_base64": "aGVsbG8="})
    error(image, 422, "UnsupportedModelError")  # a text-only engine
    assert http.get(f"/v1/sessions/{sid}").json()["chunks"] == []


def test_values_of_another_json_type_are_refused_not_coerced(http: httpx.Client) -> None:
    sid = session(http)
    first = http.post(f"/v1/sessions/{sid}/chunks", json={"text": "one"}).json()["chunk"]
    http.post(f"/v1/sessions/{sid}/chunks", json={"text": "two"})
    for n in (True, "1", 1.0):  # each would have slid a chunk out
        msg = error(http.post(f"/v1/sessions/{sid}/slide", json={"n": n}), 422, "InvalidInputError")
        assert "n: Input should be a valid integer" in msg
    error(http.post(f"/v1/sessions/{sid}/chunks", json={"token_ids": ["5"]}), 422, "InvalidInputError")
    msg = error(http.post(f"/v1/sessions/{sid}/fork", json={"x": 1}), 422, "InvalidInputError")
    assert "x: Extra inputs are not permitted" in msg
    assert len(http.get(f"/v1/sessions/{sid}").json()["chunks"]) == 2  # nothing changed
    gen = http.post(f"/v1/sessions/{sid}/generate", json={"prompt": "hi", "max_new_tokens": 1, "temperature": 1})
    assert gen.status_code == 200, gen.text  # an int is still a float
    assert http.post(f"/v1/sessions/{sid}/fork").status_code == 201  # no body
    assert http.post(f"/v1/sessions/{sid}/slide").json()["removed"] == [first]  # no body: one


def test_oversized_bodies_are_refused(http: httpx.Client) -> None:
    sid = session(http)
    big = {"text": "word " * (MAX_BODY // 4)}
    error(http.post(f"/v1/sessions/{sid}/chunks", json=big), 413, "PayloadTooLargeError")

    def chunked() -> Iterator[bytes]:  # no content-length: the limit still holds while reading
        yield b'{"text": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = http.post(f"/v1/sessions/{sid}/chunks", content=chunked(), headers={"content-type": "application/json"})
    error(r, 413, "PayloadTooLargeError")
    many_tokens = {"token_ids": [5] * 3000}  # under the body limit, over the 2048-token session limit
    assert "2048" in error(http.post(f"/v1/sessions/{sid}/chunks", json=many_tokens), 413, "PayloadTooLargeError")
    assert http.get(f"/v1/sessions/{sid}").json()["chunks"] == []


def test_sessions_are_isolated(http: httpx.Client) -> None:
    a, b = session(http), session(http)
    assert a != b and len(a) >= 32
    chunk_a = http.post(f"/v1/sessions/{a}/chunks", json={"text": "Alice's secret is 4711."}).json()["chunk"]
    http.post(f"/v1/sessions/{b}/chunks", json={"text": "Bob's note."})
    # a chunk id from another session is unknown here, whatever the operation
    error(http.post(f"/v1/sessions/{b}/evict", json={"chunk": chunk_a}), 404, "ChunkNotFoundError")
    error(http.post(f"/v1/sessions/{b}/recall", json={"chunk": chunk_a}), 404, "ChunkNotFoundError")
    error(http.post(f"/v1/sessions/{b}/reorder", json={"order": [chunk_a]}), 422, "InvalidInputError")
    assert chunk_a not in json.dumps(http.get(f"/v1/sessions/{b}").json())
    assert http.get(f"/v1/sessions/{a}").json()["chunks"] == [chunk_a]
    # unknown and deleted sessions
    error(http.get("/v1/sessions/ks_not-a-session"), 404, "SessionNotFoundError")
    error(http.post("/v1/sessions/ks_nope/chunks", json={"text": "x"}), 404, "SessionNotFoundError")
    assert http.delete(f"/v1/sessions/{a}").status_code == 204
    error(http.get(f"/v1/sessions/{a}/stats"), 404, "SessionNotFoundError")
    error(http.delete(f"/v1/sessions/{a}"), 404, "SessionNotFoundError")


def test_session_limit_and_clean_shutdown(default_engine: Engine) -> None:
    app = make_app(default_engine, api_key=None, max_sessions=2)
    with TestClient(app) as client:
        ids = [client.post("/v1/sessions").json()["id"] for _ in range(2)]
        error(client.post("/v1/sessions", json={}), 429, "LimitExceededError")  # type: ignore[arg-type]
        error(client.post(f"/v1/sessions/{ids[0]}/fork"), 429, "LimitExceededError")  # type: ignore[arg-type]
        assert client.delete(f"/v1/sessions/{ids[0]}").status_code == 204
        assert client.post("/v1/sessions", json={"policy": "prefix"}).status_code == 201
    state = app.state.kamera
    assert len(state.sessions) == 0  # the lifespan shut the worker down and dropped the sessions
    with pytest.raises(RuntimeError):
        state.worker._pool.submit(print)


def _chunk(first: int) -> dict[str, Any]:
    return {"token_ids": list(range(first, first + 8))}  # a chunk of 8 token ids


def _held(c: TestClient, limit: int | None) -> tuple[int, int]:
    got = c.get("/v1/server/stats").json()
    assert (got["max_held_tokens"], got["max_sessions"], got["vision_cache"]) == (limit, 256, None)  # a text model
    return int(got["held_tokens"]), int(got["sessions"])


def test_the_sessions_together_hold_at_most_max_held_tokens(default_engine: Engine) -> None:
    """A session holds its window's tokens and the content it has seen (8 placed + 8 of canonical per chunk
    here): content past the server-wide bound gets 429 and changes nothing; a slide or eviction gives back
    the placed part, deleting the session all of it; ``/v1/server/stats`` reports the count."""
    models = sum(t.name == "kamera-model" for t in threading.enumerate())
    for bad in (0, -5):
        with pytest.raises(InvalidInputError, match=f"max_held_tokens must be an int >= 1 or None, got {bad}"):
            make_app(default_engine, max_held_tokens=bad)
    assert sum(t.name == "kamera-model" for t in threading.enumerate()) == models  # refused before any start
    with TestClient(make_app(default_engine, api_key=None, max_held_tokens=40)) as c:

        def add(sid: str, first: int) -> httpx.Response:
            return c.post(f"/v1/sessions/{sid}/chunks", json=_chunk(first))

        def refused(r: httpx.Response, total: int | None) -> None:
            message = error(r, 429, "LimitExceededError")
            said = re.search(r"the sessions would hold (\d+) tokens together; this server allows 40", message)
            assert said is not None and int(said[1]) == (total or int(said[1])) > 40, message

        a, b = (c.post("/v1/sessions").json()["id"] for _ in range(2))
        oldest = add(a, 1000).json()["chunk"]
        assert add(a, 2000).status_code == 201 and _held(c, 40) == (32, 2)
        refused(add(b, 3000), 48)
        assert c.get(f"/v1/sessions/{b}").json()["tokens"] == 0 and _held(c, 40) == (32, 2)
        refused(c.post(f"/v1/sessions/{a}/fork"), 64)
        assert _held(c, 40) == (32, 2)  # the refused fork left no session behind
        # a slide gives back the placed part; the slid chunk's canonical stays (it is recallable)
        assert c.post(f"/v1/sessions/{a}/slide").json()["removed"] == [oldest] and _held(c, 40) == (24, 2)
        assert add(b, 3000).status_code == 201 and _held(c, 40) == (40, 2)
        refused(c.post(f"/v1/sessions/{a}/recall", json={"chunk": oldest}), 48)
        refused(add(a, 1000), 48)  # adding it again places it again: the same
        assert c.get(f"/v1/sessions/{a}").json()["evicted"] == [oldest] and _held(c, 40) == (40, 2)
        assert c.delete(f"/v1/sessions/{b}").status_code == 204 and _held(c, 40) == (24, 1)
        assert add(a, 1000).json()["window"]["tokens"] == 16 and _held(c, 40) == (32, 1)  # its content was held
        assert c.post(f"/v1/sessions/{a}/evict", json={"chunk": oldest}).json()["tokens"] == 8
        assert _held(c, 40) == (24, 1)
        # a job that fails after its check gives its claim back; a text chunk counts its tokens
        d = c.post("/v1/sessions").json()["id"]
        error(c.post(f"/v1/sessions/{d}/chunks", json={"token_ids": [10**9]}), 422, "InvalidInputError")
        assert _held(c, 40) == (24, 2)
        words = "Invoice paid."
        n = len(default_engine.tokenize(words))
        assert c.post(f"/v1/sessions/{d}/chunks", json={"text": words}).status_code == 201
        assert _held(c, 40) == (24 + 2 * n, 2)
        # chat windows are counted; one made for a refused request does not stay behind
        long = " ".join(["The quick brown fox jumps over the lazy dog."] * 3)  # about 30 tokens
        r = c.post("/v1/chat/completions", json={"user": "u", "max_tokens": 1,
                   "messages": [{"role": "user", "content": long}, {"role": "user", "content": "And?"}]})  # fmt: skip
        refused(r, None)  # its turn of the chat template, placed and seen: about 66 tokens
        assert _held(c, 40) == (24 + 2 * n, 2)
        assert c.delete(f"/v1/sessions/{a}").status_code == 204 and _held(c, 40) == (2 * n, 1)
        r = c.post("/v1/chat/completions", json={"user": "u", "max_tokens": 1,
                   "messages": [{"role": "user", "content": words}, {"role": "user", "content": "And?"}]})  # fmt: skip
        assert r.status_code == 200, r.text
        held, sessions = _held(c, 40)
        assert sessions == 2 and held > 4 * n  # the chat window holds the message as a turn of the template


def test_a_deleted_branch_stays_counted_while_its_family_shares_its_content(default_engine: Engine) -> None:
    """Forks share one table of content: what a deleted branch added stays in it, and in the count, until
    the family's last session goes (counted, no bound: ``max_held_tokens`` null)."""
    with TestClient(make_app(default_engine, api_key=None)) as c:
        parent = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{parent}/chunks", json=_chunk(1000)).raise_for_status()
        assert _held(c, None) == (16, 1)
        child = c.post(f"/v1/sessions/{parent}/fork").json()["id"]
        assert _held(c, None) == (32, 2)  # counted at its parent's size
        c.post(f"/v1/sessions/{child}/chunks", json=_chunk(2000)).raise_for_status()
        assert _held(c, None) == (16 + 32, 2)
        assert c.delete(f"/v1/sessions/{child}").status_code == 204
        assert _held(c, None) == (16 + 32, 1)  # its chunk's canonical stays in the table the parent holds
        c.post(f"/v1/sessions/{parent}/evict", json={"chunk": c.get(f"/v1/sessions/{parent}").json()["chunks"][0]})
        assert _held(c, None) == (16 + 32, 1)  # the parent counts the shared content now; the branch's count
        # stands while the family lives (it errs high)
        assert c.delete(f"/v1/sessions/{parent}").status_code == 204 and _held(c, None) == (0, 0)


def test_forget_gives_back_what_an_evicted_chunk_held(default_engine: Engine) -> None:
    """An evicted chunk stays held (recallable) until ``forget`` gives its content back; a bad ``forget``
    gets the window's error and changes nothing."""
    with TestClient(make_app(default_engine, api_key=None, max_held_tokens=39)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        a = c.post(f"/v1/sessions/{sid}/chunks", json=_chunk(1000)).json()["chunk"]
        b = c.post(f"/v1/sessions/{sid}/chunks", json=_chunk(2000)).json()["chunk"]
        assert _held(c, 39) == (32, 1)

        def forget(chunk: str) -> httpx.Response:
            return c.post(f"/v1/sessions/{sid}/forget", json={"chunk": chunk})

        assert "evict it first" in error(forget(a), 409, "WindowOperationError")
        error(forget("0" * 32), 404, "ChunkNotFoundError")
        c.post(f"/v1/sessions/{sid}/evict", json={"chunk": a}).raise_for_status()
        assert _held(c, 39) == (24, 1)  # the placed part went; the content stays, recallable
        add = c.post(f"/v1/sessions/{sid}/chunks", json=_chunk(3000))
        assert "forget them" in error(add, 429, "LimitExceededError")
        got = forget(a)
        assert got.status_code == 200 and (got.json()["chunks"], got.json()["evicted"]) == ([b], [])
        assert _held(c, 39) == (16, 1)
        assert c.post(f"/v1/sessions/{sid}/chunks", json=_chunk(3000)).status_code == 201
        error(c.post(f"/v1/sessions/{sid}/recall", json={"chunk": a}), 404, "ChunkNotFoundError")
        assert _held(c, 39) == (32, 1)


def test_a_user_chat_window_lets_go_of_messages_its_client_no_longer_sends(
    default_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the bound, a chat window keyed by ``user`` forgets the messages a trimmed history no longer lists
    rather than refusing the request, if that is enough (else 429, nothing changed); a session's window keeps
    what it has seen (429, nothing changed)."""
    fmt = turn_format(default_engine)
    assert fmt is not None

    def size(text: str) -> int:
        return len(default_engine.tokenize(fmt.turn("user", text)))

    old = ["Ada lives in Lisbon.", "Bo lives in Oslo."]
    new = "Cy lives in Rome, Dee in Paris, Eve in Berlin, Fay in Madrid and Gus in Vienna, all by rivers."
    assert size(new) >= size(old[0]) + size(old[1])  # so the trimmed history alone fits where both do not
    limit = 2 * size(new)

    def ask(c: TestClient, texts: list[str], **key: str) -> httpx.Response:
        msgs = [{"role": "user", "content": t} for t in [*texts, "Where?"]]
        return c.post("/v1/chat/completions", json={**key, "max_tokens": 1, "messages": msgs})

    with TestClient(make_app(default_engine, api_key=None, max_held_tokens=limit)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        assert ask(c, old, session=sid).status_code == 200
        assert _held(c, limit) == (2 * (size(old[0]) + size(old[1])), 1)
        error(ask(c, [new], session=sid), 429, "LimitExceededError")
        state = c.get(f"/v1/sessions/{sid}").json()
        assert len(state["chunks"]) == 2 and state["evicted"] == []  # the refusal changed nothing
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204 and _held(c, limit) == (0, 0)

        assert ask(c, old, user="u").status_code == 200
        assert _held(c, limit) == (2 * (size(old[0]) + size(old[1])), 1)
        error(ask(c, [old[0], new], user="u"), 429, "LimitExceededError")  # letting old[1] go is not enough
        assert _held(c, limit) == (2 * (size(old[0]) + size(old[1])), 1)  # so nothing was let go

        # another session claims while the messages are let go: the tokens the let-go needs are already its
        other = c.post("/v1/sessions").json()["id"]
        counts = c.app.state.kamera.sessions.held  # type: ignore[attr-defined]
        refused: list[LimitExceededError] = []

        def claimed_meanwhile(op: Callable[..., None]) -> Callable[..., None]:
            def run(self: ContextWindow, chunk_id: str, **kw: Any) -> None:
                try:
                    counts.claim(other, 1)
                except LimitExceededError as exc:
                    refused.append(exc)
                op(self, chunk_id, **kw)

            return run

        for name in ("evict", "forget"):  # however the messages are let go
            monkeypatch.setattr(ContextWindow, name, claimed_meanwhile(getattr(ContextWindow, name)))
        r = ask(c, [new], user="u")
        assert r.status_code == 200, r.text
        assert refused  # the other session's claim came too late
        assert _held(c, limit) == (2 * size(new), 2)  # the old messages were let go, placed and seen


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_request_without_a_session_is_counted_while_its_answer_runs(
    default_engine: Engine, stream: bool
) -> None:
    """A chat request with neither ``session`` nor ``user`` holds a window of its own for as long as its answer
    runs: its messages count against ``max_held_tokens`` (429 past it, nothing left behind), and the count
    goes when the answer ends."""
    messages = [{"role": "user", "content": "Ada lives in Lisbon, Bo in Oslo."}, {"role": "user", "content": "Where?"}]
    body = {"max_tokens": 2, "messages": messages, "stream": stream}
    with TestClient(make_app(default_engine, api_key=None)) as c:  # what its window holds
        counts = c.app.state.kamera.sessions.held  # type: ignore[attr-defined]
        seen: list[int] = []
        claim = counts.claim

        def recorded(key: Any, tokens: int) -> None:
            seen.append(tokens)
            claim(key, tokens)

        counts.claim = recorded
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert len(seen) == 1 and seen[0] > 0 and _held(c, None) == (0, 0)  # gone with the answer
    held = seen[0]
    with TestClient(make_app(default_engine, api_key=None, max_held_tokens=held)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert _held(c, held) == (0, 0)
        sid = c.post("/v1/sessions").json()["id"]
        assert c.post(f"/v1/sessions/{sid}/chunks", json={"text": "one more"}).status_code == 201
        before = _held(c, held)
        assert 0 < before[0] < held and before[1] == 1
        error(c.post("/v1/chat/completions", json=body), 429, "LimitExceededError")  # the session holds some
        assert _held(c, held) == before


@pytest.mark.parametrize("client", ["reads_it_all", "gone_at_its_start", "gone_at_once"])
def test_a_streamed_chat_without_a_session_is_counted_until_its_response_ends(
    default_engine: Engine, client: str
) -> None:
    """A streamed chat request without a session holds its count while its answer streams, and lets it go
    however the response ends: read to the end, its client gone as the response starts (an ASGI 2.4 server's
    ``send`` fails), or gone at once (an ASGI 2.3 server reports the disconnect before a byte is sent)."""
    app = make_app(default_engine, api_key=None, max_held_tokens=10_000)
    body = json.dumps({"stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "Ada."}] * 2})
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3" if client == "gone_at_once" else "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("kamera", 80),
    }
    counted: list[int] = []  # the count as each part of the response is sent

    async def main() -> int:
        messages = [{"type": "http.request", "body": body.encode(), "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            if client != "gone_at_once":
                await asyncio.Event().wait()  # connected until the response ends
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            counted.append(app.state.kamera.sessions.held.total)
            if client == "gone_at_its_start":
                raise OSError("the client is gone")
            if client == "gone_at_once" and message["type"] == "http.response.start":
                await asyncio.sleep(0.5)  # the disconnect is seen first

        if client == "gone_at_its_start":
            with pytest.raises(ClientDisconnect):
                await app(scope, receive, send)
        else:
            await app(scope, receive, send)
        return app.state.kamera.sessions.held.total

    try:
        assert asyncio.run(main()) == 0  # let go of once the response ended
        assert counted and all(n > 0 for n in counted)  # held while it was sent
        if client == "reads_it_all":
            assert len(counted) > 3  # the start, pieces, the end
    finally:
        asyncio.run(app.state.kamera.shutdown())


def test_a_chat_whose_caller_gave_up_stays_counted_until_its_job_ends(
    default_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller of a chat request without a session is cancelled while its job runs: the job runs on, and
    what its window claimed stays counted until it ends, then goes."""
    from kamera_sdk.server import chat as chat_ops

    app = make_app(default_engine, api_key=None, max_held_tokens=10_000)
    claimed, release = threading.Event(), threading.Event()
    sync = chat_ops.sync_window

    def slow_sync(*args: Any, **kw: Any) -> None:
        sync(*args, **kw)
        claimed.set()
        assert release.wait(60)

    monkeypatch.setattr(chat_ops, "sync_window", slow_sync)
    counts = app.state.kamera.sessions.held
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Ada lives in Lisbon."}] * 2}

    async def main() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kamera") as c:
            request = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            while not claimed.is_set():
                await asyncio.sleep(0.01)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            during = counts.total  # the job still runs: its window is counted
            release.set()
            (await c.get("/v1/models")).raise_for_status()
            for _ in range(500):  # the barrier job after it lets the count go
                if counts.total == 0:
                    break
                await asyncio.sleep(0.01)
            return during, counts.total

    try:
        during, after = asyncio.run(main())
        assert during > 0 and after == 0
    finally:
        release.set()
        asyncio.run(app.state.kamera.shutdown())


@pytest.mark.parametrize("gives_up_in", ["fork", "state"])
def test_a_fork_whose_caller_gave_up_leaves_no_window_behind(
    default_engine: Engine, monkeypatch: pytest.MonkeyPatch, gives_up_in: str
) -> None:
    """The caller of a fork is cancelled while the fork job runs (``fork``), or while the child's first
    state is read (``state``): the job runs on, but the child it made is closed and nothing stays
    registered or counted for it."""
    from kamera_sdk.server import ops

    app = make_app(default_engine, api_key=None)
    waiting, release = threading.Event(), threading.Event()
    made: list[ContextWindow] = []
    closed: list[ContextWindow] = []
    fork, close, window_state = ContextWindow.fork, ContextWindow.close, ops.window_state

    def slow_fork(self: ContextWindow) -> ContextWindow:
        if gives_up_in == "fork":
            waiting.set()
            assert release.wait(60)
        made.append(fork(self))
        return made[-1]

    def slow_state(sid: str, win: ContextWindow) -> Any:
        if gives_up_in == "state" and any(win is m for m in made):
            waiting.set()
            assert release.wait(60)
        return window_state(sid, win)

    def recorded_close(self: ContextWindow) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(ContextWindow, "fork", slow_fork)
    monkeypatch.setattr(ContextWindow, "close", recorded_close)
    monkeypatch.setattr(ops, "window_state", slow_state)

    async def main() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kamera") as c:
            parent = (await c.post("/v1/sessions")).json()["id"]
            (await c.post(f"/v1/sessions/{parent}/chunks", json=_chunk(1000))).raise_for_status()
            request = asyncio.ensure_future(c.post(f"/v1/sessions/{parent}/fork"))
            while not waiting.is_set():
                await asyncio.sleep(0.01)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            release.set()
            (await c.get(f"/v1/sessions/{parent}")).raise_for_status()  # queued after the closing job
            return dict((await c.get("/v1/server/stats")).json())

    try:
        stats = asyncio.run(main())
        assert len(made) == 1 and any(w is made[0] for w in closed)  # the child the job made was closed, not leaked
        assert (stats["sessions"], stats["held_tokens"]) == (1, 16)  # the parent alone, counted as before
    finally:
        release.set()
        asyncio.run(app.state.kamera.shutdown())


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json=body)


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "My name is Ada and I live in Lisbon."},
    {"role": "assistant", "content": "Nice to meet you, Ada."},
    {"role": "user", "content": "Which city do I live in?"},
]


def test_openai_chat_completions(http: httpx.Client, default_engine: Engine) -> None:
    r = chat(http, model="whatever", messages=MESSAGES, max_tokens=8, frequency_penalty=0.0)  # unknown: ignored
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "SmolLM2-135M-Instruct"  # the model that answered, not the name asked for
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 8
    # the same content as an in-process window: each earlier message one chunk, a turn of the chat
    # template closing the one in front; the last one the prompt, a turn of its own
    fmt = turn_format(default_engine)
    assert fmt is not None and fmt.turn("system", "x") == "<|im_end|>\n<|im_start|>system\nx"
    local = ContextWindow(default_engine)
    for m in MESSAGES[:-1]:
        local.add_text(fmt.turn(m["role"], m["content"]))
    answer = local.generate(fmt.turn("user", MESSAGES[-1]["content"]), max_new_tokens=8)
    assert choice["message"]["content"] == answer
    # streaming: OpenAI chunks, the same text, usage on request, then [DONE]
    r = chat(http, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == usage["completion_tokens"]
    # a single message needs no window
    r = chat(http, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_openai_user_windows_reuse_chunks(http: httpx.Client) -> None:
    first = chat(http, messages=MESSAGES, max_tokens=4, user="ada").json()["usage"]
    grown = [*MESSAGES[:-1], {"role": "user", "content": "And my name?"}]
    second = chat(http, messages=grown, max_tokens=4, user="ada").json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] > first["prompt_tokens_details"]["cached_tokens"]
    trimmed = [MESSAGES[0], *grown[2:]]  # history trimmed: the window evicts, nothing is prefilled again
    r = chat(http, messages=trimmed, max_tokens=4, user="ada")
    assert r.status_code == 200
    # a native session can back the conversation too; unknown ones are refused
    sid = session(http)
    assert chat(http, messages=MESSAGES, max_tokens=4, session=sid).status_code == 200
    assert len(http.get(f"/v1/sessions/{sid}").json()["chunks"]) == 3
    error(chat(http, messages=MESSAGES, session="ks_nope"), 404, "SessionNotFoundError")
    # a refused request changes nothing: sampling is checked before the window is synced
    before = http.get(f"/v1/sessions/{sid}").json()
    error(chat(http, messages=MESSAGES[:2] + MESSAGES[3:], session=sid, stop=[""]), 422, "InvalidInputError")
    assert http.get(f"/v1/sessions/{sid}").json()["chunks"] == before["chunks"]
    # a repeated message is in the window twice, as in the message list
    again = [*MESSAGES[:3], {"role": "assistant", "content": "Nice to meet you, Ada."}, MESSAGES[-1]]
    assert chat(http, messages=again, max_tokens=4, session=sid).status_code == 200
    assert len(http.get(f"/v1/sessions/{sid}").json()["chunks"]) == 4


def test_openai_malformed(http: httpx.Client) -> None:
    error(chat(http, messages=[]), 422, "InvalidInputError")
    error(chat(http, messages=[{"role": "wizard", "content": "x"}]), 422, "InvalidInputError")
    error(chat(http, messages=MESSAGES, n=2), 422, "InvalidInputError")
    assert "limit" in error(chat(http, messages=MESSAGES, max_tokens=1000), 422, "InvalidInputError")
    error(chat(http, messages=[{"role": "user", "content": "  "}]), 422, "InvalidInputError")
    bad_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": "f"}]}
    assert "function" in error(chat(http, messages=[bad_call, MESSAGES[-1]]), 422, "InvalidInputError")
    remote_image = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]},
        MESSAGES[-1],
    ]
    assert "data: URL" in error(chat(http, messages=remote_image), 422, "InvalidInputError")


def test_an_unexpected_failure_is_a_500_that_keeps_internals_in_the_log(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kamera_sdk.server import ops

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("secret detail at /srv/kamera/internal.py")

    monkeypatch.setattr(ops, "logprobs", broken)
    sid = session(http)
    with caplog.at_level(logging.ERROR, logger="kamera.server"):
        r = http.post(f"/v1/sessions/{sid}/logprobs", json={"prompt": "Q"})
    message = error(r, 500, "InternalError")
    assert "secret" not in r.text and "RuntimeError" not in r.text
    ref = re.fullmatch(r"internal error ([0-9a-f]{12}) \(the server log has the details\)", message)
    assert ref is not None
    logged = [rec for rec in caplog.records if ref.group(1) in rec.getMessage()]
    assert len(logged) == 1 and "secret detail" in str(logged[0].exc_info[1])  # type: ignore[index]
