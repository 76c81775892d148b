"""Execute a plan: turn each slot's source into placed KV and assemble the window.

Consecutive FORWARD slots share one forward pass over their tokens on top of everything assembled in
front of them; that forward is also where patches for later reuse are formed. When the plan ends with
such a run and the caller passes the prompt, the prompt rides in the same forward (one pass instead of
two: causal attention makes the chunks' KV the same either way, to float rounding: a matmul over more
rows may sum in another order, so the KV differs from a window-only prefill by ~1e-6). Every other source
is a rotation plus at most one rank-m GEMM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kamera_engine import KV, Engine
from kamera_engine.runner import ForwardResult
from kamera_engine.selective import recompute_tokens

from .chunks import Antecedent, Chunk, ChunkId, ChunkTable, StoredPatch
from .config import WindowConfig
from .graph import DependencyGraph
from .persistence import Persistence
from .plan import Plan, SlotPlan, Source
from .slots import PendingPatch, Slot
from .stats import Decision, WindowStats


@dataclass
class Execution:
    """The assembled window and what each slot now holds."""

    parts: list[KV]  # anchor + every slot, placed, in order
    placed: list[KV]  # per slot, placed
    slots: list[Slot]  # new slot states (conditioned KV kept position-free when the policy keeps it)
    prompt: ForwardResult | None = None  # the prompt's forward, when it rode in the plan's trailing forward

    @cached_property
    def assembled(self) -> KV:
        """The window as one KV (one copy, made on first use: a prompt that rode in the plan's forward
        never needs it)."""
        return KV.cat(self.parts)


#: sources served from the chunk's canonical (the loads worth starting before the forwards)
_FROM_CANONICAL = frozenset({Source.LEAD, Source.PATCH, Source.BLIND, Source.SELECTIVE})


class Executor:
    """Carries out plans for one window (shares the engine, the table and the stats)."""

    def __init__(
        self,
        engine: Engine,
        table: ChunkTable,
        config: WindowConfig,
        stats: WindowStats,
        persistence: Persistence | None = None,
    ) -> None:
        self.engine = engine
        self.table = table
        self.config = config
        self.stats = stats
        self.persistence = persistence
        #: pending patches whose slot was served another way this time (it led, or was re-prefilled): the
        #: KV they are formed from is kept here until the window forms them, after the answer
        self.orphans: list[tuple[Chunk, KV, PendingPatch]] = []

    def canonical(self, chunk: Chunk) -> KV:
        """The chunk's canonical: from the table, else from the store, else one forward (then stored)."""
        if chunk.canonical is None:
            kv = self.persistence.load_canonical(chunk) if self.persistence is not None else None
            if kv is None:
                kv = self._compile(chunk)
                self.stats.canonicals_computed += 1
                self.stats.canonical_bytes += kv.nbytes
                if self.persistence is not None:
                    self.persistence.save_canonical(chunk, kv)
            chunk.canonical = kv
        return chunk.canonical

    def _compile(self, chunk: Chunk) -> KV:
        t0 = time.perf_counter()
        kv = self.engine.canonical(chunk.token_ids)
        self.stats.forwards += 1
        self.stats.ingest_tokens += len(chunk)
        self.stats.time("canonical", time.perf_counter() - t0)
        return kv

    def run(
        self,
        plan: Plan,
        slots: list[Slot],
        keep_slot_kv: bool,
        graph: DependencyGraph,
        step: int,
        prompt: list[int] | None = None,
    ) -> Execution:
        """Assemble the window. ``prompt``: token ids to prefill in the trailing forward run, if the plan
        ends with one (``Execution.prompt`` then holds that forward; otherwise it is None)."""
        e = self.engine
        fuse = prompt is not None and plan.recompute is None
        prompt_result: ForwardResult | None = None
        if self.persistence is not None:  # loads overlap with the forwards below
            self.persistence.prefetch([sp.chunk for sp in plan.slots if sp.source in _FROM_CANONICAL])
        parts: list[KV] = [e.anchor_kv]
        placed: list[KV] = []
        new_slots: list[Slot] = []
        carried: dict[ChunkId, frozenset] = {}  # what each slot served so far carries (``Slot.absorbed``)

        def add(sp: SlotPlan, slot: Slot, kv: KV, *, formed: bool, free: KV | None = None) -> None:
            new = self._after(sp, slot, kv, keep_slot_kv, graph, step, formed=formed, prior=carried, free=free)
            parts.append(kv)
            placed.append(kv)
            new_slots.append(new)
            carried[new.chunk_id] = new.absorbed

        i = 0
        while i < len(plan.slots):
            sp = plan.slots[i]
            if sp.source is Source.FORWARD:
                j = i
                while j < len(plan.slots) and plan.slots[j].source is Source.FORWARD:
                    j += 1
                run = plan.slots[i:j]
                tail = prompt if fuse and j == len(plan.slots) else None
                kvs, prompt_result = self._forward_run(run, parts, tail)
                for k, kv in enumerate(kvs):
                    add(run[k], slots[i + k], kv, formed=True)
                i = j
                continue
            kv, free = self._serve(sp, slots[i])
            add(sp, slots[i], kv, formed=False, free=free)
            i += 1
        if plan.recompute is not None and any(sp.source is Source.SELECTIVE for sp in plan.slots):
            assembled, placed = self._selective(plan, KV.cat(parts))
            parts = [assembled]
        self.stats.window_kv_bytes = sum(p.nbytes for p in parts)
        self.stats.window_tokens = sum(len(p) for p in parts)
        return Execution(parts, placed, new_slots, prompt_result)

    def _serve(self, sp: SlotPlan, slot: Slot) -> tuple[KV, KV | None]:
        """Placed KV (and the position-free conditioned KV, when there is one) for a non-forward slot."""
        e, st = self.engine, self.stats
        if sp.source in (Source.KEEP, Source.SURVIVOR):
            assert slot.kv is not None  # the policy only keeps materialised slots
            if sp.source is Source.SURVIVOR:
                st.survivors_rotated += 1
            else:
                st.kept += 1
            return e.apply(slot.kv, None, sp.start), slot.kv
        if sp.source is Source.PREFIX:
            assert sp.reuse_kv is not None
            st.prefix_hits += 1
            return sp.reuse_kv, None
        canonical = self.canonical(sp.chunk)
        if sp.source is Source.PATCH:
            assert sp.patch is not None
            st.patches_reused += 1
            free = e.reconstruct(canonical, sp.patch.patch)
            return e.apply(free, None, sp.start), free
        if sp.source is Source.BLIND:
            st.blind_served += 1
        return e.apply(canonical, None, sp.start), canonical  # LEAD, BLIND, or SELECTIVE before its repair

    def _selective(self, plan: Plan, assembled: KV) -> tuple[KV, list[KV]]:
        """Recompute the SELECTIVE slots' chosen tokens in context (CacheBlend / MPIC)."""
        assert plan.recompute is not None
        ids = list(self.engine.anchor_ids) + [t for sp in plan.slots for t in sp.chunk.token_ids]
        cand = [sp.start + i for sp in plan.slots if sp.source is Source.SELECTIVE for i in sp.recompute_tokens]
        t0 = time.perf_counter()
        res = recompute_tokens(
            self.engine,
            assembled,
            ids,
            torch.tensor(cand, dtype=torch.long),
            ratio=plan.recompute.ratio,
            check_layer=plan.recompute.check_layer,
        )
        self.stats.time("selective", time.perf_counter() - t0)
        if len(res.selected):
            self.stats.forwards += 1
        self.stats.selective_tokens += len(res.selected)
        self.stats.tokens_prefilled += len(res.selected)
        placed = [res.kv.slice(sp.start, sp.start + len(sp.chunk)) for sp in plan.slots]
        return res.kv, placed

    def _forward_run(
        self, run: list[SlotPlan], parts: list[KV], prompt: list[int] | None
    ) -> tuple[list[KV], ForwardResult | None]:
        """One forward over a run of slots (and the prompt behind them, if given) on top of everything
        assembled so far. Returns each slot's placed KV, and the forward itself when the prompt rode in it."""
        ids = [t for sp in run for t in sp.chunk.token_ids]
        t0 = time.perf_counter()
        res = self.engine.forward(
            ids + (prompt or []), parts, run[0].start, logits="none" if prompt is None else "last"
        )
        self.stats.time("forward", time.perf_counter() - t0)
        self.stats.forwards += 1
        self.stats.tokens_prefilled += len(ids)
        out, at = [], 0
        for sp in run:
            out.append(res.kv.slice(at, at + len(sp.chunk)).clone())
            at += len(sp.chunk)
        return out, (res if prompt is not None else None)

    def _after(
        self,
        sp: SlotPlan,
        slot: Slot,
        kv: KV,
        keep_slot_kv: bool,
        graph: DependencyGraph,
        step: int,
        *,
        formed: bool,
        prior: dict[ChunkId, frozenset],
        free: KV | None = None,
    ) -> Slot:
        """Record the slot's new state. A forward that should yield a patch leaves it *pending* on the
        slot (the slot holds the conditioned KV it is formed from); the window forms it off the answer's
        critical path, when the slot leaves the window or its conditioning is needed elsewhere."""
        if formed and keep_slot_kv:
            free = self.engine.make_free(kv)
        pending = None
        absorbed = self._absorbed(sp, slot, prior)
        if formed and sp.form_patch:
            pending = PendingPatch(sp.antecedent, sp.patch_kind, absorbed)
            if free is None:  # nothing to form it from later: form it now
                self.form_pending(sp.chunk, kv, pending)
                pending = None
        elif sp.source in (Source.KEEP, Source.SURVIVOR):
            pending = slot.pending
        if slot.pending is not None and slot.kv is not None and pending is not slot.pending:
            self.orphans.append((sp.chunk, slot.kv, slot.pending))  # never dropped: formed later
        self._record(sp, slot, graph, step)
        graph.set_conditioning(sp.chunk.id, tuple(sorted(absorbed)), sp.source.value)
        return Slot(sp.chunk.id, free if keep_slot_kv else None, sp.antecedent, sp.source.value, absorbed, pending)

    def _record(self, sp: SlotPlan, slot: Slot, graph: DependencyGraph, step: int) -> None:
        """Log the slot's decision and count what it was (before its conditioning is recorded: a stale
        slot is still marked stale here)."""
        st, drifted = self.stats, slot.antecedent not in (None, sp.antecedent)
        if sp.source is not Source.KEEP or drifted:  # a plain keep is not news
            st.log(Decision(step=step, chunk=sp.chunk.label(), source=sp.source.value, reason=sp.reason))
        if graph.is_stale(sp.chunk.id) and sp.source in (Source.FORWARD, Source.PATCH):
            st.cascade_rematerialised += 1
        if sp.source is Source.PATCH and sp.patch is not None and sp.patch.antecedent != sp.antecedent:
            st.envelope_reuse += 1  # a stored patch formed on a drifted antecedent
        elif sp.source is Source.KEEP and drifted:
            st.envelope_reuse += 1  # its own conditioning, formed on a drifted antecedent
        elif sp.source is Source.FORWARD and sp.reason == "antecedent outside the envelope":
            st.envelope_rebuild += 1

    def form_pending(self, chunk: Chunk, conditioned: KV, pending: PendingPatch) -> StoredPatch:
        """Form and store the patch of ``chunk`` from its conditioned KV (placed or position-free); a
        pending patch another branch already formed is not formed again."""
        if pending.stored is not None:
            return pending.stored
        t0 = time.perf_counter()
        stored = self.store_patch(chunk, conditioned, pending.kind, pending.antecedent, absorbed=pending.absorbed)
        pending.stored = stored
        self.stats.patches_formed += 1
        self.stats.fresh_patches_formed += pending.kind == "fresh"
        self.stats.time("patch_form", time.perf_counter() - t0)
        return stored

    def store_patch(
        self,
        chunk: Chunk,
        conditioned: KV | Sequence[KV],
        kind: str,
        antecedent: Antecedent,
        *,
        absorbed: frozenset[ChunkId] | None = None,
    ) -> StoredPatch:
        """Form ``chunk``'s patch as the config says (rank of ``kind``, layers, dtype) from its conditioned
        KV (several: their mean, an orbit), add it to the table and the store, and count its bytes."""
        cfg = self.config
        patch = self.engine.form_patch(
            conditioned,
            self.canonical(chunk),
            cfg.patch_rank(kind),
            layers=cfg.patch_layer_indices(self.engine),
            dtype=cfg.torch_patch_dtype(),
        )
        orderings = 1 if isinstance(conditioned, KV) else len(conditioned)
        stored = StoredPatch(patch, antecedent, kind=kind, orderings=orderings, absorbed=absorbed)
        self.table.add_patch(chunk, stored)
        if self.persistence is not None:
            self.persistence.save_patch(chunk, stored)
        self.stats.patch_bytes += patch.nbytes
        return stored

    @staticmethod
    def _absorbed(sp: SlotPlan, slot: Slot, prior: dict[ChunkId, frozenset]) -> frozenset:
        """Chunks whose content the slot's KV now carries (what a recall of them would invalidate). A
        forward takes in its antecedent and, through it, whatever those slots carry (``prior``: the slots
        in front, as served this time), so a chunk stays recorded after the one that passed it on left."""
        if sp.source in (Source.KEEP, Source.SURVIVOR):
            return slot.absorbed | frozenset(sp.antecedent)
        if sp.source is Source.PATCH and sp.patch is not None:
            return sp.patch.carried
        if sp.source in (Source.LEAD, Source.BLIND):
            return frozenset()
        return frozenset(sp.antecedent).union(*(prior.get(a, frozenset()) for a in sp.antecedent))
