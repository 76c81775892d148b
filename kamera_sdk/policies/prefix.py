"""``prefix``: what vLLM automatic prefix caching and SGLang RadixAttention do, at chunk granularity.

Reuse only the longest leading run of chunks identical, in the same order from position 0, to a run
computed before (in any window sharing this policy instance, on the same model and chat anchor); re-prefill
the rest in context. A slide or a reorder changes the first chunk, so everything behind it misses.

The cache is a tree of runs (a run's node holds its last chunk's KV) bounded by ``max_tokens``; beyond it
the least recently used *leaf* goes first, as in vLLM and SGLang, so a run is never kept while the shorter
runs it extends are gone. Pass ``policy=PrefixPolicy(max_tokens=...)`` to size it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from kamera_engine import KV, InvalidInputError

from ..plan import Plan, SlotPlan, Source
from .base import ReusePolicy, WindowView, register_policy


@register_policy
@dataclass
class PrefixPolicy(ReusePolicy):
    name = "prefix"
    needs_canonical = False
    keeps_slot_kv = False
    #: tokens of KV the cache may hold (least recently used leaves go beyond it); None = unbounded
    max_tokens: int | None = 32768
    # (engine id, anchor, chunk ids of the run) -> KV of the run's last chunk, least recent first
    _nodes: OrderedDict[tuple, KV] = field(default_factory=OrderedDict, repr=False)
    _engines: dict[int, weakref.ref] = field(default_factory=dict, repr=False)  # ids with live nodes
    _children: dict[tuple, int] = field(default_factory=dict, repr=False)
    _tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")

    def _root(self, view: WindowView) -> tuple:
        """Runs of one engine (model and dtype) after one chat anchor: KV never crosses them."""
        eid = id(view.engine)
        if eid not in self._engines:  # when the engine goes, so do its runs (a new engine may reuse the id)
            self._engines[eid] = weakref.ref(view.engine, lambda _, eid=eid: self._forget(eid))
        return (eid, tuple(view.engine.anchor_ids))

    def _forget(self, eid: int) -> None:
        self._engines.pop(eid, None)
        for run in [r for r in self._nodes if r[0] == eid]:
            self._tokens -= len(self._nodes.pop(run))
            self._children.pop(run, None)

    def plan(self, view: WindowView) -> Plan:
        slots: list[SlotPlan] = []
        run = self._root(view)
        hit = True
        for _, chunk, start, ante in view.layout():
            run = (*run, chunk.id)
            if hit and run in self._nodes:
                slots.append(
                    SlotPlan(
                        chunk, start, ante, Source.PREFIX, reason="identical leading run", reuse_kv=self._nodes[run]
                    )
                )
            else:
                hit = False
                slots.append(SlotPlan(chunk, start, ante, Source.FORWARD, reason="prefix miss"))
        return Plan(self.name, slots, view.anchor_len)

    def observe(self, view: WindowView, plan: Plan, placed: list[KV]) -> None:
        self.remember(view, [sp.chunk.id for sp in plan.slots], placed)

    def remember(self, view: WindowView, chunk_ids: list, placed: list[KV]) -> None:
        """Cache the runs of ``chunk_ids`` (in window order) with each chunk's placed KV."""
        run = self._root(view)
        for cid, kv in zip(chunk_ids, placed, strict=True):
            parent, run = run, (*run, cid)
            if run in self._nodes:
                self._nodes.move_to_end(run)  # used: the most recent (planning alone touches nothing)
            else:
                self._nodes[run] = kv
                self._tokens += len(kv)
                if len(parent) > 2:
                    self._children[parent] = self._children.get(parent, 0) + 1
        self._trim()

    def _trim(self) -> None:
        """Drop least recently used leaves until the cache fits ``max_tokens``."""
        while self.max_tokens is not None and self._tokens > self.max_tokens:
            leaf = next((r for r in self._nodes if not self._children.get(r)), None)
            if leaf is None:
                return
            self._tokens -= len(self._nodes.pop(leaf))
            self._children.pop(leaf, None)
            parent = leaf[:-1]
            if parent in self._children:
                self._children[parent] -= 1
