"""One thread runs all model work, in arrival order.

A ``ContextWindow`` is not thread-safe and the engine runs one forward at a time, so every window
operation is a job on this single worker; the event loop stays free to accept and answer requests.
Decoding is submitted one token step at a time, so concurrent sessions interleave instead of waiting
for each other's whole answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kamera.server")
_END = object()


class ModelWorker:
    """A single-thread executor for model and window work."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kamera-model")
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the worker and await its result (exceptions propagate)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def iterate(self, it: Iterator[T]) -> AsyncIterator[T]:
        """Pull ``it`` one item per job; the iterator is closed on the worker if the consumer stops early."""
        try:
            while True:
                item = await self.run(next, it, _END)
                if item is _END:
                    return
                yield item  # type: ignore[misc]
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                self.submit(close)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` on the worker without waiting (after the jobs already queued); a failure is
        logged. Nothing runs once the worker is closed."""
        if self._closed:
            return

        def job() -> None:
            try:
                fn(*args)
            except Exception as exc:
                log.warning("worker: %s failed: %s", getattr(fn, "__qualname__", fn), exc)

        self._pool.submit(job)

    def close(self) -> None:
        """Finish the job in progress, drop queued ones, stop the thread."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
