"""Window forwards from several threads (``Scheduler.carry``) run as rows of one step: each equals its
forward alone (logits and KV within float32 1e-4, greedy tokens identical), the step really held them
together, a forward longer than the step's token budget is split over steps, and a lone forward is the
unbatched forward bit for bit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kamera_engine import CapacityError, Engine, InvalidInputError, SamplingParams
from kamera_engine.batch import RowCache
from kamera_engine.runner import ForwardResult
from kamera_engine.scheduler import Scheduler, StepRecord
from tests.conftest import random_ids, tiny_engine

TOL = 1e-4


@pytest.fixture
def engine() -> Engine:
    return tiny_engine("llama")


def _cases(engine: Engine, n: int) -> list[tuple[torch.Tensor, object, int, str]]:
    """Window forwards of different lengths after pasts of different lengths (a past of 0 included)."""
    cases = []
    for i in range(n):
        past = None
        if i % 3:
            past = engine.forward(random_ids(3 + 4 * i, 50 + i), None, 0, logits="none").kv
        start = 0 if past is None else len(past)
        ids = torch.tensor(random_ids(2 + 3 * i, 80 + i))
        cases.append((ids, past, start, "all" if i % 2 else "last"))
    return cases


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def _carry_from_threads(
    sched: Scheduler, cases, answers: list[SamplingParams] | None = None
) -> tuple[list[ForwardResult | None], list[threading.Thread]]:
    """Each case's forward on a thread of its own, under ``serving``; with ``answers``, each forward asks for
    its last logits and starts that answer (``Engine.forward(..., answer=...)``)."""
    out: list[ForwardResult | None] = [None] * len(cases)

    def run(i: int) -> None:
        ids, past, start, logits = cases[i]
        with sched.serving(key=i):
            if answers is None:
                out[i] = sched.engine.forward(ids, past, start, logits=logits)
            else:
                out[i] = sched.engine.forward(ids, past, start, logits="last", answer=answers[i])

    return out, _started(run, len(cases))


def _started(run, n: int) -> list[threading.Thread]:
    """``run(i)`` for i < n, each on a thread of its own, started."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _same(a: ForwardResult, b: ForwardResult) -> None:
    assert a.logits.shape == b.logits.shape
    assert (a.logits - b.logits).abs().max().item() < TOL
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    assert torch.equal(a.kv.positions, b.kv.positions)
    assert (a.kv.keys - b.kv.keys).abs().max().item() < TOL
    assert (a.kv.values - b.kv.values).abs().max().item() < TOL


def test_window_forwards_of_several_threads_run_in_one_step(engine: Engine) -> None:
    cases = _cases(engine, 5)
    alone = [engine.forward(ids, past, start, logits=lg) for ids, past, start, lg in cases]
    sched = Scheduler(engine)
    with sched.driving():  # this thread steps: the forwards wait until all five are queued
        out, threads = _carry_from_threads(sched, cases)
        _wait_until(lambda: sched.stats().carried_waiting == len(cases))
        assert sched.step()
        for t in threads:
            t.join()
    stats = sched.stats()
    assert stats.steps == 1 and stats.carried_rows_max == len(cases) and stats.carried == len(cases)
    assert stats.carried_waiting == 0 and stats.carried_alone == 0
    for got, want in zip(out, alone, strict=True):
        assert got is not None
        _same(got, want)


