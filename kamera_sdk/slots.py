"""Window slots: what one position of the window holds after its last use."""

from __future__ import annotations

from dataclasses import dataclass

from kamera_engine import KV, Patch

from .chunks import Antecedent, ChunkId, PatchKind, StoredPatch


@dataclass(slots=True, eq=False)
class PendingPatch:
    """A patch still to be formed from the slot's conditioned KV, and the antecedent it belongs to.

    Forks share their slots, so one pending patch can sit in several branches: ``stored`` is set when
    any of them forms it, and the others take that patch instead of forming it again.
    """

    antecedent: Antecedent
    kind: PatchKind = PatchKind.EXACT
    absorbed: frozenset[ChunkId] | None = None  # what the conditioned KV carries (``StoredPatch.absorbed``)
    stored: StoredPatch | None = None

    def __post_init__(self) -> None:
        self.kind = PatchKind(self.kind)


@dataclass(frozen=True, slots=True)
class Slot:
    """A chunk in the window and its materialised KV.

    ``kv`` is the chunk's conditioned KV in the position-free frame (keys at angle 0), so every later
    placement is one rotation from angle 0, never a chain. ``antecedent`` is what that KV is conditioned
    on now; ``absorbed`` is every chunk whose content that KV has taken in (a survivor keeps the
    conditioning of chunks that slid out). ``patch``: when ``kv`` is the chunk's canonical plus this patch
    (served from a stored patch), the slot is placed from the canonical and the patch again, so every
    placement of it rounds as the patched one did. Slots are immutable: an operation builds new slots, so
    forks can share the old ones.
    """

    chunk_id: ChunkId
    kv: KV | None = None
    antecedent: Antecedent | None = None
    source: str = ""
    absorbed: frozenset[ChunkId] = frozenset()
    pending: PendingPatch | None = None
    recalled: bool = False  # re-admitted after an eviction and not materialised since
    patch: Patch | None = None

    def materialised(self) -> bool:
        return self.kv is not None and self.antecedent is not None
