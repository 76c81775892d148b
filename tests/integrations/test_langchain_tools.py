"""bind_tools and with_structured_output on a tiny random model (fast): constrained decoding makes even
random weights emit a call or a document that parses; how calls, tool turns and refusals are handled."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel
from typing_extensions import TypedDict

from kamera_langchain import ChatKamera
from kamera_sdk import Engine, InvalidInputError
from kamera_sdk import closed_schema as closed
from kamera_sdk.tools import JSON_MODE_PROMPT
from tests.conftest import tiny_chat_engine


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return tiny_chat_engine()


@tool
def switch(on: bool, room: Literal["kitchen", "hall"]) -> str:
    """Turn the light in a room on or off."""
    return "done"


@tool
def ring() -> str:
    """Ring the bell."""
    return "ding"


class Mood(BaseModel):
    """How the user feels."""

    mood: Literal["happy", "sad"]
    sure: bool


class MoodDict(TypedDict):
    mood: Literal["happy", "sad"]
    sure: bool


def chat(tiny: Engine, **kw: Any) -> ChatKamera:
    return ChatKamera(engine=tiny, **{"max_tokens": 40, **kw})


def test_a_forced_call_always_parses_and_follows_the_tool_schema(tiny: Engine) -> None:
    llm = chat(tiny).bind_tools([switch, ring], tool_choice="switch")
    reply = llm.invoke("Turn on the kitchen light.")
    assert isinstance(reply, AIMessage) and reply.content == "" and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["name"] == "switch" and call["type"] == "tool_call" and call["id"]
    assert set(call["args"]) == {"on", "room"}  # no invented keys: the arguments object is closed
    assert isinstance(call["args"]["on"], bool) and call["args"]["room"] in ("kitchen", "hall")
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    assert switch.invoke(call).content == "done"  # the tool runs on it

    for choice in ("any", "required", True):  # a call of one of the tools
        forced = chat(tiny).bind_tools([switch, ring], tool_choice=choice).invoke("hello")
        assert len(forced.tool_calls) == 1 and forced.tool_calls[0]["name"] in ("switch", "ring")


def test_a_streamed_call_is_one_chunk_and_merges_to_the_invoked_call(tiny: Engine) -> None:
    llm = chat(tiny).bind_tools([switch], tool_choice="any")
    reply = llm.invoke("Turn on the hall light.", session_id="a")
    chunks = list(llm.stream("Turn on the hall light.", session_id="b"))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert isinstance(full, AIMessageChunk)
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    assert full.response_metadata["finish_reason"] == "tool_calls" and full.usage_metadata is not None


def test_tool_none_and_auto(tiny: Engine) -> None:
    free = chat(tiny, max_tokens=4).bind_tools([switch], tool_choice="none").invoke("hi")
    assert free.tool_calls == [] and isinstance(free.content, str)
    auto = chat(tiny, max_tokens=40).bind_tools([switch]).invoke("hi")  # a call, or text that is not one
    assert auto.tool_calls or not str(auto.content).lstrip().startswith("{")


def test_the_tools_are_described_in_a_system_turn_that_the_window_reuses(tiny: Engine) -> None:
    base = chat(tiny)
    llm = base.bind_tools([switch], tool_choice="any")
    history = [HumanMessage("Turn on the kitchen light.")]
    first = llm.invoke(history)
    texts = base.window().chunks
    assert len(texts) == 2  # the tools' turn, then the message
    described = str(base.window().chunk(texts[0]).text)
    assert described.startswith("<|im_start|>system\nYou can call these tools:") and '"name":"switch"' in described
    # the call comes back as history with the tool's result: both reuse the window, the call reads as emitted
    history += [first, ToolMessage("done", tool_call_id=first.tool_calls[0]["id"]), HumanMessage("and now?")]
    again = llm.invoke(history)
    assert again.response_metadata["kamera"]["window_ops"]["reused"] == 2
    assert base.get_num_tokens_from_messages(history, tools=[switch]) > base.get_num_tokens_from_messages(history)


@pytest.mark.parametrize("schema", [Mood, MoodDict, Mood.model_json_schema()], ids=["pydantic", "typeddict", "dict"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses_whatever_the_model(tiny: Engine, schema: Any, method: str) -> None:
    out = chat(tiny).with_structured_output(schema, method=method).invoke("How do I feel?")
    value = out.model_dump() if isinstance(out, BaseModel) else out
    assert isinstance(out, Mood) == (schema is Mood)
    assert set(value) == {"mood", "sure"} and value["mood"] in ("happy", "sad") and isinstance(value["sure"], bool)


def test_structured_output_include_raw_and_json_mode(tiny: Engine) -> None:
    both = chat(tiny).with_structured_output(Mood, include_raw=True).invoke("How do I feel?")
    assert isinstance(both["raw"], AIMessage) and isinstance(both["parsed"], Mood) and both["parsing_error"] is None
    cut = chat(tiny, max_tokens=2).with_structured_output(Mood, include_raw=True).invoke("How do I feel?")
    assert cut["parsed"] is None and cut["parsing_error"] is not None  # cut short by max_tokens: reported
    loose = chat(tiny, max_tokens=24).with_structured_output(None, method="json_mode", include_raw=True)
    raw = loose.invoke("Anything.")["raw"]
    assert str(raw.content).startswith("{")  # a JSON object, however far it got


def test_json_mode_states_its_rule_in_a_system_turn_and_schemas_do_not(tiny: Engine) -> None:
    base = chat(tiny, max_tokens=8)
    base.bind(response_format={"type": "json_object"}).invoke("Return 'a' and 'b' keys.")
    texts = [str(base.window().chunk(c).text) for c in base.window().chunks]
    assert len(texts) == 2 and texts[0] == f"<|im_start|>system\n{JSON_MODE_PROMPT}<|im_end|>\n"
    base.with_structured_output(Mood, include_raw=True).invoke("How do I feel?")
    first = base.window().chunks[0]
    assert str(base.window().chunk(first).text).startswith("<|im_start|>user")


def test_a_call_back_in_history_reads_as_the_grammar_writes_it(tiny: Engine) -> None:
    base = chat(tiny)
    llm = base.bind_tools([switch], tool_choice="switch")
    ask = HumanMessage("Light the hall.")
    call = llm.invoke([ask])
    llm.invoke([ask, call, ToolMessage("done", tool_call_id=call.tool_calls[0]["id"])])
    texts = [str(base.window().chunk(c).text) for c in base.window().chunks]
    written = json.dumps({"name": "switch", "arguments": call.tool_calls[0]["args"]})  # name first, ", " ": "
    assert texts[2] == f"<|im_start|>assistant\n{written}<|im_end|>\n"


def test_refusals(tiny: Engine) -> None:
    with pytest.raises(InvalidInputError, match="not among the tools"):
        chat(tiny).bind_tools([switch], tool_choice="ring")
    with pytest.raises(InvalidInputError, match="tool_choice must be"):
        chat(tiny).bind_tools([switch], tool_choice=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="names must be unique"):
        chat(tiny).bind_tools([switch, switch]).invoke("hi")
    with pytest.raises(InvalidInputError, match="not both"):
        chat(tiny).bind_tools([switch]).invoke("hi", response_format={"type": "json_object"})
    with pytest.raises(InvalidInputError, match="method must be"):
        chat(tiny).with_structured_output(Mood, method="xml")
    with pytest.raises(InvalidInputError, match="needs a schema"):
        chat(tiny).with_structured_output(None)
    llm = chat(tiny)
    llm.invoke("first")
    before = llm.window().chunks
    with pytest.raises(InvalidInputError, match="json_object or json_schema"):
        llm.invoke("second", response_format={"type": "yaml"})
    assert llm.window().chunks == before  # refused before the window changed


def test_closed_schemas_keep_what_they_say() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {}}}, "free": {"type": "object"}},
        "$defs": {"D": {"type": "object", "properties": {"q": {}}, "additionalProperties": True}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in out["properties"]["free"]  # lists no properties: left open
    assert out["$defs"]["D"]["additionalProperties"] is True  # said otherwise: kept
