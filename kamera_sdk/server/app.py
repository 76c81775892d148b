"""The engine server: one engine behind an HTTP API where sessions are windows.

``create_app(engine)`` returns a FastAPI app. Requests are handled concurrently on the event loop;
window work runs on the worker (``worker.py``). With batching (the default for engines whose forwards
can be packed), each session's jobs run in its own lane on a pool of window threads (one job of a session
at a time, several sessions at once), every session's answer is a request of the engine's ``Scheduler``,
and one model thread steps it: all running answers decode together, one batched forward per step, and
the window forwards of every session's jobs (new pages, prompts) are rows of the same steps; an answer
streams from its request without holding a thread. With ``batch=False``, one thread runs every job in
order and decoding is pulled one token per job so concurrent sessions interleave. Endpoints (JSON; errors as
``{"error": {"type", "message"}}``, see ``errors.py``)::

    GET    /healthz                         liveness (no API key needed)
    POST   /v1/sessions                     new window -> {id, window}
    GET    /v1/sessions/{id}                chunks, evicted, tokens
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/chunks         add text, token ids or an image
    POST   /v1/sessions/{id}/evict|recall|forget|reorder|slide
    POST   /v1/sessions/{id}/fork           copy-on-write branch -> a new session
    POST   /v1/sessions/{id}/generate       JSON, or SSE with stream=true
    POST   /v1/sessions/{id}/logprobs       next-token log-probs (full vector or top-k)
    GET    /v1/sessions/{id}/stats          WindowStats
    POST   /v1/chat/completions             OpenAI-compatible, streaming included
    POST   /v1/completions                  OpenAI's legacy completions (``completions.py``)
    GET    /v1/models
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kamera_engine import Engine, InvalidInputError, KameraError, TextStream
from kamera_engine.scheduler import Scheduler, SchedulerStats
from kamera_engine.vision import VisionEngine

from ..stats import WindowStats
from ..store import default_store_path, open_store
from ..window import ContextWindow
from . import chat as chat_ops
from . import ops
from .completions import router as completions_router
from .errors import (
    AuthenticationError,
    PayloadTooLargeError,
    error_body,
    error_headers,
    exception_body,
    status_for,
)
from .schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkAdd,
    ChunkAdded,
    ChunkChoice,
    ChunkDelta,
    ChunkRef,
    ForkRequest,
    GenerateRequest,
    GenerateResult,
    Health,
    LogprobsRequest,
    LogprobsResult,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RecallRequest,
    ReorderRequest,
    ServerStats,
    SessionCreate,
    SessionCreated,
    SlideRequest,
    SlideResult,
    ToolCallDelta,
    Usage,
    WindowState,
)
from .sessions import Session, SessionRegistry, chat_key, new_session_id
from .sse import encode_event
from .worker import ModelWorker

T = TypeVar("T")
log = logging.getLogger("kamera.server")

#: Paths served without an API key.
OPEN_PATHS = frozenset({"/healthz"})
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ServerState:
    """What the app owns: the engine, the model worker, the sessions and the limits."""

    def __init__(
        self,
        engine: Engine,
        limits: ops.Limits,
        store: object | None,
        *,
        batch: bool = True,
        kv_budget_bytes: int | None = None,
        step_tokens: int | None = None,
        max_batch_rows: int | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits
        # first: a refused limit leaves nothing started. A dropped session's window is closed on the worker
        # (its pending patches stored, its pins released)
        self.sessions = SessionRegistry(
            limits.max_sessions,
            limits.session_ttl_s,
            on_drop=lambda w: self.worker.submit(w.close),
            max_held_tokens=limits.max_held_tokens,
        )
        # every session's answers decode together in the scheduler's batches (engines with a forward of
        # their own kind, e.g. vision, decode one answer at a time on the worker)
        batchable = batch and isinstance(engine, Engine) and engine.batchable
        options = {"kv_budget_bytes": kv_budget_bytes, "step_tokens": step_tokens, "max_batch_rows": max_batch_rows}
        given = {k: v for k, v in options.items() if v is not None}
        for name, value in given.items():
            if value < 1:
                raise InvalidInputError(f"{name} must be at least 1, got {value}")
        scheduler = None
        if batchable:  # built before the store opens: a refused option leaves nothing open
            sizes = {"step_tokens": step_tokens, "max_rows": max_batch_rows}
            sizes = {k: v for k, v in sizes.items() if v is not None}  # those not given keep its defaults
            scheduler = Scheduler(engine, kv_budget_bytes=kv_budget_bytes, **sizes)
        elif given:  # never ignored: without the scheduler nothing would hold the budget
            why = "batch=False" if not batch else f"{type(engine).__name__} decodes one answer at a time"
            verb = "configures" if len(given) == 1 else "configure"
            raise InvalidInputError(
                f"{', '.join(given)} {verb} the batching scheduler, which this server does not run ({why})"
            )
        # one store for every session: a path or URL is opened once here and shared
        self.store = open_store(default_store_path() if store == "default" else store) if store is not None else None
        self._owns_store = self.store is not None and self.store is not store
        self.scheduler = scheduler
        self.worker = ModelWorker(self.scheduler)

    #: What ``max_held_tokens`` counts for a session's window (read it on the window's own thread).
    held_tokens = staticmethod(ops.held_tokens)

    def new_window(self, options: SessionCreate) -> ContextWindow:
        return ContextWindow(
            self.engine,
            policy=options.policy,
            rank=options.rank,
            budget_tokens=options.budget_tokens,
            store=self.store,
            compress=options.compress,
            kv_budget=options.kv_budget,
        )

    async def shutdown(self) -> None:
        """Close every session's window on the worker (after the jobs queued before), stop the worker, then
        flush and close the server's store."""
        self.sessions.clear()  # each window's close is queued on the worker
        await self.worker.run(lambda: None)  # the worker runs jobs in order: every close has run
        await asyncio.to_thread(self.worker.close)
        if self.store is not None:
            self.store.flush()
            if self._owns_store:  # opened here from a path or URL; a ChunkStore passed in stays open
                self.store.close()


