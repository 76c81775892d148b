"""Execute a plan: turn each slot's source into placed KV and assemble the window.

Consecutive FORWARD slots share one forward pass over their tokens on top of everything assembled in
front of them; that forward is also where patches for later reuse are formed. When the plan ends with
such a run and the caller passes the prompt, the prompt rides in the same forward (one pass instead of
two: causal attention makes the chunks' KV the same either way, to float rounding: a matmul over more
rows may sum in another order, so the KV differs from a window-only prefill by ~1e-6). Every other source
is a rotation plus at most one rank-m GEMM.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from kamera_engine import KV, Engine, Patch
from kamera_engine.decode import SamplingParams
from kamera_engine.runner import ForwardResult
from kamera_engine.selective import recompute_tokens
from kamera_engine.window_buffer import Key, WindowBuffer

from .chunks import Antecedent, Chunk, ChunkId, ChunkTable, PatchKind, StoredPatch
from .config import WindowConfig
from .graph import DependencyGraph
from .metering import EngineMeter
from .persistence import Persistence
from .plan import Plan, SlotPlan, Source
from .slots import FreeLater, PendingPatch, Slot, resolve
from .stats import Decision, Work

log = logging.getLogger("kamera.window")


@dataclass
class Execution:
    """The assembled window and what each slot now holds."""

    parts: list[KV]  # anchor + every slot, placed, in order (one view of the window's buffer)
    placed: list[KV]  # per slot, placed (views of the buffer's rows)
    slots: list[Slot]  # new slot states (conditioned KV kept position-free when the policy keeps it)
    prompt: ForwardResult | None = None  # the prompt's forward, when it rode in the plan's trailing forward

    @cached_property
    def assembled(self) -> KV:
        """The window as one KV: the buffer's view when assembled in one (no copy), else one concatenation."""
        return self.parts[0] if len(self.parts) == 1 else KV.cat(self.parts)


#: sources served from the chunk's canonical (the loads worth starting before the forwards)
_FROM_CANONICAL = frozenset({Source.LEAD, Source.PATCH, Source.BLIND, Source.SELECTIVE})


