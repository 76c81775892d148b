"""The scheduler: requests decoded together give exactly their single-request outputs, in order per key,
and a failing, cancelled or refused request never disturbs the others."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from kamera_engine import Engine, SamplingParams
from kamera_engine.errors import CapacityError, InvalidInputError, KameraError
from kamera_engine.kv import KV
from kamera_engine.runner import run_forward
from kamera_engine.scheduler import Scheduler, StepRecord
from tests.conftest import CharTokenizer, char_engine, random_ids


@pytest.fixture
def engine() -> Engine:
    return char_engine()


def _past(engine: Engine, n: int, seed: int) -> KV | None:
    if n == 0:
        return None
    return run_forward(engine.model, torch.tensor(random_ids(n, seed)), None, 0, logits="none").kv


#: (past tokens, prompt tokens, sampling) per request: lengths, temperatures, top-p, seeds, stops, EOS
CASES = [
    (0, 6, dict(max_new_tokens=12)),
    (9, 3, dict(max_new_tokens=7, temperature=0.8, seed=3)),
    (17, 11, dict(max_new_tokens=10, temperature=1.2, top_p=0.7, seed=11)),
    (4, 1, dict(max_new_tokens=15, stop=("k", "zz"))),
    (25, 5, dict(max_new_tokens=9, eos_token_ids=(7, 40))),
    (2, 30, dict(max_new_tokens=0)),
]


def _single(engine: Engine, past: KV | None, ids: list[int], start: int, kw: dict) -> tuple[list[int], str]:
    params = SamplingParams(**kw)
    tokens = list(engine.generate_ids(past, ids, start, params))
    return tokens, "".join(engine.stream(iter(tokens), SamplingParams(**kw)))


def _batched(engine: Engine, sched: Scheduler, cases: list) -> list:
    reqs = []
    for past, ids, start, kw in cases:
        reqs.append(sched.submit(past, ids, start, SamplingParams(**kw)))
    out = [[] for _ in reqs]
    live = set(range(len(reqs)))
    while live:  # pull the requests in turn: each next() steps the whole batch
        for i in sorted(live):
            t = next(reqs[i], None)
            if t is None:
                live.discard(i)
            else:
                out[i].append(t)
    return reqs, out


def _cases(engine: Engine) -> list:
    return [(_past(engine, p, i), random_ids(n, 40 + i), p, kw) for i, (p, n, kw) in enumerate(CASES)]


@pytest.mark.parametrize("step_tokens", [512, 4])  # 4: prompts are prefilled in chunks across steps
def test_a_batch_gives_every_request_its_single_output(engine: Engine, step_tokens: int) -> None:
    cases = _cases(engine)
    expected = [_single(engine, *c) for c in cases]
    sched = Scheduler(engine, step_tokens=step_tokens)
    reqs, tokens = _batched(engine, sched, cases)
    for (want_tokens, want_text), got, req, (_, _, _, kw) in zip(expected, tokens, reqs, cases, strict=True):
        assert got[: len(want_tokens)] == want_tokens
        # a stop string ends the batched row at once; the single path's consumer cuts the same text
        assert "".join(engine.stream(iter(got), SamplingParams(**kw))) == want_text
        assert req.done and req.state == "done"
    stats = sched.stats()
    assert stats.batch_max >= min(5, step_tokens) and stats.running == 0 and stats.kv_bytes == 0
    assert stats.finished == len(cases)
    assert stats.decode_tokens > 0 and stats.prefill_tokens == sum(n for _, n, _ in CASES)


def test_observe_reports_every_step_and_its_errors_change_nothing(engine: Engine, caplog) -> None:
    cases = _cases(engine)
    _, want = _batched(engine, Scheduler(engine, step_tokens=4), cases)
    sched = Scheduler(engine, step_tokens=4)
    seen: list[StepRecord] = []

    def broken(_: StepRecord) -> None:
        raise RuntimeError("an observer's own bug")

    with sched.observe(broken), sched.observe(seen.append):
        _, got = _batched(engine, sched, cases)
    assert got == want
    stats = sched.stats()
    assert len(seen) == stats.steps > 1
    assert sum(s.decode_rows for s in seen) == stats.decode_tokens
    assert sum(s.prompt_tokens for s in seen) == stats.prefill_tokens
    assert all(s.seconds > 0 and s.ended > 0 and not s.alone and not s.window_forwards for s in seen)
    assert caplog.text.count("a step observer failed") == len(seen)  # logged every time, the steps went on
    _batched(engine, sched, cases[:1])  # after the block: no longer reported
    assert len(seen) == stats.steps < sched.stats().steps


def test_observe_reports_work_run_alone_between_steps(engine: Engine) -> None:
    sched = Scheduler(engine)
    seen: list[StepRecord] = []
    with sched.observe(seen.append):
        assert sched.run_alone(lambda: 7) == 7
    (step,) = seen
    assert step.alone and step.window_forwards == 0 and step.decode_rows == 0 and sched.stats().alone == 1


def test_stop_strings_end_rows_early_in_the_scheduler(engine: Engine) -> None:
    past, ids = _past(engine, 4, 3), random_ids(1, 43)
    params = SamplingParams(max_new_tokens=15, stop=("k", "zz"))
    full = _single(engine, past, ids, 4, dict(max_new_tokens=15))[0]
    text = CharTokenizer().decode(full)
    req = Scheduler(engine).submit(past, ids, 4, params)
    got = list(req)
    if "k" in text:  # the row stopped on the token that completed the stop string
        assert len(got) == len(CharTokenizer().decode(full).split("k")[0]) + 1
        assert req.finish_reason == "stop"
    else:
        assert got == full


def test_window_generate_goes_through_the_scheduler(engine: Engine) -> None:
    from kamera_sdk import ContextWindow

    windows = [ContextWindow(engine, policy=p) for p in ("kamera", "recompute", "prefix")]
    for i, w in enumerate(windows):
        for j in range(i + 1):
            w.add(random_ids(5 + 3 * j, 70 + 10 * i + j))
    prompts = [random_ids(4, 90 + i) for i in range(len(windows))]
    alone = [
        list(engine.generate_ids(w.assemble(), p, 4 + w.tokens, SamplingParams(max_new_tokens=8)))
        for w, p in zip(windows, prompts, strict=True)
    ]
    sched = Scheduler(engine)
    streams = []
    for i, (w, p) in enumerate(zip(windows, prompts, strict=True)):
        with sched.serving(key=i):
            streams.append(w.generate(p, 8, stream=True))
    assert sched.stats().submitted == len(windows)
    texts = ["".join(s) for s in streams]
    assert texts == [CharTokenizer().decode(a) for a in alone]
    assert sched.stats().batch_max == len(windows)


def test_a_failing_request_never_disturbs_the_others(engine: Engine) -> None:
    cases = _cases(engine)[:3]
    expected = [_single(engine, *c)[0] for c in cases]
    sched = Scheduler(engine)
    reqs = [sched.submit(past, ids, start, SamplingParams(**kw)) for past, ids, start, kw in cases]
    # a past whose shape no forward accepts: it fails inside the batched forward
    bad_past = KV(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), torch.arange(3))
    bad = sched.submit(bad_past, [5, 6], 3, SamplingParams(max_new_tokens=4))
    outs = [list(r) for r in reqs]
    assert outs == expected
    with pytest.raises(KameraError, match="forward failed"):
        list(bad)
    assert bad.state == "failed" and sched.stats().failed == 1


def test_a_cancelled_request_leaves_and_the_others_go_on(engine: Engine) -> None:
    cases = _cases(engine)[:3]
    expected = [_single(engine, *c)[0] for c in cases]
    sched = Scheduler(engine)
    reqs = [sched.submit(past, ids, start, SamplingParams(**kw)) for past, ids, start, kw in cases]
    first = next(reqs[0])
    reqs[0].close()
    assert list(reqs[0]) == [] and reqs[0].state == "cancelled"
    assert first == expected[0][0]
    assert [list(r) for r in reqs[1:]] == expected[1:]
    assert sched.stats().cancelled == 1 and sched.stats().kv_bytes == 0


def test_a_cancel_from_another_thread_lands_at_the_next_step(engine: Engine) -> None:
    # the driver steps in a tight loop: a cancel that waited for the step lock could wait for hundreds of steps
    # (it did, and an answer cancelled in the window tests decoded to its end); one queued lands at the next step
    sched = Scheduler(engine)
    sched.start()
    try:
        for seed in range(5):
            req = sched.submit(None, random_ids(4, seed), 0, SamplingParams(max_new_tokens=4000, eos_token_ids=()))
            while len(req.generated) < 20 and not req.done:
                time.sleep(0.001)
            before = len(req.generated)
            req.close()
            assert req.state == "cancelled"
            # the step in progress when it was queued, and one that began before it was read
            assert len(req.generated) - before <= 2
        stats = sched.stats()
        assert (stats.cancelled, stats.running, stats.waiting, stats.kv_bytes) == (5, 0, 0, 0)
    finally:
        sched.stop()


def test_one_keys_requests_run_in_order(engine: Engine) -> None:
    sched = Scheduler(engine)
    a = sched.submit(None, random_ids(3, 1), 0, SamplingParams(max_new_tokens=5), key="w")
    b = sched.submit(None, random_ids(3, 2), 0, SamplingParams(max_new_tokens=5), key="w")
    c = sched.submit(None, random_ids(3, 3), 0, SamplingParams(max_new_tokens=5), key="other")
    sched.step()
    assert (a.state, b.state, c.state) == ("decode", "waiting", "decode")
    list(a)
    sched.step()
    assert b.state != "waiting" and b.first_token_at is not None and b.first_token_at >= a.first_token_at


def test_the_memory_budget_queues_then_refuses(engine: Engine) -> None:
    sched = Scheduler(engine, kv_budget_bytes=1, max_waiting=0)
    with pytest.raises(CapacityError) as exc:  # can never fit
        sched.submit(None, [5, 6], 0, SamplingParams(max_new_tokens=2))
    assert exc.value.retry_after_s is None
    one = (2 + 4) * sched.bytes_per_token
    sched = Scheduler(engine, kv_budget_bytes=one, max_waiting=1)
    a = sched.submit(None, [5, 6], 0, SamplingParams(max_new_tokens=4))
    sched.step()
    b = sched.submit(None, [7, 8], 0, SamplingParams(max_new_tokens=4))  # waits: a holds the budget
    with pytest.raises(CapacityError) as exc:
        sched.submit(None, [9, 10], 0, SamplingParams(max_new_tokens=4))
    assert exc.value.retry_after_s is not None and exc.value.retry_after_s > 0
    assert b.state == "waiting"
    assert len(list(a)) == 4
    assert len(list(b)) == 4
    stats = sched.stats()
    assert stats.refused == 1 and stats.kv_bytes_peak <= one and stats.kv_bytes == 0


def test_bad_requests_are_refused_before_anything_runs(engine: Engine) -> None:
    sched = Scheduler(engine)
    with pytest.raises(InvalidInputError):
        sched.submit(None, [], 0, SamplingParams())
    with pytest.raises(InvalidInputError):
        sched.submit(None, [engine.vocab_size], 0, SamplingParams())
    with pytest.raises(InvalidInputError):
        sched.submit(None, [5], 0, SamplingParams(top_p=0))
    assert sched.stats().submitted == 0 and not sched.has_work()


def test_a_driver_thread_and_async_consumers(engine: Engine) -> None:
    cases = _cases(engine)[:4]
    expected = [_single(engine, *c)[0] for c in cases]
    sched = Scheduler(engine)
    sched.start()
    try:

        async def consume(req) -> list[int]:
            return [t async for t in req.aiter()]

        async def main() -> list[list[int]]:
            reqs = [sched.submit(p, i, s, SamplingParams(**kw)) for p, i, s, kw in cases]
            return await asyncio.gather(*(consume(r) for r in reqs))

        assert asyncio.run(main()) == expected
        # a blocking consumer on another thread waits for the driver
        got: list[int] = []
        t = threading.Thread(target=lambda: got.extend(sched.submit(*cases[0][:3], SamplingParams(**cases[0][3]))))
        t.start()
        t.join(timeout=60)
        assert got == expected[0]
    finally:
        sched.stop()


def test_the_stepping_threads_idle_time_is_counted(engine: Engine) -> None:
    p, i, s, kw = _cases(engine)[0]
    sched = Scheduler(engine)
    assert sched.stats().idle_s == 0.0
    t0 = time.perf_counter()
    sched.start()
    try:
        time.sleep(1.2)  # nothing to do: the driver waits for work, half a second at a time
        idle = sched.stats().idle_s
        assert 0.4 < idle <= time.perf_counter() - t0
        assert list(sched.submit(p, i, s, SamplingParams(**kw)))
        stats = sched.stats()
        assert stats.forward_s > 0.0 and stats.idle_s >= idle
    finally:
        sched.stop()
    # a wait in progress counts up to the moment the stats are read
    before = sched.stats().idle_s
    waiter = threading.Thread(target=sched.wait_for_work, args=(30.0,))
    waiter.start()
    time.sleep(0.6)
    assert sched.stats().idle_s - before > 0.3 and waiter.is_alive()
    sched.notify()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and sched.stats().idle_s - before < 30.0
    # with work already there a wait returns at once and counts nothing
    req = sched.submit(p, i, s, SamplingParams(**kw))
    before = sched.stats().idle_s
    sched.wait_for_work(5.0)
    assert sched.stats().idle_s == before
    req.cancel()
