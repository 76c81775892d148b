"""LangChain messages -> (role, text): what each message contributes to its chunk.

Tool calls on an AI message are written out as ``<tool_call>{json}</tool_call>`` lines (the Hermes /
Qwen convention), tool results as a ``tool`` turn. Image parts raise: they need a vision-language
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
    {"tool_call", "tool_call_chunk", "invalid_tool_call", "server_tool_call", "reasoning", "thinking"}
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
        calls = [
            "<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["args"]}, sort_keys=True) + "\n</tool_call>"
            for c in message.tool_calls
        ]
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return text


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
