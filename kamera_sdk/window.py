"""``ContextWindow``: an agent's context as a set of position-free chunks.

Data flows one way: chunk in -> canonical -> plan -> assemble -> decode. Window operations (reorder,
slide, evict/recall, fork) only edit the slot list; the next use plans how each slot's KV is obtained
(see ``policies/``) and the executor assembles it. Every operation validates its arguments before it
changes anything, so a refused operation leaves the window as it was.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar, overload

import torch
from pydantic import BaseModel

from kamera_engine import (
    KV,
    ChunkNotFoundError,
    ContextLengthError,
    Engine,
    Grammar,
    InvalidInputError,
    SamplingParams,
    WindowOperationError,
)
from kamera_engine.decode import AsyncTextStream, TextStream, stop_strings
from kamera_engine.runner import Prefilled

from . import vision
from .aio import in_background, to_thread
from .background import BackgroundQueue, IdleWorker, Phase, Task, gate_of
from .chunks import VISION_KINDS, Antecedent, Chunk, ChunkId, ChunkTable, PatchKind, StoredPatch, content_id, tokens_id
from .compress import CompressionPolicy, make_compressor
from .compress.runner import Compressed, decode_compressed, prefill_compressed
from .config import WindowConfig
from .envelope import judge
from .executor import Execution, Executor
from .graph import DependencyGraph
from .media import DEFAULT_LIMITS, FetchLimits
from .metering import EngineMeter
from .persistence import Persistence
from .placement import best_order
from .plan import Plan, SlotPlan, Source
from .plan_cost import FROM_CANONICAL, CostModel, choose
from .policies import ReusePolicy, WindowView, make_policy
from .policies.kamera import dropped_run
from .slots import FreeLater, PendingPatch, Slot
from .splitting import split_text
from .stats import Decision, WindowStats, Work
from .store import ChunkStore, default_store_path, open_store
from .window_state import WindowState

log = logging.getLogger("kamera.window")

#: default size of the chunks ``add_document`` splits a long text into (tokens)
DOCUMENT_CHUNK_TOKENS = 256

_P = ParamSpec("_P")
_R = TypeVar("_R")


def foreground(*, drain: bool = True) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A foreground call: it holds the window's gate (background work of every window on the engine stops
    at its next forward boundary; other windows' foreground calls run at once)
    and, with ``drain``, first finishes the window's queued work that later results depend on, so that
    what the idle time reached changes only latency."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            self: ContextWindow = args[0]  # type: ignore[assignment]
            with self._gate.foreground():
                outer = self._depth == 0
                self._depth += 1
                try:
                    if outer and drain:
                        self._finish_required()
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1
                    if outer and self._worker is not None and len(self._queue):
                        self._worker.notify()

        return call

    return wrap


def as_index(value: object) -> int | None:
    """``value`` as an int if it is one (ints, numpy ints, one-element integer tensors; not bools)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def order_arg(order: object) -> list:
    """``reorder``'s argument as a list, or ``InvalidInputError``: any ordered iterable, not a set."""
    if not isinstance(order, Iterable) or isinstance(order, (str, AbstractSet, Mapping)):  # a set has no order
        raise InvalidInputError(f"reorder takes a permutation of the window or 'auto', not {type(order).__name__}")
    return list(order)


class DisposabilityResult(BaseModel):
    """Outcome of the disposability test (core paper, appendix E)."""

    chunk: str
    mode: str  # "conditioning": the chunk's patch toggled off; "chunk": the chunk dropped
    disposable: bool
    answer_with: str
    answer_without: str


