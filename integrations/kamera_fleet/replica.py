"""One fleet replica: an ``Engine``, the ``kamera serve`` app around it, and its sessions' journal.

Requests arrive from the ingress already parsed (method, path, headers, body) and run through the very
FastAPI app ``create_app`` builds, called in-process over ASGI, so every route, limit and error of
``kamera serve`` holds unchanged. Around the app, per session: before a request, the replica checks that
its window is the journal's latest version and rebuilds it from the journal and the store when it is
absent or stale; after a request that changed the window, it journals the new state. A session's
requests on one replica run one at a time (a lock per session), as a client's do.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from kamera_sdk import ContextWindow, Engine, KameraError, SessionCreate, create_app, open_store

from .journal import JournalLostError, SessionJournal, WindowRecord

#: Response header naming the replica that answered a session's request.
REPLICA_HEADER = "x-kamera-replica"

Head = dict[str, Any]


async def call_asgi(app: Any, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[Head | bytes]:  # fmt: skip
    """Run one request through an ASGI app in this process: the response head, then body pieces as sent."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}  # fmt: skip
    queue: asyncio.Queue[Any] = asyncio.Queue()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the app asks only to notice a disconnect: the ingress owns that
        return {"type": "http.disconnect"}  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        await queue.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while True:
            message = await queue.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                headers = [(k.decode(), v.decode()) for k, v in message["headers"]]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        if not task.done():
            task.cancel()


def _json_response(status: int, body: object) -> list[Head | bytes]:
    data = json.dumps(body).encode()
    return [{"status": status, "headers": [("content-type", "application/json")]}, data]


def _spec_add(win: ContextWindow, cid: str, spec: dict[str, Any]) -> None:
    """Add one journaled chunk to ``win`` the way it was first added (so it gets the same content id)."""
    kind, text = spec["kind"], spec.get("text")
    if kind == "text" and text:
        got = win.add_text(text)
    elif kind.startswith("text#") and text:
        got = win.add_text(text, copy=int(kind.removeprefix("text#")))
    elif kind in ("image", "video"):
        raise JournalLostError(f"chunk {cid} is a {kind}: the fleet journal rebuilds text and token chunks only")
    else:
        got = win.add(spec["token_ids"], kind=kind, text=text)
    if str(got) != cid:
        raise JournalLostError(f"journaled chunk {cid} came back as {got}: the engine's tokenizer differs")


