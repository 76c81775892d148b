"""Background work in the window: queued, run in idle time, and never changing a result.

The same scripted session runs with its background work never run (the foreground finishes what it
needs), run in full by ``prepare()`` after every operation, run partly (a budget), and on the idle thread;
tokens and log-probs must be identical. With it on, slide survivors are re-conditioned exactly, so the
window equals re-prefill to float rounding, and the critical path never prefills more than recompute.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kamera_sdk import ContextWindow, InvalidInputError, WindowConfig
from kamera_sdk.stats import Work
from tests.conftest import random_ids, reprefill_logprobs, tiny_engine

PROMPT = [9, 10, 11]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=3)


def _greedy(win: ContextWindow, n: int) -> list[int]:
    """``n`` greedy tokens after the prompt (the tiny engine has no tokenizer for ``generate``)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(win.next_token_logprobs(PROMPT + out).argmax()))
    return out


def _session(engine, config: WindowConfig, idle: str) -> tuple[list[torch.Tensor], list[list[int]], ContextWindow]:
    """A scripted session; ``idle``: what happens in the agent's idle time after each known operation."""
    win = ContextWindow(engine, config=config)
    for i in range(4):
        win.add(random_ids(12 + i, seed=100 + i))
    lps, answers = [win.next_token_logprobs(PROMPT)], []
    for step in range(7):
        win.slide(1)
        if idle == "prepare":
            win.prepare()
        elif idle == "thread":
            deadline = time.time() + 5
            while win.background_pending and time.time() < deadline:
                time.sleep(0.01)
        if step % 3 == 2:
            win.recall(win.evicted[0])
        else:
            win.add(random_ids(10 + step, seed=200 + step))
        if step == 4:
            win.reorder(list(reversed(win.chunks)))
        lps.append(win.next_token_logprobs(PROMPT))
        answers.append(_greedy(win, 3))
    return lps, answers, win


def test_results_do_not_depend_on_what_finished_in_the_background(engine) -> None:
    base_lps, base_answers, base = _session(engine, WindowConfig(rank=4, background="manual"), "none")
    runs = {
        "prepare": _session(engine, WindowConfig(rank=4, background="manual"), "prepare"),
        "partial": _session(engine, WindowConfig(rank=4, background="manual", background_budget_tokens=12), "prepare"),
        "thread": _session(engine, WindowConfig(rank=4, background="auto"), "thread"),
    }
    for name, (lps, answers, win) in runs.items():
        assert answers == base_answers, name
        assert all(torch.equal(a, b) for a, b in zip(lps, base_lps, strict=True)), name
        assert win.chunks == base.chunks
    st_none, st_full = base.stats(), runs["prepare"][2].stats()
    assert not st_none.background_done and st_none.background_inline["survivors"] >= 7
    assert st_full.background_done["survivors"] >= 7 and "survivors" not in st_full.background_inline
    assert st_full.background_tokens > 0 and st_none.background_tokens == 0
    # idle time took the survivors off the critical path
    assert st_full.tokens_prefilled < st_none.tokens_prefilled
    partial = runs["partial"][2].stats()
    assert partial.background_inline  # the budget left work to the foreground
    assert any(d.source == "background" for d in st_full.decisions)
    assert runs["thread"][2].stats().background_done


