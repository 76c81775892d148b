"""The fleet ingress's retries, without a cluster: a replica that dies mid-answer is retried elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from starlette.requests import Request

from kamera_fleet.ingress import FleetIngress

JSON_HEAD = {"status": 200, "headers": [("content-type", "application/json")]}
SSE_HEAD = {"status": 200, "headers": [("content-type", "text/event-stream")]}


class _Replicas:
    """Stands in for a Serve handle: each call plays the next script (pieces, then maybe a death)."""

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.calls: list[dict[str, Any]] = []

    def options(self, **_: Any) -> _Replicas:
        return self

    @property
    def handle(self) -> _Replicas:
        return self

    def remote(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        self.calls.append(req)
        script = self.scripts.pop(0)

        async def play() -> AsyncIterator[Any]:
            for piece in script:
                if isinstance(piece, BaseException):
                    raise piece
                yield piece

        return play()


def _request(path: str) -> Request:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"prompt": "hi"}', "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": [], "raw_path": b""}
    return Request(scope, receive)


async def _body(response: Any) -> bytes:
    if hasattr(response, "body_iterator"):
        return b"".join([piece async for piece in response.body_iterator])
    return bytes(response.body)


def _answer(ingress: FleetIngress, path: str) -> tuple[Any, bytes]:
    async def go() -> tuple[Any, bytes]:
        response = await ingress(_request(path))
        return response, await _body(response)

    return asyncio.run(go())


def test_a_replica_dying_between_first_and_last_bytes_of_an_answer_is_retried() -> None:
    dead = RayActorError()
    replicas = _Replicas([[JSON_HEAD, b'{"text": "par', dead], [JSON_HEAD, b'{"text": "partial"', b"}"]])
    ingress = FleetIngress(replicas, retry_s=5)
    response, body = _answer(ingress, "/v1/sessions/ks_abc/generate")
    assert body == b'{"text": "partial"}' and response.status_code == 200
    assert ingress.retries == 1 and len(replicas.calls) == 2
    assert replicas.calls[0]["request"] == replicas.calls[1]["request"]  # the same id: the journal dedups it


def test_an_event_stream_is_relayed_as_it_comes() -> None:
    replicas = _Replicas([[SSE_HEAD, b"data: a\n\n", b"data: b\n\n"]])
    response, body = _answer(FleetIngress(replicas), "/v1/sessions/ks_abc/generate")
    assert response.media_type == "text/event-stream" and body == b"data: a\n\ndata: b\n\n"
