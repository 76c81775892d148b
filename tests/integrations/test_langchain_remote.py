"""ChatKamera against a running ``kamera serve`` app on loopback (a tiny random Llama over the default
model's tokenizer and chat template, served by uvicorn in a thread), and ChatKamera's store option in-process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from kamera_langchain import ChatKamera
from kamera_sdk import Engine, InvalidInputError, KameraError, RemoteWindow
from tests.conftest import tiny_chat_engine
from tests.server.conftest import API_KEY, LiveServer, make_app, run_server

SYS = SystemMessage("You answer in one word.")


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return tiny_chat_engine()


@pytest.fixture(scope="module")
def server(tiny: Engine) -> Iterator[LiveServer]:
    with run_server(make_app(tiny), API_KEY) as live:
        yield live


_OPEN: list[ChatKamera] = []


@pytest.fixture(autouse=True)
def _close_models() -> Iterator[None]:
    """Every remote model a test made closes its server sessions' clients afterwards (no socket left open)."""
    yield
    while _OPEN:
        _OPEN.pop().reset()


def remote(server: LiveServer, **kw: object) -> ChatKamera:
    llm = ChatKamera(base_url=server.url, api_key=server.api_key, **{"max_tokens": 4, **kw})
    _OPEN.append(llm)
    return llm


def _server_answer(server: LiveServer, messages: list[dict[str, str]]) -> str:
    """The server's own chat endpoint on a window for this request only: the reference answer."""
    body = {"messages": messages, "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=60)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def test_invoke_runs_on_the_server_and_reuses_the_conversation(server: LiveServer) -> None:
    llm = remote(server)
    first = llm.invoke([SYS, HumanMessage("hello")])
    assert first.response_metadata["model_name"] == "tiny-llama-chat"
    expected = _server_answer(
        server, [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "hello"}]
    )
    assert first.content == expected
    win = llm.window()
    assert isinstance(win, RemoteWindow) and first.response_metadata["kamera"]["server_session"] == win.id
    assert len(win.chunks) == 1  # the system message; the last message is the prompt
    grown = llm.invoke([SYS, HumanMessage("hello"), first, HumanMessage("again")])
    usage = grown.usage_metadata
    assert usage is not None and usage["output_tokens"] <= 4
    # the system message and "hello" were served from the session's window, not prefilled again
    assert usage["input_token_details"]["cache_read"] > first.usage_metadata["input_token_details"]["cache_read"]
    assert len(win.chunks) == 3


def test_stream_gives_the_same_answer_and_usage(server: LiveServer) -> None:
    llm = remote(server)
    history = [SYS, HumanMessage("hi there")]
    reply = llm.invoke(history, session_id="a")
    chunks = list(llm.stream(history, session_id="b"))  # same work on a new server session
    assert "".join(str(c.content) for c in chunks) == reply.content
    last = chunks[-1]
    assert last.chunk_position == "last" and last.usage_metadata is not None
    assert last.usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert last.response_metadata["finish_reason"] == reply.response_metadata["finish_reason"]


def test_sessions_are_server_sessions_and_reset_deletes_them(server: LiveServer) -> None:
    llm = remote(server, policy="recompute", rank=8)
    llm.invoke([SYS, HumanMessage("one")], session_id="a")
    llm.invoke([SYS, HumanMessage("two")], config={"metadata": {"thread_id": "b"}})
    assert sorted(llm.sessions) == ["a", "b"]
    a, b = llm.window("a"), llm.window("b")
    assert a.id != b.id and a.state().policy == "recompute"
    llm.reset("a")
    assert llm.sessions == ["b"]
    with pytest.raises(KameraError, match="unknown session"):  # the server deleted it
        with RemoteWindow(server.url, api_key=server.api_key, session_id=a.id) as gone:
            gone.state()
    llm.reset()
    assert llm.sessions == []


def test_refusals_and_errors(server: LiveServer, tiny: Engine) -> None:
    with pytest.raises(ValueError, match="base_url runs the model on the server"):
        ChatKamera(base_url=server.url, engine=tiny)
    llm = remote(server)
    with pytest.raises(InvalidInputError, match="temperature"):  # checked here, before any request
        llm.invoke([HumanMessage("x")], temperature=-1.0)
    assert llm.sessions == []
    with pytest.raises(InvalidInputError, match="no engine or tokenizer"):
        llm.get_num_tokens_from_messages([HumanMessage("x")])
    with pytest.raises(KameraError, match="max_tokens"):  # the server's limit, raised as a Kamera error
        llm.invoke([HumanMessage("x")], max_tokens=10_000)
    wrong = ChatKamera(base_url=server.url, api_key="not-the-key")
    with pytest.raises(KameraError):
        wrong.invoke([HumanMessage("x")])


def test_store_option_shares_canonicals_across_models(tiny: Engine, tmp_path: Path) -> None:
    history = [SYS, HumanMessage("a question about rivers"), AIMessage("Loire"), HumanMessage("and?")]
    first = ChatKamera(engine=tiny, max_tokens=3, store=str(tmp_path / "store"))
    reply = first.invoke(history)
    first_win = first.window()
    assert first_win.store is not None and first_win.store.stats().writes + first_win.store.stats().memory_entries
    first_win.close()  # flush the write-behind queue
    second = ChatKamera(engine=tiny, max_tokens=3, store=str(tmp_path / "store"))
    again = second.invoke(history)
    assert again.content == reply.content
    assert second.window().store is not first_win.store
    assert second.window().store.stats().backend_hits > 0  # canonicals read back, not computed again


@tool
def switch(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light in a room on or off."""
    return "done"


class Mood(BaseModel):
    mood: Literal["happy", "sad"]
    sure: bool


def test_tools_and_structured_output_run_on_the_server(server: LiveServer) -> None:
    llm = remote(server, max_tokens=40).bind_tools([switch], tool_choice="switch")
    call = llm.invoke([HumanMessage("Turn on the kitchen light.")])
    assert len(call.tool_calls) == 1 and call.tool_calls[0]["name"] == "switch" and call.tool_calls[0]["id"]
    assert set(call.tool_calls[0]["args"]) == {"on", "room"} and call.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(llm.stream([HumanMessage("Turn on the kitchen light.")]))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert [c["name"] for c in full.tool_calls] == ["switch"]
    # the call and its result go back to the server as an assistant tool_calls message and a tool message
    result = ToolMessage("done", tool_call_id=call.tool_calls[0]["id"])
    history = [HumanMessage("Turn on the kitchen light."), call, result]
    assert remote(server, max_tokens=3).invoke(history).tool_calls == []
    mood = remote(server, max_tokens=40).with_structured_output(Mood).invoke("How do I feel?")
    assert isinstance(mood, Mood)


def test_auto_tool_policy_travels_to_the_server(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote ChatKamera's ``auto_tool_policy`` is the server's under ``tool_choice="auto"`` (the default,
    ``"relevance"``, consults the request's scores there; ``"model"`` does not)."""
    import kamera_sdk.auto_tools as auto

    asked: list[str] = []

    def pinned(engine, turn, request, tools):
        asked.append(request)
        return {t.name: 1.0 for t in tools}

    monkeypatch.setattr(auto, "tool_relevance", pinned)
    call = remote(server, max_tokens=40).bind_tools([switch]).invoke([HumanMessage("Turn on the kitchen light.")])
    assert asked == ["Turn on the kitchen light."] and [c["name"] for c in call.tool_calls] == ["switch"]
    asked.clear()
    remote(server, max_tokens=4, auto_tool_policy="model").bind_tools([switch]).invoke("Turn on the light.")
    assert asked == []
