"""Random sequences of add / evict / recall / reorder / slide / fork against a plain model of the window.

After every step: the window's contents equal the model's; ``recompute`` equals re-prefill exactly; a
``kamera`` survivor's KV is the rotation of its previous conditioned KV; forks stay isolated; invalid
operations raise and change nothing.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kamera_sdk import ChunkNotFoundError, ContextWindow, InvalidInputError, Source, WindowOperationError
from tests.conftest import ANCHOR, random_ids, tiny_engine

ENGINE = tiny_engine("qwen2", seed=5)
POOL = [random_ids(6 + (i % 5), seed=300 + i) for i in range(10)]
PROMPT = [7, 8, 9]
ERRORS = (InvalidInputError, WindowOperationError, ChunkNotFoundError)


def reprefill(win: ContextWindow) -> torch.Tensor:
    ids = [t for c in win.chunks for t in win.chunk(c).token_ids]
    # re-prefill as a serving engine does it: the window and the prompt in one forward after the anchor
    res = ENGINE.forward(ids + PROMPT, ENGINE.anchor_kv, len(ANCHOR), logits="last")
    return torch.log_softmax(res.logits[-1].float(), dim=-1)


class WindowMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kam = ContextWindow(ENGINE, rank=4)
        self.rec = ContextWindow(ENGINE, policy="recompute")
        self.order: list[str] = []
        self.evicted: list[str] = []
        self.snapshot: tuple[ContextWindow, list[str], torch.Tensor] | None = None

    def _both(self, fn) -> None:
        fn(self.kam)
        fn(self.rec)

    @rule(i=st.integers(0, len(POOL) - 1))
    def add(self, i: int) -> None:
        ids = POOL[i]
        cid = self.kam.add(ids)
        assert self.rec.add(ids) == cid
        if cid in self.order:
            return
        if cid in self.evicted:
            self.evicted.remove(cid)
        self.order.append(cid)

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
        if self.order:
            self.kam.next_token_logprobs(PROMPT)  # materialise so survivors have conditioned KV
        before = {s.chunk_id: s.kv for s in self.kam._slots}
        self._both(lambda w: w.slide(n))
        self.evicted += self.order[:n]
        self.order = self.order[n:]
        if not self.order:
            return
        plan = self.kam.plan()
        assembled = self.kam.assemble()
        for sp in plan.slots:
            if sp.source is Source.SURVIVOR:
                expect = ENGINE.relocate(before[sp.chunk.id], sp.start)
                got = assembled.slice(sp.start, sp.start + len(sp.chunk))
                assert (got.keys - expect.keys).abs().max() <= 1e-5
                assert torch.equal(got.values, expect.values)

    @precondition(lambda self: self.order and self.snapshot is None)
    @rule()
    def fork(self) -> None:
        lp = self.kam.next_token_logprobs(PROMPT)
        parent = self.kam
        self.snapshot = (parent, list(parent.chunks), lp)
        self.kam = parent.fork()

    @rule(which=st.integers(0, 4))
    def invalid(self, which: int) -> None:
        before = (list(self.kam.chunks), list(self.kam.evicted))
        ops = [
            lambda w: w.evict("not-a-chunk"),
            lambda w: w.slide(len(self.order) + 1),
            lambda w: w.reorder([*self.order, "extra"]),
            lambda w: w.recall(self.order[0]) if self.order else w.recall("nope"),
            lambda w: w.add([]),
        ]
        try:
            ops[which](self.kam)
        except ERRORS:
            pass
        else:
            raise AssertionError("invalid operation was accepted")
        assert (self.kam.chunks, self.kam.evicted) == before

    @invariant()
    def contents_match_the_model(self) -> None:
        assert self.kam.chunks == self.order and self.rec.chunks == self.order
        assert sorted(self.kam.evicted) == sorted(self.evicted)

    @invariant()
    def recompute_equals_reprefill(self) -> None:
        if self.order:
            assert torch.equal(self.rec.next_token_logprobs(PROMPT), reprefill(self.rec))
            lp = self.kam.next_token_logprobs(PROMPT)
            assert torch.isfinite(lp).all()

    @invariant()
    def forks_stay_isolated(self) -> None:
        if self.snapshot is not None:
            parent, chunks, lp = self.snapshot
            assert parent.chunks == chunks
            assert torch.allclose(parent.next_token_logprobs(PROMPT), lp, atol=1e-6)


WindowMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)
TestWindowStateful = WindowMachine.TestCase
