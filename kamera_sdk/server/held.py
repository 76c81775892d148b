"""The tokens every session holds, counted against the server's ``max_held_tokens``.

A session's memory grows with the tokens its window holds: its chunks' KV as placed, their
position-free canonicals, its buffers and row caches (docs/batching.md measured about 60 MB for each
session of `kamera bench serve`, whose windows hold three pages of about 56 tokens). An evicted or slid
chunk stays recallable, so its canonical stays too: a window holds its chunks' tokens and its evicted
chunks' (``ops.held_tokens``), and only deleting the session gives them back. ``max_sessions`` times
``max_session_tokens`` bounds none of this usefully (256 windows of 32768 tokens), so the server can bound
the sum instead, refusing the content that would pass it with a 429 before anything changes.

A session's count is raised before its window takes new content (``claim``, run in the session's lane,
so nothing else changes that window meanwhile) and set to what the window holds after each of its jobs
(``settle``). A count is never below what its window holds, so no interleaving lets the sum pass the
limit. Only the sessions the registry holds are counted (``open`` / ``close``): a job that finishes
after its session was deleted records nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from kamera_engine import InvalidInputError

from .errors import LimitExceededError


class HeldTokens:
    """Per-session token counts and their bound; thread-safe. ``limit=None``: counted, never refused."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InvalidInputError(f"max_held_tokens must be an int >= 1 or None, got {limit!r}")
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[Hashable, int] = {}

    @property
    def total(self) -> int:
        """Tokens the counted sessions hold (or have claimed) together."""
        with self._lock:
            return sum(self._held.values())

    def open(self, key: Hashable) -> None:
        """Start counting ``key`` (at 0 tokens; a key already counted keeps its count)."""
        with self._lock:
            self._held.setdefault(key, 0)

    def close(self, key: Hashable) -> None:
        """Stop counting ``key``: its window is gone."""
        with self._lock:
            self._held.pop(key, None)

    def of(self, key: Hashable) -> int:
        """The count of ``key`` (0 if it is not counted)."""
        with self._lock:
            return self._held.get(key, 0)

    def check(self, more: int) -> None:
        """Raise ``LimitExceededError`` if ``more`` tokens on top of the counts would pass the limit (records
        nothing: an early refusal, before work whose own ``claim`` decides)."""
        with self._lock:
            self._refuse(sum(self._held.values()) + more)

    def claim(self, key: Hashable, tokens: int) -> None:
        """Let ``key``'s window grow to ``tokens`` or raise ``LimitExceededError`` (counts unchanged).

        A key not counted (its session already deleted) is let through and not recorded."""
        with self._lock:
            mine = self._held.get(key)
            if mine is None or tokens <= mine:
                return
            self._refuse(sum(self._held.values()) - mine + tokens)
            self._held[key] = tokens

    def _refuse(self, total: int) -> None:
        if self.limit is not None and total > self.limit:
            raise LimitExceededError(
                f"the sessions would hold {total} tokens together; this server allows {self.limit} "
                "(delete a session first: evicted and slid chunks stay held, recallable)"
            )

    def settle(self, key: Hashable, tokens: int) -> None:
        """Record what ``key``'s window holds after a job (nothing if ``key`` is no longer counted)."""
        with self._lock:
            if key in self._held:
                self._held[key] = tokens
