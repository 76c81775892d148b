"""Continuous batching: one scheduler owns an engine's decode forwards and batches every client's work.

Clients submit requests (a prompt to prefill after a past KV, or an already prefilled prompt, then
decoding under their own ``SamplingParams``). Each ``step()`` runs one batched forward
(``batch.batched_forward``): one token for every running decode, plus prompt tokens of requests still
prefilling, up to ``step_tokens`` in all, so a long prompt is prefilled in chunks over several steps
and never stalls everyone's decode. Requests join at the next step and leave when they finish.
Decoding requests keep their KV in the scheduler's ``DecodeSlab`` (while it fits the KV budget), so a
step's decode rows attend in one call.
A window's own forwards (``Engine.forward`` under ``serving``, from any thread) are carried: they wait for
the next step and run as rows of it, with every running decode, waiting prompts and other windows'
forwards (``carry``); a recorded one (a canonical's pre-RoPE keys) too, its recorders seeing only its own
row (``capture.recording_rows``). A forward that must not be packed with others (one inside
:func:`alone`, one outside ``serving`` while a thread drives the scheduler) runs alone between
two steps (``run_alone``): the unbatched path, bit for bit. So the engine's forwards through
``Engine.forward`` reach the model one at a time, through the scheduler (selective recompute, which runs
decoder layers itself, goes through ``exclusive``: alone, between two steps). Whether a
carried forward runs alone or batched depends on what else is queued: a batched row equals its lone
forward within float32 rounding (1e-4), not bit for bit; a forward whose result must not depend on load
runs inside :func:`alone`.

A request's tokens stream back through its ``Request`` handle: a blocking iterator (which drives the
scheduler itself when no thread does) and an async iterator. Requests under one submitter key (one
window) run in submission order. Admission counts every request's KV bytes against ``kv_budget_bytes``:
work that does not fit waits in a bounded queue, and past that it is refused with ``CapacityError``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, MutableSequence, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from pydantic import BaseModel
from transformers import DynamicCache

from .adapters.capture import Recorder, recording_rows, unrecorded
from .batch import DecodeSlab, Row, RowCache, batched_forward, packed_length, row_spans
from .decode import SamplingParams, next_token
from .errors import CapacityError, InvalidInputError, KameraError
from .kv import Past, past_parts
from .runner import ForwardResult, Prefilled, run_forward
from .threads import small_kernels_inline

if TYPE_CHECKING:
    from .engine import Engine

T = TypeVar("T")
log = logging.getLogger("kamera.scheduler")

RequestState = Literal["waiting", "prefill", "decode", "done", "failed", "cancelled"]

#: The scheduler that ``Engine.generate_ids`` / ``continue_ids`` submit to in this context, and the key.
_ACTIVE: ContextVar[tuple[Scheduler, Hashable | None] | None] = ContextVar("kamera_scheduler", default=None)


#: Whether forwards in this context must run alone (never packed into a step with other rows).
_ALONE: ContextVar[bool] = ContextVar("kamera_forward_alone", default=False)


@contextmanager
def alone() -> Iterator[None]:
    """Within this block, the engine's forwards run alone even under a scheduler (``Scheduler.run_alone``):
    the unbatched path bit for bit, so a result compared with a threshold cannot flip with the load."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def forwards_alone() -> bool:
    """Whether the calling context asked for lone forwards (:func:`alone`)."""
    return _ALONE.get()


#: per model, the scheduler a thread drives now (``Scheduler.driving``)
_DRIVEN: weakref.WeakKeyDictionary[object, Scheduler] = weakref.WeakKeyDictionary()
_DRIVEN_LOCK = threading.Lock()


#: per model, the scheduler ``batching()`` made every engine over that model use (engines may share a model:
#: a chat engine with its own anchor over the default engine's weights)
_BATCHING: weakref.WeakKeyDictionary[object, Scheduler] = weakref.WeakKeyDictionary()
_BATCHING_LOCK = threading.Lock()


def batching_scheduler(engine: object) -> Scheduler | None:
    """The scheduler of the ``batching()`` block open on ``engine``'s model, if any (``Engine.scheduler``)."""
    with _BATCHING_LOCK:
        try:
            return _BATCHING.get(_model_of(engine))
        except TypeError:  # a model that cannot be weakly referenced is never registered
            return None


def active_scheduler(engine: object) -> tuple[Scheduler, Hashable | None] | None:
    """The scheduler (and submitter key) that decoding on ``engine`` goes through here, if any."""
    active = _ACTIVE.get()
    if active is not None and active[0].engine is engine:
        return active
    own = batching_scheduler(engine)
    return (own, None) if own is not None else None


def _model_of(engine: object) -> object:
    """What the registries below key on: the engine's model (engines over the same weights share it)."""
    return getattr(engine, "model", engine)


def driven_scheduler(engine: object) -> Scheduler | None:
    """The scheduler a thread drives for ``engine``'s model now, if any: a forward outside ``serving`` (a
    window's idle-time work, a score) runs alone through it (``run_alone``), never beside its steps."""
    with _DRIVEN_LOCK:
        try:
            return _DRIVEN.get(_model_of(engine))
        except TypeError:  # a model that cannot be weakly referenced is never registered
            return None


class SchedulerStats(BaseModel):
    """What the scheduler did: forwards, batch sizes, queue waits, KV memory."""

    steps: int = 0
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    refused: int = 0
    rows_total: int = 0  # sum of batch sizes over steps
    batch_max: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    queue_wait_s_total: float = 0.0
    queue_wait_s_max: float = 0.0
    forward_s: float = 0.0  # the stepping thread's forwards: batched steps, window forwards and jobs run alone
    idle_s: float = 0.0  # the stepping thread waiting for work (``wait_for_work``); the rest of its time is steps
    carried: int = 0  # callers' own forwards (window work) that ran batched in a step with other rows
    carried_tokens: int = 0
    carried_alone: int = 0  # window forwards that ran alone (nothing else to run in their step)
    carried_steps: int = 0  # steps that held window forwards' rows
    carried_rows_total: int = 0  # window forwards' rows summed over those steps (chunks count one each)
    carried_rows_max: int = 0  # most window forwards' rows in one step
    carried_waiting: int = 0  # window forwards waiting for or running in steps now
    carried_failed: int = 0  # window forwards whose planning or assembly failed (the caller got the error)
    follow_ons: int = 0  # answers queued by the step that ran their prompt's forward (``carry(..., answer=...)``)
    alone: int = 0  # forwards run alone between steps on request (``run_alone``: ``alone()``, idle-time work)
    kv_bytes: int = 0  # held now by admitted requests
    kv_bytes_peak: int = 0
    slab_rows: int = 0  # decoding requests whose KV sits in the decode slab now (attended in one call)
    slab_bytes: int = 0  # the slab's buffers now, padding included
    kv_budget_bytes: int | None = None  # the limits it runs under (its constructor's)
    step_tokens: int = 512
    max_rows: int = 64
    running: int = 0
    waiting: int = 0

    @property
    def batch_mean(self) -> float:
        return self.rows_total / self.steps if self.steps else 0.0


