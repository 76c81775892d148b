"""The state of one window branch, as data: what a fork copies.

A window is shared parts (the engine, its config, the content table of canonicals and patches, the
store) and one branch's state: its slot list, what it evicted, the image names it gave, its dependency
graph and its step count. ``fork`` copies the state and shares the rest; nothing else is per branch but
the stats and the work in flight, which a branch starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .chunks import ChunkId
from .graph import DependencyGraph
from .slots import Slot
from .vision import WindowMedia


@dataclass(eq=False)  # one branch's state is itself: the content table keeps it by weak reference
class WindowState:
    """One branch's slots (in window order), evicted chunks (oldest first), images, graph and step."""

    slots: list[Slot] = field(default_factory=list)
    evicted: list[ChunkId] = field(default_factory=list)
    media: WindowMedia = field(default_factory=WindowMedia)
    graph: DependencyGraph = field(default_factory=DependencyGraph)
    step: int = 0

    def holds(self, chunk_id: ChunkId) -> bool:
        """Whether this branch has ``chunk_id`` in its window or evicted (recallable)."""
        return chunk_id in self.evicted or any(s.chunk_id == chunk_id for s in self.slots)

    def fork(self) -> WindowState:
        """A copy a branch can edit alone: slots are immutable (their tensors are shared, not copied)."""
        return WindowState(list(self.slots), list(self.evicted), self.media.fork(), self.graph.copy(), self.step)
