"""A client that leaves stops the work: decoding of a non-streamed answer ends when the connection does
(tiny random model over the default model's tokenizer, real uvicorn on loopback)."""

from __future__ import annotations

import time

import httpx
import torch
import transformers as T

from kamera_engine.default_model import ensure_converted
from kamera_sdk import Engine
from kamera_sdk.server import create_app, ops
from tests.server.conftest import run_server


def _tiny() -> Engine:
    tok = T.AutoTokenizer.from_pretrained(str(ensure_converted()))
    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=4096,
    )
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return Engine(model.eval(), tok, name="tiny-llama-chat")


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
    app = create_app(_tiny(), api_key="k", max_new_tokens_limit=4096)
    with run_server(app, "k") as server:
        auth = {"Authorization": "Bearer k"}
        c = httpx.Client(base_url=server.url, headers=auth, timeout=60)
        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/chunks", json={"text": "The sky is blue. " * 20})
        body = {"prompt": "Q", "max_new_tokens": 4096}
        try:
            httpx.post(f"{server.url}/v1/sessions/{sid}/generate", headers=auth, json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        left = time.monotonic()
        time.sleep(2.0)
        after = sum(1 for t in decoded if t > left + 0.5)
        assert decoded and after == 0  # it decoded, and stopped once the client was gone
        assert c.get(f"/v1/sessions/{sid}").status_code == 200  # the session is intact