class GuardMiddleware:
    """API key (Bearer) and body size, checked before routing so no handler sees a refused request.

    The body is read up to the limit and replayed to the app, so chunked uploads are bounded too.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                exc = AuthenticationError("missing or wrong API key (send 'Authorization: Bearer <key>')")
                response = _error_response(exc, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        too_large = PayloadTooLargeError(f"request body over this server's limit of {self.max_body_bytes} bytes")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _error_response(too_large)(scope, receive, send)
            return
        body = bytearray()
        messages: list[Message] = []
        more = scope["method"] not in ("GET", "HEAD", "DELETE", "OPTIONS")
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _error_response(too_large)(scope, receive, send)
                return
            more = message.get("more_body", False)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _error_response(exc: BaseException, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**(error_headers(exc) or {}), **(headers or {})}
    return JSONResponse(exception_body(exc), status_code=status_for(exc), headers=headers or None)


def _validation_message(exc: RequestValidationError, content_type: str | None) -> tuple[int, str]:
    errors = exc.errors()
    if any(tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes) for e in errors):
        # a body sent as another media type (curl -d sends a form) is never read as JSON
        return 415, f"send the request body as JSON with content-type: application/json (got {content_type or 'none'})"
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return 400, f"request body is not valid JSON: {detail.get('ctx', {}).get('error', detail.get('msg'))}"
    parts = []
    for e in errors[:8]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return 422, "invalid request: " + "; ".join(parts)


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    store: object | None = None,
    max_body_bytes: int = 2 << 20,
    max_image_bytes: int = 8 << 20,
    max_sessions: int = 256,
    max_new_tokens_limit: int = 1024,
    max_session_tokens: int = 32768,
    session_ttl_s: float | None = 3600.0,
    max_held_tokens: int | None = None,
    batch: bool = True,
    kv_budget_bytes: int | None = None,
    step_tokens: int | None = None,
    max_batch_rows: int | None = None,
) -> FastAPI:
    """An app serving ``engine``; every window shares ``store`` (an object, or a path each window opens).

    ``api_key``: require ``Authorization: Bearer <api_key>`` on every path but ``/healthz``. Limits:
    request body bytes (413), decoded image bytes (413), open sessions (429), ``max_new_tokens`` per
    request (422), tokens per session window (413), idle seconds before a session expires, tokens all
    sessions hold together (``max_held_tokens``: placed and seen, ``ops.held_tokens``; 429; None: no limit).
    ``batch``: decode every session's answers together in one scheduler (``False``: one forward per job,
    answers interleaved token by token). ``kv_budget_bytes``: KV the answers being decoded may hold;
    past it new answers wait in a bounded queue, then get 429 with ``Retry-After``. ``step_tokens``: most
    tokens one batched step runs (prompts beyond it are prefilled in chunks; the scheduler's default 512),
    ``max_batch_rows``: most rows in one step (64). These three configure the batching scheduler: with
    ``batch=False``, or an engine that cannot batch, passing them is an error rather than ignored.
    """
    limits = ops.Limits(
        max_body_bytes=max_body_bytes,
        max_image_bytes=max_image_bytes,
        max_sessions=max_sessions,
        max_new_tokens=max_new_tokens_limit,
        max_session_tokens=max_session_tokens,
        session_ttl_s=session_ttl_s,
        max_held_tokens=max_held_tokens,
    )
    state = ServerState(
        engine,
        limits,
        store,
        batch=batch,
        kv_budget_bytes=kv_budget_bytes,
        step_tokens=step_tokens,
        max_batch_rows=max_batch_rows,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await state.shutdown()

    from ..version import __version__

    app = FastAPI(title="Kamera engine server", version=__version__, lifespan=lifespan)
    app.state.kamera = state
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    _install_error_handlers(app)
    app.include_router(completions_router)

    worker, sessions = state.worker, state.sessions

    def check_max_new_tokens(n: int) -> None:
        if n > limits.max_new_tokens:
            raise InvalidInputError(f"max_new_tokens={n} is over this server's limit of {limits.max_new_tokens}")

    # --- sessions -------------------------------------------------------------------------------
    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return Health(model=engine.name)

    @app.get("/v1/engine/stats", response_model=SchedulerStats | None)
    async def engine_stats() -> SchedulerStats | None:
        """The scheduler's batch sizes, queue waits and KV memory (null when the server does not batch)."""
        return state.scheduler.stats() if state.scheduler is not None else None

    @app.get("/v1/server/stats", response_model=ServerStats)
    async def server_stats() -> ServerStats:
        """Open sessions and the tokens they hold, against the server's limits."""
        held = sessions.held
        return ServerStats(
            sessions=len(sessions),
            max_sessions=limits.max_sessions,
            held_tokens=held.total,
            max_held_tokens=held.limit,
            vision_cache=engine.vision_cache.stats.model_copy() if isinstance(engine, VisionEngine) else None,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.name)])

    @app.post("/v1/sessions", response_model=SessionCreated, status_code=201)
    async def create_session(options: SessionCreate | None = None) -> SessionCreated:
        options = options or SessionCreate()
        sessions.reserve()
        session = sessions.add(state.new_window(options))
        return SessionCreated(id=session.id, window=ops.window_state(session.id, session.window))

    @app.get("/v1/sessions/{session_id}", response_model=WindowState)
    async def get_session(session_id: str) -> WindowState:
        s = sessions.get(session_id)
        return await worker.run_keyed(s.id, ops.window_state, s.id, s.window)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str) -> Response:
        sessions.delete(session_id)
        return Response(status_code=204)

    async def on_window(key: str, window: ContextWindow, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in ``key``'s lane, then count what ``window`` holds (``HeldTokens.settle``)."""
        ticket = sessions.held.ticket(key)  # this session's, not a later one's under the same key

        def job() -> T:
            try:
                return fn(*args)
            finally:
                try:
                    sessions.held.settle(key, ops.held_tokens(window), ticket)
                except Exception:  # never in place of the job's own outcome; the next job settles it
                    log.exception("counting the tokens of session %s failed", key)

        return await worker.run_keyed(key, job)

    def claim(key: str) -> Callable[[int], None]:
        return partial(sessions.held.claim, key)

    @app.get("/v1/sessions/{session_id}/stats", response_model=WindowStats)
    async def stats(session_id: str) -> WindowStats:
        s = sessions.get(session_id)
        return await worker.run_keyed(s.id, s.window.stats)

    # --- chunk operations ------------------------------------------------------------------------
    @app.post("/v1/sessions/{session_id}/chunks", response_model=ChunkAdded, status_code=201)
    async def add_chunk(session_id: str, req: ChunkAdd) -> ChunkAdded:
        s = sessions.get(session_id)
        cid, window = await on_window(s.id, s.window, ops.add_chunk, s.id, s.window, req, limits, claim(s.id))
        return ChunkAdded(chunk=cid, window=window)

    def _then_state(s: Session, fn: Any, *args: Any) -> WindowState:
        fn(*args)
        return ops.window_state(s.id, s.window)

    @app.post("/v1/sessions/{session_id}/evict", response_model=WindowState)
    async def evict(session_id: str, req: ChunkRef) -> WindowState:
        s = sessions.get(session_id)
        return await on_window(s.id, s.window, _then_state, s, s.window.evict, req.chunk)

    @app.post("/v1/sessions/{session_id}/recall", response_model=WindowState)
    async def recall(session_id: str, req: RecallRequest) -> WindowState:
        s = sessions.get(session_id)
        return await on_window(s.id, s.window, ops.recall, s.id, s.window, req.chunk, req.at, limits, claim(s.id))

    @app.post("/v1/sessions/{session_id}/forget", response_model=WindowState)
    async def forget(session_id: str, req: ChunkRef) -> WindowState:
        """Forget an evicted chunk for good: it is no longer recallable, and no longer held (``held.py``)."""
        s = sessions.get(session_id)
        return await on_window(s.id, s.window, _then_state, s, s.window.forget, req.chunk)

    @app.post("/v1/sessions/{session_id}/reorder", response_model=WindowState)
    async def reorder(session_id: str, req: ReorderRequest) -> WindowState:
        s = sessions.get(session_id)
        return await on_window(s.id, s.window, _then_state, s, s.window.reorder, req.order)

    @app.post("/v1/sessions/{session_id}/slide", response_model=SlideResult)
    async def slide(session_id: str, req: SlideRequest | None = None) -> SlideResult:
        s = sessions.get(session_id)
        req = req or SlideRequest()  # no body: slide one

        def job() -> SlideResult:
            removed = [str(c) for c in s.window.slide(req.n)]
            return SlideResult(removed=removed, window=ops.window_state(s.id, s.window))

        return await on_window(s.id, s.window, job)

    @app.post("/v1/sessions/{session_id}/fork", response_model=SessionCreated, status_code=201)
    async def fork(session_id: str, _: ForkRequest | None = None) -> SessionCreated:
        s = sessions.get(session_id)
        sessions.held.check(sessions.held.of(s.id))  # before reserve, which may displace a chat window
        sessions.reserve()  # before the fork: a refused fork leaves nothing behind
        child_id = new_session_id()
        sessions.held.open(child_id, family_of=s.id)  # the child's tokens are claimed before it exists

        made: list[ContextWindow] = []  # the child, once the job has forked it

        def job() -> ContextWindow:
            sessions.held.claim(child_id, ops.held_tokens(s.window))  # the count that decides
            made.append(s.window.fork())
            return made[0]

        try:
            child_window = await worker.run_keyed(s.id, job)
        except BaseException as exc:
            sessions.held.close(child_id, shared=False)
            if made or isinstance(exc, asyncio.CancelledError):
                # a caller that gave up does not stop a job already running: the child it makes is closed
                # after it (a barrier job), so its pins on the store are not leaked
                worker.submit(_close_all, made)
            raise
        child = sessions.add(child_window, key=child_id, family_of=s.id)
        try:
            state_now = await on_window(child.id, child_window, ops.window_state, child.id, child_window)
        except BaseException:
            sessions.discard(child, shared=False)  # nobody learns its id (it added nothing): closed now
            raise
        return SessionCreated(id=child.id, window=state_now)

    # --- using the window ------------------------------------------------------------------------
    @app.post("/v1/sessions/{session_id}/logprobs", response_model=LogprobsResult)
    async def logprobs(session_id: str, req: LogprobsRequest) -> LogprobsResult:
        s = sessions.get(session_id)
        return await worker.run_keyed(s.id, ops.logprobs, s.window, req.prompt, req.top_k)

    @app.post(
        "/v1/sessions/{session_id}/generate",
        response_model=GenerateResult,
        responses={200: {"content": {"text/event-stream": {}}, "description": "SSE when stream=true"}},
    )
    async def generate(session_id: str, req: GenerateRequest, request: Request) -> Any:
        s = sessions.get(session_id)
        check_max_new_tokens(req.max_new_tokens)
        pieces, first = await worker.run_keyed(s.id, ops.start_generate, s.window, req)
        if req.stream:
            return StreamingResponse(
                _sse_generate(worker, pieces, first, s.id), media_type="text/event-stream", headers=_SSE_HEADERS
            )
        text = [first] if first is not None else []
        text += await _collect(request, worker.iterate(pieces, key=s.id))
        return GenerateResult(text="".join(text), tokens=pieces.tokens, finish_reason=_finish(pieces))

    # --- OpenAI-compatible -----------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        params = chat_ops.sampling(req, limits)
        held: Session | None = None  # the registered window the messages sync into, if any
        made_here = False
        if req.session is not None:
            held = sessions.get(req.session)
        elif req.user is not None:
            held = sessions.find(chat_key(req.user), kind="chat")
            if held is None:
                sessions.reserve()
                held = sessions.add(ContextWindow(engine, store=state.store), key=chat_key(req.user), kind="chat")
                made_here = True
        lease: str | None = None  # a window for this request only: counted until its answer ends

        def release() -> None:
            if lease is not None:
                sessions.held.close(lease, shared=False)

        if held is None:
            lease = f"request-{uuid.uuid4().hex}"
            sessions.held.open(lease)
            try:
                start = await worker.run_keyed(
                    None, chat_ops.start_chat, engine, None, req, params, limits, claim(lease)
                )
            except asyncio.CancelledError:
                worker.submit(release)  # its job runs on, and is counted until it ends (a barrier job after it)
                raise
            except BaseException:
                release()
                raise
        else:
            w = held.window
            held.users += 1
            try:
                # a user's window caches what its client sends: messages no longer listed may go, if that is enough
                job = partial(chat_ops.start_chat, let_go=held.kind == "chat")
                start = await on_window(held.id, w, job, engine, w, req, params, limits, claim(held.id))
            except BaseException:
                if made_here and held.users == 1:  # a chat window made for a refused request does not stay
                    sessions.discard(held)
                raise
            finally:
                held.users -= 1
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), engine.name
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            body = _sse_chat(worker, start, cid, created, model, include_usage, req)
            return _StreamThen(body, release, media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            text = (start.first or "") + "".join(await _collect(request, worker.iterate(start.pieces)))
        finally:
            release()
        message, finish = chat_ops.answer_message(req, text, _finish(start.pieces))
        return ChatCompletion(
            id=cid,
            created=created,
            model=model,
            choices=[ChatChoice(message=message, finish_reason=finish)],
            usage=_usage(start),
        )

    return app


async def _collect(request: Request, pieces: AsyncIterator[str]) -> list[str]:
    """The answer's pieces; decoding stops (and the iterator is closed on the worker) if the client leaves."""
    out: list[str] = []
    async with aclosing(pieces):
        async for piece in pieces:
            out.append(piece)
            if await request.is_disconnected():
                break
    return out


def _usage(start: chat_ops.ChatStart) -> Usage:
    completion = start.pieces.tokens  # the tokens decoded (the text re-tokenised can count otherwise)
    return Usage(
        prompt_tokens=start.prompt_tokens,
        completion_tokens=completion,
        total_tokens=start.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=start.cached_tokens),
    )


