"""Window slots: what one position of the window holds after its last use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


class FreeLater:
    """A slot's position-free KV, un-rotated from its placed KV on first use.

    Un-rotating (``Engine.make_free``: one exact float64 rotation per key, and a copy of whatever it leaves
    pointing into the forward's output: the values, or the keys of a model that rotates its values) is not
    needed for the answer of the use that formed the KV, only for the window's next placement of it. So the
    window holds the placed KV and does this in idle time (``ContextWindow.prepare``) or, at the latest, in
    whichever call reads ``Slot.kv`` first: the same arithmetic either way, so the bits do not depend on
    when it ran. Forks share the holder, and the first reader computes it once (under a lock, for
    background threads).
    """

    __slots__ = ("_free", "_lock", "_make_free", "_placed")

    def __init__(self, placed: KV, make_free: Callable[[KV], KV]) -> None:
        if placed.positions is None:
            raise ValueError("FreeLater takes a placed KV (positions set)")
        self._placed: KV | None = placed
        self._make_free = make_free
        self._free: KV | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Whether the position-free KV has been computed."""
        return self._free is not None

    def get(self) -> KV:
        """The position-free KV (computed on the first call, the same object on every later one)."""
        free = self._free
        if free is not None:
            return free
        with self._lock:
            if self._free is None:
                placed = self._placed
                assert placed is not None
                free = self._make_free(placed)
                held = {t.untyped_storage().data_ptr() for t in (placed.keys, placed.values)}

                def own(t: torch.Tensor) -> torch.Tensor:  # a copy of what still points into the forward's output
                    return t.clone() if t.untyped_storage().data_ptr() in held else t

                deltas = None if free.deltas is None else free.deltas.clone()
                self._free = KV(own(free.keys), own(free.values), None, deltas)
                self._placed = None  # the forward's output is no longer held
            return self._free


def resolve(held: KV | FreeLater | None) -> KV | None:
    """The position-free KV ``held`` stands for (computing a ``FreeLater``'s on first use)."""
    return held.get() if isinstance(held, FreeLater) else held


@dataclass(frozen=True, slots=True)
class Slot:
    """A chunk in the window and its materialised KV.

    ``kv`` is the chunk's conditioned KV in the position-free frame (keys at angle 0), so every later
    placement is one rotation from angle 0, never a chain; ``held`` is that KV, or a ``FreeLater`` that
    computes it on first use (``kv`` reads through it; ``has_kv`` asks without computing). ``antecedent``
    is what that KV is conditioned on now; ``absorbed`` is every chunk whose content that KV has taken in
    (a survivor keeps the conditioning of chunks that slid out). ``patch``: when ``kv`` is the chunk's
    canonical plus this patch (served from a stored patch), the slot is placed from the canonical and the
    patch again, so every placement of it rounds as the patched one did. Slots are immutable: an operation
    builds new slots, so forks can share the old ones.
    """

    chunk_id: ChunkId
    held: KV | FreeLater | None = None
    antecedent: Antecedent | None = None
    source: str = ""
    absorbed: frozenset[ChunkId] = frozenset()
    pending: PendingPatch | None = None
    recalled: bool = False  # re-admitted after an eviction and not materialised since
    patch: Patch | None = None

    @property
    def kv(self) -> KV | None:
        return resolve(self.held)

    @property
    def has_kv(self) -> bool:
        return self.held is not None

    @property
    def free_later(self) -> FreeLater | None:
        """The holder still to compute this slot's position-free KV, if there is one."""
        held = self.held
        return held if isinstance(held, FreeLater) and not held.ready else None

    def materialised(self) -> bool:
        return self.held is not None and self.antecedent is not None
