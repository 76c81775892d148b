"""Eviction policies for the host-RAM tier: one dataclass each, registered by name.

A policy ranks resident entries; the lowest rank is evicted first. Pinned entries are never ranked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kamera_engine.errors import InvalidInputError


@dataclass(slots=True)
class Residency:
    """What a tier knows about one resident entry: last touch (a logical clock), use count, size."""

    tick: int
    uses: int
    nbytes: int


@dataclass(frozen=True)
class EvictionPolicy:
    """Base: override ``rank``. Lower ranks are evicted first."""

    name: ClassVar[str] = ""

    def rank(self, r: Residency) -> tuple[int, ...]:
        raise NotImplementedError


#: name -> policy class; ``MemoryTier(eviction=name)`` resolves through it.
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_eviction(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy selectable by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a name")
    EVICTION_POLICIES[cls.name] = cls
    return cls


def make_eviction(name: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a registered name (or an instance, passed through)."""
    if isinstance(name, EvictionPolicy):
        return name
    try:
        return EVICTION_POLICIES[name]()
    except (KeyError, TypeError) as exc:
        raise InvalidInputError(f"eviction must be one of {sorted(EVICTION_POLICIES)}, got {name!r}") from exc


@register_eviction
@dataclass(frozen=True)
class LRU(EvictionPolicy):
    """Least recently used first."""

    name: ClassVar[str] = "lru"

    def rank(self, r: Residency) -> tuple[int, ...]:
        return (r.tick,)


@register_eviction
@dataclass(frozen=True)
class LFU(EvictionPolicy):
    """Least frequently used first; ties go to the least recently used."""

    name: ClassVar[str] = "lfu"

    def rank(self, r: Residency) -> tuple[int, ...]:
        return (r.uses, r.tick)