def _close_all(windows: list[ContextWindow]) -> None:
    for window in windows:
        window.close()


class _StreamThen(StreamingResponse):
    """A streamed response that calls ``done()`` once it has been sent, however that ended: drained, failed,
    or its client gone before the first byte or during the stream."""

    def __init__(self, body: AsyncIterator[bytes], done: Callable[[], None], **options: Any) -> None:
        super().__init__(body, **options)
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with aclosing(self.body_iterator):  # type: ignore[type-var]  # closed now, not once collected
                await super().__call__(scope, receive, send)
        finally:
            self._done()


def _finish(pieces: TextStream) -> Any:
    return pieces.finish_reason or "stop"  # None only if decoding was cut short


async def _sse_generate(worker: ModelWorker, pieces: TextStream, first: str | None, key: str) -> AsyncIterator[bytes]:
    """``token`` events with each piece, then ``done`` with the whole text, the tokens decoded and the
    finish reason, or ``error``."""
    text: list[str] = []
    try:
        if first is not None:
            text.append(first)
            yield encode_event({"text": first}, "token")
        async for piece in worker.iterate(pieces, key=key):
            text.append(piece)
            yield encode_event({"text": piece}, "token")
        done = {"text": "".join(text), "tokens": pieces.tokens, "finish_reason": _finish(pieces)}
        yield encode_event(done, "done")
    except Exception as exc:  # headers are sent: report in-band
        yield encode_event(exception_body(exc), "error")


