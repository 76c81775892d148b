"""Chunks and the content table: what the window holds, keyed by content.

A chunk is a run of tokens (a page, a tool result, a message, later an image). Its id is a hash of its
content, so adding the same content twice finds the same entry. The table keeps, per chunk, the
position-free canonical ``KV(B | ∅)`` and the conditioning patches formed for it, each keyed by the
antecedent it was formed on. The table is shared by every fork of a window (copy-on-write): entries
are immutable once written, so sharing needs no copies.
"""

from __future__ import annotations

import hashlib
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType, Protocol

from kamera_engine import KV, ChunkNotFoundError, Patch

ChunkId = NewType("ChunkId", str)

#: Chunk kinds that count as vision tokens (for modality-aware policies such as DAVID).
VISION_KINDS = frozenset({"image", "video", "screenshot"})

#: An antecedent: the ordered ids of the chunks in front of a chunk when its conditioning was formed.
Antecedent = tuple[ChunkId, ...]


def content_id(kind: str, payload: bytes) -> ChunkId:
    """Stable content hash (hex, 32 chars) of a chunk's kind and bytes."""
    return ChunkId(hashlib.blake2b(kind.encode() + b"\0" + payload, digest_size=16).hexdigest())


def tokens_id(kind: str, token_ids: Sequence[int]) -> ChunkId:
    """The content id of a pre-tokenised chunk of ``kind`` (``ContextWindow.add``): its ids as int64 bytes."""
    return content_id(kind, array("q", token_ids).tobytes())


def sequence_digest(parts: Sequence[str]) -> str:
    """Order-sensitive digest of a sequence of strings (24 hex chars; part of persisted store keys, so it
    never changes)."""
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def antecedent_signature(antecedent: Antecedent) -> str:
    """Order-sensitive digest of an antecedent (names its patch in store keys and the dependency graph)."""
    return sequence_digest(antecedent)


class PatchKind(StrEnum):
    """How a stored patch was formed. A ``str`` enum: its value is what store keys and entry metadata
    hold, so persisted keys read the same as when kinds were plain strings."""

    EXACT = "exact"  # one conditioned forward in this order
    ORBIT = "orbit"  # averaged over several orderings of the same set
    FRESH = "fresh"  # formed at recall on the chunk's fixed earlier context
    REMOVAL = "removal"  # a slide survivor re-conditioned on what remains (``survivors="patch"``)


@dataclass(slots=True)
class StoredPatch:
    """A patch for one chunk, the antecedent(s) it was formed on and how (``kind``)."""

    patch: Patch
    antecedent: Antecedent
    kind: PatchKind = PatchKind.EXACT
    orderings: int = 1
    #: every chunk the conditioned KV had taken in, through its antecedent too (None: the antecedent only)
    absorbed: frozenset[ChunkId] | None = None

    def __post_init__(self) -> None:
        self.kind = PatchKind(self.kind)  # a plain string names a kind too; an unknown one is a ValueError

    @property
    def antecedent_set(self) -> frozenset[ChunkId]:
        return frozenset(self.antecedent)

    @property
    def carried(self) -> frozenset[ChunkId]:
        """The chunks this patch puts back into its chunk's KV."""
        return self.antecedent_set if self.absorbed is None else self.absorbed


@dataclass(slots=True)
class Chunk:
    """One piece of content: its tokens and where its canonical KV comes from."""

    id: ChunkId
    kind: str
    token_ids: list[int]
    text: str | None = None
    canonical: KV | None = None
    patches: list[StoredPatch] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def label(self) -> str:
        if self.text:
            head = " ".join(self.text.split())[:32]
            return f"{self.id[:8]} {head!r}"
        return f"{self.id[:8]} ({len(self)} tokens)"


class Holder(Protocol):
    """A branch of a window, as the table sees it: does it hold a chunk (in its window, or evicted)?"""

    def holds(self, chunk_id: ChunkId) -> bool: ...


class ChunkTable:
    """Content-addressed chunk entries, shared by a window and its forks (``attach``-ed as holders: an
    entry may be dropped only when no live branch holds it)."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkId, Chunk] = {}
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()
        self._forgotten: set[ChunkId] = set()  # forgotten by a branch while another still held them

    def attach(self, holder: Holder) -> None:
        """Count ``holder`` (a branch's state) among the table's users while it lives."""
        self._holders.add(holder)

    def held(self, chunk_id: ChunkId, *, but: Holder) -> bool:
        """Whether a live branch other than ``but`` holds ``chunk_id``."""
        return any(h.holds(chunk_id) for h in list(self._holders) if h is not but)

    def forget(self, chunk_id: ChunkId) -> None:
        """A branch let ``chunk_id`` go: drop every forgotten entry no live branch holds (this one now, or
        later, at a ``forget`` after the last branch still holding it is gone)."""
        self.get(chunk_id)
        self._forgotten.add(chunk_id)
        live = list(self._holders)
        for cid in [c for c in self._forgotten if not any(h.holds(c) for h in live)]:
            self._forgotten.discard(cid)
            self._chunks.pop(cid, None)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, chunk_id: ChunkId) -> Chunk:
        try:
            return self._chunks[chunk_id]
        except KeyError:
            raise ChunkNotFoundError(f"unknown chunk {chunk_id!r}") from None

    def find(self, chunk_id: ChunkId) -> Chunk | None:
        """The entry of ``chunk_id``, or None."""
        return self._chunks.get(chunk_id)

    def put(self, chunk: Chunk) -> Chunk:
        """Insert ``chunk`` unless an entry with its id exists; return the entry in the table."""
        return self._chunks.setdefault(chunk.id, chunk)

    def add_patch(self, chunk: Chunk, stored: StoredPatch) -> None:
        """Record a patch; a newer patch for the same ordered antecedent and kind replaces the older."""
        chunk.patches = [p for p in chunk.patches if not (p.antecedent == stored.antecedent and p.kind == stored.kind)]
        chunk.patches.append(stored)

    def values(self) -> list[Chunk]:
        return list(self._chunks.values())
