"""Elastic Cache and DAVID: exact budgets, protected tokens kept, budget 1.0 equals the full cache."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV
from kamera_sdk import ContextWindow, InvalidInputError
from kamera_sdk.compress import CompressionInput
from kamera_sdk.compress.david import DAVID
from kamera_sdk.compress.elastic import ElasticCache
from kamera_sdk.compress.runner import prefill_compressed, score_continuation
from tests.conftest import random_ids, tiny_engine

PROMPT = [9, 10, 11, 12, 13]


def _input(n: int = 40, vision: slice | None = None, protected_last: int = 5) -> CompressionInput:
    g = torch.Generator().manual_seed(0)
    kv = KV(torch.randn(2, n, 2, 8, generator=g), torch.randn(2, n, 2, 8, generator=g), torch.arange(n))
    scores = torch.rand(2, 2, n, generator=g)
    vis = torch.zeros(n, dtype=torch.bool)
    if vision is not None:
        vis[vision] = True
    prot = torch.zeros(n, dtype=torch.bool)
    prot[-protected_last:] = True
    return CompressionInput(kv, scores, vis, prot, protected_last, protected_last)


@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_david_keeps_exactly_the_budget_and_the_observation_window(budget: float) -> None:
    for vision in (None, slice(4, 24)):
        inp = _input(vision=vision)
        out = DAVID(budget=budget).compress(inp)
        assert len(out) == round(budget * 40)
        # the observation window (last 5 tokens) survives in every layer and head
        for layer in range(2):
            for head in range(2):
                kept = out.keys[layer, :, head]
                for t in range(35, 40):
                    assert any(torch.equal(kept[i], inp.kv.keys[layer, t, head]) for i in range(len(out)))


def test_david_without_vision_tokens_is_snapkv() -> None:
    inp = _input()
    out = DAVID(budget=0.5).compress(inp)
    score = DAVID().smooth(inp.scores[0]).masked_fill(inp.protected[None], float("inf"))
    top = torch.topk(score, 20, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(out.keys[0, :, 0], inp.kv.keys[0, top[0], 0])


def test_elastic_keeps_exactly_the_budget_first_and_last_and_merges_by_mean() -> None:
    inp = _input()
    inp.protected[:] = False
    policy = ElasticCache(budget=0.25)
    out = policy.compress(inp)
    assert len(out) == 10
    anchors = policy.anchors(inp.scores[0].mean(0), 10)
    assert anchors[0] == 0 and anchors[-1] == 39
    # the first anchor's bucket is the tokens nearest to it: its merged key is their mean
    nxt = int(anchors[1])
    bucket = [t for t in range(40) if abs(t - 0) <= abs(t - nxt)]
    assert torch.allclose(out.keys[0, 0], inp.kv.keys[0, bucket].mean(0), atol=1e-6)


@pytest.mark.parametrize("policy", [ElasticCache(budget=1.0), DAVID(budget=1.0)])
def test_budget_one_equals_the_uncompressed_window(policy) -> None:
    engine = tiny_engine("llama", seed=2)
    win = ContextWindow(engine, policy="recompute")
    for i in range(3):
        win.add(random_ids(12, seed=700 + i))
    past = win.assemble()
    window_ids = list(engine.anchor_ids) + [t for c in win.chunks for t in win.chunk(c).token_ids]
    continuation = random_ids(6, seed=9)
    c = prefill_compressed(engine, past, window_ids, PROMPT, policy)
    assert c.kept_tokens == c.full_tokens and c.kv_bytes_fraction == 1.0
    got = score_continuation(engine, c, policy, continuation)
    full = prefill_compressed(engine, past, window_ids, PROMPT, DAVID(budget=1.0))
    ids = PROMPT + continuation[:-1]
    ref = [engine.next_token_logprobs(past, ids[: len(PROMPT) + i], len(past)) for i in range(len(continuation))]
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    assert full.kept_tokens == full.full_tokens


def test_compressed_window_decodes_and_reports_bytes() -> None:
    engine = tiny_engine("qwen2", seed=2)
    win = ContextWindow(engine, compress="david", kv_budget=0.3)
    for i in range(3):
        win.add(random_ids(20, seed=800 + i))
    c = win.compress_window(PROMPT)
    assert c.kept_tokens == round(0.3 * c.full_tokens)
    assert win.stats().kv_bytes_fraction == pytest.approx(c.kept_tokens / c.full_tokens)
    with pytest.raises(InvalidInputError, match="kv_budget"):
        ContextWindow(engine, compress="elastic")
    with pytest.raises(InvalidInputError, match="unknown compression"):
        ContextWindow(engine, compress="zip", kv_budget=0.5)


def test_a_budget_that_cannot_hold_the_protected_tokens_is_refused() -> None:
    """DAVID always keeps the prompt's last queries; a budget below them is refused when the window is
    compressed (naming both numbers), not decoded with part of the prompt dropped."""
    engine = tiny_engine("qwen2", seed=2)
    win = ContextWindow(engine, compress="david", kv_budget=0.01)
    for i in range(3):
        win.add(random_ids(20, seed=810 + i))
    forwards = win.stats().forwards
    with pytest.raises(InvalidInputError, match=r"keeps 1 of this window's \d+ tokens, fewer than the 5 david"):
        win.compress_window(PROMPT)  # what generate decodes from
    assert len(win.chunks) == 3 and win.stats().forwards == forwards  # refused before any work
    elastic = ContextWindow(engine, compress="elastic", kv_budget=1e-9)
    elastic.add(random_ids(5, seed=1))
    with pytest.raises(InvalidInputError, match=r"fewer than the 2 elastic always keeps \(the first and last token\)"):
        elastic.compress_window(PROMPT)


@pytest.mark.parametrize("bad", ["0.2", True, float("nan"), None])
def test_kv_budget_must_be_a_number(bad) -> None:
    with pytest.raises(InvalidInputError, match="kv_budget"):
        ContextWindow(tiny_engine("qwen2", seed=2), compress="david", kv_budget=bad)
