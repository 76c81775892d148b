"""The anchor's KV is computed once however many windows ask for it at once, and a failed first forward
leaves it to the next caller."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kamera_engine import Engine
from tests.conftest import tiny_engine


def _counted(engine: Engine, monkeypatch: pytest.MonkeyPatch, *, fail_first: bool = False) -> list[int]:
    calls: list[int] = []
    original = engine._anchor_forward

    def slow() -> object:
        calls.append(1)
        time.sleep(0.2)  # long enough for every other thread to arrive while it runs
        if fail_first and len(calls) == 1:
            raise RuntimeError("first anchor forward fails")
        return original()

    monkeypatch.setattr(engine, "_anchor_forward", slow)
    return calls


def _ask(engine: Engine, n: int) -> tuple[list[object], list[BaseException]]:
    got: list[object] = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait(10)
        try:
            got[i] = engine.anchor_kv
        except BaseException as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, errors


def test_windows_asking_at_once_share_one_anchor_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine("llama")
    expected = tiny_engine("llama").anchor_kv
    calls = _counted(engine, monkeypatch)
    got, errors = _ask(engine, 6)
    assert not errors and len(calls) == 1
    assert all(g is got[0] for g in got)  # the one published KV
    assert torch.equal(got[0].keys, expected.keys) and torch.equal(got[0].values, expected.values)


def test_a_failed_first_anchor_forward_is_run_again_by_a_waiting_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine("llama")
    calls = _counted(engine, monkeypatch, fail_first=True)
    got, errors = _ask(engine, 4)
    assert len(errors) == 1 and "first anchor forward fails" in str(errors[0])  # only the first caller's
    assert len(calls) == 2  # one waiter ran it again; the others got its result
    assert sum(g is not None for g in got) == 3 and len({id(g) for g in got if g is not None}) == 1


def test_a_waiter_that_drives_the_scheduler_runs_the_first_callers_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first caller's anchor forward runs alone through a driven scheduler, so it needs the driving
    thread; when that thread asks for the anchor too, it steps the scheduler while it waits (no deadlock)."""
    from kamera_engine.scheduler import Scheduler

    engine = tiny_engine("llama")
    sched = Scheduler(engine)
    original = engine._anchor_forward
    started = threading.Event()

    def first() -> object:
        started.set()
        return original()  # alone(): queued for the driving thread

    monkeypatch.setattr(engine, "_anchor_forward", first)
    got: list[object] = []
    driving = threading.Event()

    def driver() -> None:
        with sched.driving():
            driving.set()
            started.wait(10)
            got.append(engine.anchor_kv)  # a waiter: the first caller's forward needs this thread's steps

    d = threading.Thread(target=driver, daemon=True)
    d.start()
    driving.wait(10)
    f = threading.Thread(target=lambda: got.append(engine.anchor_kv), daemon=True)
    f.start()
    d.join(30)
    f.join(30)
    assert not d.is_alive() and not f.is_alive(), "the anchor's waiters deadlocked"
    assert len(got) == 2 and got[0] is got[1] and sched.stats().alone == 1
