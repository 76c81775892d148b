"""Sessions: one ``ContextWindow`` each, found by an unguessable id.

Each session owns its window and that window's chunk table, so a chunk id is only meaningful inside
the session that added it: another session's ids are unknown to it (404), and nothing one session
does can change another's window. Content is shared between sessions only through the store.

The registry is touched only from the event loop thread, so it needs no lock; the windows themselves
are only touched on the model worker (``worker.py``).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..window import ContextWindow
from .errors import LimitExceededError, SessionNotFoundError
from .held import HeldTokens

SessionKind = Literal["session", "chat"]


@dataclass(slots=True)
class Session:
    """A window and its bookkeeping. ``kind="chat"``: a window keyed by an OpenAI ``user`` field."""

    id: str
    window: ContextWindow
    kind: SessionKind = "session"
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    users: int = 0  # requests using the window now (the event loop counts them)


def new_session_id() -> str:
    """An unguessable token (192 random bits)."""
    return "ks_" + secrets.token_urlsafe(24)


def chat_key(user: str) -> str:
    """The registry key of the chat window of an OpenAI ``user`` value (never a valid session id)."""
    return "chat:" + hashlib.sha256(user.encode()).hexdigest()


class SessionRegistry:
    """Open sessions, bounded in number and idle time.

    When full, the least recently used chat windows (rebuilt from messages on their next request)
    make room first; explicit sessions are only dropped by ``DELETE`` or after ``ttl_s`` idle. ``held``
    counts the tokens of every registered session's window (``held.py``).
    """

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float | None,
        on_drop: Callable[[ContextWindow], None] | None = None,
        *,
        max_held_tokens: int | None = None,
    ) -> None:
        """``on_drop``: called with the window of every session that is deleted, expired or displaced (the
        server closes it on its model worker; the registry itself never touches a window).
        ``max_held_tokens``: the bound of ``held`` (None: counted, never refused)."""
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.on_drop = on_drop
        self.held = HeldTokens(max_held_tokens)
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def reserve(self) -> None:
        """Make room for one more session or raise ``LimitExceededError``."""
        self._expire()
        if len(self._sessions) < self.max_sessions:
            return
        chats = sorted((s for s in self._sessions.values() if s.kind == "chat"), key=lambda s: s.last_used)
        if chats:
            self._drop(chats[0].id)
            return
        raise LimitExceededError(f"the server holds its maximum of {self.max_sessions} sessions; delete one first")

    def add(
        self,
        window: ContextWindow,
        *,
        key: str | None = None,
        kind: SessionKind = "session",
        family_of: str | None = None,
    ) -> Session:
        """Register ``window`` under a fresh id (or ``key``); call ``reserve`` first. ``family_of``: the session
        ``window`` was forked from (they share content, ``HeldTokens``)."""
        session = Session(key or new_session_id(), window, kind)
        self._sessions[session.id] = session
        self.held.open(session.id, family_of=family_of)
        return session

    def get(self, session_id: str, *, kind: SessionKind = "session") -> Session:
        """The live session ``session_id`` or ``SessionNotFoundError`` (chat windows are not sessions)."""
        self._expire()
        session = self._sessions.get(session_id)
        if session is None or session.kind != kind:
            raise SessionNotFoundError("unknown session (never created, deleted, or expired)")
        session.last_used = time.monotonic()
        return session

    def find(self, key: str, *, kind: SessionKind) -> Session | None:
        try:
            return self.get(key, kind=kind)
        except SessionNotFoundError:
            return None

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        self._drop(session_id)

    def discard(self, session: Session, *, shared: bool = True) -> None:
        """Drop ``session`` (a session or a chat window) if the registry still holds it under its id.
        ``shared=False``: it added nothing its family shares (``HeldTokens.close``)."""
        if self._sessions.get(session.id) is session:
            self._drop(session.id, shared=shared)

    def clear(self) -> None:
        for sid in list(self._sessions):
            self._drop(sid)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        cutoff = time.monotonic() - self.ttl_s
        for sid in [sid for sid, s in self._sessions.items() if s.last_used < cutoff]:
            self._drop(sid)

    def _drop(self, session_id: str, *, shared: bool = True) -> None:
        """Forget a session and hand its window to ``on_drop``."""
        session = self._sessions.pop(session_id)
        self.held.close(session_id, shared=shared)
        if self.on_drop is not None:
            self.on_drop(session.window)
