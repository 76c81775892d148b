"""The scripted window trace follows the issue's recipe: a slide every step, a look-back recall every 4th
step, a rerank every 5th, pages of 200-400 tokens in a window of 4. Its TTFT floor prefills only what is
new to the window."""

from __future__ import annotations

from collections import Counter

import pytest

from kamera_sdk.bench.window import build_trace, floor_step
from tests.conftest import random_ids, tiny_engine


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


@pytest.mark.parametrize(
    ("new", "timed_chunks", "fused"),
    [
        ([True, True, True, True], [1, 2, 3], True),  # the first step: all but the leading page
        ([False, False, False, True], [3], True),  # a slide: the new page, with the prompt
        ([False, True, False, False], [1], False),  # a rerank put the new page second: prompt on its own
        ([True, False, False, False], [], False),  # the new page leads: its canonical is exact
    ],
)
def test_the_ttft_floor_prefills_only_the_new_chunks_and_the_prompt(
    new: list[bool], timed_chunks: list[int], fused: bool
) -> None:
    engine = tiny_engine("llama")
    chunks = [random_ids(n, seed) for seed, n in enumerate((6, 9, 7, 8))]
    prompt = random_ids(4, 9)
    _ = engine.anchor_kv  # computed once, on first use: not part of the step
    before = engine.counters.model_copy()
    seconds, tokens = floor_step(engine, chunks, new, prompt, repeats=1)
    assert tokens == sum(len(chunks[i]) for i in timed_chunks) + len(prompt)
    assert seconds > 0
    # every chunk is prefilled exactly once (the untimed ones build the exact window in front), and the
    # prompt once: fused into the last forward when the last chunk is new
    done = engine.counters
    assert done.tokens_prefilled - before.tokens_prefilled == sum(map(len, chunks)) + len(prompt)
    untimed = len(chunks) - len(timed_chunks)
    runs = 1 if timed_chunks else 0  # the timed chunks above are consecutive: one forward
    assert done.forwards - before.forwards == untimed + runs + (0 if fused else 1)