class Executor:
    """Carries out plans for one window branch: the one place that serves slots, forms their patches
    and counts that work (into the stats of ``meter``)."""

    def __init__(
        self,
        engine: Engine,
        table: ChunkTable,
        config: WindowConfig,
        meter: EngineMeter,
        persistence: Persistence | None = None,
    ) -> None:
        self.engine = engine
        self.table = table
        self.config = config
        self.meter = meter
        self.stats = meter.stats
        self.persistence = persistence
        #: pending patches whose slot was served another way this time (it led, or was re-prefilled): the
        #: KV they are formed from is kept here until the window forms them, after the answer
        self.orphans: list[tuple[Chunk, KV | FreeLater, PendingPatch]] = []
        #: the branch's window buffer, kept from one assembly to the next (``config.reuse_buffer``); a fork
        #: has an executor, and so a buffer, of its own
        self.buffer: WindowBuffer | None = None

    def canonical(self, chunk: Chunk) -> KV:
        """The chunk's canonical: from the table, else from the store (``canonicals_reused``), else one
        forward (``canonicals_computed``; then stored)."""
        if chunk.canonical is None:
            kv = self.persistence.load_canonical(chunk) if self.persistence is not None else None
            if kv is not None:
                self.stats.canonicals_reused += 1  # loaded, not computed
            else:
                kv = self._compile(chunk)
                self.stats.canonicals_computed += 1
                self.stats.canonical_bytes += kv.nbytes
                if self.persistence is not None:
                    self.persistence.save_canonical(chunk, kv)
            chunk.canonical = kv
        return chunk.canonical

    def _compile(self, chunk: Chunk) -> KV:
        t0 = time.perf_counter()
        with self.meter.measure(Work.INGEST):
            kv = self.engine.canonical(chunk.token_ids)
        self.stats.time("canonical", time.perf_counter() - t0)
        return kv

    def window_ids(self, plan: Plan) -> list[int]:
        """The token ids of the assembled window: the anchor, then every slot's chunk in plan order."""
        return list(self.engine.anchor_ids) + [t for sp in plan.slots for t in sp.chunk.token_ids]

    def run(
        self,
        plan: Plan,
        slots: list[Slot],
        keep_slot_kv: bool,
        graph: DependencyGraph,
        step: int,
        prompt: list[int] | None = None,
        answer: SamplingParams | None = None,
    ) -> Execution:
        """Assemble the window. ``prompt``: token ids to prefill in the trailing forward run, if the plan
        ends with one (``Execution.prompt`` then holds that forward; otherwise it is None). ``answer``: the
        sampling of the answer decoded on from that prompt; where the forward's step started it
        (``Engine.forward``), it is ``Execution.prompt.answer``, withdrawn if the assembly fails after."""
        e = self.engine
        fuse = prompt is not None and plan.recompute is None
        prompt_result: ForwardResult | None = None
        if self.persistence is not None:  # loads overlap with the forwards below
            self.persistence.prefetch([sp.chunk for sp in plan.slots if sp.source in _FROM_CANONICAL])
        # the window is written into a buffer sized for it (and the prompt): forwards run on top of it
        t0 = time.perf_counter()
        buffer = self._buffer_for(plan, prompt)
        placing = [0.0]  # seconds spent placing slots (rotations, patches, writes), forwards excluded
        placed: list[KV] = []
        new_slots: list[Slot] = []
        carried: dict[ChunkId, frozenset] = {}  # what each slot served so far carries (``Slot.absorbed``)
        if buffer.reuse([("placed", e.anchor_kv)]) is None:
            buffer.append(e.anchor_kv, keys=[("placed", e.anchor_kv)])
        placing[0] += time.perf_counter() - t0

        def add(sp: SlotPlan, slot: Slot, kv: KV, view: KV, *, formed: bool, free: KV | None = None) -> None:
            placed.append(view)
            new = self._after(sp, slot, kv, keep_slot_kv, graph, step, formed=formed, prior=carried, free=free)
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
                kvs, prompt_result = self._forward_run(run, [buffer.view()], tail, answer if tail else None)
                try:
                    for k, kv in enumerate(kvs):
                        t = time.perf_counter()
                        view = buffer.append(kv)  # (rows the forward wrote already: one copy, no rotation)
                        placing[0] += time.perf_counter() - t
                        add(run[k], slots[i + k], kv, view, formed=True)
                except BaseException:
                    if prompt_result is not None and prompt_result.answer is not None:
                        prompt_result.answer.close()  # nobody will read it
                    raise
                i = j
                continue
            t = time.perf_counter()
            view, free = self._place(buffer, sp, slots[i], keep_slot_kv)
            placing[0] += time.perf_counter() - t
            add(sp, slots[i], view, view, formed=False, free=free)
            i += 1
        if plan.recompute is not None and any(sp.source is Source.SELECTIVE for sp in plan.slots):
            assembled, placed = self._selective(plan, buffer.view())
            parts = [assembled]
        else:
            parts = [buffer.view()]
        self.stats.window_kv_bytes = sum(p.nbytes for p in parts)
        self.stats.window_tokens = sum(len(p) for p in parts)
        self.stats.time("place", placing[0])
        return Execution(parts, placed, new_slots, prompt_result)

    def place_ahead(self, plan: Plan, slots: list[Slot], keep_slot_kv: bool) -> int:
        """Write, before the use, the plan's leading slots whose placed KV is a rotation of KV already held
        (kept and survivor slots, a lead whose canonical is resident) into the buffer, remembered under the
        keys the use's placement looks up, so it takes those rows as they are: the same rotation, computed
        earlier (idle time), so the use's numbers are the same bits. Stops at the first other slot. Returns
        how many slots it placed."""
        if not self.config.reuse_buffer:
            return 0
        e = self.engine
        buffer = self._buffer_for(plan, None)
        if buffer.reuse([("placed", e.anchor_kv)]) is None:
            buffer.append(e.anchor_kv, keys=[("placed", e.anchor_kv)])
        placed = 0
        for sp, slot in zip(plan.slots, slots, strict=True):
            rotation = sp.source in (Source.KEEP, Source.SURVIVOR) and slot.has_kv
            if not (rotation or (sp.source is Source.LEAD and sp.chunk.canonical is not None)):
                break
            self._place(buffer, sp, slot, keep_slot_kv)
            placed += 1
        return placed

    def _buffer_for(self, plan: Plan, prompt: list[int] | None) -> WindowBuffer:
        """The buffer this assembly writes into: the branch's own from the last assembly (its rows kept for
        reuse), or a new one sized for the window's budget and the prompt."""
        e = self.engine
        cap = max(plan.end, plan.anchor_len + (self.config.budget_tokens or 0)) + len(prompt or [])
        buffer = self.buffer
        fits = buffer is not None and buffer.device == e.device and buffer.keys.dtype == e.anchor_kv.keys.dtype
        if buffer is None or not fits or not self.config.reuse_buffer:
            buffer = WindowBuffer.like(e.anchor_kv, cap, device=e.device)
            self.buffer = buffer if self.config.reuse_buffer else None
            return buffer
        buffer.restart()
        buffer.reserve(cap)
        return buffer

    def _place(self, buffer: WindowBuffer, sp: SlotPlan, slot: Slot, keep_slot_kv: bool) -> tuple[KV, KV | None]:
        """Place a non-forward slot at the buffer's next rows: taken as they are when they already hold what
        serving it would write (the same position-free KV at the same position), else served and written.
        Returns the rows' view and the slot's position-free KV (see ``_serve``)."""
        keys = self._keys(sp, slot)
        got = buffer.reuse(keys) if keys else None
        if got is not None:
            return got
        kv, free = self._serve(sp, slot, keep_slot_kv)
        # a patched slot's rows are ``apply(canonical, patch)`` (under ``rotation="model"`` not a placement of the
        # reconstruction it keeps): kept next time, it is placed the same way, under the same key (``_keys``)
        return buffer.append(kv, keys=keys, note=free), free

    @staticmethod
    def _keys(sp: SlotPlan, slot: Slot) -> list[Key]:
        """What a non-forward slot's placed KV is a function of, known before serving it (see ``_serve``):
        its position-free KV (a kept slot's, the resident canonical) or the canonical and patch it is
        reconstructed from, and its position. A prefix source's KV (a view of earlier rows) has none."""
        canonical = sp.chunk.canonical
        if sp.source in (Source.KEEP, Source.SURVIVOR) and slot.has_kv and slot.patch is not None:
            return [] if canonical is None else [("patch", canonical, slot.patch, sp.start)]
        if sp.source in (Source.KEEP, Source.SURVIVOR) and slot.has_kv:
            return [("free", slot.kv, sp.start)]
        if sp.source is Source.PATCH and sp.patch is not None and canonical is not None:
            return [("patch", canonical, sp.patch.patch, sp.start)]
        if sp.source in (Source.LEAD, Source.BLIND, Source.SELECTIVE) and canonical is not None:
            return [("free", canonical, sp.start)]
        return []

    def _serve(self, sp: SlotPlan, slot: Slot, keep_slot_kv: bool) -> tuple[KV, KV | None]:
        """Placed KV (and the position-free conditioned KV, when there is one) for a non-forward slot. A
        patched slot is placed from its canonical and patch in one ``apply`` (so the engine computes it as a
        patched chunk, ``operator.apply_patch``); its reconstruction is computed only for a slot that keeps it."""
        e = self.engine
        if sp.source in (Source.KEEP, Source.SURVIVOR):
            assert slot.kv is not None  # the policy only keeps materialised slots
            if slot.patch is not None:  # the kept reconstruction, placed as its patched serve was
                return e.apply(self.canonical(sp.chunk), slot.patch, sp.start), slot.kv
            return e.apply(slot.kv, None, sp.start), slot.kv
        if sp.source is Source.PREFIX:
            assert sp.reuse_kv is not None
            return sp.reuse_kv, None
        canonical = self.canonical(sp.chunk)
        if sp.source is Source.PATCH:
            assert sp.patch is not None
            free = e.reconstruct(canonical, sp.patch.patch) if keep_slot_kv else None
            return e.apply(canonical, sp.patch.patch, sp.start), free
        return e.apply(canonical, None, sp.start), canonical  # LEAD, BLIND, or SELECTIVE before its repair

    def _selective(self, plan: Plan, assembled: KV) -> tuple[KV, list[KV]]:
        """Recompute the SELECTIVE slots' chosen tokens in context (CacheBlend / MPIC)."""
        assert plan.recompute is not None
        ids = self.window_ids(plan)
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
        # the engine's layer-by-layer recompute runs outside its counted forward: one pass when any token is chosen
        self.meter.add(Work.CONTEXT, 1 if len(res.selected) else 0, len(res.selected))
        self.stats.selective_tokens += len(res.selected)
        placed = [res.kv.slice(sp.start, sp.start + len(sp.chunk)) for sp in plan.slots]
        return res.kv, placed

    def _forward_run(
        self, run: list[SlotPlan], parts: list[KV], prompt: list[int] | None, answer: SamplingParams | None = None
    ) -> tuple[list[KV], ForwardResult | None]:
        """One forward over a run of slots (and the prompt behind them, if given, with the answer to start
        from it) on top of everything assembled so far. Returns each slot's placed KV, and the forward itself
        when the prompt rode in it."""
        ids = [t for sp in run for t in sp.chunk.token_ids]
        t0 = time.perf_counter()
        with self.meter.measure(Work.CONTEXT) as work:
            res = self.engine.forward(
                ids + (prompt or []), parts, run[0].start, logits="none" if prompt is None else "last", answer=answer
            )
            work.move(Work.PROMPT, len(prompt or []))  # the prompt rode in this forward
        self.stats.time("forward", time.perf_counter() - t0)
        # views of the forward's own output (a copy the engine made, ``ForwardResult.kv``): a slot that keeps
        # its KV copies what it keeps when it is made position-free (``FreeLater``)
        out, at = [], 0
        for sp in run:
            out.append(res.kv.slice(at, at + len(sp.chunk)))
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
        free: KV | FreeLater | None = None,
    ) -> Slot:
        """Record the slot's new state. A forward that should yield a patch leaves it *pending* on the
        slot (the slot holds the conditioned KV it is formed from); the window forms it off the answer's
        critical path, when the slot leaves the window or its conditioning is needed elsewhere. A formed
        slot's position-free KV is computed after the answer too (``FreeLater``), unless background work
        is off (then here, as every other piece of work)."""
        if formed and keep_slot_kv:
            free = FreeLater(kv, self.engine.make_free)
            if self.config.background == "off":
                free = free.get()  # the window as before: the slot holds its position-free KV
        pending = None
        absorbed = self._absorbed(sp, slot, prior)
        if formed and sp.form_patch:
            pending = PendingPatch(sp.antecedent, sp.patch_kind, absorbed)
            if free is None:  # nothing to form it from later: form it now
                self.form_pending(sp.chunk, kv, pending)
                pending = None
        elif sp.source in (Source.KEEP, Source.SURVIVOR):
            pending = slot.pending
        if slot.pending is not None and slot.has_kv and pending is not slot.pending:
            self.orphans.append((sp.chunk, slot.held, slot.pending))  # never dropped: formed later
        self._record(sp, slot, graph, step)
        graph.set_conditioning(sp.chunk.id, tuple(sorted(absorbed)), sp.source.value)
        kept = free if keep_slot_kv else None
        if kept is None or formed:
            patch = None
        elif sp.source is Source.PATCH:
            patch = sp.patch.patch if sp.patch is not None else None
        else:
            patch = slot.patch if sp.source in (Source.KEEP, Source.SURVIVOR) else None
        return Slot(sp.chunk.id, kept, sp.antecedent, sp.source.value, absorbed, pending, patch=patch)

    def _record(self, sp: SlotPlan, slot: Slot, graph: DependencyGraph, step: int) -> None:
        """Log the slot's decision and count what it was (before its conditioning is recorded: a stale
        slot is still marked stale here)."""
        st, drifted = self.stats, slot.antecedent not in (None, sp.antecedent)
        st.count_served(sp.source)
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
        self.stats.count_formed(pending.kind)
        self.stats.time("patch_form", time.perf_counter() - t0)
        return stored

    def store_patch(
        self,
        chunk: Chunk,
        conditioned: KV | Sequence[KV],
        kind: PatchKind,
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

    # --- patches formed off the answer's path ----------------------------------------------------
    def form_slot_patches(self, slots: list[Slot], which: Sequence[Slot]) -> int:
        """Form the pending patches of the slots in ``which`` (those that have one and its KV), replacing
        each in ``slots`` (a window's slot list, edited in place) by the slot without it. Returns how many
        patches were formed here (a fork sharing a slot may have formed one already)."""
        formed = 0
        for i, slot in enumerate(slots):
            if slot.pending is None or not slot.has_kv or not any(slot is s for s in which):
                continue
            formed += slot.pending.stored is None
            self.form_pending(self.table.get(slot.chunk_id), slot.kv, slot.pending)
            slots[i] = replace(slot, pending=None)
        return formed

    def form_orphans(
        self, *, raise_errors: bool = True, wait: Callable[[Chunk, PendingPatch], bool] | None = None
    ) -> int:
        """Form the patches set aside when their slot was served another way (``orphans``), those ``wait``
        says can wait left queued. One that fails stays queued (with those behind it); with
        ``raise_errors=False`` (after a window operation, which has itself succeeded) the failure is logged,
        not raised. Returns how many were formed."""
        formed, kept = 0, []
        while self.orphans:
            chunk, kv, pending = self.orphans[0]
            if wait is not None and wait(chunk, pending):
                kept.append(self.orphans.pop(0))
                continue
            new = pending.stored is None
            try:
                self.form_pending(chunk, resolve(kv), pending)
            except Exception as exc:
                self.orphans[:0] = kept
                if raise_errors:
                    raise
                log.warning("window: forming a set-aside patch of %s failed (kept for later): %s", chunk.id[:8], exc)
                return formed
            self.orphans.pop(0)
            formed += new
        self.orphans[:0] = kept
        return formed

    def drop_orphans(self, chunk_id: ChunkId) -> None:
        """Drop the set-aside patches of a forgotten chunk (no branch can use them any more)."""
        self.orphans = [o for o in self.orphans if o[0].id != chunk_id]

    # --- orbit patches ------------------------------------------------------------------------------
    def form_orbit_patch(self, chunk: Chunk, preds: Sequence[Chunk]) -> StoredPatch:
        """Form (and store) an orbit patch for ``chunk`` over orderings of ``preds`` (the chunks in front
        of it): Delta averaged over orderings (all up to ``orbit_exhaustive_max`` predecessors, a seeded
        sample beyond), one conditioned forward per ordering (§5)."""
        by_id = {p.id: p for p in preds}
        t0 = time.perf_counter()
        conditioned = []
        for ordering in self._orderings([p.id for p in preds]):
            ids = [t for c in ordering for t in by_id[c].token_ids] + chunk.token_ids
            with self.meter.measure(Work.CONTEXT):
                res = self.engine.forward(ids, self.engine.anchor_kv, len(self.engine.anchor_ids), logits="none")
            conditioned.append(res.kv.slice(len(ids) - len(chunk), len(ids)))
        stored = self.store_patch(chunk, conditioned, PatchKind.ORBIT, tuple(p.id for p in preds))
        self.stats.count_formed(PatchKind.ORBIT)
        self.stats.time("orbit_patch", time.perf_counter() - t0)
        return stored

    def _orderings(self, preds: list[ChunkId]) -> list[tuple[ChunkId, ...]]:
        cfg = self.config
        if len(preds) <= cfg.orbit_exhaustive_max or cfg.orbit_samples >= math.factorial(len(preds)):
            return list(itertools.permutations(preds))
        rng = random.Random(cfg.seed)
        seen = {tuple(preds)}
        out = [tuple(preds)]
        while len(out) < cfg.orbit_samples:
            perm = tuple(rng.sample(preds, len(preds)))
            if perm not in seen:
                seen.add(perm)
                out.append(perm)
        return out

    # --- the window without one slot's conditioning (disposability) -------------------------------
    def parts_without(self, plan: Plan, execution: Execution, index: int, *, drop: bool) -> tuple[list[KV], int]:
        """The executed window with slot ``index`` served from its canonical (its conditioning off) or,
        with ``drop``, left out, every later slot placed where it now sits: one rotation from angle 0 for
        each. Returns the parts (anchor first) and the position after them."""
        e = self.engine
        parts = [e.anchor_kv]
        pos = plan.anchor_len
        for i, sp in enumerate(plan.slots):
            if i == index:
                if drop:
                    continue
                parts.append(e.apply(self.canonical(sp.chunk), None, pos))
            elif (patch := self._served_patch(sp, execution.slots[i])) is not None:  # placed as it was served
                placed = execution.placed[i]
                moved = int(placed.positions[0]) != pos
                parts.append(e.apply(self.canonical(sp.chunk), patch, pos) if moved else placed)
            else:
                placed, free = execution.placed[i], execution.slots[i].kv
                if int(placed.positions[0]) == pos:
                    parts.append(placed)
                elif free is not None:  # one rotation from angle 0, as every placement
                    parts.append(e.apply(free, None, pos))
                else:
                    parts.append(e.relocate(placed, pos))
            pos += len(sp.chunk)
        return parts, pos

    @staticmethod
    def _served_patch(sp: SlotPlan, slot: Slot) -> Patch | None:
        """The patch a slot's placed KV was computed with (its own stored patch, or a kept reconstruction's)."""
        if sp.source is Source.PATCH and sp.patch is not None:
            return sp.patch.patch
        return slot.patch if sp.source in (Source.KEEP, Source.SURVIVOR) else None

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
