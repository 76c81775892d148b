"""The fleet's HTTP ingress: reads which session a request is for and hands it to the replica holding it.

Each request carries its session id as Ray Serve's multiplexed model id; ``SessionRouter`` (router.py)
sends it to the session's owner, and a session no running replica owns to the replica holding the fewest
sessions (the least loaded). New sessions get
their id here, before routing, so the create lands on the least-loaded replica under its final id. A
request whose replica dies before it answered is retried on another (same request id: a mutating request
the dead replica had already journaled is answered from the journal, not applied twice); the session is
rebuilt there from the journal, so the client sees a slower answer, not an error. A whole answer (JSON) is
read to its end before it is passed on, so a replica dying between its first and last bytes is retried
too; only a server-sent event stream is relayed as it comes (what was sent cannot be taken back).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

#: ``GET`` it (``?session=<id>`` optional) for the fleet's counters; see ``FleetIngress.fleet_stats``.
STATS_PATH = "/v1/fleet/stats"
_SESSION_PATH = re.compile(r"^/v1/sessions/(ks_[A-Za-z0-9_-]+)(/.*)?$")
#: Failures that mean "the replica went away": retried on another replica.
_GONE: tuple[type[BaseException], ...] = (RayActorError,)
try:  # names of Ray 2.60; older releases raise RayActorError only
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    _GONE += (ActorDiedError, ActorUnavailableError)
except ImportError:  # pragma: no cover
    pass


def route_key(method: str, path: str, body: bytes) -> tuple[str | None, bool]:
    """(the session a request routes by, whether it creates a new session)."""
    if method == "POST" and path.rstrip("/") == "/v1/sessions":
        return "ks_" + secrets.token_urlsafe(24), True
    m = _SESSION_PATH.match(path)
    if m:
        return m.group(1), False
    if path == "/v1/chat/completions" and body:
        try:
            req = json.loads(body)
        except ValueError:
            return None, False
        if isinstance(req, dict):
            if isinstance(req.get("session"), str):
                return req["session"], False
            if isinstance(req.get("user"), str):  # a chat window kept per user: affine, rebuilt from messages
                return "chat:" + hashlib.sha256(req["user"].encode()).hexdigest()[:32], False
    return None, False


class FleetIngress:
    """A Ray Serve deployment class: every HTTP request of the fleet passes here."""

    def __init__(self, replicas: Any, *, retry_s: float = 60.0) -> None:
        self.replicas = replicas
        self.retry_s = retry_s
        self.retries = 0

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.url.path.rstrip("/") == STATS_PATH:
            return JSONResponse(await self.fleet_stats(request.query_params.get("session", "")))
        body = await request.body()
        session, create = route_key(request.method, request.url.path, body)
        req = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query.encode(),
            "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")],
            "body": body,
            "session": session,
            "create": create,
            "request": uuid.uuid4().hex if request.method in ("POST", "DELETE") else "",
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_s
        delay = 0.2
        while True:
            handle = self.replicas.options(stream=True, multiplexed_model_id=session or "")
            stream = handle.handle.remote(req)
            try:
                head = await stream.__anext__()
                if _event_stream(head):
                    first, body = await _next_or_none(stream), None
                else:  # the whole answer, so that a replica dying before its end is retried as well
                    first, body = None, b"".join([piece async for piece in stream])
            except (*_GONE, RayTaskError) as exc:
                if not _gone(exc) or loop.time() > deadline:
                    raise
                self.retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            break
        if body is not None:
            headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
            return Response(body, status_code=head["status"], headers=headers)
        return _response(head, first, stream)

    async def fleet_stats(self, session: str = "") -> dict[str, Any]:
        """The ingress's retries and one replica's counters: the replica holding ``session`` when given
        (its store's ``refused_auth`` counts forged entries refused there), else the least-loaded one."""
        replica = await self.replicas.options(multiplexed_model_id=session).whoami.remote()
        return {"ingress": {"retries": self.retries}, "replica": replica}


def _gone(exc: BaseException) -> bool:
    """A replica that died (its actor) rather than a request that failed on a live one."""
    if isinstance(exc, _GONE):
        return True
    cause = getattr(exc, "cause", None)
    return isinstance(cause, _GONE)


async def _next_or_none(stream: Any) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _event_stream(head: dict[str, Any]) -> bool:
    """Whether a replica's answer is a server-sent event stream (relayed piece by piece)."""
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head["headers"])


def _response(head: dict[str, Any], first: bytes | None, stream: Any) -> Response:
    headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}
    media = headers.pop("content-type", None)

    async def rest() -> AsyncIterator[bytes]:
        if first is not None:
            yield first
        async for piece in stream:
            yield piece

    return StreamingResponse(rest(), status_code=head["status"], headers=headers, media_type=media)
