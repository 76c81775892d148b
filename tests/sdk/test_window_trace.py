"""The scripted window trace follows the issue's recipe: a slide every step, a look-back recall every 4th
step, a rerank every 5th, pages of 200-400 tokens in a window of 4."""

from __future__ import annotations

from collections import Counter

from kamera_sdk.bench.window import build_trace


def test_the_trace_slides_every_step_recalls_every_4th_and_reranks_every_5th() -> None:
    trace = build_trace(steps=24)
    assert len(trace) == 24 and trace[0].kind == "first"
    assert [op for op, _ in trace[0].ops] == ["add"] * 4
    for step in trace[1:]:
        ops = [op for op, _ in step.ops]
        assert ops[0] == "slide"
        assert ("recall" in ops) == (step.index % 4 == 0)
        assert ("reorder" in ops) == (step.index % 5 == 0)
    kinds = [step.kind for step in trace]
    assert kinds[:6] == ["first", "slide", "slide", "slide", "recall", "rerank"]
    assert kinds[20] == "rerank"  # a recall and a rerank: the rerank is what costs
    assert Counter(kinds) == {"first": 1, "slide": 15, "recall": 4, "rerank": 4}