class StepRecord(BaseModel):
    """One step of a scheduler, as ``Scheduler.observe`` reports it: a batched forward, or work that ran alone
    (``alone``): a window forward with nothing to share its step (``window_forwards`` 1), or a job queued to
    run alone between steps (``run_alone``: a forward that must not be packed, selective recompute; no rows)."""

    ended: float  # ``time.perf_counter()`` when its forward ended
    seconds: float  # its forward
    decode_rows: int = 0
    prompt_tokens: int = 0  # prompt chunks prefilled in it (submitted requests)
    window_forwards: int = 0  # window forwards' rows in it (``carry``; a chunk of a split one counts one)
    window_tokens: int = 0
    alone: bool = False


_END = object()


class Request(Iterator[int]):
    """A submitted request: iterate it for its token ids (blocking), or ``async for`` over ``aiter()``.

    ``finish_reason``: ``"stop"`` (EOS or a stop string), ``"length"``, or None while it runs or when it
    failed or was cancelled. ``close()`` (or ``cancel()``) withdraws it; the other requests go on.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        key: Hashable,
        params: SamplingParams,
        need_bytes: int,
        *,
        past: Past = None,
        prompt_ids: torch.Tensor | None = None,
        start: int = 0,
        prefilled: Prefilled | None = None,
    ) -> None:
        self.id = next(scheduler._ids)
        self.key = key
        self.params = params
        self.need_bytes = need_bytes
        self.state: RequestState = "waiting"
        self.finish_reason: Literal["stop", "length"] | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.generated: list[int] = []
        self._scheduler = scheduler
        self._past, self._prompt, self._start, self._prefilled = past, prompt_ids, start, prefilled
        self._cache: RowCache | None = None
        self._done_prompt = 0  # prompt tokens prefilled so far
        self._position = 0  # position of the next token fed to the model
        self._generator: torch.Generator | None = None
        self._constraint = scheduler.engine.constraint(params)  # the walk through params.grammar, if any
        self._out: deque[object] = deque()
        self._cond = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    # --- the consumer side --------------------------------------------------------------------
    def __next__(self) -> int:
        while True:
            with self._cond:
                if self._out:
                    return self._item(self._out.popleft())
                if self._scheduler._driven_elsewhere():  # a driver thread will hand the token over
                    self._cond.wait(timeout=0.5)
                    continue
            if not self._scheduler.step() and not self._out:  # nobody drives: drive it from here
                raise KameraError("the scheduler has no work it can run for this request")

    def _item(self, item: object) -> int:
        if item is _END:
            self._out.appendleft(_END)  # every later next() ends too
            if self.error is not None:
                raise self.error
            raise StopIteration
        return item  # type: ignore[return-value]

    async def aiter(self) -> AsyncIterator[int]:
        """The token ids as an async iterator. Woken by the thread that drives the scheduler (``start()``,
        ``Engine.batching()``); while none does, it steps the scheduler itself, on a worker thread."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop closed without closing this iterator: nobody waits any more
                pass

        with self._cond:
            self._listeners.append(wake)
        try:
            while True:
                with self._cond:
                    item = self._out.popleft() if self._out else None
                    if item is None:
                        ready.clear()
                if item is None:
                    if self.driven:  # a driver that stops wakes us (``Scheduler.driving``): then we step it
                        await ready.wait()
                    elif not await loop.run_in_executor(None, self._scheduler.step) and not self._out:
                        raise KameraError("the scheduler has no work it can run for this request")
                    continue
                try:
                    yield self._item(item)
                except StopIteration:
                    return
        finally:
            with self._cond:
                self._listeners.remove(wake)
            if self.state not in ("done", "failed", "cancelled"):
                # withdrawn off the event loop: a cancel waits for the step in progress to end
                await loop.run_in_executor(None, self.cancel)

    def close(self) -> None:
        """Withdraw the request if it is still running (what a consumer that stops reading does)."""
        if self.state not in ("done", "failed", "cancelled"):
            self.cancel()

    def cancel(self) -> None:
        self._scheduler._cancel(self)

    @property
    def done(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    @property
    def driven(self) -> bool:
        """Whether another thread drives its scheduler, so its tokens arrive without the consumer stepping
        it (what ``aiter()`` needs)."""
        return self._scheduler._driven_elsewhere()

    # --- the scheduler side -------------------------------------------------------------------
    def _emit(self, item: object) -> None:
        with self._cond:
            self._out.append(item)
        self._notify()

    def _notify(self) -> None:
        """Wake its consumers: a token or its end is out, or its scheduler's driver stopped."""
        with self._cond:
            self._cond.notify_all()
            listeners = list(self._listeners)
        for wake in listeners:
            wake()


@dataclass(eq=False, slots=True)
class _Carried:
    """A window's own forward handed to the scheduler (``carry``), waiting for or running in its steps."""

    ids: torch.Tensor
    past: Past
    start: int
    logits: str
    recorders: tuple[Recorder, ...] = ()  # its caller's RoPE recorders (a canonical's pre-RoPE keys): run whole
    cache: RowCache | None = None  # the past copied to the device with room for ``ids`` (first chunk on)
    n_past: int = 0
    done: int = 0  # tokens planned into steps so far
    pieces: list[torch.Tensor] = field(default_factory=list)  # logits of the chunks run so far
    result: ForwardResult | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    answer: Request | None = None  # the answer to start from its end (``carry(..., answer=...)``), made by its caller
    answer_queued: bool = False  # whether the step that finished it queued that answer


@dataclass(eq=False, slots=True)
class _AloneJob:
    """A forward to run alone between two steps (``run_alone``), in its caller's context."""

    fn: Callable[[], Any]
    context: contextvars.Context
    result: Any = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _CarriedChunk:
    item: _Carried
    row: Row
    tokens: int
    final: bool


@dataclass(slots=True)
class _Plan:
    rows: list[Row] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    finishing_prompt: list[bool] = field(default_factory=list)
    decode_rows: int = 0
    prefill_tokens: int = 0
    carried: list[_CarriedChunk] = field(default_factory=list)  # window forwards' rows, after ``rows``


def exclusive(engine: object, fn: Callable[[], T]) -> T:
    """Run ``fn``, model work that does not go through ``Engine.forward`` (selective recompute drives the
    decoder layers itself), where no step runs beside it: under a scheduler (the one this context submits to,
    or one a thread drives), between two of its steps (``Scheduler.run_alone``); without one, at once."""
    batching = active_scheduler(engine)
    sched = batching[0] if batching is not None else driven_scheduler(engine)
    return fn() if sched is None else sched.run_alone(fn)


class Scheduler:
    """Continuous batching over one engine's model (see the module docstring).

    ``step_tokens``: most tokens one forward runs (decodes count one each; prompt chunks fill the
    rest). ``max_rows``: most requests in one forward. ``kv_budget_bytes``: the KV all admitted requests
    may hold on the device (None: no limit). ``max_waiting``: requests that may wait for admission
    before new ones are refused.
    """

    #: whether ``carry`` lets a forward's step queue the answer its caller decodes on from it (``answer=``);
    #: False leaves every submission to the caller, as before follow-ons existed (for comparison:
    #: ``scripts/follow_on_ab.py``)
    follow_ons: bool = True

    def __init__(
        self,
        engine: Engine,
        *,
        step_tokens: int = 512,
        max_rows: int = 64,
        kv_budget_bytes: int | None = None,
        max_waiting: int = 256,
    ) -> None:
        if not engine.batchable:
            raise InvalidInputError(f"{type(engine).__name__} runs forwards of its own kind; it cannot be batched")
        limits = (("step_tokens", step_tokens, 1), ("max_rows", max_rows, 1), ("max_waiting", max_waiting, 0))
        for name, value, least in limits:
            if value < least:
                raise InvalidInputError(f"{name} must be >= {least}, got {value}")
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise InvalidInputError(f"kv_budget_bytes must be >= 1 or None, got {kv_budget_bytes}")
        self.engine = engine
        self.step_tokens = step_tokens
        self._observers: list[Callable[[StepRecord], None]] = []
        self.max_rows = max_rows
        self.kv_budget_bytes = kv_budget_bytes
        self.max_waiting = max_waiting
        self._ids = count()
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._carried: list[_Carried] = []  # window forwards (``carry``) waiting for or running in steps
        self._alone_jobs: deque[_AloneJob] = deque()  # forwards to run alone between steps (``run_alone``)
        self._withdrawals: list[Request] = []  # requests cancelled from other threads, finished at the next step
        self._stepping: int | None = None  # the thread holding the step lock
        self._kv_bytes = 0
        self._slab = DecodeSlab()  # decoding requests' KV side by side: one attention call for all of them
        self._slab_need = 0  # need_bytes of the requests in the slab
        self._stats = SchedulerStats(kv_budget_bytes=kv_budget_bytes, step_tokens=step_tokens, max_rows=max_rows)
        self._driver: int | None = None  # the thread that drives steps, when one does
        self._wake = threading.Condition()
        self._idle_since: float | None = None  # when the stepping thread began waiting for work, while it waits
        self._stop = False
        self._thread: threading.Thread | None = None
        self._step_s = 0.05  # a running estimate of one step's time (retry hints)
        layers = engine.num_layers
        item = torch.empty((), dtype=engine.dtype).element_size()
        self.bytes_per_token = layers * engine.num_kv_heads * (engine.key_dim + engine.value_dim) * item

    # --- submitting -----------------------------------------------------------------------------
    @contextmanager
    def serving(self, key: Hashable | None = None) -> Iterator[None]:
        """Within this block, the engine's ``generate_ids`` / ``continue_ids`` (so every window's
        ``generate``) submit here, under ``key`` (one window's requests run in order)."""
        token = _ACTIVE.set((self, key))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def submit(
        self,
        past: Past,
        prompt_ids: Sequence[int] | torch.Tensor,
        start: int,
        params: SamplingParams,
        *,
        key: Hashable | None = None,
    ) -> Request:
        """Prefill ``prompt_ids`` at ``start...`` after ``past`` (a placed KV or its parts), then decode."""
        params.validate()
        ids = torch.as_tensor(list(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids)
        ids = ids.to(torch.long).reshape(-1)
        if ids.numel() == 0:
            raise InvalidInputError("prompt_ids must hold at least one token")
        self.engine.check_ids(ids)
        n_past = sum(len(p) for p in past_parts(past))
        self._check_positions(start + int(ids.numel()), params)
        need = (n_past + int(ids.numel()) + params.max_new_tokens) * self.bytes_per_token
        req = Request(self, self._key(key), self._with_eos(params), need, past=past, prompt_ids=ids, start=start)
        return self._enqueue(req)

    def submit_prefilled(self, prompt: Prefilled, params: SamplingParams, *, key: Hashable | None = None) -> Request:
        """Decode on from a prompt already prefilled (``ForwardResult.prefilled``)."""
        params.validate()
        self._check_positions(prompt.next_position, params)
        n = int(prompt.layers[0][0].shape[2]) if prompt.layers else 0
        need = (n + params.max_new_tokens) * self.bytes_per_token
        req = Request(self, self._key(key), self._with_eos(params), need, prefilled=prompt)
        return self._enqueue(req)

    def _key(self, key: Hashable | None) -> Hashable:
        return ("request", next(self._ids)) if key is None else key

    def _with_eos(self, params: SamplingParams) -> SamplingParams:
        if not params.eos_token_ids:
            params.eos_token_ids = self.engine.eos_token_ids
        return params

    def _check_positions(self, positions: int, params: SamplingParams) -> None:
        self.engine.check_length(positions, new_tokens=params.max_new_tokens)
        limit = self.engine.adapter.max_context()
        if limit is not None and positions + params.max_new_tokens > limit:
            raise InvalidInputError(
                f"{positions + params.max_new_tokens} positions exceed the sliding window ({limit})"
            )

    def _enqueue(self, req: Request) -> Request:
        with self._lock:
            refusal = self._queue_locked(req)
            if refusal is not None:
                self._stats.refused += 1
                raise refusal
        with self._wake:
            self._wake.notify_all()
        return req

    def _queue_locked(self, req: Request) -> CapacityError | None:
        """Queue ``req`` for admission, or say why it cannot be queued now (the caller holds ``_lock``)."""
        refusal = self._refusal(req)
        if refusal is None:
            self._waiting.append(req)
            self._stats.submitted += 1
        return refusal

    def _refusal(self, req: Request) -> CapacityError | None:
        """Why ``req`` cannot be queued now, or None (the caller holds ``_lock``)."""
        if self.kv_budget_bytes is not None and req.need_bytes > self.kv_budget_bytes:
            return CapacityError(
                f"the request needs {req.need_bytes} bytes of KV, more than the scheduler's whole budget "
                f"of {self.kv_budget_bytes}",
                retry_after_s=None,
            )
        if len(self._waiting) >= self.max_waiting and not self._fits_now(req):
            return CapacityError(
                f"the engine is at capacity ({len(self._running)} running, {len(self._waiting)} waiting, "
                f"{self._kv_bytes} of {self.kv_budget_bytes} KV bytes held); try again later",
                retry_after_s=self.retry_after(),
            )
        return None

    def _fits_now(self, req: Request) -> bool:
        return self.kv_budget_bytes is None or self._kv_bytes + req.need_bytes <= self.kv_budget_bytes

    def retry_after(self) -> float:
        """Seconds until some running request is likely to finish (a hint for refused clients)."""
        with self._lock:
            left = [r.params.max_new_tokens - len(r.generated) for r in self._running]
        return round(max(0.1, min(left, default=1) * self._step_s), 2)

    # --- stepping ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return self._queued()

    def _queued(self) -> bool:
        # each container's truth is read atomically, so a caller may look without ``_lock`` (``wait_for_work``)
        return bool(self._running or self._waiting or self._carried or self._alone_jobs)

    def step(self) -> bool:
        """Run the forwards waiting to run alone, if any; else admit what fits, run one batched forward and
        hand out its tokens. False when there was no work."""
        with self._step_lock:
            return self._step_locked()

    def _step_locked(self) -> bool:
        self._stepping = threading.get_ident()
        try:
            self._withdraw_queued()
            if self._run_alone_jobs():  # each in its caller's context (a recording open there sees it)
                return True
            with unrecorded():  # a step runs other requests' rows: no recording of this thread sees them
                return self._batched_step()
        finally:
            self._stepping = None

    def _batched_step(self) -> bool:
        # the step's own copies (a request into the slab, a window forward's past into its row) run inline: each
        # split of one would first wake a sleeping pool thread (``threads.small_kernels_inline``); forwards keep it
        with small_kernels_inline():
            self._admit()
        lone = self._lone_window_forward()
        if lone is not None:  # one window forward and nothing else to run: the unbatched path, bit for bit
            t0 = time.perf_counter()
            self._run_alone(lone)
            dt = time.perf_counter() - t0
            self._stats.carried_alone += 1
            self._stats.forward_s += dt
            if self._observers:
                n = int(lone.ids.numel())
                self._report(StepRecord(ended=t0 + dt, seconds=dt, window_forwards=1, window_tokens=n, alone=True))
            return True
        plan = _Plan()
        try:
            with small_kernels_inline():
                self._plan(plan)
            if not plan.rows and not plan.carried:
                return False
            self._run_plan(plan)
        except Exception as exc:  # a failure outside the forward: its rows' owners get it, later work goes on
            log.exception("scheduler step failed outside its forward: %s", exc)
            self._fail_plan(plan, _as_kamera(exc))
        return True

    def _run_plan(self, plan: _Plan) -> None:
        window_forwards, window_tokens = len(plan.carried), sum(c.tokens for c in plan.carried)
        rows = [*plan.rows, *(c.row for c in plan.carried)]
        spans = row_spans(rows)
        recorded = [(a, b, c.item.recorders) for (a, b), c in zip(spans[len(plan.rows) :], plan.carried, strict=True)]
        t0 = time.perf_counter()
        try:
            with self._recording(recorded, packed_length(spans[-1][1], self.engine.model)) as captured:
                logits = batched_forward(self.engine.model, rows)
        except Exception:
            # find the request that fails (the others go on); every window forward runs alone, so its own
            # error (if any) reaches its caller
            logits = self._alone(plan)
            for chunk in plan.carried:
                self._run_alone(chunk.item)
            plan.carried = []
        dt = time.perf_counter() - t0
        with small_kernels_inline():
            self._hand_out(plan, logits, captured, dt)
        if self._observers:  # once its tokens are handed out: an observer never delays them
            record = StepRecord(
                ended=t0 + dt,
                seconds=dt,
                decode_rows=plan.decode_rows,
                prompt_tokens=plan.prefill_tokens,
                window_forwards=window_forwards,
                window_tokens=window_tokens,
            )
            self._report(record)

    def _hand_out(self, plan: _Plan, logits: list[torch.Tensor | None], captured: Any, dt: float) -> None:
        """After a step's forward: count it, pick every request's token (one that starts decoding moves into the
        slab, one that ends leaves it) and finish the window forwards' chunks."""
        self._account(plan, dt)
        for req, lg, finishing in zip(plan.requests, logits, plan.finishing_prompt, strict=False):
            if lg is None:
                continue  # failed alone, or a prompt chunk that is not the last
            if req.state == "cancelled":
                continue
            try:
                if req.state == "prefill":
                    if not finishing:
                        continue
                    req.state = "decode"
                    self._take(req, lg)
                    self._to_slab(req)
                else:
                    self._take(req, lg)
            except Exception as exc:  # this request's own failure (its sampling or grammar): it alone fails
                self._finish(req, "failed", error=_as_kamera(exc))
        for i, (chunk, lg) in enumerate(zip(plan.carried, logits[len(plan.rows) :], strict=True)):
            try:
                captured.deliver(i)  # after the forward: a recorder's error is its own caller's alone
            except Exception as exc:
                self._carried_fail(chunk.item, _as_kamera(exc))
                continue
            self._carried_chunk_done(chunk, lg)

    def _fail_plan(self, plan: _Plan, error: BaseException) -> None:
        """Fail every row of a step that broke outside its forward: the callers of its window forwards raise
        ``error``, its requests end failed; nothing of it stays queued."""
        for chunk in plan.carried:
            self._carried_fail(chunk.item, error)
        for req in plan.requests:
            self._finish(req, "failed", error=error)

    def run_alone(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one forward on the engine's model) alone, between two steps: never packed with other
        rows, never beside a step, so its result is the unbatched path's, bit for bit, and the model runs
        one forward at a time. ``fn`` runs in the calling context (a recording open there sees it) on the
        thread that drives the scheduler, or on this one when none does; its error is raised here. Called
        while this thread is running a step, ``fn`` runs at once."""
        if self._stepping == threading.get_ident():
            return fn()
        job = _AloneJob(fn, contextvars.copy_context())
        self._queue_and_await(self._alone_jobs, job, job.finished)
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def _queue_and_await(self, queue: MutableSequence[Any], work: object, done: threading.Event) -> None:
        """Queue ``work`` for the next step (or between steps) and block until ``done``."""
        with self._lock:
            queue.append(work)
        self.notify()
        self._await(done)

    def _await(self, done: threading.Event) -> None:
        """Block until ``done`` is set: by the thread driving the scheduler, or, while none does, by steps this
        thread runs itself (another waiting caller may run the awaited work first)."""
        while not done.is_set():
            if self._driven_elsewhere():
                done.wait(0.5)  # the driver runs it (rechecked: a driver may stop)
                continue
            with self._step_lock:
                if not done.is_set():
                    self._step_locked()

    def _run_alone_jobs(self) -> bool:
        """Run every forward queued to run alone (in arrival order); whether there was one."""
        with self._lock:
            jobs = list(self._alone_jobs)
            self._alone_jobs.clear()
        for job in jobs:
            t0 = time.perf_counter()
            try:
                job.result = job.context.run(job.fn)
            except BaseException as exc:  # the caller's error, raised on its own thread
                job.error = exc
            dt = time.perf_counter() - t0
            self._stats.alone += 1
            self._stats.forward_s += dt
            job.finished.set()
            if self._observers:
                self._report(StepRecord(ended=t0 + dt, seconds=dt, alone=True))
        return bool(jobs)

    def carry(
        self,
        ids: torch.Tensor,
        past: Past,
        start: int,
        logits: str,
        *,
        recorders: Sequence[Recorder] = (),
        answer: SamplingParams | None = None,
        key: Hashable | None = None,
    ) -> ForwardResult | None:
        """Run a caller's own forward (``Engine.forward``: a window's new page, its prompt, a cascade) in the
        scheduler's steps: as one more row of a step that also advances every running decode by one token,
        prefills waiting prompts and runs other windows' forwards (other threads' ``carry``), so window
        work never stalls the decode batch and several windows' forwards read the weights once.

        Blocks until the forward has run. A thread that drives the scheduler runs it; when none does, the
        calling thread steps the scheduler itself. A step that holds this forward and nothing else runs it
        alone (``run_forward``, bit for bit the unbatched path). A forward longer than what is left of a
        step's ``step_tokens`` is split over several steps (chunked prefill). When the combined forward
        fails, every window forward of the step runs alone and its own error (if any) is raised here; an
        error copying this forward's past is raised here too (the step goes on), and so is one assembling
        its result, which happens here, on the calling thread, once the forward has run.
        Returns None only for a ``logits`` mode it does not know (the caller runs its forward itself). The
        forward is counted by ``Engine.forward``, not again in the engine's counters.

        ``recorders``: the caller's RoPE recorders (``capture.active_recorders``, all ``capture.packable``; a
        canonical's pre-RoPE keys): they see this forward's tokens of every call and nothing of the other rows
        (``capture.recording_rows``), once the forward has run; such a forward is never split over steps.

        ``answer`` (with ``logits="last"``): the sampling of an answer to decode on from the forward's end, under
        ``key`` as ``submit_prefilled``. The step that finishes the forward queues it, so it joins the very next
        step instead of the one after its caller gets round to submitting it; the result's ``answer`` is that
        request, or None where none was queued (a forward that ran alone, a request the scheduler would refuse
        now): the caller then submits it from the result's ``prefilled`` as before, and any refusal is raised
        there. Its tokens are the ones that submission would give."""
        if logits not in ("last", "all", "none"):
            return None
        item = _Carried(ids.to(torch.long).reshape(-1), past, start, logits, tuple(recorders))
        if answer is not None and logits == "last" and self.follow_ons:
            item.answer = self._follow_on(start + int(item.ids.numel()), answer, key)
        self._queue_and_await(self._carried, item, item.finished)
        queued = item.answer if item.answer_queued else None
        try:
            if item.error is not None:
                raise item.error
            if item.result is not None:  # it ran alone: nothing was queued, its caller decodes from the result
                return item.result
            with small_kernels_inline():  # it ran in steps: its result is put together on this thread (copies)
                result = self._carried_result(item)
        except BaseException:
            if queued is not None:  # nobody will read it
                queued.cancel()
            raise
        result.answer = queued
        return result

    def _follow_on(self, position: int, params: SamplingParams, key: Hashable | None) -> Request | None:
        """The answer a carried forward starts at ``position``, made on its caller's thread (a grammar's walk is
        built here, not in a step); None when its checks fail (the caller's own submission raises the error)."""
        try:
            params.validate()
            self._check_positions(position, params)
            return Request(self, self._key(key), self._with_eos(params), 0)
        except KameraError:
            return None

    def _queue_follow_on(self, item: _Carried) -> None:
        """Queue the answer of a carried forward whose last chunk just ran (on the stepping thread), decoding on
        from the row as it is (``_start`` reads it in place until the slab copies it), unless the scheduler
        would refuse it now."""
        req, cache = item.answer, item.cache
        if req is None or cache is None or not item.pieces:  # no answer asked for (or nothing to start it from)
            return
        n = int(item.ids.numel())
        req.need_bytes = (item.n_past + n + req.params.max_new_tokens) * self.bytes_per_token
        req._prefilled = Prefilled(item.pieces[-1], cache.layers(), item.start + n)
        req.submitted_at = time.perf_counter()
        with self._lock:
            if self._queue_locked(req) is not None:
                return
            self._stats.follow_ons += 1
        item.answer_queued = True

    def _lone_window_forward(self) -> _Carried | None:
        """The one window forward to run alone: nothing decoding, no prompt to prefill, no other window
        forward waiting, and this one not started in chunks."""
        with self._lock:
            if len(self._carried) != 1 or self._carried[0].done or self._running:
                return None
            return self._carried[0]

    def _recording(self, rows: Sequence[tuple[int, int, Sequence[Recorder]]], width: int) -> Any:
        """``capture.recording_rows`` over the engine's RoPE functions (looked up only when a row records)."""
        adapter, model = self.engine.adapter, self.engine.model
        modules = adapter.rope_modules(model) if any(rs for _, _, rs in rows) else ()
        return recording_rows(modules, adapter.rope_functions, rows, width)

    def _run_alone(self, item: _Carried) -> None:
        try:
            n = int(item.ids.numel())
            with self._recording([(0, n, item.recorders)], n) as captured:
                item.result = run_forward(self.engine.model, item.ids, item.past, item.start, logits=item.logits)
            captured.deliver(0)
        except BaseException as exc:  # the caller's error, raised on its own thread
            item.error = exc
        self._carried_finish(item)

    def _plan_carried(self, plan: _Plan, budget: int) -> int:
        """Add chunks of the waiting window forwards (in arrival order) to ``plan`` within ``budget`` tokens;
        returns what is left of the budget. A forward whose past cannot be copied fails on its own (its
        caller raises the error); the others are planned."""
        with self._lock:
            pending = list(self._carried)
        device = self.engine.device
        for item in pending:
            if budget <= 0 or len(plan.rows) + len(plan.carried) >= self.max_rows:
                break
            try:
                n = int(item.ids.numel())
                if item.recorders and n > budget and plan.carried:
                    continue  # a recorded forward runs whole: in the next step (a step's first may overrun it)
                if item.cache is None:
                    item.cache = RowCache.from_past(item.past, self.engine.num_layers, reserve=n, device=device)
                    item.n_past = len(item.cache)
                k = n - item.done if item.recorders else min(n - item.done, budget)
                final = item.done + k == n
                mode = "all" if item.logits == "all" else ("last" if final else "none")
                row = Row.at(item.cache, item.ids[item.done : item.done + k], item.start + item.done, logits=mode)
            except Exception as exc:
                self._carried_fail(item, _as_kamera(exc))
                continue
            plan.carried.append(_CarriedChunk(item, row, k, final))
            item.done += k
            budget -= k
        return budget

    def _carried_chunk_done(self, chunk: _CarriedChunk, logits: torch.Tensor | None) -> None:
        item = chunk.item
        if logits is not None:
            item.pieces.append(logits)
        if chunk.final:
            try:
                self._queue_follow_on(item)
            except Exception:  # not queued: its caller submits it from the result (and sees any error there)
                log.exception("queueing a follow-on answer failed")
            self._carried_finish(item)  # its caller puts the result together (``_carried_result``)

    def _carried_result(self, item: _Carried) -> ForwardResult:
        """A forward that ran in steps as its caller gets it (on the caller's thread; no step touches its row
        any more): the new tokens' placed KV, the logits asked for and a transformers cache over the row."""
        cache = item.cache
        assert cache is not None
        try:
            n = int(item.ids.numel())
            positions = torch.arange(item.start, item.start + n, dtype=torch.long, device="cpu")
            dyn = DynamicCache(config=self.engine.model.config)
            for i, (k, v) in enumerate(cache.layers()):
                dyn.update(k, v, i)
            kv = cache.kv(item.n_past, item.n_past + n, positions)
            out = torch.cat(item.pieces) if item.logits == "all" else item.pieces[-1][None]
        except Exception as exc:  # this forward's own result could not be assembled: its caller raises
            with self._lock:
                self._stats.carried_failed += 1
            if isinstance(exc, KameraError):
                raise
            raise _as_kamera(exc) from exc
        finally:
            item.cache = None
            item.pieces.clear()
        return ForwardResult(kv, out, dyn)

    def _carried_fail(self, item: _Carried, error: BaseException) -> None:
        if item.finished.is_set():
            return
        item.error = error
        item.cache = None
        item.pieces.clear()
        with self._lock:  # also counted on callers' threads (``_carried_result``)
            self._stats.carried_failed += 1
        self._carried_finish(item)

    def _carried_finish(self, item: _Carried) -> None:
        with self._lock:
            if item in self._carried:
                self._carried.remove(item)
        item.past = None  # copied or run: the caller's tensors are free again
        item.finished.set()

    def _alone(self, plan: _Plan) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for req, row in zip(plan.requests, plan.rows, strict=True):
            try:
                out.append(batched_forward(self.engine.model, [row])[0])
            except Exception as exc:
                self._finish(req, "failed", error=_as_kamera(exc))
                out.append(None)
        return out

    def _account(self, plan: _Plan, dt: float) -> None:
        s = self._stats
        rows = len(plan.rows) + len(plan.carried)
        s.steps += 1
        s.rows_total += rows
        s.batch_max = max(s.batch_max, rows)
        s.forward_s += dt
        decode, prefill = plan.decode_rows, plan.prefill_tokens
        s.decode_tokens += decode
        s.prefill_tokens += prefill
        self._step_s = 0.8 * self._step_s + 0.2 * dt
        if plan.carried:
            s.carried_steps += 1
            s.carried_rows_total += len(plan.carried)
            s.carried_rows_max = max(s.carried_rows_max, len(plan.carried))
            s.carried += sum(1 for c in plan.carried if c.final)
            s.carried_tokens += sum(c.tokens for c in plan.carried)
        if plan.rows:  # window forwards only: each is counted by its own ``Engine.forward``
            # engine-wide only: the thread that ran this step (a window's, when nothing drives) did not ask
            # for the other requests' work, and its own carried forward is counted by its ``Engine.forward``
            self.engine.count_forward(prefill, dt, per_thread=False)

    @contextmanager
    def observe(self, fn: Callable[[StepRecord], None]) -> Iterator[None]:
        """Call ``fn`` with a ``StepRecord`` after every step while the block runs (a step log, a live view of
        batch sizes), once the step's tokens are handed out. It runs on the stepping thread before the next
        step, so keep it short; an ``Exception`` in it is logged and the scheduler goes on. A step that was
        being reported as the block ended may still reach ``fn`` just after it."""
        with self._lock:
            self._observers = [*self._observers, fn]
        try:
            yield
        finally:
            with self._lock:
                observers = list(self._observers)
                observers.remove(fn)
                self._observers = observers  # a new list: a step reporting now goes over the old one

    def _report(self, record: StepRecord) -> None:
        for fn in self._observers:
            try:
                fn(record)
            except Exception:
                log.exception("a step observer failed (the step went on)")

    def _admit(self) -> None:
        """Move waiting requests into the running set, in order, while rows and memory allow; a key's
        request waits for the one before it (same key) to finish."""
        with self._lock:
            busy = {r.key for r in self._running}
            kept: deque[Request] = deque()
            blocked: set[Hashable] = set()
            while self._waiting:
                req = self._waiting.popleft()
                if req.state == "cancelled":
                    continue
                if req.key in busy or req.key in blocked:  # a key's requests run one after another, in order
                    kept.append(req)
                    blocked.add(req.key)
                    continue
                if len(self._running) >= self.max_rows or not self._fits_now(req):
                    kept.append(req)  # first come, first served: nothing overtakes a request memory holds back
                    kept.extend(self._waiting)
                    self._waiting.clear()
                    break
                wait = time.perf_counter() - req.submitted_at
                self._stats.queue_wait_s_total += wait
                self._stats.queue_wait_s_max = max(self._stats.queue_wait_s_max, wait)
                try:
                    self._start(req)
                except Exception as exc:
                    self._finish(req, "failed", error=_as_kamera(exc))
                    continue
                busy.add(req.key)
            self._waiting = kept

    def _start(self, req: Request) -> None:
        params = req.params
        if params.seed is not None and params.temperature > 0:
            req._generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self._running.append(req)
        self._kv_bytes += req.need_bytes
        self._stats.kv_bytes_peak = max(self._stats.kv_bytes_peak, self._kv_bytes)
        device = self.engine.device
        if req._prefilled is not None:
            p = req._prefilled
            # read in place until the slab's admit copies it into a slot (one copy, not two); the prefilled
            # tensors may start other answers and are never written
            req._cache = RowCache.borrowing(p.layers)
            req._position = p.next_position
            req._prefilled = None
            req.state = "decode"
            self._take(req, p.logits.float())
            self._to_slab(req)
            if req._cache is not None and req._cache.slab is None:  # outside the slab: a cache of its own
                # (after its first token: an allocation failing here fails the request as a later step would)
                req._cache = RowCache.from_layers(p.layers, reserve=params.max_new_tokens)
            return
        assert req._prompt is not None
        reserve = int(req._prompt.numel()) + params.max_new_tokens
        req._cache = RowCache.from_past(req._past, self.engine.num_layers, reserve=reserve, device=device)
        req._past = None  # copied: the caller's tensors are free again
        req._position = req._start
        req.state = "prefill"

    def _plan(self, plan: _Plan) -> None:
        with self._lock:
            decoding = [r for r in self._running if r.state == "decode"]
            prefilling = [r for r in self._running if r.state == "prefill"]
            rows = self.max_rows - 1 if self._carried else self.max_rows  # a window forward always gets a row
        budget = self.step_tokens
        # in slot order: the slab's rows then sit side by side in the packed sequence, and their attention
        # reads and writes them as slices (``batch._together``)
        decoding = sorted(decoding[:rows], key=lambda r: r._cache.slot if r._cache is not None else -1)
        for req in decoding:
            if len(plan.rows) >= rows:
                break
            assert req._cache is not None
            plan.rows.append(Row.at(req._cache, [req.generated[-1]], req._position))
            plan.requests.append(req)
            plan.finishing_prompt.append(False)
            plan.decode_rows += 1
            budget -= 1
        # window forwards: callers block on them, so before prompts; they get a share of the step even when
        # the decode rows use up its budget (else a window forward could wait as long as anything decodes)
        carried_budget = max(budget, self._carried_share())
        budget -= carried_budget - self._plan_carried(plan, carried_budget)  # prompts get what is left
        for req in prefilling:
            if budget <= 0 or len(plan.rows) + len(plan.carried) >= self.max_rows:
                break
            assert req._prompt is not None and req._cache is not None
            left = int(req._prompt.numel()) - req._done_prompt
            n = min(left, budget)
            chunk = req._prompt[req._done_prompt : req._done_prompt + n]
            last = n == left
            plan.rows.append(Row.at(req._cache, chunk, req._position, logits="last" if last else "none"))
            plan.requests.append(req)
            plan.finishing_prompt.append(last)
            req._done_prompt += n
            req._position += n
            plan.prefill_tokens += n
            budget -= n
        for req in plan.requests[: plan.decode_rows]:  # a decode row feeds its last token at the current position
            req._position += 1

    def _carried_share(self) -> int:
        """Tokens a waiting window forward gets in a step whatever the decode rows took: a quarter of
        ``step_tokens``, at least one."""
        return max(1, self.step_tokens // 4)

    def _to_slab(self, req: Request) -> None:
        """Move a request that starts decoding into the decode slab (one copy of its KV), when the slab with
        it stays within the KV budget; otherwise it decodes from its own cache (attention of its own)."""
        cache = req._cache
        if req.state != "decode" or cache is None or cache.slab is not None:
            return
        capacity = len(cache) + req.params.max_new_tokens - len(req.generated) + 1
        if self.kv_budget_bytes is not None:
            others = self._kv_bytes - self._slab_need - req.need_bytes  # what the other requests may hold
            if self._slab.nbytes_with(cache, capacity) + others > self.kv_budget_bytes:
                return
        try:
            self._slab.admit(cache, capacity)
        except InvalidInputError:  # a row of another shape (cannot happen for one engine's rows): decode alone
            return
        self._slab_need += req.need_bytes

    def _take(self, req: Request, logits: torch.Tensor) -> None:
        """Pick the request's next token from its logits, hand it out, and finish the request when it ends."""
        params = req.params
        if params.max_new_tokens == 0:
            self._finish(req, "done", reason="length")
            return
        token = next_token(logits, params, req._generator, req._constraint)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.generated.append(token)
        req._emit(token)
        if token in params.eos_token_ids:
            self._finish(req, "done", reason="stop")
        elif params.stop and self._hit_stop(req):
            self._finish(req, "done", reason="stop")
        elif len(req.generated) >= params.max_new_tokens:
            self._finish(req, "done", reason="length")

    def _hit_stop(self, req: Request) -> bool:
        """Whether the text decoded so far holds a stop string (the consumer cuts the text there)."""
        tok = self.engine.tokenizer
        if tok is None:
            return False
        text = tok.decode(req.generated, skip_special_tokens=True)
        return any(s in text for s in req.params.stop)

    def _finish(
        self,
        req: Request,
        state: RequestState,
        *,
        reason: Literal["stop", "length"] | None = None,
        error: BaseException | None = None,
    ) -> None:
        with self._lock:
            if req.done:
                return
            req.state = state
            req.finish_reason = reason
            req.error = error
            if req in self._running:
                self._running.remove(req)
                self._kv_bytes -= req.need_bytes
            elif req in self._waiting:
                self._waiting.remove(req)
            if req._cache is not None and req._cache.slab is self._slab:  # its slot goes to the last row
                self._slab.release(req._cache)
                self._slab_need -= req.need_bytes
            req._cache = None
            req._past = req._prefilled = None
            counter = {"done": "finished", "failed": "failed", "cancelled": "cancelled"}[state]
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
        req._emit(_END)
        with self._wake:
            self._wake.notify_all()

    def _cancel(self, req: Request) -> None:
        """Withdraw ``req`` and return once it is withdrawn. Another thread's cancel never waits for the step
        lock: a driver stepping in a tight loop takes it again before a waiting thread wakes, so a cancel could
        wait for hundreds of steps while the answer decodes on. It queues the request instead; the next step
        finishes it before anything else (or the canceller, when no step runs)."""
        me = threading.get_ident()
        if me in (self._driver, self._stepping):  # between or inside its own steps: nothing else runs
            self._finish(req, "cancelled")
            return
        with self._lock:
            if req.done:
                return
            self._withdrawals.append(req)
        while True:
            if self._step_lock.acquire(blocking=False):  # no step in progress: withdraw it here
                try:
                    self._withdraw_queued()
                finally:
                    self._step_lock.release()
            with self._wake:  # ``_finish`` notifies under ``_wake`` once the state is set: no wake-up is lost
                if req.done:
                    return
                self._wake.wait(0.01)  # rechecked: the step that drained the queue may have ended first

    def _withdraw_queued(self) -> None:
        """Finish the requests other threads cancelled (the caller holds the step lock)."""
        if not self._withdrawals:  # every step looks: no lock when none is queued (a canceller rechecks its own)
            return
        with self._lock:
            queued, self._withdrawals = self._withdrawals, []
        for req in queued:
            self._finish(req, "cancelled")

    # --- a thread that drives it ------------------------------------------------------------------
    def start(self) -> None:
        """Drive the scheduler from a thread of its own until ``stop()``."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kamera-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        with self.driving():
            while not self._stop:
                if not self.step():
                    self.wait_for_work(0.5)

    @contextmanager
    def driving(self) -> Iterator[None]:
        """Mark the current thread as the one that steps this scheduler (consumers elsewhere wait)."""
        self._driver = threading.get_ident()
        with _DRIVEN_LOCK:
            _DRIVEN[_model_of(self.engine)] = self
        try:
            yield
        finally:
            self._driver = None
            with _DRIVEN_LOCK:
                if _DRIVEN.get(_model_of(self.engine)) is self:
                    del _DRIVEN[_model_of(self.engine)]
            with self._lock:
                live = [*self._running, *self._waiting]
            for req in live:  # a consumer waiting for this driver's steps steps the scheduler itself now
                req._notify()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request runs or waits and no window forward is queued (a thread must drive the
        scheduler meanwhile); False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while self.has_work():  # not under ``_wake``: a step takes ``_lock`` then ``_wake`` (``_finish``)
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return False
            with self._wake:
                self._wake.wait(0.05 if left is None else min(0.05, left))
        return True

    def cancel_all(self) -> int:
        """Cancel every request that runs or waits (their consumers see them end); how many."""
        with self._lock:
            live = [*self._running, *self._waiting]
        for req in live:
            req.cancel()
        return len(live)

    def wait_for_work(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for work to arrive, unless some is there (the driving thread, between
        steps); the wait counts in ``stats().idle_s``, a wait in progress up to the moment ``stats()`` is read."""
        since: float | None = None
        try:
            # never ``_lock`` inside ``_wake``: a step takes ``_lock`` then ``_wake`` (``_finish``). Work queued after
            # this look notifies under ``_wake``, so it wakes the wait below: nothing is missed.
            with self._wake:
                if self._queued():
                    return
                since = self._idle_since = time.perf_counter()
                self._wake.wait(timeout)
        finally:
            if since is not None:
                with self._lock:
                    self._stats.idle_s += time.perf_counter() - since
                    self._idle_since = None

    def notify(self) -> None:
        """Wake a driver waiting for work (a caller that added work of its own)."""
        with self._wake:
            self._wake.notify_all()

    def _driven_elsewhere(self) -> bool:
        return self._driver is not None and self._driver != threading.get_ident()

    def drives_here(self) -> bool:
        """Whether the calling thread drives this scheduler (``driving()``): work it waits for runs only
        if it steps the scheduler itself."""
        return self._driver == threading.get_ident()

    def stats(self) -> SchedulerStats:
        with self._lock:
            s = self._stats.model_copy()
            s.kv_bytes = self._kv_bytes
            s.slab_rows = len(self._slab)
            s.slab_bytes = self._slab.nbytes
            s.running = len(self._running)
            s.waiting = len(self._waiting)
            s.carried_waiting = len(self._carried)
            since = self._idle_since
            if since is not None:  # a wait in progress counts up to now
                s.idle_s += time.perf_counter() - since
        return s


@contextmanager
def batching(engine: Engine, **options: Any) -> Iterator[Scheduler]:
    """``Engine.batching``: a scheduler for ``engine`` (``options``: ``Scheduler``'s), driven by a thread of its
    own and made the one of every engine over ``engine.model`` (engines that share a model share its steps), so
    every window on them, on any thread or coroutine, decodes and runs its forwards in shared steps. On
    leaving, the answers in progress finish first (or, when the block raises, are cancelled); then the thread
    stops and the engines run unbatched again."""
    sched = Scheduler(engine, **options)
    model = _model_of(engine)
    with _BATCHING_LOCK:
        if model in _BATCHING or driven_scheduler(engine) is not None:
            raise InvalidInputError("this engine is already batching (engine.batching(), or a server's scheduler)")
        _BATCHING[model] = sched
    ok = False
    try:
        sched.start()
        yield sched
        ok = True
    finally:
        with _BATCHING_LOCK:  # first: new work runs unbatched from here on
            del _BATCHING[model]
        if ok:
            sched.wait_idle()  # the answers in progress finish, driven as before
        else:
            sched.cancel_all()
        # a consumer or caller of work that arrives after this steps the scheduler itself
        sched.stop()


def _as_kamera(exc: BaseException) -> BaseException:
    if isinstance(exc, KameraError):
        return exc
    err = KameraError(f"the request's forward failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
