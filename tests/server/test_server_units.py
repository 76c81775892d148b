"""Server pieces that need no model: SSE framing, error mapping, the session registry, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from kamera_sdk import ChunkNotFoundError, InvalidInputError, KameraError, MediaError, WindowOperationError
from kamera_sdk.server import (
    AuthenticationError,
    LimitExceededError,
    PayloadTooLargeError,
    RemoteError,
    SessionNotFoundError,
)
from kamera_sdk.server.errors import error_body, error_from_response, status_for
from kamera_sdk.server.held import HeldTokens
from kamera_sdk.server.sessions import SessionRegistry, chat_key
from kamera_sdk.server.sse import SSEDecoder, encode_event
from kamera_sdk.server.worker import ModelWorker


def test_sse_round_trip() -> None:
    raw = encode_event({"text": "a\nb"}, "token") + b": keep-alive\n\n" + encode_event("[DONE]")
    decoder = SSEDecoder()
    events = [e for line in raw.decode().split("\n") if (e := decoder.feed(line)) is not None]
    assert [(e.event, e.data) for e in events] == [("token", '{"text":"a\\nb"}'), ("message", "[DONE]")]
    assert events[0].json() == {"text": "a\nb"}


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidInputError("x"), 422),
        (MediaError("x"), 422),
        (PayloadTooLargeError("x"), 413),
        (ChunkNotFoundError("x"), 404),
        (WindowOperationError("x"), 409),
        (AuthenticationError("x"), 401),
        (SessionNotFoundError("x"), 404),
        (LimitExceededError("x"), 429),
        (KameraError("x"), 500),
        (RuntimeError("x"), 500),
    ],
)
def test_errors_round_trip(exc: Exception, status: int) -> None:
    assert status_for(exc) == status
    back = error_from_response(status, error_body(type(exc).__name__, "why"))
    assert isinstance(back, KameraError) and str(back) == "why"
    if isinstance(exc, KameraError):
        assert type(back) is type(exc)
    else:
        assert isinstance(back, RemoteError) and back.status == 500 and back.type_name == "RuntimeError"


def test_unknown_error_bodies_become_remote_errors() -> None:
    err = error_from_response(502, "<html>bad gateway</html>")
    assert isinstance(err, RemoteError) and err.status == 502 and "bad gateway" in str(err)
    assert isinstance(error_from_response(413, error_body("PayloadTooLargeError", "big")), InvalidInputError)


def test_registry_limits_ttl_and_kinds() -> None:
    reg = SessionRegistry(max_sessions=2, ttl_s=None)
    win = object()
    reg.reserve()
    a = reg.add(win)  # type: ignore[arg-type]
    reg.reserve()
    chat = reg.add(win, key=chat_key("u"), kind="chat")  # type: ignore[arg-type]
    assert a.id.startswith("ks_") and len(a.id) > 30 and not chat.id.startswith("ks_")
    with pytest.raises(SessionNotFoundError):
        reg.get(chat.id)  # chat windows are not addressable as sessions
    reg.reserve()  # full: the chat window makes room
    assert reg.find(chat.id, kind="chat") is None and len(reg) == 1
    reg.add(win)  # type: ignore[arg-type]
    with pytest.raises(LimitExceededError):
        reg.reserve()
    reg.ttl_s = 0.0
    reg.reserve()  # everything idle for longer than 0 s expired
    assert len(reg) == 0


def test_held_tokens_claim_settle_and_forget() -> None:
    held = HeldTokens(100)
    ta = held.open("a")
    tb = held.open("b")
    held.claim("a", 60)
    with pytest.raises(LimitExceededError, match="would hold 101 tokens together; this server allows 100"):
        held.claim("b", 41)
    assert held.total == 60  # a refused claim changes no count
    held.claim("b", 40)
    held.claim("a", 30)  # a claim below the count keeps it: the window has not shrunk yet
    assert held.total == 100
    held.settle("a", 20, ta)  # after the job: what the window holds
    held.claim("b", 80)
    held.close("b")
    held.settle("b", 50, tb)  # a job that ends after its session was dropped records nothing
    held.claim("b", 10**9)  # nor is a claim of a dropped session counted
    assert held.total == 20
    assert held.open("b") != tb and held.ticket("b") != tb  # a new session under the same key
    held.settle("b", 70, tb)  # the old session's job does not count for the new one
    assert held.of("b") == 0
    assert held.open("a") == ta  # opening a counted key keeps its count and ticket
    assert held.total == 20 and held.of("a") == 20 and held.ticket("zz") is None
    held.check(80)  # an early check records nothing
    with pytest.raises(LimitExceededError, match="would hold 101 tokens"):
        held.check(81)
    assert held.total == 20


def test_held_tokens_count_a_family_until_its_last_session_goes() -> None:
    """Forked sessions share their content: a branch's count stands for it after it closes, while the family
    lives (the largest such count, once), and goes with the family's last session."""
    held = HeldTokens()
    held.open("p")
    held.open("c1", family_of="p")
    held.open("c2", family_of="c1")  # a fork of a fork: the same family
    held.open("q")
    for key, n in (("p", 10), ("c1", 30), ("c2", 20), ("q", 5)):
        held.claim(key, n)
    held.close("c1")
    held.close("c2")
    assert held.total == 10 + 30 + 5
    held.close("q")  # a family of one: nothing stays
    assert held.total == 40
    held.close("p")
    assert held.total == 0
    held.open("r", family_of="gone")  # forked from a session no longer counted: a family of its own
    held.claim("r", 7)
    held.close("r")
    assert held.total == 0
    held.open("s")
    held.open("t", family_of="s")
    held.claim("t", 9)
    held.close("t", shared=False)  # a fork that failed: its family keeps nothing of it
    assert held.total == 0

    unbounded = HeldTokens()
    unbounded.open("x")
    unbounded.claim("x", 10**12)
    assert unbounded.total == 10**12
    for bad in (0, -1, 1.5, True, "100"):
        with pytest.raises(InvalidInputError, match="max_held_tokens must be an int >= 1 or None"):
            HeldTokens(bad)  # type: ignore[arg-type]