async def _sse_chat(
    worker: ModelWorker,
    start: chat_ops.ChatStart,
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
    req: ChatCompletionRequest,
) -> AsyncIterator[bytes]:
    """OpenAI's stream: a role delta, content deltas, a finish chunk, optionally usage, then ``[DONE]``.
    With tools the answer is held back until it is known to be a call (one ``tool_calls`` delta) or text."""

    def chunk(delta: ChunkDelta, finish: Any = None) -> bytes:
        c = ChatCompletionChunk(
            id=cid, created=created, model=model, choices=[ChunkChoice(delta=delta, finish_reason=finish)]
        )
        return encode_event(c.model_dump(mode="json", exclude_none=True))

    try:
        yield chunk(ChunkDelta(role="assistant", content=""))
        held = chat_ops.request_tools(req) != []
        text = [] if start.first is None else [start.first]
        if start.first is not None and not held:
            yield chunk(ChunkDelta(content=start.first))
        async for piece in worker.iterate(start.pieces):
            text.append(piece)
            if not held:
                yield chunk(ChunkDelta(content=piece))
        usage = _usage(start)
        finish = _finish(start.pieces)
        if held:
            message, finish = chat_ops.answer_message(req, "".join(text), finish)
            if message.tool_calls:
                calls = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(message.tool_calls)]
                yield chunk(ChunkDelta(tool_calls=calls))
            elif message.content:
                yield chunk(ChunkDelta(content=message.content))
        yield chunk(ChunkDelta(), finish)
        if include_usage:
            tail = ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=usage)
            yield encode_event(tail.model_dump(mode="json", exclude_none=True))
    except Exception as exc:
        yield encode_event(exception_body(exc))
    yield encode_event("[DONE]")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KameraError)
    async def kamera_error(_: Request, exc: KameraError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message = _validation_message(exc, request.headers.get("content-type"))
        return JSONResponse(error_body("InvalidInputError", message), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        names = {404: "NotFound", 405: "MethodNotAllowed"}
        return JSONResponse(
            error_body(names.get(exc.status_code, "HTTPError"), str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(exc)
