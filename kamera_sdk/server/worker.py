"""One thread runs all model work: window jobs in arrival order, and between them the scheduler's steps.

A ``ContextWindow`` is not thread-safe and the engine runs one forward at a time, so every window
operation is a job on this single thread; the event loop stays free to accept and answer requests.
With a ``Scheduler`` (the default server), the same thread drives it: after each job it runs one
batched step, so every session's decode (and prompt prefill) shares one forward, and a session's
answer streams from its scheduler request without occupying the thread. Jobs run under
``scheduler.serving(key)``, so a window's ``generate`` submits to the scheduler under its session's key
(one session's answers run in order). Without a scheduler, decoding is pulled one token per job, so
sessions interleave instead of waiting for each other's whole answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any, TypeVar

from kamera_engine.scheduler import Request, Scheduler

T = TypeVar("T")
log = logging.getLogger("kamera.server")
_END = object()


class ModelWorker:
    """A single model thread for window jobs, which also drives ``scheduler`` (if any) between them."""

    def __init__(self, scheduler: Scheduler | None = None) -> None:
        self.scheduler = scheduler
        self._jobs: deque[tuple[Future[Any], Callable[[], Any], Hashable | None]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        # streams wait for their scheduler's tokens here, never on the model thread
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="kamera-stream")
        self._thread = threading.Thread(target=self._loop, name="kamera-model", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker and await its result (exceptions propagate)."""
        return await asyncio.wrap_future(self._enqueue(partial(fn, *args, **kwargs), None))

    async def run_keyed(self, key: Hashable, fn: Callable[..., T], *args: Any) -> T:
        """``run``, with answers the job starts submitted under ``key`` (a session: its answers in order)."""
        return await asyncio.wrap_future(self._enqueue(partial(fn, *args), key))

    async def iterate(self, it: Iterator[T]) -> AsyncIterator[T]:
        """Pull ``it`` item by item; the iterator is closed if the consumer stops early.

        A scheduler's stream (a ``Request``, or a ``TextStream`` over one) is pulled on a stream thread (a
        pull waits for the scheduler's next step, which the model thread runs); anything else is pulled
        one job per item on the model thread."""
        loop = asyncio.get_running_loop()
        # only a scheduler's stream waits off the model thread; any other iterator runs model work itself
        batched = self.scheduler is not None and streams_from_scheduler(it)
        try:
            while True:
                if batched:
                    item = await loop.run_in_executor(self._pool, next, it, _END)
                else:
                    item = await self.run(next, it, _END)
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                if batched:
                    self._pool.submit(_logged(close))
                else:
                    self.submit(close)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the worker without waiting (after the jobs already queued); a failure is
        logged. Nothing runs once the worker is closed."""
        if self._closed:
            return
        self._enqueue(_logged(partial(fn, *args)), None)

    def close(self) -> None:
        """Finish the job in progress, drop queued ones, stop the thread."""
        with self._cond:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for fut, _, _ in dropped:
            fut.cancel()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _enqueue(self, job: Callable[[], Any], key: Hashable | None) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._closed:
                fut.cancel()
                return fut
            self._jobs.append((fut, job, key))
            self._cond.notify()
        return fut

    def _loop(self) -> None:
        sched = self.scheduler
        with sched.driving() if sched is not None else nullcontext():
            while True:
                with self._cond:
                    if self._closed:
                        return
                    item = self._jobs.popleft() if self._jobs else None
                if item is not None:
                    self._run_job(*item)
                stepped = sched is not None and sched.has_work() and self._step(sched)
                if item is None and not stepped:
                    with self._cond:
                        if not self._jobs and not self._closed:
                            self._cond.wait(timeout=0.05 if sched is not None and sched.has_work() else 1.0)

    def _run_job(self, fut: Future[Any], job: Callable[[], Any], key: Hashable | None) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        sched = self.scheduler
        try:
            with sched.serving(key) if sched is not None else nullcontext():
                result = job()
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    @staticmethod
    def _step(sched: Scheduler) -> bool:
        try:
            return sched.step()
        except Exception as exc:  # a step's own failures are handed to its requests; this is a bug
            log.exception("scheduler step failed: %s", exc)
            return False


def streams_from_scheduler(it: object) -> bool:
    """Whether ``it`` (a ``Request``, or a ``TextStream`` over one) gets its tokens from a scheduler's steps."""
    return isinstance(getattr(it, "source", it), Request)


def _logged(fn: Callable[[], Any]) -> Callable[[], None]:
    def job() -> None:
        try:
            fn()
        except Exception as exc:
            log.warning("worker: %s failed: %s", getattr(fn, "__qualname__", fn), exc)

    return job
