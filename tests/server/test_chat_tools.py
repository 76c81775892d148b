"""The chat endpoint's tools: described to the model in a system turn, argument objects closed, calls parsed."""

from __future__ import annotations

import json

import jsonschema

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
