"""The scheduler under failures, load and accounting: a window forward that breaks outside the combined
forward fails on its own thread and the scheduler goes on; forwards that must run alone (``run_alone``:
recordings, ``alone()``, forwards outside ``serving`` while a thread drives) run between steps, bit for bit
the unbatched path and never beside a step; a window forward gets a share of every step however many rows
decode; a step's work is counted engine-wide only, never in the stepping thread's own counters; counting
from many threads loses nothing."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from kamera_engine import Engine, SamplingParams
from kamera_engine import scheduler as scheduler_module
from kamera_engine.batch import RowCache
from kamera_engine.runner import ForwardResult, run_forward
from kamera_engine.scheduler import Scheduler, alone
from tests.conftest import random_ids, tiny_engine

TOL = 1e-4


@pytest.fixture
def engine() -> Engine:
    return tiny_engine("llama")


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def _forward_on_thread(sched: Scheduler, ids, past, start: int, key: int, out: dict, errors: dict):
    def run() -> None:
        try:
            with sched.serving(key=key):
                out[key] = sched.engine.forward(ids, past, start, logits="last")
        except Exception as exc:
            errors[key] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def _past(engine: Engine, n: int, seed: int):
    return engine.forward(random_ids(n, seed), None, 0, logits="none").kv


def test_a_window_forward_failing_in_planning_fails_alone_and_the_scheduler_goes_on(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad_past, good_past = _past(engine, 6, 1), _past(engine, 4, 2)
    ids_bad, ids_good = torch.tensor(random_ids(3, 3)), torch.tensor(random_ids(5, 4))
    want = engine.forward(ids_good, good_past, len(good_past), logits="last")
    real = RowCache.from_past.__func__

    def from_past(cls, past, *args, **kwargs):
        if past is bad_past:
            raise RuntimeError("cannot copy this past")
        return real(cls, past, *args, **kwargs)

    monkeypatch.setattr(scheduler_module.RowCache, "from_past", classmethod(from_past))
    sched = Scheduler(engine)
    out: dict[int, ForwardResult] = {}
    errors: dict[int, Exception] = {}
    with sched.driving():
        threads = [
            _forward_on_thread(sched, ids_bad, bad_past, len(bad_past), 0, out, errors),
            _forward_on_thread(sched, ids_good, good_past, len(good_past), 1, out, errors),
        ]
        _wait_until(lambda: sched.stats().carried_waiting == 2)
        assert sched.step()  # both were planned into this step: the bad one fails, the good one runs
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        stats = sched.stats()
        assert stats.carried_waiting == 0 and stats.carried_failed == 1 and not sched.has_work()
        # later work is served
        req = sched.submit(None, random_ids(5, 9), 0, SamplingParams(max_new_tokens=3))
        while sched.step():
            pass
    assert set(errors) == {0} and "cannot copy this past" in str(errors[0])
    assert (out[1].logits - want.logits).abs().max().item() < TOL
    assert req.state == "done" and len(req.generated) == 3


def test_a_window_forward_failing_in_assembly_fails_alone(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    pasts = [_past(engine, 6, 1), _past(engine, 4, 2)]
    ids = [torch.tensor(random_ids(3, 3)), torch.tensor(random_ids(5, 4))]
    want = [engine.forward(ids[i], pasts[i], len(pasts[i]), logits="last") for i in range(2)]
    real = RowCache.kv

    def kv(self, start, stop, *args, **kwargs):  # on the callers' threads, at once: the first case's 3 tokens fail
        if stop - start == len(ids[0]):
            raise RuntimeError("cannot assemble")
        return real(self, start, stop, *args, **kwargs)

    monkeypatch.setattr(scheduler_module.RowCache, "kv", kv)
    sched = Scheduler(engine)
    out: dict[int, ForwardResult] = {}
    errors: dict[int, Exception] = {}
    with sched.driving():
        threads = [_forward_on_thread(sched, ids[i], pasts[i], len(pasts[i]), i, out, errors) for i in range(2)]
        _wait_until(lambda: sched.stats().carried_waiting == 2)
        assert sched.step()
        for t in threads:
            t.join(30)
    assert not sched.has_work() and len(errors) == 1 and len(out) == 1
    ((failed, error),) = errors.items()
    ((ran, got),) = out.items()
    assert "cannot assemble" in str(error) and (failed, ran) == (0, 1)
    assert (got.logits - want[ran].logits).abs().max().item() < TOL


def test_an_error_outside_the_forward_fails_the_steps_rows_and_later_work_runs(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = Scheduler(engine)
    broken = [True]
    real = Scheduler._account

    def account(self, plan, dt):
        if broken[0]:
            broken[0] = False
            raise RuntimeError("bookkeeping broke")
        return real(self, plan, dt)

    monkeypatch.setattr(Scheduler, "_account", account)
    out: dict[int, ForwardResult] = {}
    errors: dict[int, Exception] = {}
    req = sched.submit(None, random_ids(5, 9), 0, SamplingParams(max_new_tokens=3))
    with sched.driving():
        t = _forward_on_thread(sched, torch.tensor(random_ids(4, 5)), None, 0, 0, out, errors)
        _wait_until(lambda: sched.stats().carried_waiting == 1)
        assert sched.step()  # the prompt and the window forward in one step, which breaks after its forward
        t.join(30)
        assert not t.is_alive() and "bookkeeping broke" in str(errors[0])
        assert req.state == "failed" and not sched.has_work()
        later = sched.submit(None, random_ids(5, 9), 0, SamplingParams(max_new_tokens=3))
        while sched.step():
            pass
    assert later.state == "done" and len(later.generated) == 3


def test_a_window_forward_is_not_starved_by_decodes(engine: Engine) -> None:
    sched = Scheduler(engine, step_tokens=3)  # three one-token prompts fill the first step, then three decodes
    never_ends = SamplingParams(max_new_tokens=40, eos_token_ids=(-1,))  # no token ends it before 40
    reqs = [sched.submit(None, random_ids(1, 20 + i), 0, never_ends) for i in range(3)]
    ids = torch.tensor(random_ids(6, 7))
    want = engine.forward(ids, None, 0, logits="last")
    out: dict[int, ForwardResult] = {}
    errors: dict[int, Exception] = {}
    with sched.driving():
        sched.step()
        assert all(r.state == "decode" for r in reqs)
        t = _forward_on_thread(sched, ids, None, 0, 0, out, errors)
        _wait_until(lambda: sched.stats().carried_waiting == 1)
        steps = 0
        while t.is_alive() and steps < 20:
            sched.step()
            steps += 1
            t.join(0.01)
        t.join(5)
        # three decode rows use up a budget of three tokens; the window forward still got its share
        assert not errors and 0 in out and steps <= 8
        assert all(r.state == "decode" for r in reqs)
        for r in reqs:
            r.cancel()
    assert (out[0].logits - want.logits).abs().max().item() < TOL


def test_a_thread_stepping_the_scheduler_counts_only_its_own_forward(engine: Engine) -> None:
    sched = Scheduler(engine)
    sched.submit(None, random_ids(7, 5), 0, SamplingParams(max_new_tokens=2))  # its prompt rides in our step
    ids = torch.tensor(random_ids(4, 6))
    before_all = engine.counters.model_copy()
    seen: dict[str, int] = {}

    def run() -> None:
        counters = engine.thread_counters
        f, t = counters.forwards, counters.tokens_prefilled
        with sched.serving(key="w"):
            engine.forward(ids, None, 0, logits="last")  # no driver: this thread steps the scheduler
        seen["forwards"], seen["tokens"] = counters.forwards - f, counters.tokens_prefilled - t

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    assert seen == {"forwards": 1, "tokens": 4}
    assert sched.stats().carried == 1  # it really ran in a step with the prompt
    after = engine.counters
    assert after.forwards - before_all.forwards == 2  # the step's own (the prompt) and the window's
    assert after.tokens_prefilled - before_all.tokens_prefilled == 7 + 4


def test_counting_forwards_from_many_threads_loses_nothing(engine: Engine) -> None:
    threads, per = 8, 3000
    before = engine.counters.forwards
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [
            threading.Thread(target=lambda: [engine.count_forward(1, 0.0) for _ in range(per)]) for _ in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    assert engine.counters.forwards - before == threads * per


def _most_at_once(modules, pause: float) -> tuple[list[int], list]:
    """Hooks that count how many of ``modules`` run at once (the most, in a one-item list, and the hooks to
    remove); each call pauses ``pause`` seconds first, to widen the window in which an overlap would show."""
    active, most = [0], [0]
    lock = threading.Lock()

    def enter(module, args, kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(pause)

    def leave(module, args, kwargs, output):
        with lock:
            active[0] -= 1

    hooks = [
        h
        for m in modules
        for h in (
            m.register_forward_pre_hook(enter, with_kwargs=True),
            m.register_forward_hook(leave, with_kwargs=True),
        )
    ]
    return most, hooks


def _on_threads(run, n: int) -> list[threading.Thread]:
    """``run(i)`` for i < n, each on a thread of its own; returns the threads once each has ended (or 60 s passed)."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return threads


