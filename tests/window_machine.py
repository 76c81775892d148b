"""The window's stateful model, shared by the text and the mixed-media stateful tests.

A ``kamera`` window and a ``recompute`` window go through the same random operations while a plain
model (``order``, ``evicted``) tracks what they should hold. Two ``kamera`` windows with background work on
go through them too: one runs its queued work at random points (``prepare``, in full or in part), the
other never does; their answers must be identical (what finished in the background changes only latency).
Subclasses add the ``add`` and ``invalid`` rules for their chunk kinds and the re-prefill invariant for their engine.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kamera_engine import KV, Engine
from kamera_sdk import (
    ChunkNotFoundError,
    ContextWindow,
    InvalidInputError,
    Source,
    WindowConfig,
    WindowOperationError,
)

#: what a refused window operation may raise
REFUSALS = (InvalidInputError, WindowOperationError, ChunkNotFoundError)


class WindowModelMachine(RuleBasedStateMachine):
    def __init__(self, engine: Engine, prompt: list[int]) -> None:
        super().__init__()
        self.engine = engine
        self.prompt = prompt
        self.kam = ContextWindow(engine, rank=4)
        self.rec = ContextWindow(engine, policy="recompute")
        self.bg = ContextWindow(engine, config=WindowConfig(rank=4, background="manual"))
        self.bg_twin = ContextWindow(engine, config=WindowConfig(rank=4, background="manual"))
        self.order: list[str] = []
        self.evicted: list[str] = []
        self.snapshot: tuple[ContextWindow, list[str], torch.Tensor] | None = None

    def _both(self, fn) -> None:
        for win in (self.kam, self.rec, self.bg, self.bg_twin):
            fn(win)

    def add_to_both(self, add) -> None:
        """``add`` on both windows (the same content id), then the model's bookkeeping: a window is a set;
        adding an evicted chunk recalls it."""
        cid = add(self.kam)
        assert add(self.rec) == cid
        assert add(self.bg) == cid and add(self.bg_twin) == cid
        if cid in self.order:
            return
        if cid in self.evicted:
            self.evicted.remove(cid)
        self.order.append(cid)

    def assert_refused(self, op) -> None:
        """``op`` on the kamera window must raise a clear error and leave the window as it was."""
        for win in (self.kam, self.bg):
            before = (list(win.chunks), list(win.evicted))
            try:
                op(win)
            except REFUSALS:
                pass
            else:
                raise AssertionError("invalid operation was accepted")
            assert (win.chunks, win.evicted) == before

    def check_survivor(self, got: KV, expect: KV) -> None:
        """A survivor's KV is the rotation of its previous conditioned KV (keys rotated, values carried)."""
        assert (got.keys - expect.keys).abs().max() <= 1e-5
        assert torch.equal(got.values, expect.values)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.order))
        self._both(lambda w: w.evict(cid))
        self.order.remove(cid)
        self.evicted.append(cid)

    @precondition(lambda self: self.evicted)
    @rule(data=st.data())
    def recall(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(self.evicted))
        at = data.draw(st.integers(0, len(self.order)))
        self._both(lambda w: w.recall(cid, at=at))
        self.evicted.remove(cid)
        self.order.insert(at, cid)

    @precondition(lambda self: len(self.order) > 1)
    @rule(data=st.data())
    def reorder(self, data: st.DataObject) -> None:
        perm = data.draw(st.permutations(self.order))
        self._both(lambda w: w.reorder(list(perm)))
        self.order = list(perm)

    @precondition(lambda self: self.order)
    @rule(data=st.data())
    def slide(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.order)))
        self.kam.next_token_logprobs(self.prompt)  # materialise so survivors have conditioned KV
        before = {s.chunk_id: s.kv for s in self.kam.slots}
        self._both(lambda w: w.slide(n))
        self.evicted += self.order[:n]
        self.order = self.order[n:]
        if not self.order:
            return
        plan, assembled = self.kam.plan(), self.kam.assemble()
        for sp in plan.slots:
            if sp.source is Source.SURVIVOR:
                expect = self.engine.relocate(before[sp.chunk.id], sp.start)
                self.check_survivor(assembled.slice(sp.start, sp.start + len(sp.chunk)), expect)

    @precondition(lambda self: self.order and self.snapshot is None)
    @rule()
    def fork(self) -> None:
        lp = self.kam.next_token_logprobs(self.prompt)
        parent = self.kam
        self.snapshot = (parent, list(parent.chunks), lp)
        self.kam = parent.fork()

    @rule(seconds=st.sampled_from([None, 0.0, 0.001]))
    def prepare(self, seconds: float | None) -> None:
        """Idle time reaches the queued work of one background window: all of it, none, or part."""
        self.bg.prepare(seconds)

    @invariant()
    def background_changes_no_result(self) -> None:
        assert self.bg.chunks == self.order and self.bg_twin.chunks == self.order
        if self.order:
            assert torch.equal(self.bg.next_token_logprobs(self.prompt), self.bg_twin.next_token_logprobs(self.prompt))

    @invariant()
    def contents_match_the_model(self) -> None:
        assert self.kam.chunks == self.order and self.rec.chunks == self.order
        assert sorted(self.kam.evicted) == sorted(self.evicted)

    @invariant()
    def forks_stay_isolated(self) -> None:
        if self.snapshot is not None:
            parent, chunks, lp = self.snapshot
            assert parent.chunks == chunks
            assert torch.allclose(parent.next_token_logprobs(self.prompt), lp, atol=1e-6)
