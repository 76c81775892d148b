"""``mpic``: MPIC-k, recompute the first k tokens of every reused span in context, reuse the rest.

MPIC (Hu et al.), as read in the project's baseline notes: stored KV is reused for every chunk except
its first ``k`` tokens (default 32), which are recomputed in context, at every layer, in one pass (they
played the attention-sink role when the chunk was stored alone). With ``k`` >= the chunk length this is
a full recompute; with ``k = 0`` it is blind reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, RecomputeSpec, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class MPICPolicy(ReusePolicy):
    name = "mpic"
    keeps_slot_kv = False
    k: int = 32

    def plan(self, view: WindowView) -> Plan:
        slots = []
        for i, (_, chunk, start, ante) in enumerate(view.layout()):
            if i == 0:
                slots.append(SlotPlan(chunk, start, ante, Source.LEAD, reason="leading chunk: exact"))
            else:
                first = list(range(min(self.k, len(chunk))))
                slots.append(
                    SlotPlan(chunk, start, ante, Source.SELECTIVE, recompute_tokens=first, reason=f"first {self.k}")
                )
        return Plan(self.name, slots, view.anchor_len, RecomputeSpec(1.0, None))