def test_background_survivors_are_exact(engine) -> None:
    """With background work on, survivors are re-conditioned on what remains: the window equals re-prefill
    (to float rounding), where rotation-only survivors keep what slid out."""
    for idle in ("none", "prepare"):
        win = ContextWindow(engine, config=WindowConfig(rank=4, background="manual"))
        for i in range(4):
            win.add(random_ids(12 + i, seed=100 + i))
        win.next_token_logprobs(PROMPT)
        win.slide(1)
        if idle == "prepare":
            win.prepare()
        win.add(random_ids(9, seed=7))
        assert (win.next_token_logprobs(PROMPT) - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4
    off = ContextWindow(engine, rank=4)
    for i in range(4):
        off.add(random_ids(12 + i, seed=100 + i))
    off.next_token_logprobs(PROMPT)
    off.slide(1)
    off.add(random_ids(9, seed=7))
    assert (off.next_token_logprobs(PROMPT) - reprefill_logprobs(off, PROMPT)).abs().max() > 1e-3


def test_canonicals_of_content_prefilled_in_context_are_deferred(engine) -> None:
    win = ContextWindow(engine, config=WindowConfig(rank=4, background="manual"))
    first = win.add(random_ids(12, seed=1))
    second = win.add(random_ids(12, seed=2))
    assert win.chunk(first).canonical is not None  # it leads: its canonical is exact and needed
    assert win.chunk(second).canonical is None  # prefilled in context at its first use
    assert win.stats().background_queued == {"canonical": 1}
    win.prepare()
    assert win.chunk(second).canonical is not None
    assert win.stats().work[Work.BACKGROUND].tokens == 12


def test_background_off_is_todays_window(engine) -> None:
    win = ContextWindow(engine, rank=4)
    for i in range(3):
        win.add(random_ids(12 + i, seed=100 + i))
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    assert win.background_pending == 0 and win.prepare() == 0
    assert win.stats().survivors_rotated == 0  # counted at the next use
    win.next_token_logprobs(PROMPT)
    assert win.stats().survivors_rotated == 1


def test_background_option_is_checked() -> None:
    with pytest.raises(InvalidInputError):
        WindowConfig(background="sometimes")
    with pytest.raises(InvalidInputError):
        WindowConfig(background_budget_tokens=0)


def _critical(engine, policy: str, config: WindowConfig | None, ops: list[tuple[str, int]]) -> list[int]:
    """Tokens each step's operation plus question ran on the critical path (background work excluded)."""
    win = ContextWindow(engine, policy=policy, config=config)
    out = []
    for op, arg in ops:
        before = win.stats()
        if op == "add":
            win.add(random_ids(6 + arg % 7, seed=500 + arg))
        elif op == "slide" and len(win) > 1:
            win.slide(1)
            win.prepare()  # the idle time before the step (a no-op for recompute)
        elif op == "evict" and len(win) > 1:
            win.evict(win.chunks[arg % len(win)])
            win.prepare()  # like a slide, known ahead: the agent chose what to drop
        elif op == "recall" and win.evicted:
            win.recall(win.evicted[arg % len(win.evicted)])
        elif op == "reorder" and len(win) > 1:
            order = list(win.chunks)
            order.insert(0, order.pop(arg % len(order)))
            win.reorder(order)
        if not len(win):
            win.add(random_ids(8, seed=900 + arg))
        win.next_token_logprobs(PROMPT)
        after = win.stats()
        out.append(
            sum(after._work(w).tokens - before._work(w).tokens for w in (Work.INGEST, Work.CONTEXT, Work.PROMPT))
        )
    return out


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "slide", "evict", "recall", "reorder"]), st.integers(0, 20)),
    min_size=1,
    max_size=10,
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_critical_path_never_prefills_more_than_recompute(ops) -> None:
    """Over random operation sequences: each step's operation plus question runs no more tokens on the
    critical path with background work on (idle time after each slide or eviction, the operations the agent
    knows ahead, as in the window benchmark) than recompute's build plus question."""
    engine = _ENGINE
    ops = [("add", 0), ("add", 1), *ops]
    kam = _critical(engine, "kamera", WindowConfig(rank=4, background="manual"), ops)
    rec = _critical(engine, "recompute", None, ops)
    assert all(k <= r for k, r in zip(kam, rec, strict=True)), (kam, rec)


def test_a_leaving_chunks_patch_is_formed_off_the_critical_path() -> None:
    """Evicting the last chunk: its pending patch (and the canonical it needs, deferred at arrival) waits for
    idle time or its recall, since no plan can use it before; the step costs the prompt alone."""
    ops = [("add", 0), ("add", 1), ("evict", 1)]
    kam = _critical(_ENGINE, "kamera", WindowConfig(rank=4, background="manual"), ops)
    rec = _critical(_ENGINE, "recompute", None, ops)
    assert kam[-1] < rec[-1] and all(k <= r for k, r in zip(kam, rec, strict=True)), (kam, rec)