class _SlowCounts(dict):
    """A dict whose sum is slow to read: a claim that read the counts and wrote its own without the lock
    would let many threads pass together."""

    def values(self):  # type: ignore[override]
        counts = list(super().values())  # read now, used after others had their turn
        time.sleep(0.002)
        return counts


def test_held_tokens_never_pass_the_limit_under_concurrent_claims() -> None:
    """32 threads each claim 10 tokens at once against a limit of 95: exactly 9 claims win."""
    held = HeldTokens(95)
    held._held = _SlowCounts()  # widens the window a missing lock would leave open
    for k in range(32):
        held.open(k)
    start = threading.Barrier(32)
    won: list[int] = []

    def claim(k: int) -> None:
        start.wait()
        try:
            held.claim(k, 10)
            won.append(k)
        except LimitExceededError:
            pass

    threads = [threading.Thread(target=claim, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 9 and held.total == 90


def test_the_registry_counts_the_sessions_it_holds() -> None:
    reg = SessionRegistry(max_sessions=4, ttl_s=None, max_held_tokens=50)
    a = reg.add(object())  # type: ignore[arg-type]
    reg.held.claim(a.id, 30)
    b = reg.add(object(), key=chat_key("u"), kind="chat")  # type: ignore[arg-type]
    with pytest.raises(LimitExceededError):
        reg.held.claim(b.id, 21)
    reg.delete(a.id)  # its tokens are given back with it
    reg.held.claim(b.id, 50)
    assert reg.held.total == 50
    reg.discard(b)  # any kind; one it no longer holds is no error
    reg.discard(b)
    assert reg.held.total == 0 and len(reg) == 0
    stale = b
    b = reg.add(object(), key=chat_key("u"), kind="chat")  # type: ignore[arg-type]
    reg.discard(stale)  # another session under the same key stays
    assert len(reg) == 1
    reg.held.claim(b.id, 50)
    reg.clear()
    assert reg.held.total == 0


def test_worker_runs_in_order_and_closes_iterators() -> None:
    worker = ModelWorker()
    closed: list[bool] = []

    def pieces() -> Iterator[str]:
        try:
            yield from ["a", "b", "c"]
        finally:
            closed.append(True)

    async def main() -> list[str]:
        out = []
        async for p in worker.iterate(pieces()):
            out.append(p)
            if p == "b":
                break
        return out

    assert asyncio.run(main()) == ["a", "b"]
    worker.close()
    assert closed == [True]


def test_shutdown_flushes_a_given_store_without_closing_it() -> None:
    from kamera_sdk.server.app import ServerState
    from kamera_sdk.server.ops import Limits
    from kamera_sdk.store import ChunkStore

    class Store(ChunkStore):
        flushed = closed = 0

        def flush(self) -> None:
            self.flushed += 1

        def close(self) -> None:
            self.closed += 1

    store = Store()
    state = ServerState(engine=None, limits=Limits(), store=store)  # type: ignore[arg-type]
    asyncio.run(state.shutdown())
    assert (store.flushed, store.closed) == (1, 0)


def test_a_stream_cut_before_its_end_is_an_error_not_a_short_answer() -> None:
    import httpx

    from kamera_sdk.server import RemoteError, RemoteWindow

    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        sent.append(json.loads(request.content))
        body = encode_event({"text": "Lis"}, "token") + encode_event({"text": "bon"}, "token")
        if sent[-1].get("stop") == ["full"]:
            body += encode_event({"text": "Lisbon"}, "done")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = httpx.Client(base_url="http://kamera.test", transport=httpx.MockTransport(handler))
    win = RemoteWindow("http://kamera.test", session_id="ks_x", client=client)
    assert "".join(win.generate("q", stream=True, stop="full")) == "Lisbon"
    assert sent[-1]["stop"] == ["full"]  # one stop string, not its letters
    with pytest.raises(RemoteError, match="cut before its end"):
        list(win.generate("q", stream=True))


def test_chat_messages_become_template_turns() -> None:
    """Each earlier message closes the open turn in front and opens its own, in the template's markers;
    images sit between their turn's opening and its text; no template, no tokenizer: plain paragraphs."""
    import base64
    import io

    from PIL import Image

    from kamera_sdk.chat_format import OpenTurnFormat
    from kamera_sdk.server.chat import message_items
    from kamera_sdk.server.ops import Limits
    from kamera_sdk.server.schemas import ChatMessage
    from tests.conftest import tiny_chat_engine, tiny_engine

    engine = tiny_chat_engine()  # the default model's tokenizer and ChatML template
    fmt = OpenTurnFormat.for_engine(engine)
    assert fmt is not None
    assert engine.tokenize(fmt.turn("user", "Hi")) == engine.tokenize("<|im_end|>\n<|im_start|>user\nHi")
    assert fmt.turn("developer", "x") == fmt.turn("system", "x")  # OpenAI's developer is the system role
    assert fmt.turn("critic", "x") == "<|im_end|>\n<|im_start|>user\n[critic] x"  # a role the template lacks
    limits = Limits()
    named = ChatMessage(role="user", content="Hello", name="ada")
    assert message_items(named, limits, fmt) == ["<|im_end|>\n<|im_start|>user\nada: Hello"]
    assert message_items(ChatMessage(role="assistant", content=None), limits, fmt) == []
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    items = message_items(ChatMessage(role="user", content=parts), limits, fmt)
    assert items[0] == fmt.opening("user") and isinstance(items[1], bytes) and items[2] == "What is it?"
    assert OpenTurnFormat.for_engine(tiny_engine("llama")) is None  # no tokenizer
    plain = message_items(named, limits, None)
    assert plain == ["user (ada): Hello\n\n"]
