"""``prefix_idle``: the prefix cache, plus what it can do while the agent acts.

A serving engine with a prefix cache can use idle time too: once it knows the leading run of the next
window (after a slide, the survivors now lead), it prefills that run from position 0 and caches it, so
the next use hits it and prefills only what arrives with the step. This is the fair baseline for
Kamera's background work (``kamera bench window --act-seconds``): the same idle time, spent the way a
prefix cache can spend it. Answers are those of ``prefix`` (the KV of an identical run from position 0
is what prefix itself would compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from kamera_engine import KV

from .base import WindowView, register_policy
from .prefix import PrefixPolicy


@register_policy
@dataclass
class PrefixIdlePolicy(PrefixPolicy):
    name = "prefix_idle"

    def idle(self, view: WindowView) -> int:
        """Prefill the window's chunks behind its longest cached leading run, in one forward, and cache
        each run they complete. Returns the forwards run (0 when the whole window is cached)."""
        layout = view.layout()
        run = self._root(view)
        parts: list[KV] = [view.engine.anchor_kv]
        missing = 0
        for _, chunk, _, _ in layout:
            run = (*run, chunk.id)
            if run not in self._nodes:
                break
            parts.append(self._nodes[run])
            missing += 1
        rest = layout[missing:]
        if not rest:
            return 0
        ids = [t for _, chunk, _, _ in rest for t in chunk.token_ids]
        res = view.engine.forward(ids, parts, rest[0][2], logits="none")
        placed, at = [], 0
        for _, chunk, _, _ in rest:
            placed.append(res.kv.slice(at, at + len(chunk)).clone())
            at += len(chunk)
        self.remember(view, [c.id for _, c, _, _ in layout], [*parts[1:], *placed])
        return 1
