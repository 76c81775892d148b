"""Background work of a window: what improves the next step without being needed for its correctness.

A window queues such work (``Task``) instead of running it inside the call that found it: forming the
patches set aside at the last use, re-conditioning slide survivors on what remains, compiling canonicals
nothing on the critical path needs yet, prefetching store entries. It runs when the engine is idle: in
``ContextWindow.prepare()`` (explicit: run it now and wait) or on an idle thread (``background="auto"``).

Thread safety is one lock per window (``WindowGate``, shared by the window's forks, which share its
chunks): every foreground call of the window holds it, and its background work takes it one task (at
most one forward) at a time, only while no foreground call of ANY window on the engine is in progress or
waiting (``EngineGate`` counts them). So foreground work goes first engine-wide and waits behind at most
one background forward, while foreground calls of different windows run at once on their own threads:
their forwards meet in the engine's scheduler, which batches them (``kamera_engine.scheduler``); an
idle thread's forward, outside any ``serving`` block, runs alone between the scheduler's steps while a
thread drives it (``Scheduler.run_alone``). The engine counts work per thread too
(``Engine.thread_counters``), so ``metering`` still sees one call's.

The plan and the tokens never depend on timing; the floating-point rounding of a forward may, within the
batching tolerance (float32 1e-4), when a scheduler batches several windows' forwards (whether one runs
alone or batched depends on what else is queued; docs/batching.md). A task is ``required`` when its
outcome can change a later plan (patches, survivor conditioning): the next foreground operation or use of
the window finishes the required tasks still queued before it does anything else, in the same order the
background would have run them. Whether the idle time reached them changes only where their cost lands. The other tasks
(``required=False``: canonicals, prefetches) compute exactly what the foreground would compute lazily.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum

from kamera_engine import Engine

log = logging.getLogger("kamera.window")


class Phase(IntEnum):
    """Order of work that may depend on earlier work: patches before survivors (a survivor's plan may use
    a patch), and what no result depends on last."""

    PATCHES = 0
    SURVIVORS = 1
    LATENCY = 2


@dataclass(eq=False)
class Task:
    """One unit of background work: at most one forward pass (so the foreground waits behind one)."""

    kind: str  # "patches", "survivors", "leaving", "canonical", "prefetch"
    label: str  # what it is about (a chunk label, or "*")
    phase: Phase
    value: float  # critical-path tokens it is expected to save on the next step (orders work in a phase)
    tokens: int  # tokens its forward runs (0: no forward), counted against the budget
    run: Callable[[], None]
    seq: int = 0
    chunk: str | None = None  # the chunk it is about, when one (a leaving patch, a canonical: found by it)

    @property
    def required(self) -> bool:
        return self.phase is not Phase.LATENCY

    def key(self) -> tuple[int, float, int]:
        return (int(self.phase), -self.value, self.seq)


@dataclass
class BackgroundQueue:
    """A window branch's queued work, most valuable first within each phase, and its token budget."""

    budget_tokens: int | None = None  # background forward tokens allowed per window step (None: unbounded)
    tasks: list[Task] = field(default_factory=list)
    spent: int = 0  # tokens run in the background since the budget was last reset
    _seq: int = 0

    def push(self, task: Task) -> None:
        self._seq += 1
        task.seq = self._seq
        self.tasks.append(task)

    def replace(self, kind: str, task: Task | None) -> None:
        """Drop queued tasks of ``kind`` (the window changed under them) and queue ``task`` instead."""
        self.tasks = [t for t in self.tasks if t.kind != kind]
        if task is not None:
            self.push(task)

    def drop(self, kind: str, chunk: str) -> None:
        """Drop the queued tasks of ``kind`` about ``chunk`` (an id: a foreground call did their work)."""
        self.tasks = [t for t in self.tasks if not (t.kind == kind and t.chunk == chunk)]

    def new_step(self) -> None:
        """A window operation happened: the budget starts again."""
        self.spent = 0

    def next(self, *, required_only: bool = False, within_budget: bool = False) -> Task | None:
        """The next task in order (``key``), or None. ``within_budget``: only a task that fits what is left
        of the budget (the order is not skipped past one that does not: required work keeps its order)."""
        pool = [t for t in self.tasks if t.required] if required_only else self.tasks
        if not pool:
            return None
        task = min(pool, key=Task.key)
        if within_budget and self.budget_tokens is not None and self.spent + task.tokens > self.budget_tokens:
            return None
        return task

    def take(self, task: Task) -> None:
        self.tasks.remove(task)

    def __len__(self) -> int:
        return len(self.tasks)

    def pending_required(self) -> int:
        return sum(1 for t in self.tasks if t.required)


class EngineGate:
    """Per engine: how many foreground calls of any window are in progress or waiting. Background work of
    every window on the engine runs only while there are none (foreground work first, engine-wide)."""

    def __init__(self) -> None:
        self._state = threading.Condition()
        self._foreground = 0

    def window(self) -> WindowGate:
        """A new window's own lock on this engine (its forks share it)."""
        return WindowGate(self)

    @contextmanager
    def _counted(self) -> Iterator[None]:
        with self._state:
            self._foreground += 1
        try:
            yield
        finally:
            with self._state:
                self._foreground -= 1
                self._state.notify_all()

    def idle(self) -> bool:
        """Whether no foreground call of any window is in progress or waiting."""
        return self._foreground == 0

    def wait(self, seconds: float) -> None:
        with self._state:
            self._state.wait(seconds)


class WindowGate:
    """One lock per window (shared by its forks, which share its chunks): its foreground calls hold it
    (re-entrant) and exclude each other and its background work; background work takes it one task at a
    time, only while no foreground call of any window on the engine is in progress or waiting. Calls of
    different windows run at once; their forwards meet in the engine's scheduler, which runs them."""

    def __init__(self, engine: EngineGate) -> None:
        self.engine = engine
        self._lock = threading.RLock()

    @contextmanager
    def foreground(self) -> Iterator[None]:
        with self.engine._counted(), self._lock:
            yield

    @contextmanager
    def background(self) -> Iterator[bool]:
        """Yields True with the lock held when no foreground call waits or runs on the engine, else False
        at once."""
        got = False
        with self.engine._state:
            if self.engine.idle():
                got = self._lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                self._lock.release()

    def wait(self, seconds: float) -> None:
        self.engine.wait(seconds)


_GATES: weakref.WeakKeyDictionary[Engine, EngineGate] = weakref.WeakKeyDictionary()
_GATES_LOCK = threading.Lock()


def gate_of(engine: Engine) -> EngineGate:
    """The engine's gate (one per engine, shared by every window on it)."""
    with _GATES_LOCK:
        gate = _GATES.get(engine)
        if gate is None:
            gate = _GATES[engine] = EngineGate()
        return gate


class IdleWorker:
    """Runs a window's queued work on a daemon thread while the engine has no foreground call (automatic
    mode). ``step`` is the window's (weakly held) method that runs one task and says whether it did."""

    def __init__(self, gate: WindowGate, step: Callable[[], bool | None]) -> None:
        self._gate = gate
        self._step = step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kamera-window-idle", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            while not self._stop.is_set():
                with self._gate.background() as got:
                    ran = self._step() if got else None
                if ran is False:  # nothing (more) to do within the budget: sleep until notified
                    break
                if ran is None:  # a foreground call holds or wants the engine: let it go first
                    self._gate.wait(0.01)
