"""Windows of every reuse policy under one scheduler: their window work (new pages, materialisation, prompt
prefill) runs in steps with the other windows' running decodes, and every answer and log-prob equals the
window's own alone; a failing or cancelled request in the same batch changes nothing for the others."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import Engine, SamplingParams
from kamera_engine.errors import KameraError
from kamera_engine.kv import KV
from kamera_engine.scheduler import Scheduler
from kamera_sdk import ContextWindow
from kamera_sdk.policies import POLICIES
from tests.conftest import char_engine, random_ids

POLICY_NAMES = sorted(POLICIES)
#: per window: sampling settings (greedy, temperature, top-p, stop strings), cycled over the windows
SAMPLING = [
    dict(max_new_tokens=10),
    dict(max_new_tokens=8, temperature=0.9, seed=5),
    dict(max_new_tokens=12, temperature=1.1, top_p=0.8, seed=17),
    dict(max_new_tokens=14, stop=["k", "q"]),
]


@pytest.fixture
def engine() -> Engine:
    return char_engine()


def _pages(i: int) -> list[list[int]]:
    """Window i's pages: 1 to 3 of them, of different lengths."""
    return [random_ids(4 + 3 * j + i, 100 + 10 * i + j) for j in range(1 + i % 3)]


def _prompt(i: int) -> list[int]:
    return random_ids(3 + i % 4, 300 + i)


def _window(engine: Engine, i: int, policy: str) -> ContextWindow:
    w = ContextWindow(engine, policy=policy)
    for page in _pages(i)[:-1]:
        w.add(page)
    return w


def _alone(engine: Engine, i: int, policy: str) -> tuple[str, torch.Tensor]:
    """Window i's answer and prompt log-probs with no scheduler at all."""
    w = _window(engine, i, policy)
    w.add(_pages(i)[-1])
    lp = w.next_token_logprobs(_prompt(i))
    text = w.generate(_prompt(i), **SAMPLING[i % len(SAMPLING)])
    return text, lp


def test_every_policy_answers_under_batching_as_alone(engine: Engine) -> None:
    cases = [(i, policy) for i, policy in enumerate(POLICY_NAMES * 2)]  # 12 windows, every policy twice
    expected = [_alone(engine, i, p) for i, p in cases]
    windows = [_window(engine, i, p) for i, p in cases]
    sched = Scheduler(engine)
    streams, logprobs = [], []
    for (i, _), w in zip(cases, windows, strict=True):
        with sched.serving(key=i):
            # the last page's forward, the log-prob forward and the materialisation run with the answers
            # already decoding (the windows before this one), as one more row of a step
            w.add(_pages(i)[-1])
            logprobs.append(w.next_token_logprobs(_prompt(i)))
            kw = SAMPLING[i % len(SAMPLING)]
            streams.append(w.generate(_prompt(i), kw["max_new_tokens"], stream=True, **_sampling_only(kw)))
        sched.step()  # as the server's model thread does between window jobs
    texts = ["".join(s) for s in streams]
    assert texts == [t for t, _ in expected]
    for lp, (_, want) in zip(logprobs, expected, strict=True):
        torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)
    stats = sched.stats()
    assert stats.carried > 0  # window forwards did ride with running decodes
    # and answers whose prompt rode in a window's forward were queued by that forward's step (``carry``'s
    # ``answer``): they decode from the next step, the same answers as submitted by their windows
    assert stats.follow_ons >= 1
    assert stats.batch_max >= 3 and stats.finished == len(cases) and stats.kv_bytes == 0


def _sampling_only(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k != "max_new_tokens"}


def test_a_failing_and_a_cancelled_request_leave_window_answers_as_alone(engine: Engine) -> None:
    cases = [(i, p) for i, p in enumerate(POLICY_NAMES)]
    expected = [_alone(engine, i, p)[0] for i, p in cases]
    windows = [_window(engine, i, p) for i, p in cases]
    sched = Scheduler(engine)
    # a request whose past no forward accepts (fails inside the batched forward), and one cancelled early
    bad_past = KV(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), torch.arange(3))
    bad = sched.submit(bad_past, [5, 6], 3, SamplingParams(max_new_tokens=6))
    leaving = sched.submit(None, random_ids(5, 9), 0, SamplingParams(max_new_tokens=30))
    streams = []
    for (i, _), w in zip(cases, windows, strict=True):
        with sched.serving(key=i):
            w.add(_pages(i)[-1])
            kw = SAMPLING[i % len(SAMPLING)]
            streams.append(w.generate(_prompt(i), kw["max_new_tokens"], stream=True, **_sampling_only(kw)))
        sched.step()
        if i == 1:
            next(leaving)
            leaving.close()
    texts = ["".join(s) for s in streams]
    assert texts == expected
    with pytest.raises(KameraError, match="forward failed"):
        list(bad)
    assert leaving.state == "cancelled" and bad.state == "failed"
    s = sched.stats()
    assert s.failed == 1 and s.cancelled == 1 and s.kv_bytes == 0


def test_window_work_with_nothing_decoding_runs_alone(engine: Engine) -> None:
    """No running decode: a window's forward takes the plain path (bit-identical to no scheduler)."""
    sched = Scheduler(engine)
    w = _window(engine, 2, "kamera")
    with sched.serving(key="w"):
        w.add(_pages(2)[-1])
        lp = w.next_token_logprobs(_prompt(2))
    assert sched.stats().carried == 0
    assert torch.equal(lp, _alone(engine, 2, "kamera")[1])
