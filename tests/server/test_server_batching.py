"""The server decodes concurrent sessions' answers together, each equal to its answer alone, and refuses
work past the KV budget with 429 and Retry-After (tiny random model, real uvicorn on loopback)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from kamera_engine.errors import CapacityError, InvalidInputError
from kamera_sdk.server import create_app, ops
from kamera_sdk.server.client import RemoteWindow
from tests.conftest import tiny_chat_engine
from tests.server.conftest import run_server

AUTH = {"Authorization": "Bearer k"}


def _at_once(ask, n: int) -> None:
    """``ask(0)`` to ``ask(n - 1)``, each on a thread of its own, all started before any is joined."""
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _answers(batch: bool, engine) -> tuple[list[str], dict | None]:
    app = create_app(engine, api_key="k", batch=batch)
    out: list[str] = [""] * 4
    with run_server(app, "k") as server:
        c = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
        sids = []
        for i in range(4):
            sid = c.post("/v1/sessions").json()["id"]
            c.post(f"/v1/sessions/{sid}/chunks", json={"text": f"Agent {i} keeps {i * 3 + 1} lamps. " * (i + 1)})
            sids.append(sid)
        barrier = threading.Barrier(4)

        def ask(i: int) -> None:
            barrier.wait()
            body = {"prompt": f"How many lamps, agent {i}?", "max_new_tokens": 24, "stream": i % 2 == 1}
            r = httpx.post(f"{server.url}/v1/sessions/{sids[i]}/generate", headers=AUTH, json=body, timeout=120)
            out[i] = r.text if body["stream"] else r.json()["text"]

        _at_once(ask, 4)
        stats = c.get("/v1/engine/stats").json()
    return out, stats


def test_concurrent_answers_batch_and_equal_their_answers_alone() -> None:
    engine = tiny_chat_engine()
    alone, none = _answers(False, engine)
    together, stats = _answers(True, engine)
    assert none is None
    assert together == alone and all(alone)
    assert stats["batch_max"] >= 2 and stats["finished"] == 4 and stats["kv_bytes"] == 0
    assert stats["forward_s"] > 0 and stats["idle_s"] > 0  # the model thread: in forwards, waiting for work


def test_a_full_engine_answers_429_with_retry_after(monkeypatch) -> None:
    def full(win, req):
        raise CapacityError("the engine is at capacity", retry_after_s=2.3)

    monkeypatch.setattr(ops, "start_generate", full)
    app = create_app(tiny_chat_engine(), api_key="k")
    with run_server(app, "k") as server:
        c = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/chunks", json={"text": "A page."})
        r = c.post(f"/v1/sessions/{sid}/generate", json={"prompt": "Q", "max_new_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "CapacityError"


def test_an_answer_over_the_whole_budget_is_refused_and_the_session_goes_on() -> None:
    app = create_app(tiny_chat_engine(), api_key="k", kv_budget_bytes=1)
    with run_server(app, "k") as server:
        win = RemoteWindow(server.url, api_key="k")
        win.add_text("A page.")
        with pytest.raises(CapacityError):
            win.generate("Q", max_new_tokens=4)
        assert len(win.chunks) == 1  # the window is as it was
        stats = httpx.get(f"{server.url}/v1/engine/stats", headers=AUTH).json()
        assert stats["refused"] == 1 and stats["running"] == 0


def _scheduler_of(app: object) -> object:
    """The app's scheduler (None without batching), the app shut down (its worker threads stopped)."""
    state = app.state.kamera  # type: ignore[attr-defined]
    asyncio.run(state.shutdown())
    return state.scheduler


