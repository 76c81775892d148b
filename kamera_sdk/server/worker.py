"""Where the server's window jobs run, and the thread that drives the engine's scheduler.

With a ``Scheduler`` (the default server), window jobs (adding pages, slides, materialisation, a
``generate``'s start) run on a pool of window threads, one job of a session at a time and in arrival
order within a session (its *lane*), several sessions at once; a job with no lane is a barrier (it runs
after every job queued before it, and nothing queued after it starts before it ends). One model thread
drives the scheduler: each step runs, in one batched forward, every running answer's next token, prompt
chunks, and the window forwards the jobs on the window threads are blocked on (``Scheduler.carry``), so
several sessions' new pages and prompts share a forward. Each window's own calls exclude each other
(its gate, ``kamera_sdk.background``); the scheduler is the one place that runs the engine's token
forwards: a window's forward (a canonical's compile included) is a row of a step, and one that must run
alone (a relevance score, a window's idle-time work) runs between two steps on the model thread
(``Scheduler.run_alone``).
Jobs run under ``scheduler.serving(key)``, so a window's ``generate`` submits to the scheduler under its
session's key (one session's answers run in order), and an answer streams from its request on a stream
thread.

Without a scheduler (``batch=False``, or an engine whose forwards cannot be packed), one model thread
runs every job in arrival order, and decoding is pulled one token per job, so sessions interleave
instead of waiting for each other's whole answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kamera_engine.scheduler import Request, Scheduler

T = TypeVar("T")
log = logging.getLogger("kamera.server")
_END = object()
#: the lane of a job that must run alone, after everything queued before it
_BARRIER = object()


@dataclass(eq=False, slots=True)
class _Job:
    fut: Future[Any]
    fn: Callable[[], Any]
    key: Hashable | None  # the scheduler key its answers are submitted under
    lane: Hashable  # jobs of one lane run one at a time, in order; ``_BARRIER``: alone


class ModelWorker:
    """Runs window jobs and drives ``scheduler`` (if any); see the module docstring. ``lanes``: most
    window jobs running at once (with a scheduler)."""

    def __init__(self, scheduler: Scheduler | None = None, *, lanes: int = 64) -> None:
        self.scheduler = scheduler
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy: set[Hashable] = set()  # lanes with a job running
        self._barrier = False  # a barrier job is running
        self._stop_driver = False  # set by ``close`` once the window jobs have finished
        # streams wait for their scheduler's tokens here, never on the model thread
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="kamera-stream")
        self._lanes: ThreadPoolExecutor | None = None
        if scheduler is not None:
            self._lanes = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="kamera-window")
            self._thread = threading.Thread(target=self._drive, name="kamera-model", daemon=True)
        else:
            self._thread = threading.Thread(target=self._loop, name="kamera-model", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` as a barrier job and await its result (exceptions propagate)."""
        return await asyncio.wrap_future(self._enqueue(partial(fn, *args, **kwargs), None, _BARRIER))

    async def run_keyed(self, key: Hashable | None, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in ``key``'s lane (a session: its jobs one at a time, in order; other sessions'
        at once), with answers the job starts submitted under ``key``. ``None``: a lane of its own (a job
        that touches no session)."""
        lane = object() if key is None else key
        return await asyncio.wrap_future(self._enqueue(partial(fn, *args), key, lane))

    async def iterate(self, it: Iterator[T], *, key: Hashable | None = None) -> AsyncIterator[T]:
        """Pull ``it`` item by item; the iterator is closed if the consumer stops early.

        A scheduler's stream (a ``Request``, or a ``TextStream`` over one) is pulled on a stream thread (a
        pull waits for the scheduler's next step, which the model thread runs); anything else is pulled
        one job per item, in ``key``'s lane (default: a lane of the iterator's own)."""
        loop = asyncio.get_running_loop()
        # only a scheduler's stream waits off the job threads; any other iterator runs model work itself
        batched = self.scheduler is not None and streams_from_scheduler(it)
        lane: Hashable = ("iterator", id(it)) if key is None else key
        try:
            while True:
                if batched:
                    item = await loop.run_in_executor(self._pool, next, it, _END)
                else:
                    item = await asyncio.wrap_future(self._enqueue(partial(next, it, _END), key, lane))
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                if batched:
                    self._pool.submit(_logged(close))
                elif not self._closed:
                    self._enqueue(_logged(close), key, lane)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` as a barrier job without waiting; a failure is logged. Nothing runs once the
        worker is closed."""
        if self._closed:
            return
        self._enqueue(_logged(partial(fn, *args)), None, _BARRIER)

    def close(self) -> None:
        """Finish the jobs in progress, drop queued ones, stop the threads."""
        with self._cond:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in dropped:
            job.fut.cancel()
        if self._lanes is not None:
            self._lanes.shutdown(wait=True)  # the driver still runs: a job blocked on a forward finishes
        self._stop_driver = True  # the lanes are drained: nothing needs a step any more
        if self.scheduler is not None:
            self.scheduler.notify()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _enqueue(self, fn: Callable[[], Any], key: Hashable | None, lane: Hashable) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._closed:
                fut.cancel()
                return fut
            self._jobs.append(_Job(fut, fn, key, lane))
            if self._lanes is not None:
                self._dispatch()
            else:
                self._cond.notify()
        return fut

    # --- with a scheduler: window threads and a driver ---------------------------------------------
    def _dispatch(self) -> None:
        """Start every queued job whose lane is free, in order (called with ``_cond`` held): a job waits
        for its lane's earlier jobs, a barrier for every earlier job, and every later job for a barrier."""
        assert self._lanes is not None
        kept: deque[_Job] = deque()
        blocked: set[Hashable] = set()
        jobs, self._jobs = self._jobs, kept
        while jobs:
            if self._barrier:
                kept.extend(jobs)
                break
            job = jobs.popleft()
            if job.lane is _BARRIER:
                if self._busy or kept:
                    kept.append(job)
                    kept.extend(jobs)
                    break
                self._barrier = True
            elif job.lane in self._busy or job.lane in blocked:
                kept.append(job)
                blocked.add(job.lane)
                continue
            else:
                self._busy.add(job.lane)
            self._lanes.submit(self._run_lane, job)

    def _run_lane(self, job: _Job) -> None:
        try:
            self._run_job(job)
        finally:
            with self._cond:
                if job.lane is _BARRIER:
                    self._barrier = False
                else:
                    self._busy.discard(job.lane)
                if not self._closed:
                    self._dispatch()

    def _drive(self) -> None:
        sched = self.scheduler
        assert sched is not None
        with sched.driving():
            while not self._stop_driver:
                if not self._step(sched):
                    sched.wait_for_work(0.5)

    # --- without a scheduler: one thread, every job in order -----------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait(timeout=1.0)
                if self._closed:
                    return
                job = self._jobs.popleft()
            self._run_job(job)

    def _run_job(self, job: _Job) -> None:
        if not job.fut.set_running_or_notify_cancel():
            return
        sched = self.scheduler
        try:
            with sched.serving(job.key) if sched is not None else nullcontext():
                result = job.fn()
        except BaseException as exc:
            job.fut.set_exception(exc)
        else:
            job.fut.set_result(result)

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
