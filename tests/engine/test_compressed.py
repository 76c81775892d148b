"""The engine side of compression: attention statistics equal the model's own attention probabilities, and
bad input is refused before any forward."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import KV, InvalidInputError
from kamera_engine.compressed import AttentionStatsSpec
from tests.conftest import ANCHOR, random_ids, tiny_engine

PROMPT = [9, 10, 11, 12, 13]


def _window(family: str):  # type: ignore[no-untyped-def]
    engine = tiny_engine(family, seed=3)
    ids = random_ids(14, seed=6)
    kv = KV.cat([engine.anchor_kv, engine.forward(ids, engine.anchor_kv, len(ANCHOR), logits="none").kv.to("cpu")])
    return engine, kv, ANCHOR + ids


def _eager_attention(engine, ids: list[int]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Per layer, (Hq, T, T) softmax probabilities from the model's eager attention over ``ids``."""
    engine.model.set_attn_implementation("eager")
    try:
        out = engine.model(input_ids=torch.tensor([ids], device=engine.device), output_attentions=True)
    finally:
        engine.model.set_attn_implementation("sdpa")
    return [a[0].cpu() for a in out.attentions]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("every_query", [True, False])
def test_scores_are_the_models_attention_summed_over_the_declared_queries(family: str, every_query: bool) -> None:
    engine, kv, window_ids = _window(family)
    pre = engine.prefill_with_stats(kv, window_ids, PROMPT, AttentionStatsSpec(every_query=every_query), 3)
    n = len(window_ids) + len(PROMPT)
    assert pre.stats_tokens == (len(window_ids) if every_query else 0)
    expected_q = torch.arange(n) if every_query else torch.arange(n - 3, n)
    assert torch.equal(pre.query_positions, expected_q)
    probs = _eager_attention(engine, window_ids + PROMPT)
    group = probs[0].shape[0] // engine.num_kv_heads
    for layer, p in enumerate(probs):
        ref = p[:, expected_q].sum(dim=1).view(engine.num_kv_heads, group, n).sum(dim=1)
        assert torch.allclose(pre.scores[layer], ref, atol=1e-4)
    assert pre.next_position == n and len(pre.kv) == n


def test_window_ids_that_do_not_match_the_window_are_refused_before_any_forward() -> None:
    engine, kv, window_ids = _window("llama")
    forwards = engine.counters.forwards
    with pytest.raises(InvalidInputError, match="token ids for the window"):
        engine.prefill_with_stats(kv, window_ids[:-1], PROMPT, AttentionStatsSpec(), 3)
    with pytest.raises(InvalidInputError, match="observation"):
        engine.prefill_with_stats(kv, window_ids, PROMPT, AttentionStatsSpec(), 0)
    assert engine.counters.forwards == forwards
