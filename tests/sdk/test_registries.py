"""Every registered reuse policy (``POLICIES``) and compression policy (``COMPRESSORS``) goes through the same
invariants on a tiny random model, so a newly registered one is checked without anyone listing it here.

Policies: one chunk gives the same next-token log-probs and answer as ``recompute`` (DESIGN.md §2: the
leading chunk's canonical is exact); on a multi-chunk window driven through add / slide / evict / reorder,
every slot whose plan claims an exact source (``LEAD``, ``FORWARD``, ``PREFIX``, or ``KEEP`` of a slot that
was exact) holds the keys and values a re-prefill of the window computes.
Compressors: the budget is honoured to the token, budget 1.0 answers like the uncompressed window, and a
budget below what the policy always keeps is refused before any work.
"""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, Engine
from kamera_sdk import POLICIES, ContextWindow, InvalidInputError, Source
from kamera_sdk.compress import COMPRESSORS
from tests.conftest import random_ids, tiny_chat_engine, tiny_engine

PROMPT = [9, 10, 11, 12, 13]
#: Sources whose KV a plan claims equals re-prefill (KEEP: if the slot's last KV was exact).
EXACT = frozenset({Source.LEAD, Source.FORWARD, Source.PREFIX})
ATOL = 1e-5


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine("llama", seed=3)


@pytest.fixture(scope="module")
def chat_engine() -> Engine:
    return tiny_chat_engine()


def _reprefill(engine: Engine, win: ContextWindow) -> KV:
    ids = [t for c in win.chunks for t in win.chunk(c).token_ids]
    kv = engine.forward(ids, engine.anchor_kv, len(engine.anchor_ids), logits="none").kv
    return KV.cat([engine.anchor_kv, kv.to("cpu")])  # the anchor is kept in host memory


# --- reuse policies --------------------------------------------------------------------------------
def test_policies_are_registered() -> None:
    assert {"recompute", "kamera", "blind", "prefix", "cacheblend", "mpic"} <= set(POLICIES)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_chunk_answers_like_recompute(engine: Engine, chat_engine: Engine, policy: str) -> None:
    chunk = random_ids(24, seed=41)
    got, ref = ContextWindow(engine, policy=policy), ContextWindow(engine, policy="recompute")
    for w in (got, ref):
        w.add(chunk)
    assert (got.next_token_logprobs(PROMPT) - ref.next_token_logprobs(PROMPT)).abs().max().item() <= ATOL
    answers = []
    for p in (policy, "recompute"):
        w = ContextWindow(chat_engine, policy=p)
        w.add_text("The river Loire is the longest river in France.")
        answers.append(w.generate("Which river is the longest?", max_new_tokens=6))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_slots_claimed_exact_equal_reprefill(engine: Engine, policy: str) -> None:
    win = ContextWindow(engine, policy=policy, rank=4)
    exact: dict[str, bool] = {}  # chunk id -> its last served KV was claimed (and checked) exact
    checked = 0

    def use() -> None:
        nonlocal checked
        plan = win.plan()
        kv, ref = win.assemble().to("cpu"), _reprefill(engine, win)  # the window on the model's device
        assert kv.keys.shape == ref.keys.shape
        now: dict[str, bool] = {}
        for sp in plan.slots:
            claims = sp.source in EXACT or (sp.source is Source.KEEP and exact.get(sp.chunk.id, False))
            now[sp.chunk.id] = claims
            if claims:
                pos = list(sp.positions)
                for got, want in ((kv.keys, ref.keys), (kv.values, ref.values)):
                    assert (got[:, pos] - want[:, pos]).abs().max().item() <= ATOL, (policy, sp.source, sp.reason)
                checked += 1
        exact.clear()
        exact.update(now)

    ids = [win.add(random_ids(10 + i, seed=500 + i)) for i in range(3)]
    use()
    use()  # nothing changed: kept slots
    ids.append(win.add(random_ids(8, seed=510)))
    use()
    win.slide(1)
    use()
    win.evict(ids[2])
    use()
    win.recall(ids[2])
    win.reorder(list(reversed(win.chunks)))
    use()
    assert checked >= 1  # every policy serves at least its leading chunk exactly


# --- compression policies --------------------------------------------------------------------------
def test_compressors_are_registered() -> None:
    assert {"david", "elastic"} <= set(COMPRESSORS)


def _compressed_window(engine: Engine, name: str, budget: float, n: int = 3) -> ContextWindow:
    win = ContextWindow(engine, policy="recompute", compress=name, kv_budget=budget)
    for i in range(n):
        win.add(random_ids(20, seed=800 + i))
    return win


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("budget", [0.3, 0.7])
def test_compressor_keeps_exactly_its_budget(engine: Engine, name: str, budget: float) -> None:
    c = _compressed_window(engine, name, budget).compress_window(PROMPT)
    assert c.kept_tokens == max(1, round(budget * c.full_tokens))
    assert c.kv_bytes_fraction == pytest.approx(c.kept_tokens / c.full_tokens)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressor_at_budget_one_answers_like_the_full_window(chat_engine: Engine, name: str) -> None:
    answers = []
    for compress in (name, None):
        win = ContextWindow(chat_engine, policy="recompute", compress=compress, kv_budget=1.0 if compress else None)
        for text in ("The Po flows into the Adriatic Sea.", "The Elbe passes Dresden."):
            win.add_text(text)
        answers.append(win.generate("Where does the Po flow?", max_new_tokens=6))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_compressor_refuses_a_budget_below_what_it_always_keeps(engine: Engine, name: str) -> None:
    win = _compressed_window(engine, name, 1e-9)
    before = (list(win.chunks), win.stats().forwards)
    with pytest.raises(InvalidInputError, match="always keeps"):
        win.compress_window(PROMPT)
    assert (list(win.chunks), win.stats().forwards) == before


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_first_logits_come_from_the_full_cache_at_any_budget(engine: Engine, name: str) -> None:
    """The first token after the prompt is chosen with the full cache; compression starts with the answer."""
    full = _compressed_window(engine, name, 1.0).compress_window(PROMPT)
    small = _compressed_window(engine, name, 0.5).compress_window(PROMPT)
    assert torch.equal(full.first_logits, small.first_logits)
