"""The batching server's worker: different sessions' jobs run at once, one session's in order, a job with no
session after everything queued before it; the model thread drives the scheduler meanwhile."""

from __future__ import annotations

import asyncio
import threading

from kamera_engine.scheduler import Scheduler
from kamera_sdk.server.worker import ModelWorker
from tests.conftest import tiny_engine


def _worker() -> ModelWorker:
    return ModelWorker(Scheduler(tiny_engine("llama")))


def test_two_sessions_jobs_run_at_once() -> None:
    worker = _worker()
    a_in, b_in = threading.Event(), threading.Event()

    def job(mine: threading.Event, other: threading.Event) -> bool:
        mine.set()
        return other.wait(10)  # only true when the other session's job runs at the same time

    async def main() -> list[bool]:
        both = await asyncio.gather(worker.run_keyed("a", job, a_in, b_in), worker.run_keyed("b", job, b_in, a_in))
        return list(both)

    try:
        assert asyncio.run(main()) == [True, True]
    finally:
        worker.close()


def test_one_sessions_jobs_run_in_order_and_a_barrier_waits_for_all() -> None:
    worker = _worker()
    log: list[str] = []
    lock = threading.Lock()
    running = [0]
    most = [0]

    def job(name: str) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.02)
        with lock:
            running[0] -= 1
            log.append(name)
        return name

    def barrier() -> int:
        return running[0]

    async def main() -> tuple[list[str], int]:
        first = [worker.run_keyed("a", job, f"a{i}") for i in range(4)]
        first += [worker.run_keyed("b", job, f"b{i}") for i in range(4)]
        tasks = [asyncio.ensure_future(c) for c in first]
        await asyncio.sleep(0)
        during = await worker.run(barrier)
        await asyncio.gather(*tasks)
        return log, during

    try:
        order, during = asyncio.run(main())
    finally:
        worker.close()
    assert [n for n in order if n[0] == "a"] == ["a0", "a1", "a2", "a3"]
    assert [n for n in order if n[0] == "b"] == ["b0", "b1", "b2", "b3"]
    assert during == 0 and most[0] <= 2  # the barrier ran alone; never two jobs of one session at once
