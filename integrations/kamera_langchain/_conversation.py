"""A conversation kept as a ``ContextWindow``: each call's message list is diffed against the window.

Messages are chunks keyed by their rendered text (plus an occurrence number, so the same text twice is
two chunks). On every call the window is brought to the new list with window operations, never by
rebuilding it: chunks no longer listed are slid out (a leading run) or evicted; chunks listed again
after an eviction are recalled; new ones are appended; a different order is a ``reorder``. What the
window then reuses or recomputes is the reuse policy's decision (see ``kamera_sdk.policies``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kamera_sdk import ChunkId, ContextWindow, InvalidInputError, WindowStats

#: WindowStats counters reported per call (as differences).
STAT_FIELDS = (
    "tokens_prefilled",
    "ingest_tokens",
    "prompt_tokens",
    "forwards",
    "canonicals_computed",
    "patches_formed",
    "patches_reused",
    "survivors_rotated",
    "kept",
)


@dataclass(slots=True)
class SyncReport:
    """Window operations one call's message list turned into."""

    added: int = 0
    recalled: int = 0
    reused: int = 0
    slid: int = 0
    evicted: int = 0
    reordered: bool = False

    def as_dict(self) -> dict[str, int | bool]:
        return {
            "added": self.added,
            "recalled": self.recalled,
            "reused": self.reused,
            "slid": self.slid,
            "evicted": self.evicted,
            "reordered": self.reordered,
        }


@dataclass(slots=True)
class Conversation:
    """One conversation (session) and its window. ``lock`` serialises calls on it."""

    window: ContextWindow
    ids: dict[tuple[str, int], ChunkId] = field(default_factory=dict)  # (text, occurrence) -> chunk id
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sync(self, texts: Sequence[str]) -> SyncReport:
        """Make the window hold exactly ``texts`` (rendered messages), in order, by window operations."""
        if not texts:
            raise InvalidInputError("a chat call needs at least one message")
        keys = _keys(texts)
        win, report = self.window, SyncReport()
        wanted = {self.ids[k] for k in keys if k in self.ids}
        current = win.chunks
        lead = 0
        while lead < len(current) and current[lead] not in wanted:
            lead += 1
        if lead:
            report.slid = len(win.slide(lead))
        for cid in current[lead:]:
            if cid not in wanted:
                win.evict(cid)
                report.evicted += 1
        present = set(win.chunks)
        evicted = set(win.evicted)
        order: list[ChunkId] = []
        for key in keys:
            cid = self.ids.get(key)
            if cid is not None and cid in present:
                report.reused += 1
            else:
                was_evicted = cid is not None and cid in evicted
                cid = self._add(key)
                self.ids[key] = cid
                report.recalled += was_evicted
                report.added += not was_evicted
            order.append(cid)
        in_window = set(win.chunks)  # a token budget may have slid some out again
        order = [c for c in order if c in in_window]
        if order != win.chunks:
            win.reorder(order)
            report.reordered = True
        return report

    def _add(self, key: tuple[str, int]) -> ChunkId:
        text, occurrence = key
        return self.window.add_text(text, copy=occurrence)  # a repeated message is a chunk of its own


def _keys(texts: Sequence[str]) -> list[tuple[str, int]]:
    seen: Counter[str] = Counter()
    keys = []
    for t in texts:
        keys.append((t, seen[t]))
        seen[t] += 1
    return keys


def stats_delta(before: WindowStats, after: WindowStats) -> dict[str, int]:
    """Per-call differences of the counters in ``STAT_FIELDS``."""
    return {f: int(getattr(after, f)) - int(getattr(before, f)) for f in STAT_FIELDS}
