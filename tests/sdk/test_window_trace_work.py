"""The window trace's per-step work on the critical path, on a tiny engine behind the real tokenizer: the
idle-time run counts, per step and policy, the forwards and tokens run between the agent knowing the step
and the first token, next to the floor's tokens. Kamera with background work never runs more tokens there
than recompute, never fewer than the floor, and a rerank that brings an older page to the front prefills
only what sits behind it (that page's canonical was compiled in the idle time after the last answer)."""

from __future__ import annotations

import pytest

from kamera_sdk.bench.window import ACT_ARMS, build_trace, run_trace
from tests.conftest import tiny_chat_engine


@pytest.fixture(scope="module")
def result():
    trace = build_trace(steps=24)
    steps = [trace[i] for i in range(21)]  # through the rerank that recalls a page and puts an older one first
    return run_trace(
        tiny_chat_engine(), steps, ("recompute", "prefix", "kamera"), answer_tokens=2, act_seconds=60.0, arms=ACT_ARMS
    )


def test_critical_tokens_are_counted_per_step_and_bounded(result) -> None:
    for row in result["steps"]:
        kam, rec = row["critical_tokens"]["kamera"], row["critical_tokens"]["recompute"]
        assert row["floor_tokens"] <= kam <= rec, row
        assert row["critical_forwards"]["recompute"] == 1
        if row["kind"] in ("slide", "recall"):
            assert kam == row["floor_tokens"] and row["critical_forwards"]["kamera"] == 1, row
    assert result["kamera"]["critical_tokens_over_recompute_max"] <= 1.0


def test_a_rerank_serves_an_older_lead_from_its_canonical(result) -> None:
    """Step 20: slide, recall p09, rerank to p19 p17 p09 p18. p19 arrived at step 19, before that answer: it
    is served from its canonical, and only the three chunks behind it (and the prompt) are prefilled."""
    row = result["steps"][20]
    assert row["kind"] == "rerank"
    kam, rec = row["critical_tokens"]["kamera"], row["critical_tokens"]["recompute"]
    assert row["critical_forwards"]["kamera"] == 1 and kam < 0.8 * rec, row