class ContextWindow:
    """A window of chunks served by a reuse policy over one engine.

    ``policy``: ``kamera`` (default), ``recompute``, ``prefix``, ``prefix_idle``, ``blind``, ``cacheblend``,
    ``mpic`` (the registered policies, ``POLICIES``; a test keeps this list complete), or a ``ReusePolicy``
    instance.
    ``rank``: patch rank m (default 32). ``budget_tokens``: slide the oldest chunks out when the window
    exceeds it (a chunk larger than the whole budget is refused). Or pass both inside ``config``.
    ``store``: where canonicals and patches persist: None (this process only), a directory path,
    ``"default"`` (``$KAMERA_HOME/store``), a ``redis://`` URL, or an open ``ChunkStore`` to share.
    """

    def __init__(
        self,
        engine: Engine,
        policy: str | ReusePolicy = "kamera",
        rank: int | None = None,
        budget_tokens: int | None = None,
        store: str | Path | ChunkStore | None = None,
        *,
        config: WindowConfig | None = None,
        compress: str | CompressionPolicy | None = None,
        kv_budget: float | None = None,
    ) -> None:
        if config is None:
            config = WindowConfig(rank=32 if rank is None else rank, budget_tokens=budget_tokens)
        elif rank is not None or budget_tokens is not None:
            raise InvalidInputError("pass rank/budget_tokens either directly or inside config, not both")
        self.engine = engine
        self.config = config
        resolved = make_policy(policy)
        self.compressor = None if compress is None else make_compressor(compress, kv_budget)
        if compress is None and kv_budget is not None:
            raise InvalidInputError("kv_budget needs compress= ('elastic' or 'david')")
        self.store: ChunkStore | None = None
        if store is not None:
            self.store = open_store(default_store_path() if store == "default" else store)
        self._table = ChunkTable()  # shared by every branch
        # one per window and its forks; foreground calls of any window go before background work of any
        self._gate = gate_of(engine).window()
        self._open_branch(resolved, WindowState())

    def _open_branch(self, policy: ReusePolicy, state: WindowState, *, forked: bool = False) -> None:
        """Start this object as a branch with ``state``: its own stats, meter, executor (and its queue of
        set-aside patches) and store pins; everything else is shared with the window it came from."""
        self.policy = policy
        self._state = state
        self._table.attach(state)  # an entry this branch holds is never dropped by another's ``forget``
        self._stats = WindowStats(policy=policy.name, forked=forked, started_at_step=state.step)
        self._meter = EngineMeter(self.engine, self._stats)
        self._persistence = None if self.store is None else Persistence(self.store, self.engine, self._stats)
        self._executor = Executor(self.engine, self._table, self.config, self._meter, self._persistence)
        self._queue = BackgroundQueue(self.config.background_budget_tokens)
        self._policy_idle_at = -1  # the window step the policy's idle work last ran at
        #: chunks whose canonical compile was deferred and that no foreground plan has served from it yet:
        #: required work is priced counting their compile (whether idle time reached it must not change a plan)
        self._uncompiled: set[ChunkId] = set(getattr(self, "_uncompiled", ()))
        #: of those, the ones deferred since the last use: the agent has not acted (idle time) since, so the
        #: cost model counts their compile; an older one it expects idle time to have compiled
        self._deferred_since_use: set[ChunkId] = set(getattr(self, "_deferred_since_use", ()))
        self._leaving: set[ChunkId] = set()  # chunks that left with a patch to form (it compiles their canonical)
        self.cost_model = getattr(self, "cost_model", CostModel())
        self._depth = 0  # foreground calls of this branch in progress (they nest: admit -> recall -> slide)
        self._worker: IdleWorker | None = None
        if self.config.background == "auto":
            ref = weakref.ref(self)

            def step() -> bool | None:
                win = ref()
                return False if win is None else win._idle_step()

            self._worker = IdleWorker(self._gate, step)
        self._forget_uses()
        self._pins_released = False  # close() hands the pins back
        for cid in self.chunks:
            self._pin(cid)  # a branch holds its own pins: its chunks stay resident while it lives

    # --- lifecycle ----------------------------------------------------------------------------
    @foreground()
    def close(self) -> None:
        """Form pending patches, flush the store's write-behind queue and release this window's pins on
        the store's memory tier (the store stays open for other windows sharing it). The window still
        answers afterwards; it just no longer keeps its chunks resident."""
        self.flush()
        if self._worker is not None:
            self._worker.stop()
        if self.store is not None:
            for cid in self.chunks:
                self._unpin(cid)
            self._pins_released = True
            self.store.flush()

    def __enter__(self) -> ContextWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inspection ----------------------------------------------------------------------------
    @property
    def refs(self) -> dict[str, ChunkId]:
        """``IMAGE#<ref>`` names given with ``add_image(..., ref=...)``, and the chunks they name."""
        return self._state.media.refs

    @property
    def chunks(self) -> list[ChunkId]:
        """Chunk ids in window order."""
        return [s.chunk_id for s in self._state.slots]

    @property
    def slots(self) -> tuple[Slot, ...]:
        """The window's slots in order: each chunk's conditioned KV (position-free) as of its last use, what
        it is conditioned on and any patch still to be formed from it. Slots are immutable records."""
        return tuple(self._state.slots)

    @property
    def evicted(self) -> list[ChunkId]:
        """Chunks evicted from the window and still recallable (oldest first)."""
        return list(self._state.evicted)

    @property
    def graph(self) -> DependencyGraph:
        """The dependency graph of conditioning (antecedent -> patch -> dependent)."""
        return self._state.graph

    @property
    def tokens(self) -> int:
        """Tokens in the window, chunks only (the chat anchor and prompt excluded)."""
        return sum(len(self._table.get(s.chunk_id)) for s in self._state.slots)

    @property
    def content_tokens(self) -> int:
        """Tokens of all content in the table this window shares with its branches: in a window, evicted
        (recallable) or a branch's. An entry stays until ``forget`` lets it go."""
        return sum(len(c) for c in self._table.values())

    def __len__(self) -> int:
        return len(self._state.slots)

    def __contains__(self, chunk_id: object) -> bool:
        return any(s.chunk_id == chunk_id for s in self._state.slots)

    def chunk(self, chunk_id: ChunkId) -> Chunk:
        """The table entry of a chunk in this window or evicted from it."""
        if chunk_id not in self and chunk_id not in self._state.evicted:
            raise ChunkNotFoundError(f"chunk {chunk_id!r} is not in this window nor evicted from it")
        return self._table.get(chunk_id)

    def known(self, chunk_id: ChunkId) -> Chunk | None:
        """The table entry of content this window or any of its branches holds or held, else None (content
        ids are hashes of content: a caller that builds a chunk itself asks here first, so known content
        is not processed again)."""
        return self._table.find(chunk_id)

    @foreground(drain=False)
    def stats(self) -> WindowStats:
        """A snapshot of what this window has done (store counters included when there is a store)."""
        snap = self._stats.model_copy(deep=True)
        snap.vision_tower_runs = self._state.media.tower_runs
        if self.store is not None:
            st = self.store.stats()
            snap.store_load_failures += st.refused_checksum + st.refused_fingerprint + st.refused_auth + st.load_errors
        return snap

    # --- adding content ------------------------------------------------------------------------
    @foreground()
    def add_text(self, text: str, *, copy: int = 0) -> ChunkId:
        """Append a text chunk; returns its content id. Known content is not recomputed. The window is a
        set: the same text is one chunk, unless it is a ``copy`` (1, 2, ...) of it, a chunk of its own
        with the same tokens (kind ``text#<copy>``), as a message repeated in a conversation is."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError("add_text needs a non-empty string")
        k = as_index(copy)
        if k is None or k < 0:
            raise InvalidInputError(f"copy must be an int >= 0, got {copy!r}")
        if k:
            return self.add(self.engine.tokenize(text), kind=f"text#{k}", text=text)
        cid = self.text_id(text)
        known = self.known(cid)
        (chunk_id,) = self.admit(known or Chunk(cid, "text", self.engine.tokenize(text), text=text))
        return chunk_id

    def text_id(self, text: str, *, copy: int = 0) -> ChunkId:
        """The content id ``add_text(text, copy=copy)`` gives, without adding anything."""
        return content_id("text", text.encode()) if not copy else tokens_id(f"text#{copy}", self.engine.tokenize(text))

    @foreground()
    def add_document(self, text: str, *, max_chunk_tokens: int | None = None) -> list[ChunkId]:
        """Append a long text as a run of text chunks split at paragraph, then sentence, then word
        boundaries, each at most ``max_chunk_tokens`` tokens (default: 256, or the window's budget if
        smaller); returns their ids in order. The pieces joined are the text; every piece is checked
        before any is added, so a refusal changes nothing."""
        if max_chunk_tokens is None:
            budget = self.config.budget_tokens
            max_chunk_tokens = DOCUMENT_CHUNK_TOKENS if budget is None else min(DOCUMENT_CHUNK_TOKENS, budget)
        pieces = split_text(text, lambda t: len(self.engine.tokenize(t)), max_chunk_tokens)
        chunks = []
        for piece in pieces:
            if not piece.strip():  # whitespace alone between boundaries carries nothing: no chunk of its own
                continue
            cid = content_id("text", piece.encode())
            chunks.append(self.known(cid) or Chunk(cid, "text", self.engine.tokenize(piece), text=piece))
        return self.admit(*chunks)

    @foreground()
    def add_image(self, image: object, **kwargs: object) -> ChunkId:
        """Append an image chunk (PIL image, path, bytes or http(s) URL; VLM engines). See ``vision``."""
        return vision.add_image(self, self._state.media, image, **kwargs)  # type: ignore[arg-type]

    @foreground()
    def image_chunk(self, image: object, *, limits: FetchLimits = DEFAULT_LIMITS) -> Chunk:
        """The chunk ``add_image(image)`` would append, not yet in the window (the vision tower runs here,
        once per picture): ``len()`` is the tokens it would take, ``admit`` appends it. A named picture
        (``ref``) goes through ``add_image``, which records its name."""
        return vision.image_chunk(self, self._state.media, image, limits=limits)  # type: ignore[arg-type]

    @foreground()
    def add_video(self, video: object, **kwargs: object) -> list[ChunkId]:
        """Append a video (file, bytes or frames) as one chunk per segment of sampled frames. See ``vision``."""
        return vision.add_video(self, self._state.media, video, **kwargs)  # type: ignore[arg-type]

    @foreground()
    def add(self, token_ids: Sequence[int], *, kind: str = "tokens", text: str | None = None) -> ChunkId:
        """Append a pre-tokenised chunk. ``kind`` is part of its content id (the same tokens under two kinds
        are two chunks); images and video go through ``add_image`` / ``add_video``."""
        if not isinstance(kind, str) or not kind or kind in VISION_KINDS:
            raise InvalidInputError(f"add() takes a text kind, not {kind!r}; images and video: add_image / add_video")
        ids = self._token_ids(token_ids, "a chunk")
        cid = tokens_id(kind, ids)
        (chunk_id,) = self.admit(self.known(cid) or Chunk(cid, kind, ids, text=text))
        return chunk_id

    @foreground()
    def admit(self, *chunks: Chunk) -> list[ChunkId]:
        """Append ready-made chunks (in order); returns their ids. The one way content enters a window:
        ``add_text`` / ``add`` / ``add_image`` / ``add_video`` build chunks and admit them here.

        Every chunk is checked against ``budget_tokens`` before any is added (a refusal changes nothing).
        Then, per chunk: content already in the window is left as it is (a window is a set); an evicted
        chunk is recalled; content another branch holds is appended with its canonical and patches; new
        content gets its stored patches and its canonical (from the store, or one forward) and is
        recorded. The window then slides to stay in budget."""
        for chunk in chunks:
            if not isinstance(chunk, Chunk):
                raise InvalidInputError(f"admit takes Chunk objects, not {type(chunk).__name__}")
            self._check_fits(chunk)
        return [self._admit_one(chunk) for chunk in chunks]

    def _admit_one(self, chunk: Chunk) -> ChunkId:
        cid = chunk.id
        if cid in self._table:
            if cid in self:
                return cid  # a window is a set: already present, nothing to do
            if cid in self._state.evicted:
                self.recall(cid)
                return cid
            if self.policy.needs_canonical:  # known to another branch of this window
                self._executor.canonical(self._table.get(cid))
            self._stats.canonicals_reused += 1
        else:
            if self._persistence is not None:
                chunk.patches = self._persistence.load_patches(chunk)
            deferred = self._defers_canonical(chunk)
            if self.policy.needs_canonical and not deferred:
                self._executor.canonical(chunk)  # written at arrival; if it fails, nothing is recorded
            self._state.graph.add_chunk(self._table.put(chunk).id)
            if deferred:
                self._queue_canonical(chunk)
        self._state.slots.append(Slot(cid))
        self._pin(cid)
        self._changed("add")
        self._enforce_budget(keep=cid)
        return cid

    def _check_fits(self, chunk: Chunk) -> None:
        """A chunk larger than the budget, or than the model's context with the anchor, is refused (a long
        text is told how to split itself)."""
        hint = "; a long text can be added as a run of chunks: win.add_document(text, max_chunk_tokens=N)"
        hint = hint if chunk.kind not in VISION_KINDS else ""
        budget = self.config.budget_tokens
        if budget is not None and len(chunk) > budget:
            raise InvalidInputError(f"a chunk of {len(chunk)} tokens does not fit in budget_tokens={budget}{hint}")
        limit, anchor = self.engine.context_length, len(self.engine.anchor_ids)
        if limit is not None and anchor + len(chunk) > limit:
            raise ContextLengthError(
                f"a chunk of {len(chunk)} tokens does not fit the model's context length of {limit} "
                f"(with the {anchor}-token chat anchor){hint}"
            )

    # --- window operations ---------------------------------------------------------------------
    @foreground()
    def evict(self, chunk_id: ChunkId, *, forget: bool = False) -> None:
        """Drop a chunk's conditioned KV from the window; its canonical stays, so it can be recalled.
        ``forget=True``: let it go for good at once (``forget``), without forming the patch it would have
        been recalled with (unless another branch holds it and may recall it)."""
        idx = self._index(chunk_id)
        t0 = time.perf_counter()
        shared = self._table.held(chunk_id, but=self._state)  # then a branch may recall it: its patch is formed
        if not forget or shared:
            self._leave([self._state.slots[idx]])
        self._state.slots.pop(idx)
        self._unpin(chunk_id)
        self._state.graph.drop_conditioning(chunk_id)
        self._state.evicted.append(chunk_id)
        if forget:  # before the step's bookkeeping, which would queue or form work for it
            self._forget(chunk_id, shared)
        self._changed("evict", t0)

    @foreground()
    def recall(self, chunk_id: ChunkId, at: int | None = None) -> None:
        """Re-admit an evicted chunk at slot index ``at`` (default: the end). No re-encode; its next use
        forms a fresh patch on its now-fixed earlier context (or reuses one formed on that same context)."""
        self._check_evicted(chunk_id, "is already in the window")
        pos = len(self._state.slots) if at is None else as_index(at)
        if pos is None or not 0 <= pos <= len(self._state.slots):
            raise InvalidInputError(f"recall position must be an int in [0, {len(self._state.slots)}], got {at!r}")
        t0 = time.perf_counter()
        self._form_leaving(chunk_id)  # its patch from when it left, if idle time has not formed it yet
        self._state.evicted.remove(chunk_id)
        self._state.slots.insert(pos, Slot(chunk_id, recalled=True))
        self._pin(chunk_id)
        self._mark_dependents(chunk_id)
        self._changed("recall", t0)
        self._enforce_budget(keep=chunk_id)

    def _check_evicted(self, chunk_id: ChunkId, in_window: str) -> None:
        """Refuse a chunk this branch has not evicted: one in the window (``in_window`` says why), one only
        another branch holds, an unknown one."""
        if chunk_id in self:
            raise WindowOperationError(f"chunk {chunk_id!r} {in_window}")
        if chunk_id not in self._state.evicted:
            if chunk_id in self._table:
                raise WindowOperationError(f"chunk {chunk_id!r} was not evicted from this window")
            raise ChunkNotFoundError(f"unknown chunk {chunk_id!r}")

    @foreground()
    def forget(self, chunk_id: ChunkId) -> None:
        """Forget an evicted (or slid-out) chunk for good: it is no longer recallable from this window, and
        its canonical and patches leave the content table once no other live branch holds it (at the
        window's next ``forget`` after the last such branch is gone; a store keeps what it persisted). The
        window's KV and answers are unchanged; adding the same content again later prepares it anew (from
        the store, or one forward)."""
        self._check_evicted(chunk_id, "is in the window: evict it first (or evict(..., forget=True))")
        self._forget(chunk_id, self._table.held(chunk_id, but=self._state))

    def _forget(self, chunk_id: ChunkId, shared: bool) -> None:
        """``forget`` once checked; ``shared``: whether another live branch holds ``chunk_id``."""
        t0 = time.perf_counter()
        if shared:
            self._form_leaving(chunk_id)  # branches share its patches: the one it left with is formed first
        else:
            self._queue.drop("leaving", chunk_id)
            self._leaving.discard(chunk_id)
            self._executor.drop_orphans(chunk_id)
        self._queue.drop("canonical", chunk_id)
        self._uncompiled.discard(chunk_id)
        self._deferred_since_use.discard(chunk_id)
        if self._persistence is not None:
            self._persistence.forget(chunk_id)
        self._state.evicted.remove(chunk_id)
        self._state.media.forget(chunk_id)
        self._state.graph.remove_unused(chunk_id)
        self._table.forget(chunk_id)  # dropped now, or once the last other branch holding it is gone
        self._stats.time("forget", time.perf_counter() - t0)

    @foreground()
    def slide(self, n: int = 1) -> list[ChunkId]:
        """Drop the oldest ``n`` chunks (they stay recallable); survivors are served by rotation only, or
        re-conditioned once with a removal patch under ``survivors="patch"``."""
        count = as_index(n)
        if count is None or count < 0:
            raise InvalidInputError(f"slide takes a number of chunks (an int >= 0), got {n!r}")
        if count > len(self._state.slots):
            raise WindowOperationError(f"cannot slide {count} chunks out of a window of {len(self._state.slots)}")
        n = count
        if n == 0:
            return []
        t0 = time.perf_counter()
        gone = [s.chunk_id for s in self._state.slots[:n]]
        self._leave(self._state.slots[:n])
        del self._state.slots[:n]
        for cid in gone:
            self._unpin(cid)
            self._state.graph.drop_conditioning(cid)
        self._state.evicted.extend(gone)
        self._changed("slide", t0)
        return gone

    @foreground()
    def reorder(self, order: Sequence[ChunkId] | Literal["auto"]) -> list[ChunkId]:
        """Put the window's chunks in ``order`` (a permutation of the window), or ``"auto"``: the order
        that maximises reuse of stored conditioning (see ``placement``). Returns the new order."""
        t0 = time.perf_counter()  # the search for an order ("auto") counts in the reorder's time
        if isinstance(order, str):
            if order != "auto":
                raise InvalidInputError(f"reorder takes a permutation of the window or 'auto', got {order!r}")
            self._form_orphans_for_plan(everything=True)  # the search weighs every stored patch
            order = best_order(self._view(), self.policy)
        order = order_arg(order)
        current = self.chunks
        if set(order) != set(current) or len(order) != len(current):
            missing = sorted(set(current) - set(order))
            unknown = [c for c in order if c not in current]
            raise InvalidInputError(
                f"reorder needs a permutation of the current window; missing {missing}, unknown {unknown}, "
                f"{len(order)} given for {len(current)}"
            )
        by_id = {s.chunk_id: s for s in self._state.slots}
        before = self._state.slots
        self._state.slots = [by_id[c] for c in order]
        if self.config.reorder_patch == "orbit" and self.policy.forms_orbit_patches:
            try:
                self._form_missing_orbit_patches()
            except BaseException:
                self._state.slots = before  # the orbit patches formed so far stay stored; the order does not change
                raise
        self._compile_new_lead()
        self._changed("reorder", t0)
        return order

    def _compile_new_lead(self) -> None:
        """After a reorder, with background work on: a lead whose canonical compile was deferred (it arrived
        behind others) is compiled now, in the reorder, when the plan the next use would choose serves it
        from the canonical (priced with no prompt: a prompt rides in the plans' last forward and never makes
        the fused re-prefill relatively cheaper). That use would run the compile first; run by the operation
        that made it necessary, it no longer holds the answer's first token. It is decided from the
        operations alone (the set-aside patches a plan may use are formed first, as the use does), and the
        use's choice stays the same (only the compile's cost leaves its estimate). A failure here is logged
        and leaves the compile to the use."""
        if self.config.background == "off" or not self._state.slots:
            return
        lead = self._table.get(self._state.slots[0].chunk_id)
        if not self._deferred(lead):
            return
        try:
            first = self._next_plan().slots[0]
            if first.source not in FROM_CANONICAL or first.chunk.id != lead.id:
                return
            self._executor.canonical(lead)
        except Exception as exc:  # optional: the use compiles it itself (the same plan, the same answer)
            why = f"lead compile at the reorder failed, left to the use: {exc}"
            log.warning("window: %s", why)
            self._stats.log(Decision(step=self._state.step, chunk=lead.label(), source="plan", reason=why))
            return
        self._uncompiled.discard(lead.id)
        self._queue.drop("canonical", lead.id)
        why = "lead compiled by the reorder: the next use serves it from its canonical"
        self._stats.log(Decision(step=self._state.step, chunk=lead.label(), source="plan", reason=why))

    @foreground()
    def fork(self) -> ContextWindow:
        """Copy-on-write branch: canonicals, patches and current slot KV are shared, not copied; each
        branch edits only its own slot list from here on."""
        self._form_leaving()  # the branch starts with an empty queue: what left the window is formed first
        self._executor.form_orphans()  # and the patches set aside (the branches share the chunks' patches)
        child = copy.copy(self)  # the shared parts: engine, config, compressor, store, content table
        child._open_branch(self.policy.fork(), self._state.fork(), forked=True)
        self._stats.time("fork", 0.0)
        return child

    # --- using the window ----------------------------------------------------------------------
    @foreground()
    def plan(self) -> Plan:
        """The plan the next use would execute (no forward pass is run; pending patches that the plan
        needs are formed)."""
        return self._next_plan()

    def _next_plan(self) -> Plan:
        """The plan the next use would execute, priced with no prompt (the patches it may use formed first)."""
        self._flush_stale()
        self._form_orphans_for_plan()
        return self._cost_plan(self.policy.plan(self._view()), 0, count=False)

    @foreground()
    def assemble(self) -> KV:
        """Materialise the window: the anchor and every chunk's KV, placed."""
        self._new_use()
        return self._materialise()[1].assembled

    @foreground()
    def next_token_logprobs(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """Log-probabilities (vocab,) of the next token after the prompt."""
        ids = self._prompt_ids(prompt)
        self._check_length(ids)
        self._new_use()
        plan, execution = self._materialise(ids)
        t0 = time.perf_counter()
        memo = self._prefilled(ids)
        if memo is not None:  # the prompt rode in the window's trailing forward (now or at an earlier call)
            lp = torch.log_softmax(memo.logits.float(), dim=-1).cpu()
        else:
            with self._meter.measure(Work.PROMPT):
                lp = self.engine.next_token_logprobs(execution.parts, ids, plan.end)
        self._count_prompt(ids, t0)
        return lp

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        temperature: float = ...,
        top_p: float = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        grammar: Grammar | None = ...,
    ) -> str: ...
    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[True],
        temperature: float = ...,
        top_p: float = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        grammar: Grammar | None = ...,
    ) -> TextStream: ...

    @foreground()
    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        *,
        stream: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        grammar: Grammar | None = None,
    ) -> str | TextStream:
        """Answer the prompt over the window (greedy by default). ``stream=True`` returns a ``TextStream``:
        the text pieces as they are decoded, then its ``tokens`` and ``finish_reason``. ``stop``: a string,
        or strings, that end the answer (not included). ``grammar``: what the answer must match (a JSON
        schema, regex or Lark grammar: ``Grammar.json_schema(...)``; every token outside it is masked). The
        window, the prompt and ``max_new_tokens`` must fit the model's context (``ContextLengthError``)."""
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop_strings(stop),
            seed=seed,
            grammar=grammar,
        )
        params.validate()
        ids = self._prompt_ids(prompt)
        self._check_length(ids, max_new_tokens)
        if self.engine.tokenizer is None:
            raise InvalidInputError("this engine has no tokenizer; generate needs text decoding")
        self._check_compression(ids)
        self._new_use()
        fused = self.compressor is None  # the prompt rides in the window's trailing forward, if it has one
        plan, execution = self._materialise(ids if fused else None, answer=params if fused else None)
        # the answer that forward's step started (``Engine.forward``): it decodes in the next step already
        started = execution.prompt.take_answer() if execution.prompt is not None else None
        try:
            t0 = time.perf_counter()
            memo = self._prefilled(ids) if fused else None
            if self.compressor is not None:
                tokens = decode_compressed(self.engine, self._compress(ids), self.compressor, params)
            elif started is not None:
                tokens = started
            else:
                tokens = self._answer_ids(ids, plan, execution, memo, params)
            pieces = self.engine.stream(tokens, params)
            self._count_prompt(ids, t0)
        except BaseException:
            if started is not None:
                started.close()
            raise
        return pieces if stream else "".join(pieces)

    @overload
    async def agenerate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        temperature: float = ...,
        top_p: float = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        grammar: Grammar | None = ...,
    ) -> str: ...
    @overload
    async def agenerate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = ...,
        *,
        stream: Literal[True],
        temperature: float = ...,
        top_p: float = ...,
        stop: str | Sequence[str] | None = ...,
        seed: int | None = ...,
        grammar: Grammar | None = ...,
    ) -> AsyncTextStream: ...

    async def agenerate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        *,
        stream: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        grammar: Grammar | None = None,
    ) -> str | AsyncTextStream:
        """``generate`` for asyncio, so many windows answer at once (``asyncio.gather``). The window's own
        work (planning, its forwards) runs on a window thread (``kamera_sdk.to_thread``); under
        ``engine.batching()`` the answer then decodes in the engine's shared steps with every other window's
        and streams without a thread (else each token is decoded on a worker thread). ``stream=True``
        returns an ``AsyncTextStream``. The answer is ``generate``'s; a cancelled call withdraws it."""
        call = functools.partial(
            self.generate,
            prompt,
            max_new_tokens,
            stream=True,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            grammar=grammar,
        )
        handoff = _Handoff()
        try:
            text = await asyncio.shield(asyncio.ensure_future(to_thread(handoff.run, call)))
        except asyncio.CancelledError:  # the window's work ends on its thread; the answer it starts is withdrawn
            handoff.abandon()
            raise
        pieces = text.aiter(to_thread=to_thread)
        if stream:
            return pieces
        try:
            return await pieces.text()
        finally:
            await pieces.aclose()

    @foreground()
    def compress_window(self, prompt: str | Sequence[int]) -> Compressed:
        """Prefill the prompt over the window and compress the cache with the window's compression
        policy (the assembled window itself is left intact). Returns the compressed cache for decoding."""
        if self.compressor is None:
            raise WindowOperationError("this window has no compression policy (pass compress=...)")
        ids = self._prompt_ids(prompt)
        self._check_length(ids)
        self._check_compression(ids)
        self._new_use()
        return self._compress(ids)

    def _compress(self, ids: list[int]) -> Compressed:
        assert self.compressor is not None
        plan, execution = self._materialise()
        window_ids = self._executor.window_ids(plan)
        vision_mask = torch.tensor(
            [False] * plan.anchor_len + [sp.chunk.kind in VISION_KINDS for sp in plan.slots for _ in sp.chunk.token_ids]
        )
        t0 = time.perf_counter()
        with self._meter.measure(Work.PROMPT) as work:
            c = prefill_compressed(self.engine, execution.parts, window_ids, ids, self.compressor, vision_mask)
            work.move(Work.STATISTICS, c.stats_tokens, forwards=1 if c.stats_tokens else 0)
        self._stats.kv_bytes_fraction = c.kv_bytes_fraction
        self._stats.time("compress", time.perf_counter() - t0)
        return c

    @foreground()
    def is_disposable(
        self, chunk_id: ChunkId, prompt: str | Sequence[int], *, mode: str = "conditioning", max_new_tokens: int = 16
    ) -> DisposabilityResult:
        """Does the greedy answer hold without ``chunk_id``'s conditioning (``mode="conditioning"``: its slot
        served from the canonical, patch off) or without the chunk (``mode="chunk"``)? One decode over KV
        the window already holds, no chunk prefilled again (appendix E); the answer with the window as it
        is is decoded once per prompt and kept until the window changes."""
        if mode not in ("conditioning", "chunk"):
            raise InvalidInputError(f"mode must be 'conditioning' or 'chunk', got {mode!r}")
        idx = self._index(chunk_id)
        ids = self._prompt_ids(prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens)
        params.validate()
        self._check_length(ids, max_new_tokens)
        plan, execution = self._materialise(ids)  # over the KV the window holds, for every policy
        key = (tuple(ids), max_new_tokens)
        if key not in self._answers:
            t0 = time.perf_counter()
            memo = self._prefilled(ids)
            self._answers[key] = list(self._answer_ids(ids, plan, execution, memo, params))
            self._count_prompt(ids, t0)
        parts, pos = self._executor.parts_without(plan, execution, idx, drop=mode == "chunk")
        t0 = time.perf_counter()
        with self._meter.measure(Work.PROMPT):
            without = list(self.engine.generate_ids(parts, ids, pos, params))
        answers = [self._answers[key], without]
        self._count_prompt(ids, t0)
        text = [self._decode(a) for a in answers]
        return DisposabilityResult(
            chunk=chunk_id,
            mode=mode,
            disposable=answers[0] == answers[1],
            answer_with=text[0],
            answer_without=text[1],
        )

    def _answer_ids(
        self, ids: list[int], plan: Plan, execution: Execution, memo: Prefilled | None, params: SamplingParams
    ) -> Iterator[int]:
        """The answer's token ids: decoded on from the prompt's kept prefill when it rode in the window's
        forward (``memo``), else after prefilling the prompt over the assembled window (counted here; the
        decode steps that follow are not forwards of the window's)."""
        if memo is not None:
            return self.engine.continue_ids(memo, params)
        with self._meter.measure(Work.PROMPT):
            return self.engine.generate_ids(execution.parts, ids, plan.end, params)

    def _decode(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(token_ids, skip_special_tokens=True) if tok is not None else str(token_ids)

    @foreground()
    def form_orbit_patch(self, chunk_id: ChunkId) -> StoredPatch:
        """Form (and store) an orbit patch for ``chunk_id`` over orderings of its current predecessor set:
        Delta averaged over orderings (all up to ``orbit_exhaustive_max`` predecessors, a seeded sample
        beyond), one conditioned forward per ordering. One patch then serves every ordering (§5)."""
        idx = self._index(chunk_id)
        preds = self.chunks[:idx]
        if not preds:
            raise WindowOperationError("the leading chunk needs no patch")
        return self._executor.form_orbit_patch(self._table.get(chunk_id), [self._table.get(c) for c in preds])

    # --- internals -----------------------------------------------------------------------------
    def _form_missing_orbit_patches(self) -> None:
        for i, cid in enumerate(self.chunks):
            if i == 0:
                continue
            chunk = self._table.get(cid)
            preds = frozenset(self.chunks[:i])
            if not any(p.kind is PatchKind.ORBIT and p.antecedent_set == preds for p in chunk.patches):
                self.form_orbit_patch(cid)

    @foreground()
    def flush(self) -> int:
        """Form every pending patch now (normally formed when a chunk leaves the window or is needed, or
        at the next window operation once its slot was served another way). Returns how many were formed."""
        formed = self._executor.form_orphans() + self._flush(self._state.slots) + self._form_leaving()
        while self._idle_step():  # and the queued background work (within its budget)
            pass
        return formed

    # --- background work ------------------------------------------------------------------------
    @foreground(drain=False)
    def prepare(self, seconds: float | None = None) -> int:
        """Run the queued background work now (``WindowConfig.background``), most valuable first, within
        ``background_budget_tokens`` and, if given, for at most about ``seconds`` (a task started is
        finished: at most one forward). Returns how many tasks ran. Results do not depend on it: work a
        later result needs and that is still queued then is finished by that call itself."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        ran = 0
        while deadline is None or time.perf_counter() < deadline:
            if not self._idle_step():
                break
            ran += 1
        if self._state.slots and self._policy_idle_at != self._state.step:  # the policy's own idle work
            self._policy_idle_at = self._state.step
            with self._meter.measure(Work.BACKGROUND):
                if self.policy.idle(self._view()):
                    ran += 1
                    self._stats.count_task(self._stats.background_done, "policy")
        return ran

    @property
    def background_pending(self) -> int:
        """Background tasks still queued."""
        return len(self._queue)

    def _idle_step(self) -> bool:
        """Run the next queued task as idle-time work (the caller holds the engine's gate). False when
        there is nothing to run within the budget."""
        task = self._queue.next(within_budget=True)
        if task is None:
            return False
        self._run_task(task, idle=True)
        return True

    def _finish_required(self) -> None:
        """Before a foreground call: finish, in order, the queued work later results depend on."""
        while (task := self._queue.next(required_only=True)) is not None:
            self._run_task(task, idle=False)

    def _run_task(self, task: Task, *, idle: bool) -> None:
        self._queue.take(task)
        t0 = time.perf_counter()
        try:
            if idle:
                with self._meter.background():
                    task.run()
                self._queue.spent += task.tokens
            else:
                task.run()
        except Exception as exc:  # background work is never needed for correctness: log it, go on
            log.warning("window: background %s of %s failed: %s", task.kind, task.label, exc)
            why = f"{task.kind} failed: {exc}"
            self._stats.log(Decision(step=self._state.step, chunk=task.label, source="background", reason=why))
            return
        counts = self._stats.background_done if idle else self._stats.background_inline
        self._stats.count_task(counts, task.kind)
        self._stats.time(f"background_{task.kind}" if idle else f"inline_{task.kind}", time.perf_counter() - t0)
        why = f"{task.kind} {'in idle time' if idle else 'inline (idle time had not reached it)'}"
        self._stats.log(Decision(step=self._state.step, chunk=task.label, source="background", reason=why))

    def _push(self, task: Task, *, replace: bool = True) -> None:
        if replace:
            self._queue.replace(task.kind, task)
        else:
            self._queue.push(task)
        self._stats.count_task(self._stats.background_queued, task.kind)
        reason = f"queued {task.kind}: value {task.value:.0f}, {task.tokens} forward tokens"
        self._stats.log(Decision(step=self._state.step, chunk=task.label, source="background", reason=reason))

    def _defers_canonical(self, chunk: Chunk) -> bool:
        """With background work on, a text chunk that will not lead the window is prefilled in context at
        its first use: its canonical (needed only to form its patch, or if it comes to lead) is compiled
        in idle time, or lazily by whichever call needs it first (the same computation either way)."""
        return (
            self.config.background != "off"
            and self.policy.needs_canonical
            and bool(self._state.slots)
            and chunk.kind not in VISION_KINDS
        )

    def _queue_canonical(self, chunk: Chunk) -> None:
        # value: the nearer the front a chunk sits, the sooner it may lead and need its canonical on the path
        value = len(chunk) / (1 + len(self._state.slots))
        self._uncompiled.add(chunk.id)
        self._deferred_since_use.add(chunk.id)
        run = functools.partial(self._executor.canonical, chunk)
        task = Task("canonical", chunk.label(), Phase.LATENCY, value, len(chunk), run, chunk=chunk.id)
        self._push(task, replace=False)

    def _queue_patches(self) -> None:
        orphans = len(self._executor.orphans)
        if orphans and not any(t.kind == "patches" for t in self._queue.tasks):
            # latency only: a plan that could use one of them forms it first (``_form_orphans_for_plan``)
            run = functools.partial(self._executor.form_orphans, raise_errors=False, wait=self._held)
            orphans_now = [(c, p) for c, _, p in self._executor.orphans if not self._held(c, p) and p.stored is None]
            tokens = sum(len(c) for c, _ in orphans_now if c.canonical is None)
            self._push(Task("patches", "*", Phase.LATENCY, float(orphans), tokens, run))

    def _queue_prefetch(self) -> None:
        """Evicted chunks are the ones a look-back recalls: start loading their canonicals from the store."""
        if self._persistence is None or not self._state.evicted:
            return
        self._push(Task("prefetch", "*", Phase.LATENCY, 0.0, 0, self._prefetch_evicted))

    def _prefetch_evicted(self) -> None:
        """The evicted chunks when the task runs (one forgotten since it was queued is not loaded)."""
        assert self._persistence is not None
        self._persistence.prefetch([self._table.get(c) for c in self._state.evicted])

    def _queue_place(self) -> None:
        """A slide or an eviction moved the chunks behind it: their rotations into the window's buffer at the
        new positions run in idle time (after the survivors' work), so the use finds those rows written."""
        if self.config.reuse_buffer:
            run = self._place_ahead
            self._queue.replace("place", Task("place", "*", Phase.LATENCY, float(self.tokens), 0, run))

    def _place_ahead(self) -> None:
        if self._state.slots:
            plan = self._cost_plan(self.policy.plan(self._view()), 0, count=False)
            self._executor.place_ahead(plan, self._state.slots, self.policy.keeps_slot_kv)

    def _survivor_run(self) -> tuple[Plan, int, float] | None:
        """The first forward run of the plan that re-conditions survivors (a removal), as (plan, the run's
        end, value: its tokens weighted by how many members each survivor lost), or None."""
        if not self._state.slots or not self.policy.keeps_slot_kv:
            return None
        self._form_orphans_for_plan()
        plan = self.policy.plan(self._view())
        slots = plan.slots
        for i, sp in enumerate(slots):
            if sp.source is Source.FORWARD and sp.patch_kind is PatchKind.REMOVAL:
                start, end = i, i
                while start > 0 and slots[start - 1].source is Source.FORWARD:
                    start -= 1
                while end < len(slots) and slots[end].source is Source.FORWARD:
                    end += 1
                value = 0.0
                for run_sp, slot in zip(slots[start:end], self._state.slots[start:end], strict=True):
                    lost = len(slot.antecedent or ()) - len(run_sp.antecedent)
                    value += len(run_sp.chunk) * max(lost, 1)
                return plan, end, value
        return None

    def _queue_survivors(self) -> None:
        found = self._survivor_run()
        if found is None:
            self._queue.replace("survivors", None)
            return
        plan, end, value = found
        run = [sp for sp in plan.slots[:end] if sp.source is Source.FORWARD]
        label = ",".join(sp.chunk.label() for sp in run)
        tokens = sum(len(sp.chunk) for sp in run)
        self._push(Task("survivors", label, Phase.SURVIVORS, value, tokens, self._recondition_survivors))

    def _recondition_survivors(self) -> None:
        """Re-condition the first run of slide survivors on what remains in front of them: execute the
        window's plan up to the end of that run (one forward), then queue the next run if there is one."""
        self._flush_stale()
        found = self._survivor_run()
        if found is not None:
            plan, end, _ = found
            st = self._stats
            kv_bytes, tokens = st.window_kv_bytes, st.window_tokens  # a prefix is not the window
            # priced like a use (no prompt) for the case it runs in: inline when idle time has not reached it,
            # so every deferred canonical counts; a lead whose canonical is still to be compiled rides in the run
            head = Plan(plan.policy, plan.slots[:end], plan.anchor_len, plan.recompute)
            head = self._cost_plan(head, 0, inline=True)
            execution = self._executor.run(
                head, self._state.slots[:end], self.policy.keeps_slot_kv, self._state.graph, self._state.step
            )
            st.window_kv_bytes, st.window_tokens = kv_bytes, tokens
            self._compiled_by(head)
            self._state.slots[:end] = execution.slots
            self._forget_uses()
            self._log_plan(head)
            self._queue_free()
        self._queue_patches()
        self._queue_survivors()

    def _leave(self, slots: list[Slot]) -> None:
        """Slots leaving the window (slide, evict): the patches pending on them are formed now, or, with
        background work on, in idle time: no plan can use an evicted chunk's patch before it is recalled,
        and a recall (or a fork, or ``flush``) forms it first, so results do not depend on the timing."""
        if self.config.background == "off":
            self._flush(slots)
            return
        for slot in slots:
            pending = slot.pending
            if pending is None or not slot.has_kv or pending.stored is not None:
                continue
            chunk = self._table.get(slot.chunk_id)
            run = functools.partial(self._form_left, chunk, slot, pending)
            tokens = len(chunk) if chunk.canonical is None else 0  # its canonical may still be deferred
            task = Task("leaving", chunk.label(), Phase.LATENCY, float(len(chunk)), tokens, run, chunk=chunk.id)
            self._push(task, replace=False)
            self._leaving.add(chunk.id)

    def _form_left(self, chunk: Chunk, slot: Slot, pending: PendingPatch) -> None:
        kv = slot.kv  # read when the task runs: a position-free KV still to compute is computed there
        assert kv is not None
        self._executor.form_pending(chunk, kv, pending)

    def _queue_free(self) -> None:
        """Slots a forward just formed hold their placed KV (``slots.FreeLater``): made position-free in
        idle time, before the next use places them (and those set aside with a pending patch, so none keeps
        the forward's whole output alive until its patch is formed)."""
        if self._waiting_free():
            value = float(sum(len(self._table.get(s.chunk_id)) for s in self._state.slots if s.free_later))
            self._push(Task("free", "*", Phase.LATENCY, value, 0, self._make_free))

    def _waiting_free(self) -> list[FreeLater]:
        held = [s.free_later for s in self._state.slots] + [kv for _, kv, _ in self._executor.orphans]
        return [h for h in held if isinstance(h, FreeLater) and not h.ready]

    def _make_free(self) -> None:
        for held in self._waiting_free():
            held.get()

    def _form_leaving(self, chunk_id: ChunkId | None = None) -> int:
        """Form, now, the queued patches of slots that left the window (of ``chunk_id``, or all)."""
        tasks = [t for t in self._queue.tasks if t.kind == "leaving" and chunk_id in (None, t.chunk)]
        for task in tasks:
            self._run_task(task, idle=False)
        done = set(self._leaving) if chunk_id is None else self._leaving & {chunk_id}
        self._uncompiled -= done  # formed now or in idle time: either way their canonicals are compiled
        self._leaving -= done
        return len(tasks)

    def _flush(self, slots: list[Slot]) -> int:
        return self._executor.form_slot_patches(self._state.slots, slots)

    def _pin(self, chunk_id: ChunkId) -> None:
        """Chunks in a live window (or fork) are never evicted from the store's memory tier."""
        if self._persistence is not None and not self._pins_released:
            self.store.pin(self._persistence.canonical_key(self._table.get(chunk_id)))  # type: ignore[union-attr]

    def _unpin(self, chunk_id: ChunkId) -> None:
        if self._persistence is not None and not self._pins_released:
            key = self._persistence.canonical_key(self._table.get(chunk_id))
            self.store.unpin(key)  # type: ignore[union-attr]

    def _flush_stale(self) -> None:
        """Stale slots (a chunk they absorbed was recalled) may be served from their own pending patch."""
        self._flush([s for s in self._state.slots if self._state.graph.is_stale(s.chunk_id)])

    def _view(self) -> WindowView:
        return WindowView(self.engine, self.config, self._table, self._state.slots, self._state.graph, self._state.step)

    def _index(self, chunk_id: ChunkId) -> int:
        for i, s in enumerate(self._state.slots):
            if s.chunk_id == chunk_id:
                return i
        if chunk_id in self._state.evicted:
            raise WindowOperationError(f"chunk {chunk_id!r} is not in the window (evicted)")
        if chunk_id in self._table:
            raise ChunkNotFoundError(f"chunk {chunk_id!r} is not in this window (another branch holds it)")
        raise ChunkNotFoundError(f"unknown chunk {chunk_id!r}")

    def _token_ids(self, values: Sequence[int], what: str) -> list[int]:
        """``values`` as token ids of the engine's vocabulary, or a clear error (nothing changed yet)."""
        if isinstance(values, (str, bytes, bytearray)):
            raise InvalidInputError(f"{what} takes token ids (a sequence of ints), not {type(values).__name__}")
        try:
            items = list(values)
        except TypeError:
            raise InvalidInputError(f"{what} takes a sequence of token ids, got {type(values).__name__}") from None
        ids = []
        for t in items:
            index = as_index(t)
            if index is None:
                raise InvalidInputError(f"{what} takes integer token ids, got {t!r}")
            ids.append(index)
        if not ids:
            raise InvalidInputError(f"{what} needs at least one token")
        self.engine.check_ids(ids)
        return ids

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("prompt must not be empty")
            self._state.media.check_prompt(prompt, self)
            return self.engine.prompt_ids(prompt)
        return self._token_ids(prompt, "prompt")

    def _check_length(self, ids: list[int], new_tokens: int = 0) -> None:
        """The anchor, the window, the prompt and ``new_tokens`` of answer must fit the model's context
        (``ContextLengthError`` before anything is assembled)."""
        self.engine.check_length(len(self.engine.anchor_ids) + self.tokens + len(ids), new_tokens=new_tokens)

    def _check_compression(self, ids: list[int]) -> None:
        """A budget too small for what the compression policy always keeps is refused before any work."""
        if self.compressor is not None:
            self.compressor.check(len(self.engine.anchor_ids) + self.tokens + len(ids), len(ids))

    def _count_prompt(self, ids: list[int], t0: float) -> None:
        """Count one answered prompt (its forward, if it ran one, is counted where it ran)."""
        self._stats.prompt_tokens += len(ids)
        self._stats.time("prompt", time.perf_counter() - t0)

    def _forget_uses(self) -> None:
        """Drop what a use of the window as it was left behind (a change, a new branch): they would not
        belong to the window as it is."""
        self._cache: tuple[Plan, Execution] | None = None  # the last plan and its execution
        # (prompt ids, prefill) of the last prompt that rode in the window's trailing forward
        self._prompt_memo: tuple[tuple[int, ...], Prefilled] | None = None
        self._answers: dict[tuple[tuple[int, ...], int], list[int]] = {}  # greedy answers (is_disposable)

    def _new_use(self) -> None:
        """An answer starts: a policy that does not reuse the window assembled at the last use
        (``recompute``) assembles it again, as it says, even when nothing changed. ``is_disposable``
        compares answers over the KV the window holds, so it is not a new use."""
        if not self.policy.reuses_assembly:
            self._forget_uses()

    def _changed(self, op: str, t0: float | None = None) -> None:
        self._state.step += 1
        self._forget_uses()
        if self.config.background == "off":
            # off the answer's path: the patches whose slot was served another way
            self._executor.form_orphans(raise_errors=False)
        else:
            self._queue.new_step()
            self._queue_patches()
            self._queue_survivors()
            if op in ("slide", "evict"):
                self._queue_prefetch()
                self._queue_place()
        if t0 is not None:
            self._stats.time(op, time.perf_counter() - t0)

    def _mark_dependents(self, chunk_id: ChunkId) -> None:
        """A recalled chunk invalidates every chunk in the window whose KV absorbed it (the cascade)."""
        deps = [d for d in self._state.graph.dependents(chunk_id) if d in self and d != chunk_id]
        self._state.graph.mark_stale(deps)
        self._stats.cascade_marked += len(deps)

    def _enforce_budget(self, keep: ChunkId) -> None:
        """Over budget: the oldest chunks other than ``keep`` (the one just admitted) leave, by a slide when
        they lead the window, else by eviction (``keep`` was recalled in front of them)."""
        budget = self.config.budget_tokens
        while budget is not None and self.tokens > budget:
            victim = next(s.chunk_id for s in self._state.slots if s.chunk_id != keep)
            if victim == self._state.slots[0].chunk_id:
                self.slide(1)
            else:
                self.evict(victim)

    def _prefilled(self, ids: list[int]) -> Prefilled | None:
        """The prompt's prefill from the window's trailing forward, if it is this prompt on this window."""
        memo = self._prompt_memo
        if memo is None or memo[0] != tuple(ids):
            return None
        return memo[1]

    def _materialise(
        self, prompt: list[int] | None = None, *, answer: SamplingParams | None = None
    ) -> tuple[Plan, Execution]:
        """Plan and assemble the window (cached until the next change). ``prompt``: prefill it in the
        plan's trailing forward when there is one (then kept for ``_prefilled``). ``answer``: the sampling of
        the answer decoded on from that prompt, started by the forward's step where it runs in one
        (``Execution.prompt.answer``, for the caller to take; withdrawn here if what follows fails)."""
        if not self._state.slots:
            raise WindowOperationError("the window is empty: add a chunk first")
        if self._cache is not None:
            return self._cache
        t0 = time.perf_counter()
        self._flush_stale()
        self._form_orphans_for_plan()
        plan = self._cost_plan(self.policy.plan(self._view()), len(prompt or []))
        execution: Execution = self._executor.run(
            plan, self._state.slots, self.policy.keeps_slot_kv, self._state.graph, self._state.step, prompt, answer
        )
        try:
            self._materialised(plan, execution, prompt, t0)
        except BaseException:
            started = execution.prompt.take_answer() if execution.prompt is not None else None
            if started is not None:
                started.close()
            raise
        return plan, execution

    def _materialised(self, plan: Plan, execution: Execution, prompt: list[int] | None, t0: float) -> None:
        """Record an assembly that just ran: the slots' new states, the cache, the stats and the work it leaves."""
        self._compiled_by(plan)
        self._deferred_since_use.clear()  # a use: the agent acts (idle time) before the next one
        self._queue.replace("place", None)  # the use placed the window itself
        self.policy.observe(self._view(), plan, execution.placed)
        self._state.slots = execution.slots
        self._cache = (plan, execution)
        self._stats.time("materialise", time.perf_counter() - t0)
        self._log_plan(plan)
        if self.config.background != "off":
            self._queue_patches()  # patches set aside by this use: formed in idle time
            self._queue_free()
        if execution.prompt is not None:  # only when a prompt was passed
            assert prompt is not None
            self._prompt_memo = (tuple(prompt), execution.prompt.prefilled(plan.end + len(prompt)))

    # --- the cost-based plan (plan_cost) ---------------------------------------------------------------
    def _cost_plan(self, plan: Plan, prompt_len: int, *, count: bool = True, inline: bool = False) -> Plan:
        """With background work on, a policy that opts in (``ReusePolicy.cost_based``) has its plan priced
        against the exact alternatives of ``plan_cost`` (one forward from the first prefilled slot on, one
        fused re-prefill of the window) and the cheapest runs; the choice is logged and counted
        (``cost_plans``) unless the plan is only shown (``count=False``). Off, the plan is the policy's.
        ``inline``: required background work, priced for when it runs inline (every deferred compile counts)."""
        if self.config.background == "off" or not self.policy.cost_based:
            return plan
        plan = self._lead_from_own(plan)
        missing = self._deferred if inline else self._missing
        choice = choose(plan, prompt_len, missing, self.cost_model)
        if not count:
            return choice.plan
        self._stats.count_task(self._stats.cost_plans, choice.name)
        if choice.name != "policy":
            reason = choice.describe(self.cost_model)
            self._stats.log(Decision(step=self._state.step, chunk="*", source="cost", reason=reason))
            log.debug("window: %s", reason)
        return choice.plan

    def _missing(self, chunk: Chunk) -> bool:
        """Whether the cost model counts a compile of ``chunk``'s canonical: deferred, and since the last use
        (one deferred before it had the agent's idle time to be compiled in; if that time did not reach it,
        the plan compiles it itself: the same tokens as prefilling it, one forward more). Decided from the
        operations, never from what idle time reached, so the choice, and the answer, do not depend on
        timing."""
        return chunk.id in self._uncompiled and chunk.id in self._deferred_since_use

    def _deferred(self, chunk: Chunk) -> bool:
        """``chunk``'s canonical compile was deferred and no plan has served it from the canonical since."""
        return chunk.id in self._uncompiled

    def _lead_from_own(self, plan: Plan) -> Plan:
        """A lead whose canonical is still to be compiled and whose slot holds KV conditioned on the anchor
        alone (it was prefilled at the front by a fused plan) is served from that KV: the same exact KV,
        no compile on the critical path."""
        if not plan.slots or plan.slots[0].source is not Source.LEAD:
            return plan
        sp, slot = plan.slots[0], self._state.slots[0]
        own = slot.materialised() and slot.antecedent == () and not self._state.graph.is_stale(slot.chunk_id)
        if not own or not self._deferred(sp.chunk):
            return plan
        keep = SlotPlan(sp.chunk, sp.start, sp.antecedent, Source.KEEP, reason="lead: its own KV on the anchor alone")
        return Plan(plan.policy, [keep, *plan.slots[1:]], plan.anchor_len, plan.recompute)

    def _compiled_by(self, plan: Plan) -> None:
        """An executed plan served these chunks from their canonicals: compiled now, whatever the timing."""
        for sp in plan.slots:
            if sp.source in FROM_CANONICAL:
                self._uncompiled.discard(sp.chunk.id)

    def _held(self, chunk: Chunk, pending: PendingPatch) -> bool:
        """A set-aside patch of a chunk whose canonical compile was deferred and no plan has made yet is
        held back, from idle time too, until a foreground plan has compiled it (or a fork or ``flush``): its
        forming would compile the canonical, and whether idle time reached that must not change a plan."""
        return self._deferred(chunk)

    def _form_orphans_for_plan(self, *, everything: bool = False) -> None:
        """Before a plan: form the set-aside patches a plan could use. One of a chunk out of the window (until
        its recall), of the lead, of a chunk whose slot holds conditioning current for where it sits (served
        from that), or formed on an antecedent the envelope would not let it reuse where the chunk sits now
        is looked up by no plan (a survivor looks up only a patch formed on exactly what remains), so it waits
        for idle time; so does one ``_held`` back. With ``everything``, none waits."""
        if not self._executor.orphans:
            return
        # chunk -> (its antecedent now, whether only a patch formed on exactly that is looked up); absent: none
        where: dict[ChunkId, tuple[Antecedent, bool]] = {}
        graph, slots = self._state.graph, self._state.slots
        for i, (slot, _, _, ante) in enumerate(self._view().layout()):
            behind = frozenset(s.chunk_id for s in slots[i + 1 :])
            own = slot.materialised() and not (slot.absorbed & behind) and not graph.is_stale(slot.chunk_id)
            if i == 0 or (own and slot.antecedent == ante):
                continue
            where[slot.chunk_id] = (ante, own and dropped_run(slot.antecedent or (), ante))  # a survivor: exact only

        def wait(chunk: Chunk, pending: PendingPatch) -> bool:
            if everything:
                return False
            if self._held(chunk, pending) or chunk.id not in where:
                return True
            ante, exact_only = where[chunk.id]
            if exact_only:
                return pending.antecedent != ante
            return not judge(pending.antecedent, ante, self.config.envelope).reuse

        self._executor.form_orphans(wait=wait)

    def _log_plan(self, plan: Plan) -> None:
        self._stats.log(Decision(step=self._state.step, chunk="*", source="plan", reason=plan.summary()))


class _Handoff:
    """The answer a window thread starts for ``agenerate``, and whether the call still wants it: a call cancelled
    while the window's work runs withdraws the answer that work starts, whichever of the two ends first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stream: TextStream | None = None
        self._abandoned = False

    def run(self, start: Callable[[], TextStream]) -> TextStream:
        stream = start()
        with self._lock:
            self._stream, abandoned = stream, self._abandoned
        if abandoned:
            stream.close()
        return stream

    def abandon(self) -> None:
        with self._lock:
            self._abandoned, stream = True, self._stream
        if stream is not None:
            in_background(stream.close)  # off the event loop: a withdrawal may wait for a step to end
