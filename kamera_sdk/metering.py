"""Attribute the engine's work counters to one window.

The engine counts every forward it runs and the tokens it ran (``engine.counters``), for every window
on it. A window's ``forwards`` and token counts are the differences of those counters around its own
calls, so they count what the engine did, not what the window meant to do. A call runs on one thread and
the engine also counts per thread (``Engine.thread_counters``), so the differences of the calling thread's
counters belong to the call they bracket, even while other windows' calls run on other threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kamera_engine import Engine

from .stats import WindowStats, Work


class Measured:
    """The engine's work inside one ``EngineMeter.measure`` block, and what part of it served other work."""

    def __init__(self) -> None:
        self.moved: list[tuple[Work, int, int]] = []

    def move(self, to: Work, tokens: int, *, forwards: int = 0) -> None:
        """Count ``tokens`` (and ``forwards``) of the block's work as ``to`` instead: a prompt that rode in
        a window's forward, the statistics forward of a compression."""
        self.moved.append((to, forwards, tokens))


class EngineMeter:
    """Counts, into one window's stats, the forwards and tokens the engine runs inside ``measure``."""

    def __init__(self, engine: Engine, stats: WindowStats) -> None:
        self.engine = engine
        self.stats = stats
        #: while set, every block counts as this work instead (background work runs the same code)
        self.redirect: Work | None = None

    @contextmanager
    def measure(self, work: Work) -> Iterator[Measured]:
        """Count the engine's forwards and tokens inside the block as ``work`` (less what the block
        ``move``s to other work). Work done before an error still counts."""
        self.engine.anchor_kv  # noqa: B018  the engine's own, computed once for every window: never one's work
        counters = self.engine.thread_counters  # this call's thread: other windows' calls run at once
        forwards, tokens = counters.forwards, counters.tokens_prefilled
        measured = Measured()
        try:
            yield measured
        finally:
            ran = counters.forwards - forwards
            ran_tokens = counters.tokens_prefilled - tokens
            for to, f, t in measured.moved:
                f, t = min(f, ran), min(t, ran_tokens)  # an error may have cut the block short
                self.stats.add_work(self.redirect or to, f, t)
                ran, ran_tokens = ran - f, ran_tokens - t
            self.stats.add_work(self.redirect or work, ran, ran_tokens)

    def add(self, work: Work, forwards: int, tokens: int) -> None:
        """Count work the engine runs outside its counted forward (selective recompute runs the layers
        itself)."""
        self.stats.add_work(self.redirect or work, forwards, tokens)

    @contextmanager
    def background(self) -> Iterator[None]:
        """Count everything inside the block as background work (idle time, off the critical path)."""
        self.redirect = Work.BACKGROUND
        try:
            yield
        finally:
            self.redirect = None
