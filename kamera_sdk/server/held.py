"""The tokens every session holds, counted against the server's ``max_held_tokens``.

What a session holds (``ops.held_tokens``): its window's tokens (their KV as placed) and the content its
window and its branches have seen (``ContextWindow.content_tokens``: the chunks' position-free canonicals,
evicted and slid chunks included: they stay recallable until forgotten). An eviction gives back only
the placed part, a ``forget`` the content too (once no other branch holds it); deleting a
session gives back its count, except the content its family (the windows forked from one another) still
holds: that stays counted until the family's last session goes.
``max_sessions`` times ``max_session_tokens`` bounds none of this usefully (256 windows of 32768 tokens),
so the server can bound the sum instead, refusing the content that would pass it with a 429 before
anything changes (a ``user``'s chat window may instead forget the messages and pictures the request no longer lists,
if that makes it fit: ``chat.sync_window``).

A session's count is raised before its window takes new content (``claim``, run in the session's lane,
so nothing else changes that window meanwhile) and set to what the window holds after each of its jobs
(``settle``). A count is never below what its window holds, so no interleaving lets the sum pass the
limit. Only the sessions the registry holds are counted (``open`` / ``close``), and a chat request's own
window while its answer runs; a job settles only the session it was started for (``ticket``), not a
later one under the same key.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable

from kamera_engine.errors import positive_int

from .errors import LimitExceededError


class HeldTokens:
    """Per-session token counts and their bound; thread-safe. ``limit=None``: counted, never refused."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = positive_int("max_held_tokens", limit, optional=True)
        self._lock = threading.Lock()
        self._held: dict[Hashable, int] = {}
        self._ticket: dict[Hashable, int] = {}  # which opening of a key a job belongs to
        self._tickets = itertools.count(1)
        self._family: dict[Hashable, object] = {}  # key -> its family (sessions forked from one another)
        self._members: dict[object, set[Hashable]] = {}
        self._left: dict[object, int] = {}  # a family's content counted for its sessions that are gone

    @property
    def total(self) -> int:
        """Tokens the counted sessions hold (or have claimed) together."""
        with self._lock:
            return self._sum()

    def open(self, key: Hashable, *, family_of: Hashable | None = None) -> int:
        """Start counting ``key`` at 0 tokens (a key already counted keeps its count and ticket); returns the
        ticket its jobs settle with. ``family_of``: the session ``key`` was forked from."""
        with self._lock:
            if key not in self._held:
                self._held[key] = 0
                self._ticket[key] = next(self._tickets)
                family = self._family.get(family_of) or object()  # a family of its own unless forked
                self._family[key] = family
                self._members.setdefault(family, set()).add(key)
            return self._ticket[key]

    def ticket(self, key: Hashable) -> int | None:
        """The ticket of ``key``'s current opening (None if it is not counted)."""
        with self._lock:
            return self._ticket.get(key)

    def close(self, key: Hashable, *, shared: bool = True) -> None:
        """Stop counting ``key``: its window is gone, but what its family still holds stays counted.
        ``shared=False``: it never had a window (a fork that failed), so its family keeps nothing of it."""
        with self._lock:
            count = self._held.pop(key, None)
            if count is None:
                return
            del self._ticket[key]
            family = self._family.pop(key)
            members = self._members[family]
            members.discard(key)
            if members and shared:  # the others share its content: its count stands for it while they live
                self._left[family] = max(self._left.get(family, 0), count)
            elif not members:
                del self._members[family]
                self._left.pop(family, None)

    def of(self, key: Hashable) -> int:
        """The count of ``key`` (0 if it is not counted)."""
        with self._lock:
            return self._held.get(key, 0)

    def check(self, more: int) -> None:
        """Raise ``LimitExceededError`` if ``more`` tokens on top of the counts would pass the limit (records
        nothing: an early refusal, before work whose own ``claim`` decides)."""
        with self._lock:
            self._refuse(self._sum() + more)

    def claim(self, key: Hashable, tokens: int) -> None:
        """Let ``key``'s session hold ``tokens`` or raise ``LimitExceededError`` (counts unchanged).

        A key not counted (its session already deleted) is let through and not recorded."""
        with self._lock:
            mine = self._held.get(key)
            if mine is None or tokens <= mine:
                return
            self._refuse(self._sum() - mine + tokens)
            self._held[key] = tokens

    def settle(self, key: Hashable, tokens: int, ticket: int | None) -> None:
        """Record what ``key``'s session holds after a job started under ``ticket`` (nothing if that opening
        of ``key`` is no longer counted)."""
        with self._lock:
            if ticket is not None and self._ticket.get(key) == ticket:
                self._held[key] = tokens

    def _sum(self) -> int:
        return sum(self._held.values()) + sum(self._left.values())

    def _refuse(self, total: int) -> None:
        if self.limit is not None and total > self.limit:
            raise LimitExceededError(
                f"the sessions would hold {total} tokens together; this server allows {self.limit} "
                "(evicted and slid chunks stay held, recallable: forget them or delete a session first)"
            )