def test_evicting_the_lead_never_costs_more_than_recompute() -> None:
    """The next chunk comes to lead: its set-aside patch and the one of the chunk behind it wait for idle time
    (no plan uses them while their chunks' conditioning is current)."""
    ops = [("add", 0), ("add", 1), ("add", 2), ("evict", 0)]
    kam = _critical(_ENGINE, "kamera", WindowConfig(rank=4, background="manual"), ops)
    rec = _critical(_ENGINE, "recompute", None, ops)
    assert all(k <= r for k, r in zip(kam, rec, strict=True)), (kam, rec)


#: what the engine runs on a window's critical path (background work excluded)
_CRITICAL = (Work.INGEST, Work.CONTEXT, Work.PROMPT)


def _look_back(policy: str, config: WindowConfig | None, idle: bool) -> tuple[int, int, torch.Tensor]:
    """A multi-hop look-back: four passages asked over, then evict the first, add another, recall the first
    at the end, ask. Returns the forwards and tokens the engine ran on the critical path from the eviction
    to the answer, and the answer's log-probs. ``idle``: the agent's idle time after each operation."""
    win = ContextWindow(_ENGINE, policy=policy, config=config)
    passages = [win.add(random_ids(10 + 3 * i, seed=700 + i)) for i in range(4)]
    win.next_token_logprobs(PROMPT)
    steps = [
        lambda: win.evict(passages[0]),
        lambda: win.add(random_ids(12, seed=777)),
        lambda: win.recall(passages[0]),
    ]
    before = win.stats()
    for step in steps:
        if idle:
            win.prepare()
        step()
    if idle:
        win.prepare()
    lp = win.next_token_logprobs(PROMPT)
    after = win.stats()
    forwards = sum(after._work(w).forwards - before._work(w).forwards for w in _CRITICAL)
    tokens = sum(after._work(w).tokens - before._work(w).tokens for w in _CRITICAL)
    return forwards, tokens, lp


def test_a_look_back_never_costs_more_than_recompute() -> None:
    """Counted in forwards and tokens: with idle time between the operations, the look-back's operations
    plus the question run one forward (the new passage, the recalled one and the prompt together) and fewer
    tokens than recompute's build plus question; with none, no more tokens, and one forward more (the
    survivors' re-conditioning is a forward of its own, so the answer does not depend on timing); the
    answer equals recompute's to float rounding either way."""
    rec_f, rec_t, rec_lp = _look_back("recompute", None, idle=False)
    assert rec_f == 1
    for idle in (True, False):
        f, t, lp = _look_back("kamera", WindowConfig(rank=4, background="manual"), idle)
        assert (lp - rec_lp).abs().max() < 1e-4, idle
        if idle:
            assert f <= rec_f and t < rec_t, (f, t, rec_f, rec_t)
        else:
            assert f <= rec_f + 1 and t <= rec_t, (f, t, rec_f, rec_t)


