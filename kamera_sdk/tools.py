"""Tool calls and structured answers: what an agent's model may emit, as a grammar, and back again.

A tool call is emitted as one JSON object ``{"name": <tool>, "arguments": {...}}`` whose arguments
follow that tool's JSON schema; constrained decoding (``kamera_engine.Grammar``) makes every token of it
admissible, so the agent always gets a call it can parse, even from a small model. ``choice="auto"``
lets the model answer in plain text instead (text that does not open with ``{``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field

from kamera_engine import Grammar, InvalidInputError
from kamera_engine.constrained import JSON_LAYOUT


class ToolSpec(BaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolCall(BaseModel):
    """One call the model made: the tool's name and its parsed arguments."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str
    arguments: dict[str, Any]


#: The loop guard of every tool call and structured answer (``Grammar.string_loop_tokens``): a string whose
#: last 8 tokens repeat a run of 8 already in it is closed. A small model that starts repeating a phrase
#: inside a free-text field would otherwise fill ``max_tokens`` with it and never reach the fields (or the
#: closing brace) after it; 8 tokens verbatim twice in one field is a loop, not prose.
STRING_LOOP_TOKENS = 8


def json_grammar(schema: Mapping[str, Any] | bool) -> Grammar:
    """Answers that are JSON documents valid under ``schema`` (``True``: any JSON object), with the loop guard."""
    return Grammar.json_schema(schema).with_loop_guard(STRING_LOOP_TOKENS)


def tool_grammar(tools: Sequence[ToolSpec], choice: str = "auto") -> Grammar:
    """What the model may emit given ``tools``: ``"required"`` a call of any of them, a tool's name a call of
    that tool, ``"auto"`` a call or plain text."""
    if not tools:
        raise InvalidInputError("tools must name at least one tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"tool names must be unique, got {names}")
    if choice not in ("auto", "required"):
        if choice not in names:
            raise InvalidInputError(f"tool_choice names {choice!r}, which is not among the tools {names}")
        tools = [t for t in tools if t.name == choice]
    schema = _calls_schema(tools)
    if choice != "auto":
        return json_grammar(schema)
    # a call, or text that does not open with '{' (so a call is never half text); the loop guard only acts
    # inside a string that a call opened (text never opens with '{', and its quotes are the model's own)
    text = Grammar.lark(f"start: call | TEXT\ncall: %json {json.dumps(schema)}\nTEXT: /[^{{\\s][\\s\\S]*/\n")
    return text.with_loop_guard(STRING_LOOP_TOKENS)


def parse_tool_call(text: str, tools: Sequence[ToolSpec]) -> ToolCall | None:
    """The call in an answer decoded under ``tool_grammar``, or None when the model answered in text."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        return None  # cut short by max_tokens: the caller reports the text and finish_reason "length"
    if not isinstance(obj, dict) or obj.get("name") not in {t.name for t in tools}:
        return None
    arguments = obj.get("arguments")
    return ToolCall(name=obj["name"], arguments=arguments if isinstance(arguments, dict) else {})


def _calls_schema(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": dict(JSON_LAYOUT)}


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and says
    nothing about others (OpenAI's strict mode does the same): under a grammar, an open object lets the model
    invent keys until ``max_tokens`` runs out instead of closing the call."""
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


#: The system turn of a JSON-mode answer (``response_format: json_object``). The grammar only makes the answer
#: a JSON object; which keys it holds is the model's choice, and a small model asked for "'setup' and
#: 'punchline' keys" writes the first and closes. Said once, as a rule of the mode, it writes each key named.
JSON_MODE_PROMPT = (
    "You reply in JSON mode: one JSON object holding each key the user asks for, in the order they are named."
)


def answer_prompt(tools: Sequence[ToolSpec] = (), choice: str = "auto", *, json_mode: bool = False) -> str | None:
    """The system turn an answer's shape puts in front of the conversation, or None: the tools' description
    when the model may call ``tools``, JSON mode's rule for a ``json_object`` answer, nothing otherwise (a
    schema-held answer needs no words: the schema itself decides its keys). The server's chat endpoint and
    ``ChatKamera`` both ask this, so one conversation reads the same to the model on either."""
    if tools and json_mode:
        raise InvalidInputError("pass tools or a JSON response_format, not both")
    if tools:
        return tools_prompt(tools, choice)
    return JSON_MODE_PROMPT if json_mode else None


def tools_prompt(tools: Sequence[ToolSpec], choice: str) -> str:
    """The system turn that tells the model which tools it has and how a call is written."""
    lines = [json.dumps(t.model_dump(), separators=(",", ":"), ensure_ascii=False) for t in tools]
    how = 'To call a tool, reply with only a JSON object: {"name":<tool name>,"arguments":<its arguments>}.'
    when = "" if choice != "auto" else " If no tool is needed, answer in plain text."
    return "You can call these tools:\n" + "\n".join(lines) + "\n" + how + when
