"""``tool_choice="auto"``'s relevance scores run their forwards alone under a scheduler (between its steps,
never packed with other rows), so a score compared with 0 is the same bits whatever else the engine runs."""

from __future__ import annotations

import threading

from kamera_engine import SamplingParams
from kamera_engine.scheduler import Scheduler
from kamera_sdk.auto_tools import NEUTRAL_TOOL, request_log_likelihood
from kamera_sdk.tools import ToolSpec
from tests.conftest import random_ids, tiny_chat_engine


def _turn(role: str, text: str) -> str:
    return f"<{role}>{text}</{role}>"


def test_relevance_scores_run_alone_and_are_the_same_bits_under_load() -> None:
    engine = tiny_chat_engine()
    tool = ToolSpec(name="light", description="Turns a light on or off.")
    request = "Turn on the kitchen light."
    want = [request_log_likelihood(engine, _turn, t, request) for t in (NEUTRAL_TOOL, tool)]
    sched = Scheduler(engine)
    busy = [sched.submit(None, random_ids(6, 10 + i), 0, SamplingParams(max_new_tokens=20)) for i in range(3)]
    got: list[float] = []
    sched.start()
    try:

        def score() -> None:
            with sched.serving(key="s"):  # a window's thread in the server: its forwards would be carried
                got.extend(request_log_likelihood(engine, _turn, t, request) for t in (NEUTRAL_TOOL, tool))

        t = threading.Thread(target=score)
        t.start()
        t.join(120)
        for r in busy:
            list(r)
    finally:
        sched.stop()
    stats = sched.stats()
    assert got == want  # bit for bit
    assert stats.alone == 2 and stats.carried == 0
