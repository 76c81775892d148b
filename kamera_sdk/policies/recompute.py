"""``recompute``: re-prefill the whole window in order on every use, changed or not. The fidelity and cost
ceiling."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class RecomputePolicy(ReusePolicy):
    name = "recompute"
    needs_canonical = False
    keeps_slot_kv = False
    reuses_assembly = False

    def plan(self, view: WindowView) -> Plan:
        slots = [
            SlotPlan(chunk, start, ante, Source.FORWARD, reason="recompute") for _, chunk, start, ante in view.layout()
        ]
        return Plan(self.name, slots, view.anchor_len)
