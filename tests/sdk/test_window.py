"""ContextWindow on tiny random models: operations, plans, forks, graph, errors."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kamera_engine import SamplingParams
from kamera_sdk import (
    ChunkNotFoundError,
    ContextLengthError,
    ContextWindow,
    InvalidInputError,
    Source,
    WindowConfig,
    WindowOperationError,
)
from tests.conftest import ANCHOR, random_ids, reprefill_logprobs, tiny_engine

PROMPT = [9, 10, 11]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=3)


def _filled(engine, policy: str = "kamera", n: int = 4, **kw) -> tuple[ContextWindow, list[str]]:
    win = ContextWindow(engine, policy=policy, **kw)
    ids = [win.add(random_ids(12 + i, seed=100 + i)) for i in range(n)]
    return win, ids


def test_recompute_equals_reprefill_exactly(engine) -> None:
    win, _ = _filled(engine, "recompute")
    assert torch.equal(win.next_token_logprobs(PROMPT), reprefill_logprobs(win, PROMPT))


def test_adding_known_content_costs_nothing(engine) -> None:
    win, ids = _filled(engine)
    before = win.stats()
    assert win.add(random_ids(12, seed=100)) == ids[0]  # already in the window: a set, nothing happens
    after = win.stats()
    assert (after.forwards, after.canonicals_computed, len(win)) == (before.forwards, before.canonicals_computed, 4)
    win.slide(1)
    win.add(random_ids(12, seed=100))  # evicted content comes back as a recall, canonical reused
    assert win.stats().canonicals_computed == before.canonicals_computed
    assert win.chunks[-1] == ids[0]


def test_slide_survivors_are_rotation_only(engine) -> None:
    win, _ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    before = {s.chunk_id: s.kv for s in win.slots}
    win.slide(1)
    plan = win.plan()
    assert [sp.source for sp in plan.slots] == [Source.LEAD, Source.SURVIVOR, Source.SURVIVOR]
    forwards = win.stats().forwards
    assembled = win.assemble()
    assert win.stats().forwards == forwards  # no forward pass at all
    # a survivor's KV is the single rotation of its previous conditioned KV to the new place
    sp = plan.slots[2]
    expect = engine.relocate(before[sp.chunk.id], sp.start)
    got = assembled.slice(sp.start, sp.start + len(sp.chunk))
    assert (got.keys - expect.keys).abs().max() <= 1e-5 and torch.equal(got.values, expect.values)


def test_new_chunk_forwards_once_and_forms_a_patch(engine) -> None:
    win, _ = _filled(engine, n=2)
    win.next_token_logprobs(PROMPT)
    new = win.add(random_ids(10, seed=7))
    plan = win.plan()
    assert plan.slots[-1].source is Source.FORWARD and plan.slots[-1].chunk.id == new
    tokens = win.stats().tokens_prefilled
    win.next_token_logprobs(PROMPT)
    st = win.stats()
    assert st.tokens_prefilled - tokens == 10
    # the patch is pending on the slot (formed off the critical path) until the chunk leaves or a flush
    assert win.chunk(new).patches == [] and win.slots[-1].pending is not None
    assert win.flush() == 2 and len(win.chunk(new).patches) == 1  # the second original chunk too
    assert win.flush() == 0


def test_recall_gets_a_fresh_patch_and_reuses_it_in_the_same_context(engine) -> None:
    win, ids = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)
    win.evict(ids[1])
    win.next_token_logprobs(PROMPT)
    win.recall(ids[1])
    sp = win.plan().slots[-1]
    assert sp.source is Source.FORWARD and "fresh" in sp.reason
    win.next_token_logprobs(PROMPT)
    win.evict(ids[1])  # leaving the window forms its pending fresh patch
    assert win.stats().fresh_patches_formed == 1
    win.next_token_logprobs(PROMPT)
    win.recall(ids[1])
    sp = win.plan().slots[-1]
    assert sp.source is Source.PATCH and sp.patch is not None and sp.patch.kind == "fresh"


def test_reorder_reuses_conditioning_within_the_envelope(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    win.reorder([ids[1], ids[0], ids[2], ids[3]])
    plan = win.plan()
    assert [sp.source for sp in plan.slots] == [Source.LEAD, Source.FORWARD, Source.KEEP, Source.KEEP]
    assert "reordered" in plan.slots[2].reason and "reordered" in plan.slots[3].reason
    assert plan.forward_tokens() == len(win.chunk(ids[0]))  # only the chunk that gained new material


def test_reorder_auto_minimises_forward_tokens(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    win.reorder([ids[3], ids[2], ids[1], ids[0]])
    assert win.plan().forward_tokens() > 0
    order = win.reorder("auto")
    assert sorted(order) == sorted(ids)
    assert win.plan().forward_tokens() == 0


def test_reorder_auto_finds_the_free_order_beyond_the_exhaustive_search(engine) -> None:
    """Nine chunks (past the exhaustive search of six): a shuffle would re-prefill most of them; auto
    finds an order with nothing to prefill, and its search time counts in the reorder timing."""
    win = ContextWindow(engine)
    ids = [win.add(random_ids(6, seed=700 + i)) for i in range(9)]
    win.next_token_logprobs(PROMPT)
    shuffled = [ids[i] for i in (4, 7, 1, 8, 0, 3, 6, 2, 5)]
    win.reorder(shuffled)
    assert win.plan().forward_tokens() > 0
    before = win.stats().timings["reorder"].total_s
    order = win.reorder("auto")
    assert sorted(order) == sorted(ids) and win.plan().forward_tokens() == 0
    assert win.stats().timings["reorder"].total_s - before > 0.001  # the search ran inside the timing


def test_orbit_patch_serves_a_reordered_set(engine) -> None:
    cfg = WindowConfig(reorder_patch="orbit", rank=8)
    win = ContextWindow(engine, config=cfg)
    ids = [win.add(random_ids(10, seed=200 + i)) for i in range(4)]
    win.next_token_logprobs(PROMPT)
    win.reorder([ids[1], ids[0], ids[2], ids[3]])
    st = win.stats()
    assert st.orbit_patches_formed == 3
    last = win.chunk(ids[3])
    orbit = [p for p in last.patches if p.kind == "orbit"]
    assert orbit and orbit[0].orderings == 6  # all 3! orderings of its three predecessors
    assert win.plan().slots[3].source is Source.PATCH


def test_fork_is_copy_on_write_and_isolated(engine) -> None:
    win, ids = _filled(engine)
    lp_parent = win.next_token_logprobs(PROMPT)
    ptrs = [s.kv.keys.data_ptr() for s in win.slots]
    child = win.fork()
    assert child._table is win._table
    assert [s.kv.keys.data_ptr() for s in child.slots] == ptrs  # nothing copied at fork time
    child.slide(2)
    child.add(random_ids(9, seed=77))
    child.reorder(list(reversed(child.chunks)))
    child.next_token_logprobs(PROMPT)
    assert win.chunks == ids
    assert [s.kv.keys.data_ptr() for s in win.slots] == ptrs
    assert torch.equal(win.next_token_logprobs(PROMPT), lp_parent)


def test_graph_marks_dependents_and_counts_the_cascade(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    assert set(win.graph.dependents(ids[0])) == set(ids[1:])
    win.evict(ids[1])
    win.next_token_logprobs(PROMPT)
    win.recall(ids[1], at=1)
    plan = win.plan()
    # c and d are back behind exactly the antecedent their first patches were formed on: reuse them
    assert [sp.source for sp in plan.slots[2:]] == [Source.PATCH, Source.PATCH]
    assert all("identical" in sp.reason for sp in plan.slots[2:])
    win.next_token_logprobs(PROMPT)
    st = win.stats()
    assert st.cascade_marked >= 2 and st.cascade_rematerialised == 2


def test_budget_tokens_slides_the_oldest_out(engine) -> None:
    win = ContextWindow(engine, budget_tokens=30)
    a = win.add(random_ids(12, 1))
    b = win.add(random_ids(12, 2))
    c = win.add(random_ids(12, 3))
    assert win.chunks == [b, c] and win.evicted == [a]


def _greedy(engine, ids: list[int], n: int) -> str:
    """Reference answer: the chunks re-prefilled after the anchor, then the prompt decoded greedily."""
    past = engine.forward(ids, engine.anchor_kv, len(ANCHOR), logits="none").kv
    parts = [engine.anchor_kv, past]
    return str(list(engine.generate_ids(parts, PROMPT, len(ANCHOR) + len(ids), SamplingParams(max_new_tokens=n))))


def test_is_disposable_costs_one_decode(engine) -> None:
    win, ids = _filled(engine, "recompute")
    tokens = [win.chunk(c).token_ids for c in ids]
    res = win.is_disposable(ids[3], PROMPT, mode="chunk", max_new_tokens=4)
    # the last chunk: nothing in front of it changes without it, so both answers are re-prefill's
    assert res.answer_with == _greedy(engine, [t for c in tokens for t in c], 4)
    assert res.answer_without == _greedy(engine, [t for c in tokens[:3] for t in c], 4)
    assert res.disposable == (res.answer_with == res.answer_without)
    before = win.stats()
    again = win.is_disposable(ids[1], PROMPT, mode="chunk", max_new_tokens=4)
    after = win.stats()
    assert after.forwards - before.forwards == 1  # the answer with the window is kept: one decode
    assert after.tokens_prefilled == before.tokens_prefilled  # no chunk prefilled again
    assert again.answer_with == res.answer_with
    win.slide(1)  # a change: the kept answer belongs to the old window
    assert win._answers == {}


def test_is_disposable_without_a_middle_chunk_rotates_from_angle_zero(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    res = win.is_disposable(ids[1], PROMPT, mode="chunk", max_new_tokens=4)
    # the chunks behind the dropped one move up: each placed once from its position-free KV
    start = len(ANCHOR) + len(win.chunk(ids[0]))
    parts = [engine.anchor_kv, win.assemble().slice(len(ANCHOR), start)]
    for s in win.slots[2:]:
        parts.append(engine.apply(s.kv, None, start))
        start += len(s.kv)
    ref = str(list(engine.generate_ids(parts, PROMPT, start, SamplingParams(max_new_tokens=4))))
    assert res.answer_without == ref


def test_generate_needs_a_tokenizer(engine) -> None:
    win, _ = _filled(engine, n=2)
    assert engine.tokenizer is None  # streaming and stop strings are tested on a tiny VLM, which has one
    with pytest.raises(InvalidInputError, match="no tokenizer"):
        win.generate(PROMPT, max_new_tokens=2)


@pytest.mark.parametrize(
    "op",
    [
        lambda w, ids: w.evict("nope"),
        lambda w, ids: w.recall(ids[0]),
        lambda w, ids: w.recall("nope"),
        lambda w, ids: w.reorder(ids[:2]),
        lambda w, ids: w.reorder([*ids[:3], "x"]),
        lambda w, ids: w.reorder("random"),
        lambda w, ids: w.slide(9),
        lambda w, ids: w.slide(-1),
        lambda w, ids: w.add([]),
        lambda w, ids: w.add([10**6]),
        lambda w, ids: w.add_text(""),
        lambda w, ids: w.next_token_logprobs([]),
        lambda w, ids: w.is_disposable(ids[0], PROMPT, mode="whatever"),
        lambda w, ids: w.is_disposable(ids[0], [10**6]),
        lambda w, ids: w.next_token_logprobs([10**6]),
        lambda w, ids: w.next_token_logprobs([-1]),
        lambda w, ids: w.next_token_logprobs(["a"]),
        lambda w, ids: w.next_token_logprobs([True]),
        lambda w, ids: w.next_token_logprobs(torch.tensor(5)),
        lambda w, ids: w.add("123"),
        lambda w, ids: w.add([7.9, 8.2]),
        lambda w, ids: w.add([5, 6], kind="image"),
        lambda w, ids: w.add([5, 6], kind=""),
        lambda w, ids: w.slide(True),
        lambda w, ids: w.reorder([ids[0], 1, 2, 3]),
        lambda w, ids: w.reorder(None),
        lambda w, ids: w.reorder(3),
        lambda w, ids: w.reorder(set(ids)),  # a set has no order
        lambda w, ids: w.slide(1.0),
        lambda w, ids: w.slide("1"),
    ],
)
def test_invalid_operations_raise_and_leave_the_window_unchanged(engine, op) -> None:
    win, ids = _filled(engine)
    lp = win.next_token_logprobs(PROMPT)
    with pytest.raises((InvalidInputError, WindowOperationError, ChunkNotFoundError)):
        op(win, ids)
    assert win.chunks == ids and win.evicted == []
    assert torch.equal(win.next_token_logprobs(PROMPT), lp)


@pytest.mark.parametrize(
    "op",
    [
        lambda w: w.slide(1.0),
        lambda w: w.slide("1"),
        lambda w: w.slide(-1),
        lambda w: w.reorder(None),
        lambda w: w.reorder(3),
        lambda w: w.reorder(set(w.chunks)),
    ],
)
def test_arguments_of_the_wrong_kind_are_invalid_input(engine, op) -> None:
    """Not a WindowOperationError (that is for the window's state) and not a raw TypeError."""
    win, ids = _filled(engine)
    with pytest.raises(InvalidInputError, match=r"slide takes a number|reorder takes a permutation"):
        op(win)
    assert win.chunks == ids


def test_numpy_and_tensor_integers_are_indices(engine) -> None:
    """Counts and positions computed with numpy or torch are taken like ints (as add's token ids are)."""
    win, ids = _filled(engine)
    assert win.slide(np.int64(1)) == ids[:1]
    win.recall(ids[0], at=torch.tensor(1))
    assert win.chunks == [ids[1], ids[0], *ids[2:]]
    win.reorder(reversed(win.chunks))  # any ordered iterable
    assert win.chunks == [*reversed(ids[2:]), ids[0], ids[1]]
    win.slide(1)
    with pytest.raises(InvalidInputError, match="recall position"):
        win.recall(win.evicted[-1], at=np.float64(0))


def test_unknown_policy_and_empty_window_errors(engine) -> None:
    with pytest.raises(InvalidInputError, match="unknown policy"):
        ContextWindow(engine, policy="magic")
    with pytest.raises(WindowOperationError, match="empty"):
        ContextWindow(engine).next_token_logprobs(PROMPT)


def test_prompt_rides_in_the_trailing_forward(engine) -> None:
    win, _ = _filled(engine)
    before = win.stats().forwards
    lp = win.next_token_logprobs(PROMPT)
    st = win.stats()
    assert st.forwards - before == 1  # the new chunks and the prompt: one pass
    assert st.prompt_tokens == len(PROMPT)
    past = win.assemble()
    two_pass = engine.next_token_logprobs(past, PROMPT, len(past))
    assert (lp - two_pass).abs().max() < 1e-4  # same numbers as prefilling the prompt on the assembled window
    assert torch.equal(win.next_token_logprobs(PROMPT), lp)  # asking again answers from the same prefill
    memo = win._prefilled(list(PROMPT))
    assert memo is not None
    greedy = SamplingParams(max_new_tokens=6)
    from_memo = list(engine.continue_ids(memo, greedy))
    assert from_memo == list(engine.generate_ids(past, PROMPT, len(past), SamplingParams(max_new_tokens=6)))
    assert from_memo[0] == int(lp.argmax())
    assert list(engine.continue_ids(memo, SamplingParams(max_new_tokens=6))) == from_memo  # reusable snapshot
    win.slide(1)
    assert win._prompt_memo is None  # a window operation frees the kept prefill
    assert win._cache is None  # and the plan's forward it came from


def test_survivor_removal_patch_option(engine) -> None:
    cfg = WindowConfig(survivors="patch", survivor_rank=64, rank=8)
    win = ContextWindow(engine, config=cfg)
    rec = ContextWindow(engine, policy="recompute")
    ids = [win.add(random_ids(10 + i, seed=400 + i)) for i in range(4)]
    for i in range(4):
        rec.add(random_ids(10 + i, seed=400 + i))
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    rec.slide(1)
    plan = win.plan()
    assert [sp.source for sp in plan.slots] == [Source.LEAD, Source.FORWARD, Source.FORWARD]
    assert all("removal patch" in sp.reason for sp in plan.slots[1:])
    lp = win.next_token_logprobs(PROMPT)
    assert (lp - rec.next_token_logprobs(PROMPT)).abs().max() < 1e-4  # re-conditioned: re-prefill's numbers
    # the two removal patches, and the exact patches of b, c, d from the first use (b now leads, c and d
    # were re-conditioned): a conditioned forward's patch is never dropped
    assert win.flush() == 5
    assert {p.kind for p in win.chunk(ids[1]).patches} == {"exact"}
    removal = [p for p in win.chunk(ids[2]).patches if p.kind == "removal"]
    assert len(removal) == 1 and removal[0].antecedent == (ids[1],)
    assert removal[0].patch.rank == min(64, len(win.chunk(ids[2])))  # survivor_rank, capped at the chunk length
    win.evict(ids[2])
    win.recall(ids[2], at=1)  # the same place behind the same chunk: the stored removal patch serves it
    assert win.plan().slots[1].source is Source.PATCH


def test_removal_patch_below_the_conditioning_rank_is_reused(engine) -> None:
    """A removal patch is formed at survivor_rank; reuse judges it at that rank, not at ``rank``, whichever
    path finds it (survivor or recall)."""
    win = ContextWindow(engine, config=WindowConfig(survivors="patch", survivor_rank=4, rank=8))
    ids = [win.add(random_ids(10 + i, seed=400 + i)) for i in range(4)]
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    win.next_token_logprobs(PROMPT)
    win.flush()
    removal = [p for p in win.chunk(ids[2]).patches if p.kind == "removal"]
    assert len(removal) == 1 and removal[0].patch.rank == 4
    win.evict(ids[2])
    win.recall(ids[2], at=1)
    sp = win.plan().slots[1]
    assert (sp.source, sp.patch) == (Source.PATCH, removal[0])


def test_budget_keeps_a_chunk_recalled_in_front(engine) -> None:
    win = ContextWindow(engine, budget_tokens=30)
    a, b, c = (win.add(random_ids(12, seed=500 + i)) for i in range(3))
    assert (win.chunks, win.evicted) == ([b, c], [a])
    win.recall(a, at=0)  # over budget: the oldest other than a leaves
    assert (win.chunks, win.evicted) == ([a, c], [b])


def test_a_chunk_larger_than_the_budget_is_refused(engine) -> None:
    win = ContextWindow(engine, budget_tokens=30)
    a = win.add(random_ids(12, seed=510))
    before = (win.chunks, win.stats().canonicals_computed, len(win._table.values()))
    with pytest.raises(InvalidInputError, match="does not fit in budget_tokens=30"):
        win.add(random_ids(50, seed=511))
    assert (win.chunks, win.stats().canonicals_computed, len(win._table.values())) == before == ([a], 1, 1)


def test_window_options_are_checked(engine) -> None:
    with pytest.raises(InvalidInputError, match="rank"):
        ContextWindow(engine, rank=0)
    with pytest.raises(InvalidInputError, match="not both"):
        ContextWindow(engine, rank=32, config=WindowConfig())


def test_a_failed_canonical_leaves_nothing_behind(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    win, ids = _filled(engine, n=2)
    nodes = win.graph.g.number_of_nodes()

    def boom(chunk):
        raise RuntimeError("device lost")

    monkeypatch.setattr(win._executor, "_compile", boom)
    with pytest.raises(RuntimeError):
        win.add(random_ids(9, seed=520))
    assert (win.chunks, len(win._table.values()), win.graph.g.number_of_nodes()) == (ids, 2, nodes)
    monkeypatch.undo()
    before = win.stats()
    cid = win.add(random_ids(9, seed=520))
    after = win.stats()
    assert win.chunks == [*ids, cid] and win.chunk(cid).canonical is not None
    assert (after.canonicals_computed, after.canonicals_reused) == (before.canonicals_computed + 1, 0)


def test_orbit_orderings_never_exceed_those_that_exist(engine) -> None:
    cfg = WindowConfig(reorder_patch="orbit", orbit_exhaustive_max=2, orbit_samples=7)
    win = ContextWindow(engine, config=cfg)
    ids = [win.add(random_ids(6, seed=530 + i)) for i in range(4)]
    stored = win.form_orbit_patch(ids[3])  # 3 predecessors: 6 orderings exist, 7 asked for
    assert stored.orderings == 6


def test_a_failed_orbit_reorder_keeps_the_order(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    win = ContextWindow(engine, config=WindowConfig(reorder_patch="orbit"))
    ids = [win.add(random_ids(6, seed=540 + i)) for i in range(3)]
    lp = win.next_token_logprobs(PROMPT)

    def boom(cid):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(win, "form_orbit_patch", boom)
    with pytest.raises(RuntimeError):
        win.reorder(list(reversed(ids)))
    assert win.chunks == ids
    assert torch.equal(win.next_token_logprobs(PROMPT), lp)


def test_cascade_is_not_undone_by_a_patch_that_absorbed_the_recalled_chunk(engine) -> None:
    """[A, B, C], slide A out, recall A behind C: C absorbed A, and its patch formed on (A, B) is within
    the envelope of (B,) ("one dropped"), but A now sits behind C: C must be re-prefilled."""
    win = ContextWindow(engine)
    rec = ContextWindow(engine, policy="recompute")
    for w in (win, rec):
        abc = [w.add(random_ids(10, seed=550 + i)) for i in range(3)]
        w.next_token_logprobs(PROMPT)
        w.slide(1)
        w.next_token_logprobs(PROMPT)
        w.recall(abc[0])
    plan = win.plan()
    assert [sp.source for sp in plan.slots] == [Source.LEAD, Source.FORWARD, Source.FORWARD]
    assert plan.slots[1].reason.startswith("cascade") and plan.slots[2].reason.startswith("recall")
    # B leads (exact), C and A are prefilled in context: re-prefill's numbers
    assert (win.next_token_logprobs(PROMPT) - rec.next_token_logprobs(PROMPT)).abs().max() < 1e-4
    assert win.stats().cascade_rematerialised == 1


@pytest.mark.parametrize("background", ["off", "manual"])
def test_forget_drops_an_evicted_chunk_and_a_re_add_is_re_prefill_again(engine, tmp_path, background) -> None:
    """[A, B, C], slide A out and forget it: the window answers as before, A is unknown, the table lost
    its tokens. Adding A's content again behind C re-prefills C (it absorbed A), as recalling A would.
    With background work queued and a store (``manual``), the work queued for A goes with it."""
    config = WindowConfig(rank=4, background=background)
    win = ContextWindow(engine, config=config, store=tmp_path / "store" if background == "manual" else None)
    rec = ContextWindow(engine, policy="recompute")
    pages = [random_ids(10, seed=550 + i) for i in range(3)]
    for w in (win, rec):
        a, _, _ = [w.add(p) for p in pages]
        w.next_token_logprobs(PROMPT)
        w.slide(1)
    before, content = win.next_token_logprobs(PROMPT), win.content_tokens
    win.forget(a)
    assert win.evicted == [] and win.known(a) is None and win.content_tokens == content - len(pages[0])
    win.prepare()  # what stays queued never touches A
    assert win.known(a) is None and torch.equal(win.next_token_logprobs(PROMPT), before)
    with pytest.raises(ChunkNotFoundError):
        win.recall(a)
    with pytest.raises(ChunkNotFoundError):
        win.forget(a)
    assert win.add(pages[0]) == a  # new content again: its canonical is prepared anew
    rec.recall(a)
    plan = win.plan()
    if background == "off":  # C's KV still carries A, which now sits behind it (idle time had re-conditioned it)
        c = plan.slots[1]
        assert (c.source, c.reason) == (Source.FORWARD, "a chunk it absorbed now sits behind it")
    assert (win.next_token_logprobs(PROMPT) - rec.next_token_logprobs(PROMPT)).abs().max() < 1e-4
    assert win.stats().timings["forget"].count == 1


def test_forget_drops_the_work_queued_for_a_chunk_that_left_with_a_patch_to_form(engine) -> None:
    """B left the window with its patch still to form (a ``leaving`` task, ``background="manual"``): once B
    is forgotten that patch is never formed, and the window answers as before."""
    win = ContextWindow(engine, config=WindowConfig(rank=4, background="manual"))
    ids = [win.add(random_ids(12 + i, seed=100 + i)) for i in range(3)]
    win.next_token_logprobs(PROMPT)
    win.prepare()
    win.evict(ids[1])
    assert win.stats().background_queued.get("leaving") == 1
    before = win.next_token_logprobs(PROMPT)
    patches = len(win.chunk(ids[1]).patches)
    win.forget(ids[1])
    win.prepare()
    assert "leaving" not in win.stats().background_done and win.background_pending == 0
    assert win.known(ids[1]) is None and patches == 0
    assert torch.equal(win.next_token_logprobs(PROMPT), before)


def test_evict_and_forget_at_once_forms_no_patch_for_a_recall_that_cannot_come(engine) -> None:
    """``evict(c, forget=True)`` answers as ``evict`` then ``forget`` do, without forming the patch B would
    have been recalled with (background work off: ``evict`` alone forms it inline)."""
    pages = [random_ids(12 + i, seed=100 + i) for i in range(3)]
    wins = [ContextWindow(engine, config=WindowConfig(rank=4)) for _ in range(2)]
    for w in wins:
        ids = [w.add(p) for p in pages]
        w.next_token_logprobs(PROMPT)
    at_once, apart = wins
    formed = sum(at_once.stats().formed.values())
    at_once.evict(ids[1], forget=True)
    assert sum(at_once.stats().formed.values()) == formed  # nothing formed for B
    apart.evict(ids[1])
    assert sum(apart.stats().formed.values()) > formed  # evict alone forms it
    apart.forget(ids[1])
    for w in wins:
        assert w.chunks == [ids[0], ids[2]] and w.evicted == [] and w.known(ids[1]) is None
    assert torch.equal(at_once.next_token_logprobs(PROMPT), apart.next_token_logprobs(PROMPT))
    child = at_once.fork()
    before = child.next_token_logprobs(PROMPT)
    at_once.evict(ids[0], forget=True)  # the child still holds A: it stays in the table
    assert at_once.evicted == [] and at_once.known(ids[0]) is not None
    assert torch.equal(child.next_token_logprobs(PROMPT), before)


def test_forget_refuses_a_chunk_in_the_window_and_waits_for_every_branch(engine) -> None:
    win, ids = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)
    with pytest.raises(WindowOperationError, match="evict it first"):
        win.forget(ids[1])
    assert win.chunks == ids and win.evicted == []  # the refusal changed nothing
    win.evict(ids[1])
    child, twin = win.fork(), win.fork()  # they hold ids[1] too (evicted)
    content = win.content_tokens
    win.forget(ids[1])
    assert win.evicted == [] and child.evicted == [ids[1]]
    assert win.content_tokens == content and win.known(ids[1]) is not None  # the child still holds it
    with pytest.raises(WindowOperationError, match="not evicted"):
        win.forget(ids[1])
    child.recall(ids[1], at=1)
    assert child.chunks == ids and win.chunks == [ids[0], ids[2]]
    twin.recall(ids[1], at=1)  # the parent's forget changed nothing its branches do
    assert torch.equal(child.next_token_logprobs(PROMPT), twin.next_token_logprobs(PROMPT))
    del child, twin

    gc.collect()
    assert win.known(ids[1]) is not None  # the branches that held it are gone; its entry waits for a forget

    extra = win.add(random_ids(9, seed=777))
    other = win.fork()  # holds ``extra`` until it is collected
    win.evict(extra)
    del other
    gc.collect()
    win.forget(extra)  # goes at once; and ids[1], which no live branch holds now, with it
    assert win.known(extra) is None and win.known(ids[1]) is None
    assert win.content_tokens == content - len(random_ids(13, seed=101))


def test_conditioning_on_a_chunk_moved_behind_is_not_kept(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    a, b, c, d = ids
    win.reorder([a, c, b, d])  # c absorbed b, which now sits behind it
    sources = {sp.chunk.id: (sp.source, sp.reason) for sp in win.plan().slots}
    assert sources[c] == (Source.FORWARD, "a chunk it absorbed now sits behind it")
    assert sources[d] == (Source.KEEP, "own conditioning, reordered (envelope)")
    before = win.stats().envelope_reuse
    win.next_token_logprobs(PROMPT)
    st = win.stats()
    assert st.envelope_reuse == before + 1  # d: its own conditioning, on a reordered antecedent
    assert any(x.reason == "own conditioning, reordered (envelope)" for x in st.decisions)


def test_a_recalled_former_lead_is_a_recall(engine) -> None:
    win, ids = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    win.recall(ids[0])  # it led the window: it never had a patch
    assert win.chunk(ids[0]).patches == []
    sp = win.plan().slots[-1]
    assert (sp.source, sp.patch_kind, sp.reason) == (
        Source.FORWARD,
        "fresh",
        "recall: fresh patch on its earlier context",
    )


def test_forks_form_a_shared_pending_patch_once(engine) -> None:
    win, _ = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)
    child = win.fork()
    only_child = child.add(random_ids(7, seed=560))
    assert win.flush() == 2
    assert child.flush() == 0  # the parent formed them: the branch takes them as they are
    assert child.stats().patches_formed == 0
    with pytest.raises(ChunkNotFoundError, match="another branch"):
        win.evict(only_child)
    with pytest.raises(ChunkNotFoundError, match="not in this window"):
        win.chunk(only_child)


def test_the_graph_holds_one_conditioning_per_live_chunk(engine) -> None:
    win = ContextWindow(engine)
    for i in range(4):
        win.add(random_ids(6, seed=570 + i))
    for i in range(12):
        win.next_token_logprobs(PROMPT)
        win.slide(1)
        win.add(random_ids(6, seed=580 + i))
    win.next_token_logprobs(PROMPT)
    patch_nodes = [n for n in win.graph.g if n[0] == "patch"]
    assert len(patch_nodes) <= len(win)
    assert {n[1] for n in patch_nodes} <= set(win.chunks)


def test_slide_zero_changes_nothing(engine) -> None:
    win, ids = _filled(engine)
    win.next_token_logprobs(PROMPT)
    cache = win._cache
    assert win.slide(0) == [] and win._cache is cache and win.chunks == ids


def test_a_patch_is_formed_even_when_its_chunk_comes_to_lead(engine) -> None:
    win, ids = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)  # b and c prefilled in context: their patches are pending
    win.slide(1)
    win.next_token_logprobs(PROMPT)  # b leads now: served from its canonical, its pending patch is set aside
    assert win.chunk(ids[1]).patches == []
    win.add(random_ids(9, seed=590))  # the next window operation forms it, off the answer's path
    assert [(p.kind, p.antecedent) for p in win.chunk(ids[1]).patches] == [("exact", (ids[0],))]


def test_a_chunk_passed_on_by_one_that_left_still_counts_as_absorbed(engine) -> None:
    """[A, X, Y]; X leaves (Y keeps it); Z arrives behind Y (takes X in through Y); Y leaves; X comes back
    behind Z: Z carries X, which now sits behind it, so Z is rebuilt."""
    win = ContextWindow(engine)
    a, x, y = (win.add(random_ids(8, seed=620 + i)) for i in range(3))
    win.next_token_logprobs(PROMPT)
    win.evict(x)
    win.next_token_logprobs(PROMPT)
    z = win.add(random_ids(8, seed=623))
    win.next_token_logprobs(PROMPT)
    assert x in win.slots[-1].absorbed  # through y
    win.evict(y)
    win.next_token_logprobs(PROMPT)
    win.recall(x)
    sources = {sp.chunk.id: sp.source for sp in win.plan().slots}
    assert sources[z] is Source.FORWARD and sources[a] is Source.LEAD


def test_a_failed_set_aside_patch_stays_queued_and_the_operation_stands(engine, monkeypatch) -> None:
    win, ids = _filled(engine, n=3)
    win.next_token_logprobs(PROMPT)
    win.slide(1)
    win.next_token_logprobs(PROMPT)  # b leads: its patch is set aside
    assert len(win._executor.orphans) == 1

    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(win._executor, "form_pending", boom)
    new = win.add(random_ids(9, seed=630))  # the add stands; the patch waits
    assert win.chunks[-1] == new and win._cache is None and len(win._executor.orphans) == 1
    monkeypatch.undo()
    assert win.flush() >= 1 and win._executor.orphans == []
    assert [p.kind for p in win.chunk(ids[1]).patches] == ["exact"]


def test_a_window_past_the_model_context_is_refused_before_any_work() -> None:
    e = tiny_engine("llama", seed=3)
    assert e.context_length == 8192 == e.info().context_length  # the config's max_position_embeddings
    win, ids = _filled(e, "recompute")  # exact, so each answer can be checked against re-prefill
    fits = len(ANCHOR) + win.tokens + len(PROMPT)
    e.context_length = fits + 2  # the prompt and two answer tokens fit exactly
    assert torch.equal(win.next_token_logprobs(PROMPT), reprefill_logprobs(win, PROMPT))
    assert win.is_disposable(ids[1], PROMPT, max_new_tokens=2).answer_with
    before = (win.chunks, win.stats().forwards, e.counters.forwards)
    with pytest.raises(ContextLengthError, match=rf"{fits} tokens \+ 3 to generate exceed .* of {fits + 2}"):
        win.generate(PROMPT, max_new_tokens=3)
    with pytest.raises(ContextLengthError, match="context length"):
        win.is_disposable(ids[1], PROMPT, max_new_tokens=3)
    e.context_length = fits - 1
    with pytest.raises(ContextLengthError, match=rf"{fits} tokens exceed the model's context length of {fits - 1}"):
        win.next_token_logprobs(PROMPT)
    with pytest.raises(ContextLengthError):  # the engine refuses the positions itself, too
        e.forward(random_ids(fits, seed=1), None, 0)
    assert (win.chunks, win.stats().forwards, e.counters.forwards) == before
    win.slide(1)  # back inside the context: served again, as re-prefill
    assert torch.equal(win.next_token_logprobs(PROMPT), reprefill_logprobs(win, PROMPT))
    e.context_length = None  # no limit
    win.add(random_ids(40, seed=7))
    assert win.next_token_logprobs(PROMPT).shape == (128,)
    for bad in ("big", 0, -5, 2.5, True):  # refused when assigned, not at the next forward
        with pytest.raises(InvalidInputError, match="context_length must be an int >= 1 or None"):
            e.context_length = bad
    assert e.context_length is None
    e.context_length = np.int64(9000)
    assert e.context_length == 9000 and type(e.context_length) is int


def test_a_copy_of_a_text_is_a_chunk_of_its_own() -> None:
    from tests.conftest import tiny_chat_engine

    e = tiny_chat_engine()
    win = ContextWindow(e)
    first, again = win.add_text("The sky is blue."), win.add_text("The sky is blue.")
    copy = win.add_text("The sky is blue.", copy=1)
    assert first == again != copy and win.chunks == [first, copy]  # a set, unless it is a copy
    assert copy == ContextWindow(e).add(e.tokenize("The sky is blue."), kind="text#1")
    with pytest.raises(InvalidInputError, match="copy must be an int >= 0"):
        win.add_text("x", copy=-1)
    assert win.chunks == [first, copy]
    assert (win.text_id("The sky is blue."), win.text_id("The sky is blue.", copy=1)) == (first, copy)
    assert win.chunks == [first, copy]  # asking adds nothing


def test_a_token_chunk_id_is_its_ids_as_int64_bytes() -> None:
    """``tokens_id`` names a chunk as it always has (stored canonicals are found by it): the hash of its
    kind and its ids as int64 in the machine's order."""
    from kamera_sdk.chunks import content_id, tokens_id

    for ids in ([], [0], [1, 2, 3], [49151, 7, 2**40, -1]):
        want = content_id("tokens", torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
        assert tokens_id("tokens", ids) == want
    assert tokens_id("text#1", [5]) != tokens_id("tokens", [5])
