"""``ContextWindow``: an agent's context as a set of position-free chunks.

Data flows one way: chunk in -> canonical -> plan -> assemble -> decode. Window operations (reorder,
slide, evict/recall, fork) only edit the slot list; the next use plans how each slot's KV is obtained
(see ``policies/``) and the executor assembles it. Every operation validates its arguments before it
changes anything, so a refused operation leaves the window as it was.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Literal, overload

import torch
from pydantic import BaseModel

from kamera_engine import (
    KV,
    ChunkNotFoundError,
    Engine,
    Grammar,
    InvalidInputError,
    SamplingParams,
    WindowOperationError,
)
from kamera_engine.decode import TextStream, stop_strings
from kamera_engine.runner import Prefilled

from .chunks import VISION_KINDS, Chunk, ChunkId, ChunkTable, StoredPatch, content_id
from .compress import CompressionPolicy, make_compressor
from .compress.runner import Compressed, decode_compressed, prefill_compressed
from .config import WindowConfig
from .executor import Execution, Executor
from .graph import DependencyGraph
from .persistence import Persistence
from .placement import best_order
from .plan import Plan
from .policies import ReusePolicy, WindowView, make_policy
from .slots import Slot
from .stats import Decision, WindowStats
from .store import ChunkStore, default_store_path, open_store

log = logging.getLogger("kamera.window")


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

    ``policy``: ``kamera`` (default), ``recompute``, ``prefix``, ``blind`` (and any registered policy).
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
        self.policy = make_policy(policy)
        self.compressor = None if compress is None else make_compressor(compress, kv_budget)
        if compress is None and kv_budget is not None:
            raise InvalidInputError("kv_budget needs compress= ('elastic' or 'david')")
        self.store: ChunkStore | None = None
        if store is not None:
            self.store = open_store(default_store_path() if store == "default" else store)
        self._table = ChunkTable()
        self._slots: list[Slot] = []
        self._evicted: list[ChunkId] = []
        self._refs: dict[str, ChunkId] = {}  # IMAGE#<ref> names of image chunks (add_image(..., ref=...))
        self._graph = DependencyGraph()
        self._stats = WindowStats(policy=self.policy.name)
        self._step = 0
        self._forget_uses()
        self._pins_released = False  # close() hands the pins back
        self._persistence = None if self.store is None else Persistence(self.store, engine, self._stats)
        self._executor = Executor(engine, self._table, config, self._stats, self._persistence)

    # --- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Form pending patches, flush the store's write-behind queue and release this window's pins on
        the store's memory tier (the store stays open for other windows sharing it). The window still
        answers afterwards; it just no longer keeps its chunks resident."""
        self.flush()
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
        return dict(self._refs)

    @property
    def chunks(self) -> list[ChunkId]:
        """Chunk ids in window order."""
        return [s.chunk_id for s in self._slots]

    @property
    def evicted(self) -> list[ChunkId]:
        """Chunks evicted from the window and still recallable (oldest first)."""
        return list(self._evicted)

    @property
    def graph(self) -> DependencyGraph:
        """The dependency graph of conditioning (antecedent -> patch -> dependent)."""
        return self._graph

    @property
    def tokens(self) -> int:
        """Tokens in the window, chunks only (the chat anchor and prompt excluded)."""
        return sum(len(self._table.get(s.chunk_id)) for s in self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, chunk_id: object) -> bool:
        return any(s.chunk_id == chunk_id for s in self._slots)

    def chunk(self, chunk_id: ChunkId) -> Chunk:
        """The table entry of a chunk in this window or evicted from it."""
        if chunk_id not in self and chunk_id not in self._evicted:
            raise ChunkNotFoundError(f"chunk {chunk_id!r} is not in this window nor evicted from it")
        return self._table.get(chunk_id)

    def stats(self) -> WindowStats:
        """A snapshot of what this window has done (store counters included when there is a store)."""
        snap = self._stats.model_copy(deep=True)
        if self.store is not None:
            st = self.store.stats()
            snap.store_load_failures += st.refused_checksum + st.refused_fingerprint + st.load_errors
        return snap

    # --- adding content ------------------------------------------------------------------------
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
        cid = content_id("text", text.encode())
        if cid in self._table:
            return self._append_known(cid)
        return self._add(Chunk(cid, "text", self.engine.tokenize(text), text=text))

    def add_image(self, image: object, **kwargs: object) -> ChunkId:
        """Append an image chunk (PIL image, path, bytes or http(s) URL; VLM engines). See ``vision``."""
        from .vision import add_image

        return add_image(self, image, **kwargs)  # type: ignore[arg-type]

    def add_video(self, video: object, **kwargs: object) -> list[ChunkId]:
        """Append a video (file, bytes or frames) as one chunk per segment of sampled frames. See ``vision``."""
        from .vision import add_video

        return add_video(self, video, **kwargs)  # type: ignore[arg-type]

    def add(self, token_ids: Sequence[int], *, kind: str = "tokens", text: str | None = None) -> ChunkId:
        """Append a pre-tokenised chunk. ``kind`` is part of its content id (the same tokens under two kinds
        are two chunks); images and video go through ``add_image`` / ``add_video``."""
        if not isinstance(kind, str) or not kind or kind in VISION_KINDS:
            raise InvalidInputError(f"add() takes a text kind, not {kind!r}; images and video: add_image / add_video")
        ids = self._token_ids(token_ids, "a chunk")
        cid = content_id(kind, torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        if cid in self._table:
            return self._append_known(cid)
        return self._add(Chunk(cid, kind, ids, text=text))

    def _add(self, chunk: Chunk) -> ChunkId:
        self._check_fits(chunk)
        if self._persistence is not None:
            chunk.patches = self._persistence.load_patches(chunk)
        if self.policy.needs_canonical:
            self._executor.canonical(chunk)  # written at arrival; if it fails, nothing is recorded
        entry = self._table.put(chunk)
        self._graph.add_chunk(entry.id)
        return self._admit(entry.id)

    def _append_known(self, cid: ChunkId) -> ChunkId:
        if cid in self:
            return cid  # a window is a set: already present, nothing to do
        if cid in self._evicted:
            self.recall(cid)
            return cid
        chunk = self._table.get(cid)  # known to another branch of this window
        self._check_fits(chunk)
        if self.policy.needs_canonical:
            self._executor.canonical(chunk)
        self._stats.canonicals_reused += 1
        return self._admit(cid)

    def _admit(self, cid: ChunkId) -> ChunkId:
        """Append a known chunk's slot (its canonical is in place), then keep the window in budget."""
        self._slots.append(Slot(cid))
        self._pin(cid)
        self._changed("add")
        self._enforce_budget(keep=cid)
        return cid

    def _check_fits(self, chunk: Chunk) -> None:
        budget = self.config.budget_tokens
        if budget is not None and len(chunk) > budget:
            raise InvalidInputError(f"a chunk of {len(chunk)} tokens does not fit in budget_tokens={budget}")

    # --- window operations ---------------------------------------------------------------------
    def evict(self, chunk_id: ChunkId) -> None:
        """Drop a chunk's conditioned KV from the window; its canonical stays, so it can be recalled."""
        idx = self._index(chunk_id)
        t0 = time.perf_counter()
        self._flush([self._slots[idx]])
        self._slots.pop(idx)
        self._unpin(chunk_id)
        self._graph.drop_conditioning(chunk_id)
        self._evicted.append(chunk_id)
        self._changed("evict", t0)

    def recall(self, chunk_id: ChunkId, at: int | None = None) -> None:
        """Re-admit an evicted chunk at slot index ``at`` (default: the end). No re-encode; its next use
        forms a fresh patch on its now-fixed earlier context (or reuses one formed on that same context)."""
        if chunk_id in self:
            raise WindowOperationError(f"chunk {chunk_id!r} is already in the window")
        if chunk_id not in self._evicted:
            if chunk_id in self._table:
                raise WindowOperationError(f"chunk {chunk_id!r} was not evicted")
            raise ChunkNotFoundError(f"unknown chunk {chunk_id!r}")
        pos = len(self._slots) if at is None else as_index(at)
        if pos is None or not 0 <= pos <= len(self._slots):
            raise InvalidInputError(f"recall position must be an int in [0, {len(self._slots)}], got {at!r}")
        t0 = time.perf_counter()
        self._evicted.remove(chunk_id)
        self._slots.insert(pos, Slot(chunk_id, recalled=True))
        self._pin(chunk_id)
        self._mark_dependents(chunk_id)
        self._changed("recall", t0)
        self._enforce_budget(keep=chunk_id)

    def slide(self, n: int = 1) -> list[ChunkId]:
        """Drop the oldest ``n`` chunks (they stay recallable); survivors are served by rotation only, or
        re-conditioned once with a removal patch under ``survivors="patch"``."""
        count = as_index(n)
        if count is None or count < 0:
            raise InvalidInputError(f"slide takes a number of chunks (an int >= 0), got {n!r}")
        if count > len(self._slots):
            raise WindowOperationError(f"cannot slide {count} chunks out of a window of {len(self._slots)}")
        n = count
        if n == 0:
            return []
        t0 = time.perf_counter()
        gone = [s.chunk_id for s in self._slots[:n]]
        self._flush(self._slots[:n])
        del self._slots[:n]
        for cid in gone:
            self._unpin(cid)
            self._graph.drop_conditioning(cid)
        self._evicted.extend(gone)
        self._changed("slide", t0)
        return gone

    def reorder(self, order: Sequence[ChunkId] | Literal["auto"]) -> list[ChunkId]:
        """Put the window's chunks in ``order`` (a permutation of the window), or ``"auto"``: the order
        that maximises reuse of stored conditioning (see ``placement``). Returns the new order."""
        t0 = time.perf_counter()  # the search for an order ("auto") counts in the reorder's time
        if isinstance(order, str):
            if order != "auto":
                raise InvalidInputError(f"reorder takes a permutation of the window or 'auto', got {order!r}")
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
        by_id = {s.chunk_id: s for s in self._slots}
        before = self._slots
        self._slots = [by_id[c] for c in order]
        if self.config.reorder_patch == "orbit" and self.policy.name == "kamera":
            try:
                self._form_missing_orbit_patches()
            except BaseException:
                self._slots = before  # the orbit patches formed so far stay stored; the order does not change
                raise
        self._changed("reorder", t0)
        return order

    def fork(self) -> ContextWindow:
        """Copy-on-write branch: canonicals, patches and current slot KV are shared, not copied; each
        branch edits only its own slot list from here on."""
        child = ContextWindow.__new__(ContextWindow)
        child.engine = self.engine
        child.config = self.config
        child.policy = self.policy.fork()
        child.compressor = self.compressor
        child.store = self.store
        child._persistence = self._persistence
        child._table = self._table
        child._slots = list(self._slots)  # Slot objects are immutable; tensors shared
        child._evicted = list(self._evicted)
        child._refs = dict(self._refs)
        child._graph = self._graph.copy()
        child._stats = WindowStats(policy=self.policy.name)
        child._step = self._step
        child._forget_uses()
        child._pins_released = False
        for cid in child.chunks:
            child._pin(cid)  # the branch holds its own pins: its chunks stay resident while it lives
        child._executor = Executor(self.engine, self._table, self.config, child._stats, self._persistence)
        self._stats.time("fork", 0.0)
        return child

    # --- using the window ----------------------------------------------------------------------
    def plan(self) -> Plan:
        """The plan the next use would execute (no forward pass is run; pending patches that the plan
        needs are formed)."""
        self._flush_stale()
        return self.policy.plan(self._view())

    def assemble(self) -> KV:
        """Materialise the window: the anchor and every chunk's KV, placed."""
        return self._materialise()[1].assembled

    def next_token_logprobs(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """Log-probabilities (vocab,) of the next token after the prompt."""
        ids = self._prompt_ids(prompt)
        self._check_length(ids)
        plan, execution = self._materialise(ids)
        t0 = time.perf_counter()
        memo = self._prefilled(ids)
        if memo is not None:  # the prompt rode in the window's trailing forward (now or at an earlier call)
            lp = torch.log_softmax(memo.logits.float(), dim=-1).cpu()
        else:
            lp = self.engine.next_token_logprobs(execution.parts, ids, plan.end)
        self._count_prompt(ids, t0, own_forward=memo is None)
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
        plan, execution = self._materialise(ids if self.compressor is None else None)
        t0 = time.perf_counter()
        memo = self._prefilled(ids) if self.compressor is None else None
        if self.compressor is not None:
            tokens = decode_compressed(self.engine, self.compress_window(ids), self.compressor, params)
        else:
            tokens = self._answer_ids(ids, plan, execution, memo, params)
        pieces = self.engine.stream(tokens, params)
        self._count_prompt(ids, t0, own_forward=memo is None)
        return pieces if stream else "".join(pieces)

    def compress_window(self, prompt: str | Sequence[int]) -> Compressed:
        """Prefill the prompt over the window and compress the cache with the window's compression
        policy (the assembled window itself is left intact). Returns the compressed cache for decoding."""
        if self.compressor is None:
            raise WindowOperationError("this window has no compression policy (pass compress=...)")
        ids = self._prompt_ids(prompt)
        self._check_length(ids)
        self._check_compression(ids)
        plan, execution = self._materialise()
        window_ids = list(self.engine.anchor_ids) + [t for sp in plan.slots for t in sp.chunk.token_ids]
        vision = torch.tensor(
            [False] * plan.anchor_len + [sp.chunk.kind in VISION_KINDS for sp in plan.slots for _ in sp.chunk.token_ids]
        )
        t0 = time.perf_counter()
        c = prefill_compressed(self.engine, execution.parts, window_ids, ids, self.compressor, vision)
        self._stats.compression_stats_tokens += c.stats_tokens
        self._stats.kv_bytes_fraction = c.kv_bytes_fraction
        self._stats.time("compress", time.perf_counter() - t0)
        return c

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
        plan, execution = self._materialise(ids)
        key = (tuple(ids), max_new_tokens)
        if key not in self._answers:
            t0 = time.perf_counter()
            memo = self._prefilled(ids)
            self._answers[key] = list(self._answer_ids(ids, plan, execution, memo, params))
            self._count_prompt(ids, t0, own_forward=memo is None)
        parts = [self.engine.anchor_kv]
        pos = plan.anchor_len
        for i, sp in enumerate(plan.slots):
            if i == idx:
                if mode == "chunk":
                    continue
                parts.append(self.engine.apply(self._executor.canonical(sp.chunk), None, pos))
            else:
                placed, free = execution.placed[i], execution.slots[i].kv
                if int(placed.positions[0]) == pos:
                    parts.append(placed)
                elif free is not None:  # one rotation from angle 0, as every placement
                    parts.append(self.engine.apply(free, None, pos))
                else:
                    parts.append(self.engine.relocate(placed, pos))
            pos += len(sp.chunk)
        t0 = time.perf_counter()
        answers = [self._answers[key], list(self.engine.generate_ids(parts, ids, pos, params))]
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
        forward (``memo``), else after prefilling the prompt over the assembled window."""
        if memo is not None:
            return self.engine.continue_ids(memo, params)
        return self.engine.generate_ids(execution.parts, ids, plan.end, params)

    def _decode(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(token_ids, skip_special_tokens=True) if tok is not None else str(token_ids)

    def form_orbit_patch(self, chunk_id: ChunkId) -> StoredPatch:
        """Form (and store) an orbit patch for ``chunk_id`` over orderings of its current predecessor set:
        Delta averaged over orderings (all up to ``orbit_exhaustive_max`` predecessors, a seeded sample
        beyond), one conditioned forward per ordering. One patch then serves every ordering (§5)."""
        idx = self._index(chunk_id)
        preds = self.chunks[:idx]
        if not preds:
            raise WindowOperationError("the leading chunk needs no patch")
        chunk = self._table.get(chunk_id)
        orderings = self._orderings(preds)
        t0 = time.perf_counter()
        conditioned = []
        for ordering in orderings:
            ids = [t for c in ordering for t in self._table.get(c).token_ids] + chunk.token_ids
            res = self.engine.forward(ids, self.engine.anchor_kv, len(self.engine.anchor_ids), logits="none")
            self._stats.forwards += 1
            self._stats.tokens_prefilled += len(ids)
            conditioned.append(res.kv.slice(len(ids) - len(chunk), len(ids)))
        stored = self._executor.store_patch(chunk, conditioned, "orbit", tuple(preds))
        self._stats.orbit_patches_formed += 1
        self._stats.time("orbit_patch", time.perf_counter() - t0)
        return stored

    # --- internals -----------------------------------------------------------------------------
    def _orderings(self, preds: list[ChunkId]) -> list[tuple[ChunkId, ...]]:
        if len(preds) <= self.config.orbit_exhaustive_max or self.config.orbit_samples >= math.factorial(len(preds)):
            return list(itertools.permutations(preds))
        rng = random.Random(self.config.seed)
        seen = {tuple(preds)}
        out = [tuple(preds)]
        while len(out) < self.config.orbit_samples:
            perm = tuple(rng.sample(preds, len(preds)))
            if perm not in seen:
                seen.add(perm)
                out.append(perm)
        return out

    def _form_missing_orbit_patches(self) -> None:
        for i, cid in enumerate(self.chunks):
            if i == 0:
                continue
            chunk = self._table.get(cid)
            preds = frozenset(self.chunks[:i])
            if not any(p.kind == "orbit" and p.antecedent_set == preds for p in chunk.patches):
                self.form_orbit_patch(cid)

    def flush(self) -> int:
        """Form every pending patch now (normally formed when a chunk leaves the window or is needed, or
        at the next window operation once its slot was served another way). Returns how many were formed."""
        return self._form_orphans() + self._flush(self._slots)

    def _form_orphans(self, *, raise_errors: bool = True) -> int:
        """Form the patches set aside when their slot was served another way. One that fails stays queued
        (with those behind it); after a window operation the failure is logged, not raised: the
        operation itself has succeeded."""
        orphans = self._executor.orphans
        formed = 0
        while orphans:
            chunk, kv, pending = orphans[0]
            new = pending.stored is None
            try:
                self._executor.form_pending(chunk, kv, pending)
            except Exception as exc:
                if raise_errors:
                    raise
                log.warning("window: forming a set-aside patch of %s failed (kept for later): %s", chunk.id[:8], exc)
                return formed
            orphans.pop(0)
            formed += new
        return formed

    def _flush(self, slots: list[Slot]) -> int:
        formed = 0
        for i, slot in enumerate(self._slots):
            if slot.pending is None or slot.kv is None or not any(slot is s for s in slots):
                continue
            formed += slot.pending.stored is None  # a fork sharing this slot may have formed it already
            self._executor.form_pending(self._table.get(slot.chunk_id), slot.kv, slot.pending)
            self._slots[i] = replace(slot, pending=None)
        return formed

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
        self._flush([s for s in self._slots if self._graph.is_stale(s.chunk_id)])

    def _view(self) -> WindowView:
        return WindowView(self.engine, self.config, self._table, self._slots, self._graph, self._step)

    def _index(self, chunk_id: ChunkId) -> int:
        for i, s in enumerate(self._slots):
            if s.chunk_id == chunk_id:
                return i
        if chunk_id in self._evicted:
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
            if "IMAGE#" in prompt:
                from .vision import check_prompt_refs

                check_prompt_refs(self, prompt)
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

    def _count_prompt(self, ids: list[int], t0: float, *, own_forward: bool = True) -> None:
        self._stats.forwards += own_forward  # a prompt fused into the window's forward ran no pass of its own
        self._stats.prompt_tokens += len(ids)
        self._stats.time("prompt", time.perf_counter() - t0)

    def _forget_uses(self) -> None:
        """Drop what a use of the window as it was left behind (a change, a new branch): they would not
        belong to the window as it is."""
        self._cache: tuple[Plan, Execution] | None = None  # the last plan and its execution
        # (prompt ids, prefill) of the last prompt that rode in the window's trailing forward
        self._prompt_memo: tuple[tuple[int, ...], Prefilled] | None = None
        self._answers: dict[tuple[tuple[int, ...], int], list[int]] = {}  # greedy answers (is_disposable)

    def _changed(self, op: str, t0: float | None = None) -> None:
        self._step += 1
        self._forget_uses()
        self._form_orphans(raise_errors=False)  # off the answer's path: patches whose slot was served otherwise
        if t0 is not None:
            self._stats.time(op, time.perf_counter() - t0)

    def _mark_dependents(self, chunk_id: ChunkId) -> None:
        """A recalled chunk invalidates every chunk in the window whose KV absorbed it (the cascade)."""
        deps = [d for d in self._graph.dependents(chunk_id) if d in self and d != chunk_id]
        self._graph.mark_stale(deps)
        self._stats.cascade_marked += len(deps)

    def _enforce_budget(self, keep: ChunkId) -> None:
        """Over budget: the oldest chunks other than ``keep`` (the one just admitted) leave, by a slide when
        they lead the window, else by eviction (``keep`` was recalled in front of them)."""
        budget = self.config.budget_tokens
        while budget is not None and self.tokens > budget:
            victim = next(s.chunk_id for s in self._slots if s.chunk_id != keep)
            if victim == self._slots[0].chunk_id:
                self.slide(1)
            else:
                self.evict(victim)

    def _prefilled(self, ids: list[int]) -> Prefilled | None:
        """The prompt's prefill from the window's trailing forward, if it is this prompt on this window."""
        memo = self._prompt_memo
        if memo is None or memo[0] != tuple(ids):
            return None
        return memo[1]

    def _materialise(self, prompt: list[int] | None = None) -> tuple[Plan, Execution]:
        """Plan and assemble the window (cached until the next change). ``prompt``: prefill it in the
        plan's trailing forward when there is one (then kept for ``_prefilled``)."""
        if not self._slots:
            raise WindowOperationError("the window is empty: add a chunk first")
        if self._cache is not None:
            return self._cache
        t0 = time.perf_counter()
        self._flush_stale()
        plan = self.policy.plan(self._view())
        execution: Execution = self._executor.run(
            plan, self._slots, self.policy.keeps_slot_kv, self._graph, self._step, prompt
        )
        self.policy.observe(self._view(), plan, execution.placed)
        self._slots = execution.slots
        self._cache = (plan, execution)
        self._stats.time("materialise", time.perf_counter() - t0)
        self._log_plan(plan)
        if execution.prompt is not None:  # only when a prompt was passed
            assert prompt is not None
            self._prompt_memo = (tuple(prompt), execution.prompt.prefilled(plan.end + len(prompt)))
        return plan, execution

    def _log_plan(self, plan: Plan) -> None:
        self._stats.log(Decision(step=self._step, chunk="*", source="plan", reason=plan.summary()))