def test_run_alone_is_the_unbatched_forward_and_never_runs_beside_a_step(engine: Engine) -> None:
    """Forwards asked to run alone (``alone()``, and forwards outside ``serving``) while a driver steps
    running decodes: each equals ``run_forward`` bit for bit, and the model never runs two forwards at once."""
    cases = [(torch.tensor(random_ids(3 + i, 30 + i)), _past(engine, 2 + i, 40 + i)) for i in range(4)]
    want = [run_forward(engine.model, ids, past, len(past), logits="all") for ids, past in cases]
    most, hooks = _most_at_once([engine.model], pause=0.002)
    sched = Scheduler(engine)
    reqs = [sched.submit(None, random_ids(4, 60 + i), 0, SamplingParams(max_new_tokens=30)) for i in range(2)]
    sched.start()
    out: list[ForwardResult | None] = [None] * len(cases)
    try:

        def run(i: int) -> None:
            ids, past = cases[i]
            if i % 2:
                with sched.serving(key=i), alone():
                    out[i] = engine.forward(ids, past, len(past), logits="all")
            else:  # outside serving, while a thread drives: alone too
                out[i] = engine.forward(ids, past, len(past), logits="all")

        _on_threads(run, len(cases))
        for r in reqs:
            list(r)
    finally:
        sched.stop()
        for h in hooks:
            h.remove()
    assert most[0] == 1
    assert sched.stats().alone == len(cases)
    for got, w in zip(out, want, strict=True):
        assert got is not None
        assert torch.equal(got.logits, w.logits)
        assert torch.equal(got.kv.keys, w.kv.keys) and torch.equal(got.kv.values, w.kv.values)


