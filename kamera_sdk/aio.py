"""Window calls from asyncio: the thread pool they run on.

A window's operations are plain calls that run forwards (a page's compile, a prompt's prefill); under
``engine.batching()`` each blocks its thread until a shared step has run its forward. From coroutines they
run on worker threads, one per window call in flight. asyncio's default executor has ``min(32, cores + 4)``
threads (6 on a 2-core machine): fewer than the agents whose calls wait on the same step, so calls would
queue behind each other and steps would run with fewer rows. ``to_thread`` runs them on Kamera's own pool
instead, which grows to ``MAX_WORKERS`` threads (idle ones cost nothing).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

log = logging.getLogger("kamera")
P = ParamSpec("P")
T = TypeVar("T")

#: most window calls in flight at once from coroutines (each holds a thread while it waits on a step)
MAX_WORKERS = 256

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="kamera-window")
        return _POOL


async def to_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``asyncio.to_thread`` on Kamera's pool of window threads: ``await kamera_sdk.to_thread(window.add_text,
    page)`` from many agents at once lets every agent's forward join the same step."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)


def in_background(fn: Callable[[], object]) -> None:
    """Run ``fn()`` on the pool without waiting for it (a withdrawal from a done-callback or a cancelled call);
    a failure is logged."""

    def run() -> None:
        try:
            fn()
        except Exception:
            log.exception("kamera: background call %r failed", fn)

    _pool().submit(run)
