"""CacheBlend and MPIC: degenerate cases equal recompute / blind; budgets are respected."""

from __future__ import annotations

import pytest
import torch

from kamera_sdk import ContextWindow, InvalidInputError
from kamera_sdk.policies.cacheblend import CacheBlendPolicy
from kamera_sdk.policies.mpic import MPICPolicy
from kamera_sdk.policies.prefix import PrefixPolicy
from tests.conftest import random_ids, tiny_engine

PROMPT = [9, 10, 11]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt_neox"])
def engine(request):
    return tiny_engine(request.param, seed=11)


def _lp(engine, policy) -> tuple[torch.Tensor, ContextWindow]:
    win = ContextWindow(engine, policy=policy)
    for i in range(3):
        win.add(random_ids(14, seed=500 + i))
    return win.next_token_logprobs(PROMPT), win


def test_full_budget_equals_recompute_and_zero_equals_blind(engine) -> None:
    ref, _ = _lp(engine, "recompute")
    blind, _ = _lp(engine, "blind")
    for full in (CacheBlendPolicy(ratio=1.0), MPICPolicy(k=10_000)):
        lp, _ = _lp(engine, full)
        assert (lp - ref).abs().max().item() <= 1e-4, full
    for zero in (CacheBlendPolicy(ratio=0.0), MPICPolicy(k=0)):
        lp, _ = _lp(engine, zero)
        assert torch.equal(lp, blind), zero


def test_budgets_decide_how_many_tokens_are_recomputed(engine) -> None:
    _, win = _lp(engine, CacheBlendPolicy(ratio=0.25))
    assert win.stats().selective_tokens == round(0.25 * 28)
    _, win = _lp(engine, MPICPolicy(k=5))
    assert win.stats().selective_tokens == 10
    mid, _ = _lp(engine, MPICPolicy(k=7))
    ref, _ = _lp(engine, "recompute")
    blind, _ = _lp(engine, "blind")
    assert not torch.allclose(mid, ref) and not torch.allclose(mid, blind)


def test_prefix_cache_evicts_leaves_first_and_never_crosses_engines() -> None:
    engine = tiny_engine("llama", seed=3)
    chunks = [random_ids(12, seed=600 + i) for i in range(6)]
    policy = PrefixPolicy(max_tokens=60)
    win = ContextWindow(engine, policy=policy)
    for c in chunks[:5]:
        win.add(c)
    win.next_token_logprobs([9, 10, 11])  # runs (a), (a b), ... (a b c d e): 60 tokens
    win.add(chunks[5])
    win.next_token_logprobs([9, 10, 11])  # (a ... f) pushes the cache over: a leaf goes, not (a)
    assert policy._tokens <= 60
    again = ContextWindow(engine, policy=policy)
    for c in chunks[:4]:
        again.add(c)
    assert [sp.source.value for sp in again.plan().slots] == ["prefix"] * 4
    other = tiny_engine("llama", seed=4)  # another model sharing the policy: no hit, its own KV
    third = ContextWindow(other, policy=policy)
    for c in chunks[:2]:
        third.add(c)
    assert [sp.source.value for sp in third.plan().slots] == ["forward", "forward"]
    with pytest.raises(InvalidInputError, match="max_tokens"):
        PrefixPolicy(max_tokens=0)


def test_auto_placement_minimises_the_windows_own_policy_cost() -> None:
    engine = tiny_engine("llama", seed=3)
    win = ContextWindow(engine, policy="prefix")
    a, b, c = (win.add(random_ids(10, seed=610 + i)) for i in range(3))
    win.next_token_logprobs([9, 10, 11])  # (a), (a b), (a b c) cached
    win.reorder([c, b, a])  # a prefix miss everywhere
    order = win.reorder("auto")
    assert order == [a, b, c] and [sp.source.value for sp in win.plan().slots] == ["prefix"] * 3


def test_prefix_cache_lets_go_of_an_engine() -> None:
    import gc

    policy = PrefixPolicy()
    engine = tiny_engine("llama", seed=7)
    win = ContextWindow(engine, policy=policy)
    win.add(random_ids(10, seed=640))
    win.next_token_logprobs([9, 10, 11])
    assert policy._tokens == 10
    del win, engine
    gc.collect()
    assert policy._tokens == 0 and policy._engines == {} and len(policy._nodes) == 0
