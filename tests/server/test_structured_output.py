"""Structured output and tool calls over the OpenAI endpoint, with the official ``openai`` client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kamera_sdk import JSON_MODE_PROMPT
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

CLICK = {
    "type": "object",
    "properties": {
        "action": {"enum": ["click", "scroll", "type"]},
        "x": {"type": "integer", "minimum": 0, "maximum": 1920},
        "y": {"type": "integer", "minimum": 0, "maximum": 1080},
    },
    "required": ["action", "x", "y"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 60}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.api_key, timeout=120, max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schema_response_parses_and_validates(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="kamera",
        messages=ask("Click the OK button at the centre of a 1920x1080 screen. Answer as JSON."),
        max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "action", "schema": CLICK}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CLICK)


def test_json_object_response_is_an_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="kamera",
        messages=ask("Give the capital of France as JSON with a key 'capital'."),
        max_tokens=48,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_json_mode_states_its_rule_as_chatkamera_does(client: openai.OpenAI) -> None:
    """JSON mode puts the same system turn before the messages as ``ChatKamera`` (``answer_prompt``): the
    answer equals a ``{"type": "object"}`` schema's answer to the messages with that turn written out."""
    joke = "Tell me a joke about cats. Return the result as a JSON with 'setup' and 'punchline' keys."
    mode = client.chat.completions.create(
        model="kamera", messages=ask(joke), max_tokens=60, response_format={"type": "json_object"}
    )
    spelled = client.chat.completions.create(
        model="kamera",
        messages=[{"role": "system", "content": JSON_MODE_PROMPT}, *ask(joke)],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "any", "schema": {"type": "object"}}},
    )
    assert mode.usage.prompt_tokens == spelled.usage.prompt_tokens
    assert mode.choices[0].message.content == spelled.choices[0].message.content
    assert isinstance(json.loads(mode.choices[0].message.content), dict)


def test_required_tool_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="kamera",
        messages=ask("What is the weather in Paris?"),
        max_tokens=48,
        tools=[WEATHER, SEARCH],
        tool_choice="required",
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "search")
    tool = WEATHER if call.function.name == "get_weather" else SEARCH
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_call_streamed_equals_plain(client: openai.OpenAI) -> None:
    options = dict(
        model="kamera",
        messages=ask("Look up the tallest building in the world."),
        max_tokens=48,
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    plain = client.chat.completions.create(**options).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.tool_calls[0].function.name == "search"
    chunks = list(client.chat.completions.create(**options, stream=True))
    calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["search"]
    assert json.loads(calls[0].function.arguments) == json.loads(plain.message.tool_calls[0].function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_auto_tool_choice_gives_a_call_or_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="kamera", messages=ask("What is the weather in Oslo?"), max_tokens=40, tools=[WEATHER]
    )
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(
            json.loads(choice.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"]
        )
    else:
        assert choice.message.content and not choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}}, "compile"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "not both"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ],
)
def test_bad_structured_requests_are_422(client: openai.OpenAI, extra: dict, message: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError, match=message):
        client.chat.completions.create(model="kamera", messages=ask("Hi"), max_tokens=8, **extra)
