"""The chat endpoint's tools: described to the model in a system turn, argument objects closed, calls parsed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kamera_sdk import ContextWindow
from kamera_sdk.server import chat as chat_ops
from kamera_sdk.server.ops import Limits
from kamera_sdk.server.schemas import ChatCompletionRequest
from tests.conftest import tiny_chat_engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    },
}


def test_tools_are_described_in_a_system_turn_and_calls_follow_the_closed_schema() -> None:
    engine, limits = tiny_chat_engine(), Limits()
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 40,
        }
    )
    (spec,) = chat_ops.request_tools(req)
    assert spec.parameters["additionalProperties"] is False  # closed: no invented keys under the grammar
    win = ContextWindow(engine)
    params = chat_ops.sampling(req, limits)
    start = chat_ops.start_chat(engine, win, req, params, limits)
    text = (start.first or "") + "".join(start.pieces)
    first = win.chunk(win.chunks[0]).text
    assert "You can call these tools" in first and '"name":"get_weather"' in first
    message, finish = chat_ops.answer_message(req, text, start.pieces.finish_reason or "stop")
    assert finish == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), spec.parameters)


RING = {"type": "function", "function": {"name": "ring", "description": "Ring the door bell.", "parameters": {}}}


def _answer(req: ChatCompletionRequest) -> tuple[object, str]:
    engine, limits = tiny_chat_engine(), Limits()
    start = chat_ops.start_chat(engine, None, req, chat_ops.sampling(req, limits), limits)
    text = (start.first or "") + "".join(start.pieces)
    return chat_ops.answer_message(req, text, start.pieces.finish_reason or "stop")


def test_relevance_policy_on_the_server_calls_a_relevant_uncalled_tool_or_answers_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``auto_tool_policy="relevance"``: the server asks ``kamera_sdk.auto_tools`` (scores pinned here, the
    scoring itself is tested with ChatKamera), calls only a relevant tool not called since the request, and
    answers text otherwise; the default (``"model"``) never consults the scores."""
    import kamera_sdk.auto_tools as auto

    scores: dict[str, float] = {}
    asked: list[str] = []

    def pinned(engine, turn, request, tools):
        asked.append(request)
        return {t.name: scores[t.name] for t in tools}

    monkeypatch.setattr(auto, "tool_relevance", pinned)
    user = {"role": "user", "content": "Weather in Oslo?"}
    base = {"tools": [WEATHER, RING], "tool_choice": "auto", "max_tokens": 30, "auto_tool_policy": "relevance"}

    scores.update(get_weather=0.5, ring=-0.2)
    message, finish = _answer(ChatCompletionRequest.model_validate({"messages": [user], **base}))
    assert finish == "tool_calls" and [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert asked == ["Weather in Oslo?"]

    scores.update(get_weather=-0.1, ring=-0.3)
    message, finish = _answer(ChatCompletionRequest.model_validate({"messages": [user], **base}))
    assert finish != "tool_calls" and message.tool_calls is None and not (message.content or "").startswith("{")

    # after the weather call and its result, only ``ring`` is a candidate; it is not relevant: text
    scores.update(get_weather=0.5, ring=-0.3)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    result = {"role": "tool", "tool_call_id": "c1", "content": "Sun"}
    history = [user, {"role": "assistant", "tool_calls": [call]}, result]
    asked.clear()
    message, finish = _answer(ChatCompletionRequest.model_validate({"messages": history, **base}))
    assert finish != "tool_calls" and message.tool_calls is None and asked == ["Weather in Oslo?"]

    asked.clear()
    default = {k: v for k, v in base.items() if k != "auto_tool_policy"}
    _answer(ChatCompletionRequest.model_validate({"messages": [user], **default}))
    assert asked == []