def test_selective_recompute_runs_between_steps_bit_for_bit(engine: Engine) -> None:
    """Selective recompute drives the decoder layers itself (not ``Engine.forward``); under a driven scheduler,
    from inside ``serving`` or outside it, it runs between two steps: never beside a step's forward, and its
    result is the one without a scheduler, bit for bit."""
    from kamera_engine.selective import recompute_tokens, reprefill_from_layer

    anchor = 4
    windows = [(random_ids(14 + 3 * i, 70 + i)) for i in range(3)]
    placed = [engine.forward(ids, None, 0, logits="none").kv for ids in windows]

    def selective(i: int):
        ids, kv = windows[i], placed[i]
        if i == 2:
            return reprefill_from_layer(engine, kv, ids, [range(anchor, anchor + 6)], 1, anchor)
        cand = torch.arange(anchor, len(ids))
        return recompute_tokens(engine, kv, ids, cand, ratio=0.5, check_layer=1 if i else None)

    want = [selective(i) for i in range(3)]
    most, hooks = _most_at_once(engine.adapter.layers(engine.model), pause=0.001)
    sched = Scheduler(engine)
    # decodes long enough to still run while the recomputes do (they start after the driver's first steps)
    reqs = [sched.submit(None, random_ids(4, 90 + i), 0, SamplingParams(max_new_tokens=300)) for i in range(2)]
    sched.start()
    out: list = [None] * 3
    try:

        def run(i: int) -> None:
            if i % 2:
                with sched.serving(key=i):
                    out[i] = selective(i)
            else:
                out[i] = selective(i)

        assert not any(t.is_alive() for t in _on_threads(run, 3))
        assert not any(r.done for r in reqs)  # the decodes still ran when the recomputes had ended
        for r in reqs:
            list(r)
    finally:
        sched.stop()
        for h in hooks:
            h.remove()
    assert most[0] == 1  # one decoder layer runs at a time: never a step beside the recompute
    assert sched.stats().alone == 3
    for got, w in zip(out, want, strict=True):
        kv_got, kv_want = (got.kv, w.kv) if hasattr(got, "kv") else (got, w)
        assert torch.equal(kv_got.keys, kv_want.keys) and torch.equal(kv_got.values, kv_want.values)