def test_a_lead_prefilled_in_front_is_served_from_its_own_kv() -> None:
    """A fused re-prefill puts the lead in the forward; its canonical (deferred) is not compiled later to
    serve it: the next use keeps its own KV, conditioned on the anchor alone, and counts the choice."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background="manual"))
    a, b = (win.add(random_ids(8 + i, seed=40 + i)) for i in range(2))
    win.next_token_logprobs(PROMPT)
    c = win.add(random_ids(10, seed=42))
    win.reorder([c, a, b])  # c's canonical was deferred since the last use: compiling it is a forward of its own
    assert (win.next_token_logprobs(PROMPT) - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4
    st = win.stats()
    assert st.fused_refills == 1 and st.cost_plans["fused"] == 1
    assert any(d.source == "cost" and "fused" in d.reason for d in st.decisions)
    assert win.chunk(c).canonical is None
    win.add(random_ids(9, seed=60))
    assert win.plan().slots[0].source.value == "keep"
    assert (win.next_token_logprobs(PROMPT) - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4
    assert win.chunk(c).canonical is None  # idle time may still compile it; nothing on the path did


_ENGINE = tiny_engine("llama", seed=3)


def _lead_after_a_use(idle: bool) -> tuple[ContextWindow, int, int, torch.Tensor]:
    """Three chunks asked over, then (after the agent's idle time, or none) the last comes to lead. Returns
    the window, the forwards and tokens from the reorder to the answer, and the answer's log-probs."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background="manual"))
    a, b, c = (win.add(random_ids(8 + i, seed=40 + i)) for i in range(3))
    win.next_token_logprobs(PROMPT)
    if idle:
        win.prepare()
    before = win.stats()
    win.reorder([c, a, b])
    lp = win.next_token_logprobs(PROMPT)
    after = win.stats()
    forwards = sum(after._work(w).forwards - before._work(w).forwards for w in _CRITICAL)
    tokens = sum(after._work(w).tokens - before._work(w).tokens for w in _CRITICAL)
    return win, forwards, tokens, lp


def test_a_lead_deferred_before_the_last_use_is_served_from_its_canonical() -> None:
    """A chunk whose canonical was deferred before the last use had the agent's idle time to be compiled:
    the plan serves it from the canonical when it comes to lead and prefills only what sits behind it (the
    rerank of the window trace that puts an older page in front). Whether idle time compiled it changes
    where the compile runs, never the plan or the answer: with none the plan compiles it itself, the tokens
    of recompute's build in one forward more."""
    rec = ContextWindow(_ENGINE, policy="recompute")
    for i in range(3):
        rec.add(random_ids(8 + i, seed=40 + i))
    total = sum(8 + i for i in range(3)) + len(PROMPT)
    win, f, t, lp = _lead_after_a_use(idle=True)
    executed = [d.reason for d in win.stats().decisions if d.source == "plan"][-1].split()
    assert executed[0].endswith(":lead") and all(x.endswith(":forward") for x in executed[1:]), executed
    assert win.stats().cost_plans.get("fused", 0) == 0 and win.stats().background_done.get("canonical") == 2
    assert (f, t) == (1, total - 10)  # a and b behind c, with the prompt: c's canonical was ready
    assert (lp - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4
    cold, f0, t0, lp0 = _lead_after_a_use(idle=False)
    assert torch.equal(lp0, lp) and cold.chunks == win.chunks
    assert (f0, t0) == (2, total)  # c compiled on the path: recompute's tokens, one forward more


def _slide_step(idle: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, torch.Tensor]:
    """Four chunks asked over, a slide, the agent's idle time (or none), a new chunk, the question. Returns
    the rotations the question's use ran (``engine.apply`` calls) and its log-probs."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background="manual"))
    for i in range(4):
        win.add(random_ids(8 + i, seed=80 + i))
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    if idle:
        win.prepare()
    win.add(random_ids(9, seed=90))
    calls = []
    apply = _ENGINE.apply
    with monkeypatch.context() as m:
        m.setattr(_ENGINE, "apply", lambda *a, **k: calls.append(1) or apply(*a, **k))
        lp = win.next_token_logprobs(PROMPT)
    assert (lp - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4
    return len(calls), lp


def test_a_slides_survivors_are_placed_in_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a slide the chunks that stay are rotated to their new positions in idle time (a ``place`` task,
    after their re-conditioning): the use takes those rows as written and rotates nothing; with no idle time
    it rotates them itself. The same rotation either way: identical log-probs."""
    idle_rotations, idle_lp = _slide_step(True, monkeypatch)
    cold_rotations, cold_lp = _slide_step(False, monkeypatch)
    assert idle_rotations == 0 and cold_rotations == 3, (idle_rotations, cold_rotations)
    assert torch.equal(idle_lp, cold_lp)


def _make_free_calls(background: str, idle: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, list]:
    """Three chunks asked over (the first use prefills the two behind the lead, which keep their KV), the
    agent's idle time (or none), a slide, idle time again and the question. Returns the ``engine.make_free``
    calls inside the first use and inside the second, and both uses' log-probs."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background=background))
    for i in range(3):
        win.add(random_ids(8 + i, seed=60 + i))
    calls: list[int] = []
    make_free = _ENGINE.make_free
    with monkeypatch.context() as m:
        m.setattr(_ENGINE, "make_free", lambda kv: calls.append(1) or make_free(kv))
        lps = [win.next_token_logprobs(PROMPT)]
        first = len(calls)
        if idle:
            win.prepare()
            assert win.stats().background_done.get("free") == 1
        win.slide(1)
        if idle:
            win.prepare()  # the survivors' re-conditioning, and their un-rotation after it
        del calls[:]
        lps.append(win.next_token_logprobs(PROMPT))
    return first, len(calls), lps


def test_a_formed_slots_position_free_kv_is_computed_off_the_answers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slots a use's forward prefilled keep their KV position-free for later placements; the un-rotation
    (``make_free``) runs after the answer, in idle time (a ``free`` task), or at the latest in the next call
    that places them; with background work off, inside the use as before. The same arithmetic whenever it
    runs: identical log-probs."""
    idle = _make_free_calls("manual", True, monkeypatch)
    cold = _make_free_calls("manual", False, monkeypatch)
    off = _make_free_calls("off", False, monkeypatch)
    assert idle[:2] == (0, 0), idle[:2]  # neither use un-rotated anything: idle time did
    assert cold[0] == 0 and cold[1] > 0, cold[:2]  # the next use did, for the slots it places
    assert off[0] == 2, off[:2]  # inside the use that formed them
    assert all(torch.equal(a, b) for a, b in zip(idle[2], cold[2], strict=True))


def test_a_reorder_compiles_a_new_lead_its_next_use_serves_from_the_canonical() -> None:
    """A chunk added behind others (its canonical deferred) that a reorder puts in front is compiled by the
    reorder when the next use's cheapest plan serves it from that canonical (here a long lead: one forward
    of the whole window would score every token against every other): the question then runs one forward
    over what sits behind it. A short lead is left to the fused re-prefill
    (``test_a_lead_prefilled_in_front_is_served_from_its_own_kv``)."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background="manual"))
    a, b = (win.add(random_ids(90, seed=70 + i)) for i in range(2))
    win.next_token_logprobs(PROMPT)
    c = win.add(random_ids(300, seed=72))
    assert win.chunk(c).canonical is None
    win.reorder([c, a, b])
    assert win.chunk(c).canonical is not None
    assert any(d.reason.startswith("lead compiled by the reorder") for d in win.stats().decisions)
    before = win.stats()
    lp = win.next_token_logprobs(PROMPT)
    after = win.stats()
    forwards = sum(after._work(w).forwards - before._work(w).forwards for w in _CRITICAL)
    tokens = sum(after._work(w).tokens - before._work(w).tokens for w in _CRITICAL)
    assert (forwards, tokens) == (1, 180 + len(PROMPT))
    assert win.plan().slots[0].source.value == "lead"
    assert (lp - reprefill_logprobs(win, PROMPT)).abs().max() < 1e-4


def test_a_reorders_compile_drops_the_queued_canonical_task() -> None:
    """The reorder compiled the lead's canonical: its queued ``canonical`` task goes (it would spend budget on
    nothing), the other chunks' stay."""
    win = ContextWindow(_ENGINE, config=WindowConfig(rank=4, background="manual"))
    a, b = (win.add(random_ids(90, seed=70 + i)) for i in range(2))
    win.next_token_logprobs(PROMPT)
    c, d = win.add(random_ids(300, seed=72)), win.add(random_ids(20, seed=73))
    queued = {t.chunk for t in win._queue.tasks if t.kind == "canonical"}
    assert {c, d} <= queued
    win.reorder([c, a, b, d])
    assert win.chunk(c).canonical is not None
    assert {t.chunk for t in win._queue.tasks if t.kind == "canonical"} == queued - {c}
