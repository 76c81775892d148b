"""Selective recompute: relocated canonicals, with some tokens of every non-leading chunk recomputed in
context. The shape ``cacheblend`` and ``mpic`` share; each says which tokens are candidates and how the
executor picks among them (``RecomputeSpec``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..chunks import Chunk
from ..plan import Plan, RecomputeSpec, SlotPlan, Source
from .base import ReusePolicy, WindowView


@dataclass
class SelectivePolicy(ReusePolicy):
    keeps_slot_kv: ClassVar[bool] = False
    serves_images: ClassVar[bool] = False  # the chosen tokens are recomputed from token ids, not from image features

    def candidates(self, chunk: Chunk) -> tuple[list[int], str]:
        """The chunk's tokens the executor may recompute, and the reason logged for the slot."""
        raise NotImplementedError

    def recompute_spec(self) -> RecomputeSpec:
        raise NotImplementedError

    def plan(self, view: WindowView) -> Plan:
        slots = []
        for i, (_, chunk, start, ante) in enumerate(view.layout()):
            if i == 0:
                slots.append(SlotPlan(chunk, start, ante, Source.LEAD, reason="leading chunk: exact"))
                continue
            tokens, why = self.candidates(chunk)
            slots.append(SlotPlan(chunk, start, ante, Source.SELECTIVE, recompute_tokens=tokens, reason=why))
        return Plan(self.name, slots, view.anchor_len, self.recompute_spec())
