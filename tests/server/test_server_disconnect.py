"""A client that leaves stops the work: decoding of a non-streamed answer ends when the connection does
(tiny random model over the default model's tokenizer, real uvicorn on loopback)."""

from __future__ import annotations

import time

import httpx

from kamera_sdk.server import create_app, ops
from tests.conftest import tiny_chat_engine
from tests.server.conftest import run_server


def test_a_non_streamed_answer_stops_when_the_client_leaves(monkeypatch) -> None:
    decoded: list[float] = []
    start = ops.start_generate

    def counting(win, req):
        pieces, first = start(win, req)

        def each():
            for p in pieces:
                decoded.append(time.monotonic())
                yield p

        return each(), first

    monkeypatch.setattr(ops, "start_generate", counting)
    app = create_app(tiny_chat_engine(), api_key="k", max_new_tokens_limit=4096)
    with run_server(app, "k") as server:
        auth = {"Authorization": "Bearer k"}
        c = httpx.Client(base_url=server.url, headers=auth, timeout=60)
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/chunks", json={"text": "The sky is blue. " * 20})
        body = {"prompt": "Q", "max_new_tokens": 3500}  # within the 4096-token context
        try:
            httpx.post(f"{server.url}/v1/sessions/{sid}/generate", headers=auth, json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        left = time.monotonic()
        time.sleep(2.0)
        after = sum(1 for t in decoded if t > left + 0.5)
        assert decoded and after == 0  # it decoded, and stopped once the client was gone
        assert c.get(f"/v1/sessions/{sid}").status_code == 200  # the session is intact
