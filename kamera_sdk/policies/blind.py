"""``blind``: concatenate canonicals relocated by exact rotation, no repair (full reuse, Prompt-Cache-like)."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class BlindPolicy(ReusePolicy):
    name = "blind"
    keeps_slot_kv = False

    def plan(self, view: WindowView) -> Plan:
        slots = [
            SlotPlan(chunk, start, ante, Source.LEAD if i == 0 else Source.BLIND, reason="canonical, relocated")
            for i, (_, chunk, start, ante) in enumerate(view.layout())
        ]
        return Plan(self.name, slots, view.anchor_len)
