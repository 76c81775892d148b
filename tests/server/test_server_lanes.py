"""The batching server's worker: different sessions' jobs run at once, one session's in order, a job with no
session after everything queued before it; the model thread drives the scheduler meanwhile."""

from __future__ import annotations

import asyncio
import threading

from kamera_engine.scheduler import Scheduler
from kamera_sdk.server.worker import ModelWorker
from tests.conftest import random_ids, tiny_engine


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
    running = {"a": 0, "b": 0}  # jobs of each session running now
    most = {"a": 0, "b": 0}

    def job(name: str) -> str:
        session = name[0]
        with lock:
            running[session] += 1
            most[session] = max(most[session], running[session])
        threading.Event().wait(0.02)
        with lock:
            running[session] -= 1
            log.append(name)
        return name

    def barrier() -> int:
        return sum(running.values())

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
    assert during == 0  # the barrier ran alone
    assert most == {"a": 1, "b": 1}  # never two jobs of one session at once


def test_close_lets_a_job_blocked_on_a_forward_finish_on_the_model_thread() -> None:
    """``close`` drops queued jobs but the model thread drives the scheduler until the lanes have drained: a
    job in progress that needs a forward after ``close`` began still gets it from the model thread."""
    engine = tiny_engine("llama")
    worker = ModelWorker(Scheduler(engine))
    go = threading.Event()
    ran_on: list[str] = []
    hook = engine.model.register_forward_pre_hook(lambda *_: ran_on.append(threading.current_thread().name))

    def job() -> int:
        go.wait(10)
        return int(engine.forward(random_ids(5, 3), None, 0, logits="last").logits.argmax())

    async def main() -> asyncio.Future:
        return asyncio.ensure_future(worker.run_keyed("a", job))

    loop = asyncio.new_event_loop()
    try:
        fut = loop.run_until_complete(main())
        loop.run_until_complete(asyncio.sleep(0.05))  # the job is running, waiting for ``go``
        closer = threading.Thread(target=worker.close)
        closer.start()
        closer.join(0.3)  # ``close`` has begun: it waits for the lanes
        assert closer.is_alive()
        go.set()
        closer.join(30)
        assert not closer.is_alive()
        assert isinstance(loop.run_until_complete(fut), int)
    finally:
        hook.remove()
        loop.close()
    assert ran_on == ["kamera-model"]
