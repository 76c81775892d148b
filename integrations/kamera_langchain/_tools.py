"""What a call's answer must be: tools it may call (``bind_tools``) or JSON it must match (``response_format``).

LangChain hands tools over as OpenAI tool dicts (``convert_to_openai_tool``) and structured output as an
OpenAI ``response_format``; both become a ``kamera_sdk.Grammar`` the decode loop is held to, so even the
135M default model emits a call or a document that parses. The tools are also described to the model in a
system turn (``tools_prompt``): the grammar makes the call valid, the description lets the model pick the
tool and fill in sensible arguments.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, InvalidToolCall, ToolCall, ToolCallChunk

from kamera_sdk import (
    Grammar,
    InvalidInputError,
    ToolSpec,
    closed_schema,
    json_grammar,
    parse_tool_call,
    tool_grammar,
)

#: tool_choice values that force a call of one of the tools
_ANY = frozenset({"any", "required"})


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """The tools an answer may call and the grammar it is decoded under (none: free text)."""

    tools: tuple[ToolSpec, ...] = ()
    choice: str = "auto"  # "auto", "required", or a tool's name
    grammar: Grammar | None = None
    response_format: dict[str, Any] | None = field(default=None)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools)

    @property
    def json_mode(self) -> bool:
        """The answer is any JSON object (``response_format`` of type ``json_object``)."""
        return isinstance(self.response_format, Mapping) and self.response_format.get("type") == "json_object"


def choice_name(tool_choice: Any) -> str | None:
    """LangChain's ``tool_choice`` as Kamera's: ``"auto"``, ``"required"``, ``"none"``, a tool name, or None."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice is True or tool_choice in _ANY:
        return "required"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if isinstance(tool_choice, str):
        return tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if isinstance(name, str):
            return name
    raise InvalidInputError(
        f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name or {{'type': 'function', "
        f"'function': {{'name': ...}}}}; got {tool_choice!r}"
    )


def tool_specs(tools: Sequence[Any]) -> list[ToolSpec]:
    """OpenAI tool dicts (what ``bind_tools`` stores) as Kamera ``ToolSpec``s."""
    specs = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise InvalidInputError(f"a tool must be an OpenAI tool dict with a function name, got {tool!r}")
        try:
            specs.append(
                ToolSpec(
                    name=fn["name"],
                    description=str(fn.get("description") or ""),
                    parameters=closed_schema(dict(fn.get("parameters") or {"type": "object", "properties": {}})),
                )
            )
        except ValueError as exc:
            raise InvalidInputError(f"tool {fn['name']!r}: {exc}") from None
    return specs


def answer_shape(tools: Sequence[Any] | None, tool_choice: Any, response_format: Any) -> AnswerShape:
    """The grammar of one call's answer (checked before any window changes)."""
    choice = choice_name(tool_choice)
    specs = tool_specs(tools) if tools and choice != "none" else []
    if specs and response_format is not None:
        raise InvalidInputError("pass tools or a response_format, not both")
    if specs:
        return AnswerShape(tuple(specs), choice or "auto", tool_grammar(specs, choice or "auto"))
    if response_format is None:
        return AnswerShape()
    response_format = closed_format(response_format)
    return AnswerShape(grammar=format_grammar(response_format), response_format=response_format)


def closed_format(response_format: Any) -> Any:
    """A ``json_schema`` response format with its schema ``closed``; any other value as it is."""
    spec = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
        return response_format
    return {**response_format, "json_schema": {**spec, "schema": closed_schema(spec["schema"])}}


def format_grammar(response_format: Any) -> Grammar:
    """An OpenAI ``response_format`` (``json_object`` or ``json_schema``) as a grammar."""
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "json_object":
        return json_grammar(True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidInputError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
        return json_grammar(schema)
    raise InvalidInputError(f"response_format must be of type json_object or json_schema, got {response_format!r}")


def tool_message(text: str, shape: AnswerShape, finish: str) -> tuple[AIMessage, str]:
    """The reply of a call with tools: a tool call when the model made one (finish reason ``tool_calls``),
    an invalid call when it was cut short, otherwise the text."""
    call = parse_tool_call(text, shape.tools)
    if call is not None:
        tc = ToolCall(name=call.name, args=call.arguments, id=call.id, type="tool_call")
        return AIMessage(content="", tool_calls=[tc]), "tool_calls"
    if text.lstrip().startswith("{"):
        bad = InvalidToolCall(name=None, args=text, id=None, error=f"the call is incomplete (finish {finish})")
        return AIMessage(content="", invalid_tool_calls=[bad]), finish
    return AIMessage(content=text), finish


def tool_chunk(message: AIMessage) -> AIMessageChunk:
    """A whole reply as one stream chunk (a call's arguments as the JSON text LangChain merges and parses)."""
    chunks = [
        ToolCallChunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i, type="tool_call_chunk")
        for i, c in enumerate(message.tool_calls)
    ]
    chunks += [
        ToolCallChunk(name=c["name"], args=c["args"], id=c["id"], index=i + len(chunks), type="tool_call_chunk")
        for i, c in enumerate(message.invalid_tool_calls)
    ]
    return AIMessageChunk(content=message.content, tool_call_chunks=chunks)


def remote_tool_choice(choice: str) -> str | dict[str, Any]:
    """Kamera's choice as the server's ``tool_choice``."""
    if choice in ("auto", "required", "none"):
        return choice
    return {"type": "function", "function": {"name": choice}}