def test_the_scheduler_options_reach_the_scheduler_and_are_never_ignored(tmp_path) -> None:
    engine = tiny_chat_engine()
    sched = _scheduler_of(create_app(engine, kv_budget_bytes=1 << 20, step_tokens=16, max_batch_rows=4))
    assert (sched.kv_budget_bytes, sched.step_tokens, sched.max_rows) == (1 << 20, 16, 4)
    assert _scheduler_of(create_app(engine)).step_tokens == 512  # the scheduler's own defaults
    with pytest.raises(InvalidInputError, match=r"step_tokens, max_batch_rows configure .*\(batch=False\)"):
        create_app(engine, batch=False, step_tokens=16, max_batch_rows=4)
    assert _scheduler_of(create_app(engine, batch=False)) is None
    store = tmp_path / "store"
    with pytest.raises(InvalidInputError, match="max_batch_rows must be at least 1, got 0"):
        create_app(engine, store=str(store), max_batch_rows=0)
    with pytest.raises(InvalidInputError, match="kv_budget_bytes must be"):
        create_app(engine, store=str(store), kv_budget_bytes=-1)
    assert not store.exists()  # refused before the store opened


def test_scheduler_options_for_a_model_that_cannot_batch_are_refused(monkeypatch) -> None:
    engine = tiny_chat_engine()
    monkeypatch.setattr(engine, "batchable", False)  # as a vision engine: one answer at a time
    refused = r"kv_budget_bytes configures .*\(Engine decodes one answer at a time\)"
    with pytest.raises(InvalidInputError, match=refused):
        create_app(engine, kv_budget_bytes=1 << 20)
    assert _scheduler_of(create_app(engine)) is None


def _budget_run(engine, kv_budget_bytes: int | None, together: bool, extra: str | None = None) -> tuple[list, dict]:
    """Eight sessions ask at once (``together``) or one after another; ``extra``: a ninth session's page, asked
    with the others. Each answer is its text, or the HTTP status and error type it got instead."""
    app = create_app(engine, api_key="k", kv_budget_bytes=kv_budget_bytes)
    pages = [f"Agent {i} keeps {i * 3 + 1} lamps in room {i}. " * (1 + i % 4) for i in range(8)]
    pages += [extra] if extra is not None else []
    out: list = [None] * len(pages)
    with run_server(app, "k") as server:
        c = httpx.Client(base_url=server.url, headers=AUTH, timeout=120)
        sids = []
        for page in pages:
            sid = c.post("/v1/sessions").json()["id"]
            assert c.post(f"/v1/sessions/{sid}/chunks", json={"text": page}).status_code == 201
            sids.append(sid)

        def ask(i: int) -> None:
            body = {"prompt": f"How many lamps, agent {i}?", "max_new_tokens": 16, "stream": i % 2 == 1}
            r = httpx.post(f"{server.url}/v1/sessions/{sids[i]}/generate", headers=AUTH, json=body, timeout=120)
            if r.status_code != 200:
                out[i] = (r.status_code, r.json()["error"]["type"], r.headers.get("retry-after"))
            else:
                out[i] = r.text if body["stream"] else r.json()["text"]

        if together:
            _at_once(ask, len(pages))
        else:
            for i in range(len(pages)):
                ask(i)
        assert c.get("/healthz").status_code == 200
        for sid in sids:  # every session goes on: its window answers its chunks
            assert len(c.get(f"/v1/sessions/{sid}").json()["chunks"]) == 1
        stats = c.get("/v1/engine/stats").json()
    return out, stats


def test_eight_sessions_past_the_budget_wait_their_turn_and_one_too_large_is_refused_alone() -> None:
    engine = tiny_chat_engine()
    alone, stats = _budget_run(engine, None, together=False)
    largest = stats["kv_bytes_peak"]  # one answer at a time: the largest answer's KV
    assert all(isinstance(a, str) for a in alone) and largest > 0
    budget = 2 * largest  # two answers at a time at most; the other six wait
    huge = "A long page about nothing in particular. " * 40  # its answer needs more than the whole budget
    got, stats = _budget_run(engine, budget, together=True, extra=huge)
    assert got[:8] == alone  # every answer that ran is its answer alone
    assert got[8] == (429, "CapacityError", None)  # can never fit: no Retry-After
    assert stats["refused"] == 1 and stats["failed"] == 0 and stats["finished"] == 8
    assert 0 < stats["kv_bytes_peak"] <= budget and stats["kv_bytes"] == 0
    free, free_stats = _budget_run(engine, None, together=True)
    assert free == alone and free_stats["kv_bytes_peak"] > budget  # without it the eight held more at once
