"""``cacheblend``: relocated canonicals, then recompute the r% of tokens whose key deviates most.

CacheBlend (Yao et al.; LMCache ``LMCBlender``), as read in the project's baseline notes: every reused
token runs the layers up to a check layer (default 1) in context; the ``ratio`` (default 15%) with the
largest deviation between fresh and cached keys there is kept and recomputed through the remaining
layers; their K/V overwrite the cached ones from the check layer on. The leading chunk is exact already.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, RecomputeSpec, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class CacheBlendPolicy(ReusePolicy):
    name = "cacheblend"
    keeps_slot_kv = False
    ratio: float = 0.15
    check_layer: int = 1

    def plan(self, view: WindowView) -> Plan:
        slots = []
        for i, (_, chunk, start, ante) in enumerate(view.layout()):
            if i == 0:
                slots.append(SlotPlan(chunk, start, ante, Source.LEAD, reason="leading chunk: exact"))
            else:
                every = list(range(len(chunk)))
                slots.append(
                    SlotPlan(
                        chunk, start, ante, Source.SELECTIVE, recompute_tokens=every, reason="cacheblend candidates"
                    )
                )
        return Plan(self.name, slots, view.anchor_len, RecomputeSpec(self.ratio, self.check_layer))
