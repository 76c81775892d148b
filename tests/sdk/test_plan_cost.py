"""The cost model of a plan: forwards, tokens, and the token pairs each forward's attention scores."""

from __future__ import annotations

import pytest

from kamera_sdk.chunks import Chunk
from kamera_sdk.plan import Plan, SlotPlan, Source
from kamera_sdk.plan_cost import CostModel, choose

ANCHOR = 4


def _plan(sizes: list[int], sources: list[Source]) -> Plan:
    slots, at = [], ANCHOR
    for i, (n, src) in enumerate(zip(sizes, sources, strict=True)):
        chunk = Chunk(id=f"c{i}", kind="text", token_ids=list(range(n)))
        slots.append(SlotPlan(chunk, at, tuple(f"c{j}" for j in range(i)), src))
        at += n
    return Plan("kamera", slots, ANCHOR)


def test_a_forward_scores_each_token_against_all_its_keys() -> None:
    """A forward of ``n`` tokens after ``start`` counts ``n * (start + n)`` pairs: the masked half too."""
    plan = _plan([300, 900], [Source.FORWARD, Source.FORWARD])
    cost = CostModel().estimate(plan, 20, lambda c: False)
    n = 300 + 900 + 20
    assert (cost.forwards, cost.tokens, cost.span) == (1, n, n * (ANCHOR + n))


def test_a_compiled_lead_and_the_rest_is_cheaper_than_one_fused_forward_when_attention_dominates() -> None:
    """The lead's compile (a forward of its own after the anchor) plus one forward behind it score ``c * r``
    fewer pairs than one forward of both; the split wins when those pairs outweigh a forward's fixed price."""
    plan = _plan([300, 900], [Source.LEAD, Source.FORWARD])
    missing = lambda c: c.id == "c0"  # noqa: E731
    model = CostModel(per_forward=16.0, per_span=3e-4)
    choice = choose(plan, 20, missing, model)
    split, fused = choice.costs["policy"], choice.costs["fused"]
    assert (split.forwards, fused.forwards) == (2, 1) and split.tokens == fused.tokens
    assert fused.span - split.span == pytest.approx(300 * 920)
    assert choice.name == "policy"
    # with attention free, the extra forward decides: one fused re-prefill
    assert choose(plan, 20, missing, CostModel(per_forward=16.0, per_span=0.0)).name == "fused"
