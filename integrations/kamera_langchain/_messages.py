"""LangChain messages -> (role, text): what each message contributes to its chunk.

Tool calls on an AI message are written out as the JSON objects a constrained answer emits
(``{"name": ..., "arguments": {...}}``, one per line, see ``_tools``), so a call the model made reads the same
when it comes back as history; tool results are a ``tool`` turn. Image parts raise: they need a vision-language
engine, and a silently dropped image would make the answer about something the model never saw.
"""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from kamera_sdk import InvalidInputError, UnsupportedModelError

_IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})
#: Parts that are not sent as text: tool calls (rendered from ``AIMessage.tool_calls``) and earlier
#: reasoning (chat templates drop it from history too).
_SKIPPED_PARTS = frozenset(
    {
        "tool_call",
        "tool_call_chunk",
        "invalid_tool_call",
        "server_tool_call",
        "tool_use",  # Anthropic's form of a call in the content; AIMessage.tool_calls carries it too
        "function_call",
        "reasoning",
        "thinking",
    }
)


class ImageInputError(UnsupportedModelError, NotImplementedError):
    """A message has image parts; they need a vision-language engine (multimodal chunks not landed yet)."""


def message_role(message: BaseMessage) -> str:
    """The chat-template role of a LangChain message."""
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return {"human": "user", "ai": "assistant"}.get(message.role, message.role)
    raise InvalidInputError(f"unsupported message type {type(message).__name__}")


def message_text(message: BaseMessage) -> str:
    """The message's text: its text parts joined, plus its tool calls written out."""
    text = _content_text(message.content)
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = [call_text(c["name"], c["args"]) for c in message.tool_calls]
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return text


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model emits it under ``kamera_sdk.tool_grammar`` (name first, the grammar's layout)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def message_payload(message: BaseMessage) -> dict[str, Any]:
    """The message as an OpenAI chat message for a server: role, text, and its tool calls or call id."""
    payload: dict[str, Any] = {"role": message_role(message), "content": _content_text(message.content)}
    if isinstance(message, AIMessage) and message.tool_calls:
        payload["tool_calls"] = [
            {
                "id": c.get("id") or f"call_{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["args"], ensure_ascii=False)},
            }
            for i, c in enumerate(message.tool_calls)
        ]
    if isinstance(message, ToolMessage):
        payload["tool_call_id"] = message.tool_call_id
    return payload


def _content_text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            pieces.append(str(part.get("text", "")))
        elif kind in _IMAGE_PARTS or (kind == "file" and str(part.get("mime_type", "")).startswith("image/")):
            raise ImageInputError(
                "this message has an image part; images need a vision-language engine and Kamera's "
                "multimodal chunks are not available in ChatKamera yet. Send text only, or describe the image."
            )
        elif kind in _SKIPPED_PARTS:
            continue
        else:
            raise InvalidInputError(f"ChatKamera cannot send a {kind!r} content part to the model (text only)")
    return "".join(pieces)
