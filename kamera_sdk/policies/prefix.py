"""``prefix``: what vLLM automatic prefix caching and SGLang RadixAttention do, at chunk granularity.

Reuse only the longest leading run of chunks identical, in the same order from position 0, to a run
computed before (in any window sharing this cache); re-prefill the rest in context. A slide or a reorder
changes the first chunk, so everything behind it misses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kamera_engine import KV

from ..chunks import ChunkId
from ..plan import Plan, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class PrefixPolicy(ReusePolicy):
    name = "prefix"
    needs_canonical = False
    keeps_slot_kv = False
    #: tokens of KV the radix cache may hold (LRU beyond); None = unbounded
    max_tokens: int | None = None
    _nodes: OrderedDict[tuple[ChunkId, ...], KV] = field(default_factory=OrderedDict, repr=False)
    _tokens: int = 0

    def plan(self, view: WindowView) -> Plan:
        slots: list[SlotPlan] = []
        run: tuple[ChunkId, ...] = ()
        hit = True
        for _, chunk, start, ante in view.layout():
            run = (*run, chunk.id)
            if hit and run in self._nodes:
                self._nodes.move_to_end(run)
                slots.append(
                    SlotPlan(
                        chunk, start, ante, Source.PREFIX, reason="identical leading run", reuse_kv=self._nodes[run]
                    )
                )
            else:
                hit = False
                slots.append(SlotPlan(chunk, start, ante, Source.FORWARD, reason="prefix miss"))
        return Plan(self.name, slots, view.anchor_len)

    def observe(self, plan: Plan, placed: list[KV]) -> None:
        run: tuple[ChunkId, ...] = ()
        for sp, kv in zip(plan.slots, placed, strict=True):
            run = (*run, sp.chunk.id)
            if run not in self._nodes:
                self._nodes[run] = kv
                self._tokens += len(kv)
        while self.max_tokens is not None and self._tokens > self.max_tokens and self._nodes:
            _, old = self._nodes.popitem(last=False)
            self._tokens -= len(old)
