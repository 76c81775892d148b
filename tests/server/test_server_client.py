"""Every window operation through ``RemoteWindow`` against a live server, checked against in-process windows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kamera_engine import Engine
from kamera_sdk import (
    ChunkNotFoundError,
    ContextWindow,
    InvalidInputError,
    WindowOperationError,
    WindowStats,
)
from kamera_sdk.server import AsyncRemoteWindow, RemoteWindow, SessionNotFoundError
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

DOCS = [
    "The capital of France is Paris. The Eiffel Tower stands on the Champ de Mars.",
    "Bob has three cats named Tom, Jerry and Felix. They sleep on the sofa.",
    "The meeting with the design team moved from Tuesday to Thursday at 3 pm.",
]
QUESTION = "How many cats does Bob have?"


def remote(live: LiveServer, **options: object) -> RemoteWindow:
    return RemoteWindow(live.url, api_key=live.api_key, **options)  # type: ignore[arg-type]


def test_every_operation(live: LiveServer) -> None:
    with remote(live) as win:
        a, b, c = (win.add_text(t) for t in DOCS)
        assert win.chunks == [a, b, c] and win.evicted == [] and len(win) == 3 and a in win
        assert win.add_text(DOCS[0]) == a and len(win) == 3  # a window is a set
        t = win.add([1, 2, 3, 4, 5], kind="tokens")
        assert win.chunks == [a, b, c, t]
        win.evict(t)
        assert win.chunks == [a, b, c] and win.evicted == [t]
        win.recall(t, at=0)
        assert win.chunks == [t, a, b, c] and win.evicted == []
        assert win.reorder([c, b, a, t]) == [c, b, a, t] == win.chunks
        assert sorted(win.reorder("auto")) == sorted([a, b, c, t])
        win.reorder([t, a, b, c])
        assert win.slide(1) == [t] and win.chunks == [a, b, c] and win.evicted == [t]
        assert win.tokens > 0
        child = win.fork()
        try:
            assert child.id != win.id and child.chunks == [a, b, c] and child.evicted == [t]
            child.forget(t)
            assert child.evicted == [] and win.evicted == [t]
            child.evict(b)
            assert child.chunks == [a, c] and win.chunks == [a, b, c]  # copy-on-write: the parent is untouched
            assert isinstance(child.generate(QUESTION, max_new_tokens=4), str)
        finally:
            child.close()
        with (
            pytest.raises(SessionNotFoundError),
            RemoteWindow(live.url, api_key=live.api_key, session_id=child.id) as gone,
        ):
            gone.chunks  # noqa: B018
        out = win.generate(QUESTION, max_new_tokens=4)
        stats = win.stats()
        assert isinstance(out, str) and isinstance(stats, WindowStats)
        assert stats.policy == "kamera" and stats.forwards > 0 and stats.canonicals_computed >= 3
        top = win.top_logprobs(QUESTION, k=5)
        assert len(top) == 5 and top[0].logprob >= top[-1].logprob


def test_errors_come_back_as_kamera_exceptions(live: LiveServer) -> None:
    with remote(live) as win:
        with pytest.raises(WindowOperationError, match="empty"):
            win.generate(QUESTION, max_new_tokens=2)
        a = win.add_text(DOCS[0])
        with pytest.raises(ChunkNotFoundError):
            win.evict("0" * 32)
        with pytest.raises(WindowOperationError, match="already in the window"):
            win.recall(a)
        with pytest.raises(InvalidInputError, match="permutation"):
            win.reorder([a, "f" * 32])
        with pytest.raises(WindowOperationError):
            win.slide(5)
        with pytest.raises(InvalidInputError, match="non-empty"):
            win.add_text("   ")
        with pytest.raises(InvalidInputError, match="out of range"):
            win.add([10**9])
        with pytest.raises(InvalidInputError, match="max_new_tokens"):
            win.generate(QUESTION, max_new_tokens=10_000)
        with pytest.raises(InvalidInputError, match="unknown policy"):
            remote(live, policy="nope")
        with pytest.raises(InvalidInputError, match="not set"):  # a set has no order, as in-process
            win.reorder({a})
        with pytest.raises(InvalidInputError, match="slide count must be an int"):
            win.slide(1.0)  # type: ignore[arg-type]
        assert win.chunks == [a]  # refused operations changed nothing
        b = win.add_text(DOCS[1])
        assert win.slide(np.int64(1)) == [a]  # numpy ints, as in-process
        win.recall(a, at=np.int64(0))
        assert win.chunks == [a, b]


def test_generate_matches_an_in_process_window(live: LiveServer, default_engine: Engine) -> None:
    with remote(live) as win:
        ids = [win.add_text(t) for t in DOCS]
        win.reorder([ids[2], ids[0], ids[1]])
        answer = win.generate(QUESTION, max_new_tokens=10)
        remote_stream = win.generate(QUESTION, max_new_tokens=10, stream=True)
        assert (remote_stream.tokens, remote_stream.finish_reason) == (None, None)  # known at the end
        streamed = list(remote_stream)
        lp_remote = torch.tensor(win.next_token_logprobs(QUESTION))
        prompt_ids = default_engine.prompt_ids(QUESTION)
        answer_from_ids = win.generate(prompt_ids, max_new_tokens=10)
    local = ContextWindow(default_engine)
    local_ids = [local.add_text(t) for t in DOCS]
    assert local_ids == ids  # content ids: the same text is the same chunk everywhere
    local.reorder([ids[2], ids[0], ids[1]])
    expected = local.generate(QUESTION, max_new_tokens=10)
    assert answer == expected and answer_from_ids == expected
    assert len(streamed) > 1 and "".join(streamed) == expected
    with remote(live) as unread:
        unread.add_text(DOCS[0])
        closed = unread.generate(QUESTION, max_new_tokens=4, stream=True)
        closed.close()  # closed before its first piece: the connection goes too
        assert closed._response.is_closed
    local_stream = local.generate(QUESTION, max_new_tokens=10, stream=True)
    assert "".join(local_stream) == expected
    # the same totals as the local TextStream: tokens decoded and why it ended
    assert (remote_stream.tokens, remote_stream.finish_reason) == (local_stream.tokens, local_stream.finish_reason)
    assert local_stream.tokens is not None and local_stream.finish_reason in ("stop", "length")
    lp_local = local.next_token_logprobs(QUESTION)
    assert lp_remote.shape == lp_local.shape
    assert torch.allclose(lp_remote, lp_local, atol=1e-5)


def test_stream_stops_and_sampling_options(live: LiveServer, default_engine: Engine) -> None:
    with remote(live, policy="recompute") as win:
        win.add_text(DOCS[1])
        full = win.generate(QUESTION, max_new_tokens=12)
        words = full.split()
        assert len(words) >= 3
        stop = " " + words[2]
        stopped = "".join(win.generate(QUESTION, max_new_tokens=12, stream=True, stop=[stop]))
        assert stop not in stopped and full.startswith(stopped)
        a = win.generate(QUESTION, max_new_tokens=6, temperature=0.8, top_p=0.9, seed=7)
        b = win.generate(QUESTION, max_new_tokens=6, temperature=0.8, top_p=0.9, seed=7)
        assert a == b  # seeded sampling is reproducible
        assert win.stats().policy == "recompute"


def test_async_client(live: LiveServer) -> None:
    async def main() -> None:
        async with AsyncRemoteWindow(live.url, api_key=live.api_key) as win:
            a = await win.add_text(DOCS[0])
            b = await win.add_text(DOCS[1])
            assert await win.chunks() == [a, b]
            await win.evict(a)
            assert await win.evicted() == [a]
            await win.recall(a, at=0)
            assert await win.reorder([b, a]) == [b, a]
            answer = await win.generate(QUESTION, max_new_tokens=6)
            stream = await win.generate(QUESTION, max_new_tokens=6, stream=True)
            pieces = [p async for p in stream]
            assert "".join(pieces) == answer
            assert stream.finish_reason in ("stop", "length") and 0 < stream.tokens <= 6
            unread = await win.generate(QUESTION, max_new_tokens=6, stream=True)
            await unread.aclose()  # closed before its first piece: the connection goes too
            assert unread._response.is_closed
            child = await win.fork()
            assert await child.slide(1) == [b]
            assert await child.chunks() == [a] and await win.chunks() == [b, a]
            await child.forget(b)
            assert await child.evicted() == [] and await win.chunks() == [b, a]
            await child.aclose()
            assert (await win.stats()).forwards > 0
            assert len(await win.top_logprobs(QUESTION, k=3)) == 3
            with pytest.raises(ChunkNotFoundError):
                await win.evict("0" * 32)

    asyncio.run(main())
