"""Plans: before each use, say per slot how its KV will be obtained; then execute.

A policy looks at the window (chunks, their previous materialisation, stored patches) and returns a
``Plan``; the executor (``executor.py``) carries it out. Keeping the two apart makes every decision
visible in ``stats()`` before any tensor is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kamera_engine import KV

from .chunks import Antecedent, Chunk, PatchKind, StoredPatch


class Source(str, Enum):
    """Where a slot's KV comes from."""

    LEAD = "lead"  # first chunk: canonical relocated; exact (it is conditioned on the anchor only)
    KEEP = "keep"  # its conditioned KV from the last use, rotated if it moved (antecedent unchanged)
    SURVIVOR = "survivor"  # antecedent lost its oldest members (slide): rotation only, no patch
    PATCH = "patch"  # canonical + stored patch (exact / orbit / fresh / within the envelope)
    BLIND = "blind"  # canonical relocated, no repair
    FORWARD = "forward"  # prefilled in context (consecutive FORWARD slots share one forward)
    PREFIX = "prefix"  # prefix-cache hit: KV of an identical leading run
    SELECTIVE = "selective"  # canonical relocated, chosen tokens recomputed in context (CacheBlend, MPIC)


@dataclass(slots=True)
class SlotPlan:
    """How one slot is served."""

    chunk: Chunk
    start: int  # first absolute position
    antecedent: Antecedent  # ordered chunk ids in front of it now
    source: Source
    patch: StoredPatch | None = None
    form_patch: bool = False  # FORWARD slots: also form and store a patch for later reuse
    patch_kind: PatchKind = PatchKind.EXACT  # kind recorded for a patch formed here (FRESH on recall)
    reason: str = ""
    recompute_tokens: list[int] = field(default_factory=list)  # SELECTIVE: token indices to recompute
    reuse_kv: KV | None = None  # PREFIX: the cached placed KV

    @property
    def positions(self) -> range:
        return range(self.start, self.start + len(self.chunk))


@dataclass(frozen=True, slots=True)
class RecomputeSpec:
    """How SELECTIVE slots pick the tokens they recompute in context.

    ``check_layer=None``: the slots' ``recompute_tokens`` at every layer (MPIC-k). Otherwise all their
    tokens are candidates and the ``ratio`` with the largest key deviation at ``check_layer`` is kept
    (CacheBlend).
    """

    ratio: float = 1.0
    check_layer: int | None = None


@dataclass(slots=True)
class Plan:
    """The per-slot plan for one use of the window."""

    policy: str
    slots: list[SlotPlan]
    anchor_len: int
    recompute: RecomputeSpec | None = None

    @property
    def end(self) -> int:
        return self.slots[-1].start + len(self.slots[-1].chunk) if self.slots else self.anchor_len

    def count(self, source: Source) -> int:
        return sum(1 for s in self.slots if s.source is source)

    def forward_tokens(self) -> int:
        return sum(len(s.chunk) for s in self.slots if s.source is Source.FORWARD)

    def summary(self) -> str:
        return " ".join(f"{s.chunk.id[:6]}:{s.source.value}" for s in self.slots)