def test_a_window_forwards_result_is_put_together_on_its_callers_thread(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copies a result needs (its new tokens' KV, a transformers cache over the row) run on the thread that
    waits for it, not on the one stepping the scheduler, whose time every row of the batch shares."""
    cases = _cases(engine, 3)
    alone = [engine.forward(ids, past, start, logits=lg) for ids, past, start, lg in cases]
    real = RowCache.kv
    where: list[str] = []

    def kv(self, *args, **kwargs):
        where.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RowCache, "kv", kv)
    sched = Scheduler(engine)
    with sched.driving():
        out, threads = _carry_from_threads(sched, cases)
        _wait_until(lambda: sched.stats().carried_waiting == len(cases))
        assert sched.step()
        for t in threads:
            t.join()
    assert sorted(where) == sorted(t.name for t in threads)
    for got, want in zip(out, alone, strict=True):
        assert got is not None
        _same(got, want)


def test_window_forwards_batch_with_running_decodes(engine: Engine) -> None:
    cases = _cases(engine, 3)
    alone = [engine.forward(ids, past, start, logits=lg) for ids, past, start, lg in cases]
    params = SamplingParams(max_new_tokens=6)
    want_tokens = list(engine.generate_ids(None, random_ids(7, 5), 0, params))
    sched = Scheduler(engine)
    req = sched.submit(None, random_ids(7, 5), 0, SamplingParams(max_new_tokens=6))
    with sched.driving():
        sched.step()  # the prompt's prefill: the request decodes from here on
        out, threads = _carry_from_threads(sched, cases)
        _wait_until(lambda: sched.stats().carried_waiting == len(cases))
        while sched.step():
            pass
        for t in threads:
            t.join()
    assert list(req.generated) == want_tokens
    assert sched.stats().carried_rows_max == len(cases)
    for got, want in zip(out, alone, strict=True):
        assert got is not None
        _same(got, want)


def test_a_window_forward_over_the_step_budget_is_chunked(engine: Engine) -> None:
    cases = _cases(engine, 4)  # 2, 5, 8 and 11 new tokens
    alone = [engine.forward(ids, past, start, logits=lg) for ids, past, start, lg in cases]
    sched = Scheduler(engine, step_tokens=6)
    with sched.driving():
        out, threads = _carry_from_threads(sched, cases)
        _wait_until(lambda: sched.stats().carried_waiting == len(cases))
        while sched.step():
            pass
        for t in threads:
            t.join()
    stats = sched.stats()
    # batched steps never ran more than 6 tokens (a forward left alone at the end runs whole: nothing waits)
    assert stats.carried_tokens <= 6 * stats.steps and stats.carried_rows_max >= 2
    assert stats.carried + stats.carried_alone == len(cases)
    assert stats.carried_tokens > 11  # the longest forward (11 tokens) or another was split over steps
    for got, want in zip(out, alone, strict=True):
        assert got is not None
        _same(got, want)


def test_a_lone_window_forward_is_the_unbatched_forward_exactly(engine: Engine) -> None:
    ((ids, past, start, logits),) = _cases(engine, 2)[1:]
    want = engine.forward(ids, past, start, logits=logits)
    sched = Scheduler(engine)
    seen: list[StepRecord] = []
    with sched.driving(), sched.observe(seen.append):
        out, threads = _carry_from_threads(sched, [(ids, past, start, logits)])
        _wait_until(lambda: sched.stats().carried_waiting == 1)
        assert sched.step()
        threads[0].join()
    got = out[0]
    assert got is not None and sched.stats().carried_alone == 1
    (step,) = seen
    assert step.alone and step.window_forwards == 1 and step.window_tokens == len(ids) and step.decode_rows == 0
    assert torch.equal(got.logits, want.logits) and torch.equal(got.kv.keys, want.kv.keys)
    assert torch.equal(got.kv.values, want.kv.values)


def test_a_failing_window_forward_raises_on_its_own_thread_only(engine: Engine) -> None:
    cases = _cases(engine, 3)
    alone = [engine.forward(ids, past, start, logits=lg) for ids, past, start, lg in cases]
    bad_past = cases[1][1]
    assert bad_past is not None
    broken = bad_past.to(dtype=torch.float64)  # a past of another dtype: the combined forward fails
    cases[1] = (cases[1][0], broken, cases[1][2], cases[1][3])
    sched = Scheduler(engine)
    errors: list[BaseException] = []
    out: list[ForwardResult | None] = [None] * 3

    def run(i: int) -> None:
        ids, past, start, logits = cases[i]
        try:
            with sched.serving(key=i):
                out[i] = engine.forward(ids, past, start, logits=logits)
        except Exception as exc:
            errors.append(exc)

    with sched.driving():
        threads = _started(run, 3)
        _wait_until(lambda: sched.stats().carried_waiting == 3)
        while sched.step():
            pass
        for t in threads:
            t.join()
    assert len(errors) == 1 and out[1] is None
    for i in (0, 2):
        got = out[i]
        assert got is not None
        _same(got, alone[i])


#: the answers the follow-on tests start: greedy, and sampled with a seed (its generator starts at admission)
ANSWERS = [dict(max_new_tokens=6), dict(max_new_tokens=5, temperature=0.9, seed=3), dict(max_new_tokens=7)]


def test_an_answer_started_by_its_forwards_step_decodes_from_the_next_step_as_submitted(engine: Engine) -> None:
    """``forward(..., answer=...)`` in a step: that step queues the answer, so the very next step admits it (its
    first token) and decodes its second, with no round trip through the caller; its tokens are those the
    caller's own submission from the result gives (greedy and sampled)."""
    cases = _cases(engine, 3)
    sched = Scheduler(engine)
    with sched.driving():
        out, threads = _carry_from_threads(sched, cases, [SamplingParams(**kw) for kw in ANSWERS])
        _wait_until(lambda: sched.stats().carried_waiting == len(cases))
        assert sched.step()  # the three forwards, in one step
        for t in threads:
            t.join()
        answers = [r.answer if r is not None else None for r in out]
        assert all(a is not None and a.state == "waiting" for a in answers)
        assert sched.stats().follow_ons == len(cases)
        assert sched.step()  # admitted (first token from the forward's logits) and decoded once
        assert all(a is not None and len(a.generated) >= 1 for a in answers)
        while sched.step():
            pass
        started = [list(a.generated) for a in answers if a is not None]
        # the caller's own submission from the same result, as before (each result hands its answer over once)
        again = []
        for (ids, _, start, _), res, kw in zip(cases, out, ANSWERS, strict=True):
            assert res is not None and res.take_answer() is not None and res.take_answer() is None
            again.append(sched.submit_prefilled(res.prefilled(start + len(ids)), SamplingParams(**kw)))
        while sched.step():
            pass
    assert started == [list(r.generated) for r in again]
    assert sched.stats().kv_bytes == 0 and sched.stats().finished == 2 * len(cases)


def test_a_started_answer_is_withdrawn_when_its_callers_result_fails(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = _cases(engine, 2)

    def broken(self, item):
        raise InvalidInputError("assembly failed")

    monkeypatch.setattr(Scheduler, "_carried_result", broken)
    sched = Scheduler(engine)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        ids, past, start, _ = cases[i]
        try:
            with sched.serving(key=i):
                engine.forward(ids, past, start, logits="last", answer=SamplingParams(max_new_tokens=4))
        except InvalidInputError as exc:
            errors.append(exc)

    with sched.driving():
        threads = _started(run, 2)
        _wait_until(lambda: sched.stats().carried_waiting == 2)
        sched.step()
        for t in threads:
            t.join()
        while sched.step():
            pass
    s = sched.stats()
    assert len(errors) == 2 and s.follow_ons == 2 and s.cancelled == 2
    assert s.running == s.waiting == 0 and s.kv_bytes == 0 and s.steps == 1  # nothing decoded for nobody


def test_an_answer_the_scheduler_would_refuse_is_left_to_its_caller(engine: Engine) -> None:
    """A started answer that does not fit the KV budget is not queued: the caller submits it from the result
    and is refused there, as without the follow-on."""
    cases = _cases(engine, 2)
    ids, _, start, _ = cases[1]
    sched = Scheduler(engine, kv_budget_bytes=8 * Scheduler(engine).bytes_per_token)  # 8 tokens: none of these fits
    with sched.driving():
        out, threads = _carry_from_threads(sched, cases, [SamplingParams(max_new_tokens=40)] * 2)
        _wait_until(lambda: sched.stats().carried_waiting == 2)
        sched.step()
        for t in threads:
            t.join()
    assert all(r is not None and r.answer is None for r in out)
    assert sched.stats().follow_ons == 0 and sched.stats().refused == 0
    res = out[1]
    assert res is not None
    with pytest.raises(CapacityError):
        sched.submit_prefilled(res.prefilled(start + len(ids)), SamplingParams(max_new_tokens=40))
