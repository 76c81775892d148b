"""The reuse-policy contract: given the window, return a plan.

A policy is one dataclass in its own file with one method to override (``plan``), registered by name
in ``POLICIES``. It declares what it needs as class attributes so the window never special-cases it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kamera_engine import Engine, InvalidInputError

from ..chunks import Antecedent, Chunk, ChunkTable
from ..config import WindowConfig
from ..graph import DependencyGraph
from ..plan import Plan
from ..slots import Slot


@dataclass(slots=True)
class WindowView:
    """What a policy may look at when planning (read-only by convention)."""

    engine: Engine
    config: WindowConfig
    table: ChunkTable
    slots: list[Slot]
    graph: DependencyGraph
    step: int

    @property
    def anchor_len(self) -> int:
        return len(self.engine.anchor_ids)

    def layout(self) -> list[tuple[Slot, Chunk, int, Antecedent]]:
        """(slot, chunk, start position, ordered antecedent) for every slot, in window order."""
        out = []
        pos = self.anchor_len
        ids: list = []
        for slot in self.slots:
            chunk = self.table.get(slot.chunk_id)
            out.append((slot, chunk, pos, tuple(ids)))
            pos += len(chunk)
            ids.append(slot.chunk_id)
        return out


@dataclass
class ReusePolicy:
    """Base class: how each slot's KV is obtained."""

    name: ClassVar[str] = "base"
    #: compile canonicals when chunks arrive (policies that only prefill do not need them)
    needs_canonical: ClassVar[bool] = True
    #: keep each slot's materialised KV for the next use (policies that recompute every time do not)
    keeps_slot_kv: ClassVar[bool] = True
    #: serve image and video chunks (policies that run token ids back through the layers cannot)
    serves_images: ClassVar[bool] = True
    #: under ``reorder_patch="orbit"``, a reorder forms the orbit patches this policy's plans reuse
    forms_orbit_patches: ClassVar[bool] = False
    #: a use of an unchanged window reuses the window assembled at the last use (``recompute`` does not:
    #: it re-prefills the whole window on every use, the baseline it stands for)
    reuses_assembly: ClassVar[bool] = True
    #: with background work on, the window prices this policy's plan against exact alternatives with fewer
    #: forwards (one fused re-prefill of the window among them) and runs the cheapest (``plan_cost``)
    cost_based: ClassVar[bool] = False

    def plan(self, view: WindowView) -> Plan:
        raise NotImplementedError

    def observe(self, view: WindowView, plan: Plan, placed: list) -> None:
        """Called after execution with each slot's placed KV (prefix caches remember them)."""

    def idle(self, view: WindowView) -> int:
        """Work this policy does in idle time (``ContextWindow.prepare``) on the window as it is now, so the
        next use is cheaper; returns the forwards it ran. It must not change what any later use returns,
        only what that use costs."""
        return 0

    def fork(self) -> ReusePolicy:
        """The policy instance a forked window uses (shared state unless a policy says otherwise)."""
        return self


POLICIES: dict[str, type[ReusePolicy]] = {}


def register_policy(cls: type[ReusePolicy]) -> type[ReusePolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str | ReusePolicy, **options: object) -> ReusePolicy:
    """Resolve a policy by registered name (or pass an instance through)."""
    if isinstance(name, ReusePolicy):
        return name
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInputError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(**options)  # type: ignore[arg-type]
