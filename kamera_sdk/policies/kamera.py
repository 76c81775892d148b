"""``kamera``: relocated canonical + rank-m conditioning patch (core paper §3, §5, appendices B, D, E).

Per slot, cheapest correct source first:

1. leading chunk -> its canonical, relocated: exact (it is conditioned on the anchor alone);
2. antecedent unchanged since the last use -> keep its conditioned KV (rotation only if it moved);
3. antecedent lost only its oldest members (a slide) -> survivor: rotation only, no patch (§5); with
   ``survivors="patch"`` or with background work on, a removal patch formed on exactly what remains
   (re-conditioned once, in idle time when there is some);
4. a stored patch, or the slot's own conditioned KV, formed on an antecedent within the safety
   envelope (same set reordered, one dropped / duplicated member) -> apply it (orbit patches first);
   a recalled chunk only takes a patch formed on the same set (a patch frozen at eviction is stale);
5. otherwise -> one conditioned forward over the run of such slots, which also forms the patches that
   later reuse needs (a recall gets its *fresh* patch this way).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chunks import Antecedent, Chunk, PatchKind, StoredPatch
from ..envelope import judge
from ..plan import Plan, SlotPlan, Source
from ..slots import Slot
from .base import ReusePolicy, WindowView, register_policy

_KIND_RANK = {PatchKind.ORBIT: 0, PatchKind.FRESH: 1, PatchKind.EXACT: 2, PatchKind.REMOVAL: 2}


def dropped_run(formed_on: Antecedent, current: Antecedent) -> bool:
    """``current`` is ``formed_on`` with one contiguous run removed: the oldest chunks (a slide), or a run
    behind an unchanged head (a conversation trimmed behind its kept system message)."""
    k = len(formed_on) - len(current)
    if k <= 0:
        return False
    head = 0
    while head < len(current) and formed_on[head] == current[head]:
        head += 1
    return formed_on[head + k :] == current[head:]


def _usable(p: StoredPatch, view: WindowView) -> bool:
    """A stored patch is reused only as the config would form it: at its kind's rank (a patch cannot exceed
    its chunk's tokens or features), on the same layers, in the same dtype. One loaded from a store written
    under other settings is formed again."""
    cfg = view.config
    ceiling = min(p.patch.num_tokens, p.patch.k_vt.shape[-1])
    if p.patch.rank < min(cfg.patch_rank(p.kind), ceiling):
        return False
    dtype = cfg.torch_patch_dtype() or view.engine.dtype
    return tuple(p.patch.layers) == cfg.patch_layer_indices(view.engine) and p.patch.k_u.dtype == dtype


@register_policy
@dataclass
class KameraPolicy(ReusePolicy):
    name = "kamera"
    forms_orbit_patches = True
    cost_based = True

    def plan(self, view: WindowView) -> Plan:
        cfg = view.config
        layout = view.layout()
        order = [slot.chunk_id for slot, *_ in layout]
        slots: list[SlotPlan] = []
        for i, (slot, chunk, start, ante) in enumerate(layout):
            behind = frozenset(order[i + 1 :])
            slots.append(self._decide(view, i, slot, chunk, start, ante, behind, cfg.reorder_patch))
        return Plan(self.name, slots, view.anchor_len)

    def _decide(
        self,
        view: WindowView,
        i: int,
        slot: Slot,
        chunk: Chunk,
        start: int,
        ante: Antecedent,
        behind: frozenset,
        reorder: str,
    ) -> SlotPlan:
        """``behind``: the chunks placed after this one. Conditioning that took in one of them (a member
        a reorder or a recall moved behind) is never reused: re-prefill cannot see it from here."""
        if i == 0:
            return SlotPlan(chunk, start, ante, Source.LEAD, reason="leading chunk: canonical is exact")
        stale = view.graph.is_stale(chunk.id)
        own = slot.materialised() and not stale and not (slot.absorbed & behind)
        if own:
            formed = slot.antecedent or ()
            if formed == ante:
                return SlotPlan(chunk, start, ante, Source.KEEP, reason="antecedent unchanged")
            if dropped_run(formed, ante):
                if view.config.survivors == "rotate" and view.config.background == "off":
                    return SlotPlan(
                        chunk, start, ante, Source.SURVIVOR, reason=f"survivor: {len(formed) - len(ante)} slid out"
                    )
                return self._survivor_patch(view, chunk, start, ante)
        unmaterialised = not slot.materialised()
        patch = self._best_patch(view, chunk, ante, unmaterialised, behind)
        env = view.config.envelope
        if patch is not None and (patch.antecedent == ante or (reorder == "orbit" and patch.kind is PatchKind.ORBIT)):
            return self._patch_plan(view, chunk, start, ante, patch)
        if own and reorder == "transfer":
            verdict = judge(slot.antecedent or (), ante, env)
            if verdict.reuse:
                return SlotPlan(
                    chunk, start, ante, Source.KEEP, reason=f"own conditioning, {verdict.relation} (envelope)"
                )
        if patch is not None and reorder != "exact":
            return self._patch_plan(view, chunk, start, ante, patch)
        if slot.recalled:
            why = "recall: fresh patch on its earlier context"
        elif unmaterialised:
            why = "new chunk"
        elif stale:
            why = "cascade: a chunk it absorbed was recalled"
        elif slot.absorbed & behind:
            why = "a chunk it absorbed now sits behind it"
        else:
            why = "antecedent outside the envelope"
        kind = PatchKind.FRESH if slot.recalled else PatchKind.EXACT
        return SlotPlan(chunk, start, ante, Source.FORWARD, form_patch=True, patch_kind=kind, reason=why)

    def _survivor_patch(self, view: WindowView, chunk: Chunk, start: int, ante: Antecedent) -> SlotPlan:
        """survivors='patch': a patch formed on exactly what remains, else re-condition and store one."""
        for p in chunk.patches:
            if p.antecedent == ante and p.kind is not PatchKind.ORBIT and _usable(p, view):
                return self._patch_plan(view, chunk, start, ante, p)
        return SlotPlan(
            chunk,
            start,
            ante,
            Source.FORWARD,
            form_patch=True,
            patch_kind=PatchKind.REMOVAL,
            reason="survivor: re-conditioned on what remains (removal patch)",
        )

    @staticmethod
    def _patch_plan(view: WindowView, chunk: Chunk, start: int, ante: Antecedent, patch: StoredPatch) -> SlotPlan:
        verdict = judge(patch.antecedent, ante, view.config.envelope)
        return SlotPlan(chunk, start, ante, Source.PATCH, patch=patch, reason=f"{patch.kind} patch, {verdict.relation}")

    @staticmethod
    def _best_patch(
        view: WindowView, chunk: Chunk, ante: Antecedent, recalled: bool, behind: frozenset
    ) -> StoredPatch | None:
        """The stored patch to reuse for ``ante``, or None to rebuild (decisions are logged by the window).
        ``recalled``: the chunk has no conditioning in the window (new or recalled): only a patch formed
        on this same set is fresh. A patch that took in a chunk now ``behind`` this one is never used."""
        best: tuple[tuple[int, int], StoredPatch] | None = None
        for p in chunk.patches:
            if not _usable(p, view) or behind & p.carried:
                continue
            verdict = judge(p.antecedent, ante, view.config.envelope)
            if not verdict.reuse:
                continue
            if recalled and verdict.relation not in ("identical", "reordered"):
                continue  # recall: only a patch formed on this same set is fresh
            order = (0 if verdict.relation == "identical" else 1, _KIND_RANK.get(p.kind, 3))
            if best is None or order < best[0]:
                best = (order, p)
        return None if best is None else best[1]