class KameraReplica:
    """A Ray Serve deployment class (wrapped by ``deployment()``): one engine, its sessions, the journal."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        store_url: str,
        *,
        secret: str | None = None,
        journal_prefix: str = "kamera:fleet:",
        session_ttl_s: float | None = 3600.0,
        app_options: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine_factory()
        self.store = open_store(store_url, secret=secret)
        self.app = create_app(self.engine, store=self.store, session_ttl_s=session_ttl_s, **(app_options or {}))
        self.state = self.app.state.kamera
        self.journal = SessionJournal(store_url, prefix=journal_prefix, ttl_s=session_ttl_s)
        self.versions: dict[str, int] = {}  # session -> journal version its local window reflects
        self.known: dict[str, set[str]] = {}  # session -> chunk ids already journaled
        self.options: dict[str, dict[str, Any]] = {}  # session -> the options it was opened with (JSON)
        self.locks: dict[str, asyncio.Lock] = {}
        self.rebuilt = 0
        self.name = _replica_name()

    # --- the router's view: session ids this replica holds -----------------------------------------
    @serve.multiplexed(max_num_models_per_replica=-1)
    async def hold(self, session: str) -> str:
        """Report ``session`` as held here (Ray Serve's multiplexing routes its requests to this replica)."""
        return session

    async def whoami(self) -> dict[str, Any]:
        """This replica's name, the sessions it holds, how many it rebuilt and its store's counters (a forged
        entry shows as ``refused_auth``)."""
        live = [s for s in self.versions if self._local(s) is not None]
        store = self.store.stats().model_dump(mode="json")
        return {"replica": self.name, "sessions": sorted(live), "rebuilt": self.rebuilt, "store": store}

    # --- requests -------------------------------------------------------------------------------------
    async def handle(self, req: dict[str, Any]) -> AsyncIterator[Head | bytes]:
        """One HTTP request (from the ingress): the response head, then its body pieces."""
        session = req.get("session")
        if session is None or not session.startswith("ks_"):  # stateless, or a chat window keyed by user
            async for piece in self._forward(req):
                yield piece
            return
        if session not in self.locks:
            self.locks[session] = asyncio.Lock()
        async with self.locks[session]:
            async for piece in self._session_request(session, req):
                if isinstance(piece, dict):  # which replica answered (tests, debugging)
                    piece = {**piece, "headers": [*piece["headers"], (REPLICA_HEADER, self.name)]}
                yield piece

    async def _session_request(self, session: str, req: dict[str, Any]) -> AsyncIterator[Head | bytes]:
        if req.get("create"):
            for piece in await self._create(session, req):
                yield piece
            return
        if req["method"] == "DELETE" and self._local(session) is None:  # nothing to rebuild: drop the journal
            if self.journal.version(session) is None:
                message = f"session {session} is on no live replica and the fleet journal holds no record of it"
                for piece in _json_response(404, {"error": {"type": "SessionNotFoundError", "message": message}}):
                    yield piece
            else:
                self.journal.delete(session)
                yield {"status": 204, "headers": []}
            return
        try:
            record = await self._ensure(session)
        except (JournalLostError, KameraError) as exc:
            for piece in _json_response(404, {"error": {"type": "SessionNotFoundError", "message": str(exc)}}):
                yield piece
            return
        rid = req.get("request") or ""
        if record is None and rid:
            record = self.journal.read(session)
        if record is not None and rid and record.request == rid and record.response:  # a retry, applied already
            for piece in _json_response(200, json.loads(record.response)):
                yield piece
            return
        if req["method"] == "DELETE":
            self.journal.delete(session)
            for held in (self.versions, self.known, self.options):
                held.pop(session, None)
        status, body = 0, bytearray()
        async for piece in self._forward(req):
            if isinstance(piece, dict):
                status = piece["status"]
            elif len(body) < 1 << 20:
                body += piece
            yield piece
        if req["method"] == "POST" and status < 300 and self._local(session) is not None:
            await self._journal_after(session, req, status, bytes(body))

    async def _forward(self, req: dict[str, Any]) -> AsyncIterator[Head | bytes]:
        headers = [(k.encode(), v.encode()) for k, v in req["headers"]]
        async for piece in call_asgi(self.app, req["method"], req["path"], req["query"], headers, req["body"]):
            yield piece

    def _local(self, session: str) -> Any:
        return self.state.sessions.find(session, kind="session")

    async def _create(self, session: str, req: dict[str, Any]) -> list[Head | bytes]:
        try:
            options = SessionCreate.model_validate_json(req["body"] or b"{}")
        except ValueError as exc:
            return _json_response(422, {"error": {"type": "InvalidInputError", "message": f"invalid request: {exc}"}})
        try:
            self.state.sessions.reserve()
            window = self.state.new_window(options)
        except KameraError as exc:
            status = 429 if type(exc).__name__ == "LimitExceededError" else 422
            return _json_response(status, {"error": {"type": type(exc).__name__, "message": str(exc)}})
        self.state.sessions.add(window, key=session)
        record = WindowRecord(session, 1, options.model_dump(mode="json"), [], [])
        self.journal.write(record, expected=0, op="create", new_chunks={})
        self.journal.set_owner(session, self.name)
        self.versions[session], self.known[session], self.options[session] = 1, set(), record.options
        await self.hold(session)
        state = await self._state_json(session)
        return _json_response(201, {"id": session, "window": state})

    async def _state_json(self, session: str) -> Any:
        pieces = [p async for p in self._forward({"method": "GET", "path": f"/v1/sessions/{session}", "query": b"",
                                                  "headers": [], "body": b""})]  # fmt: skip
        return json.loads(b"".join(p for p in pieces if isinstance(p, bytes)))

    async def _ensure(self, session: str) -> WindowRecord | None:
        """Make the local window the journal's latest version: rebuild it when absent or stale."""
        version = self.journal.version(session)
        local = self._local(session)
        if version is None:
            if local is not None:  # the journal was lost but the window lives here: journal it whole on change
                self.versions[session], self.known[session] = 0, set()
                return None
            raise JournalLostError(
                f"session {session} cannot be rebuilt: it is on no live replica and the fleet journal holds no "
                "record of it (never created, deleted, expired, or its journal was lost)"
            )
        if local is not None and self.versions.get(session) == version:
            return None  # current
        record = self.journal.read(session)
        if record is None:
            raise JournalLostError(f"session {session}: its journal vanished while it was read")
        t0 = time.perf_counter()
        if local is not None:
            self.state.sessions.delete(session)
        window, tokens, held = await self.state.worker.run(self._build, record)
        sessions = self.state.sessions
        sessions.reserve()
        sessions.add(window, key=session)
        sessions.held.settle(session, held, sessions.held.ticket(session))  # counted against max_held_tokens
        self.versions[session], self.known[session] = record.version, set(record.chunks)
        self.options[session] = record.options
        self.rebuilt += 1
        self.journal.set_owner(session, self.name)
        await self.hold(session)
        seconds = time.perf_counter() - t0
        self.journal.record_rebuild({"session": session, "seconds": seconds, "tokens_computed": tokens,
                                     "window_tokens": record.tokens(), "replica": self.name})  # fmt: skip
        return record

    def _build(self, record: WindowRecord) -> tuple[ContextWindow, int, int]:
        """The journaled window, built fresh here (model thread): evicted chunks first (added, evicted), then
        the active ones in order. Canonicals come from the store; returns the window, the tokens computed to
        build it and the tokens it holds."""
        missing = [c for c in record.evicted + record.order if c not in record.chunks]
        if missing:
            raise JournalLostError(f"session {record.session} cannot be rebuilt: its journal lacks chunk {missing[0]}")
        window = self.state.new_window(SessionCreate.model_validate(record.options))
        try:
            for cid in record.evicted:
                _spec_add(window, cid, record.chunks[cid])
                window.evict(cid)
            for cid in record.order:
                _spec_add(window, cid, record.chunks[cid])
        except JournalLostError as exc:
            window.close()
            raise JournalLostError(f"session {record.session} cannot be rebuilt: {exc}") from exc
        return window, window.stats().ingest_tokens, self.state.held_tokens(window)

    async def _journal_after(self, session: str, req: dict[str, Any], status: int, body: bytes) -> None:
        """Journal the window of ``session`` (and a fork's child) when a request changed it."""
        op = req["path"].rstrip("/").rsplit("/", 1)[-1]
        if op == "fork":
            child = json.loads(body)["id"]
            self.known[child] = set()  # the child's journal is its own: every chunk it holds is written to it
            self.options[child] = self.options.get(session, {})
            await self._write(child, op="fork", expected=0, request="", response="", parent=session,
                              options=self.options[child], force=True)  # fmt: skip
            self.journal.set_owner(child, self.name)
            await self.hold(child)
            return
        response = body.decode() if req.get("request") and len(body) < 1 << 16 else ""
        await self._write(session, op=op, expected=self.versions.get(session, 0), request=req.get("request") or "",
                          response=response, parent="", options=None)  # fmt: skip

    async def _write(self, session: str, *, op: str, expected: int, request: str, response: str, parent: str,
                     options: dict[str, Any] | None, force: bool = False) -> None:  # fmt: skip
        found = self._local(session)
        if found is None:
            return
        known = self.known.setdefault(session, set())

        def snapshot() -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
            win = found.window
            win.flush()  # patches formed by this request go to the shared store now, not when the window closes
            order, evicted = [str(c) for c in win.chunks], [str(c) for c in win.evicted]
            new = {}
            for cid in order + evicted:
                if cid not in known:
                    c = win.chunk(cid)
                    new[cid] = {"kind": c.kind, "text": c.text, "token_ids": list(c.token_ids)}
            return order, evicted, new

        order, evicted, new = await self.state.worker.run(snapshot)
        if options is None:
            head = self.journal.read(session)
            options = head.options if head is not None else self.options.get(session, {})
            if head is not None and not force and head.order == order and head.evicted == evicted and not new:
                return  # nothing changed (a generate, a refused op)
        record = WindowRecord(session, expected + 1, options, order, evicted, parent=parent, request=request,
                              response=response)  # fmt: skip
        if self.journal.write(record, expected=expected, op=op, new_chunks=new):
            self.versions[session] = expected + 1
            known.update(new)
        else:  # another replica moved it: this copy is stale, the next request rebuilds it
            self.versions.pop(session, None)

    def __del__(self) -> None:
        try:
            self.store.flush()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass


def _replica_name() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (unit use)
        return "local"
