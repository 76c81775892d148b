"""Server-sent events: encoding on the server, a line-fed decoder for the client (no I/O here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def encode_event(data: Any, event: str | None = None) -> bytes:
    """One SSE event; ``data`` is sent as JSON unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


@dataclass(slots=True)
class Event:
    """A decoded event: its type (``message`` when none was named) and raw data."""

    event: str
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


class SSEDecoder:
    """Feed lines (without their newline); ``feed`` returns an ``Event`` when a blank line ends one."""

    def __init__(self) -> None:
        self._event = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> Event | None:
        line = line.rstrip("\r")
        if not line:
            if not self._data:
                self._event = "message"
                return None
            ev = Event(self._event, "\n".join(self._data))
            self._event, self._data = "message", []
            return ev
        if line.startswith(":"):
            return None  # comment / keep-alive
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None
