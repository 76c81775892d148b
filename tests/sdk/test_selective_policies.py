"""CacheBlend and MPIC: degenerate cases equal recompute / blind; budgets are respected."""

from __future__ import annotations

import pytest
import torch

from kamera_sdk import ContextWindow
from kamera_sdk.policies.cacheblend import CacheBlendPolicy
from kamera_sdk.policies.mpic import MPICPolicy
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
