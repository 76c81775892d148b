"""The model's context length over HTTP: an open answer ends where the context does, an explicit one past
it is refused (422) and changes nothing (tiny random model over the default model's tokenizer, real uvicorn)."""

from __future__ import annotations

import httpx

from kamera_sdk.server import create_app
from kamera_sdk.server.chat import turn_format
from tests.conftest import tiny_chat_engine
from tests.server.conftest import run_server


def test_requests_are_held_to_the_model_context() -> None:
    engine = tiny_chat_engine()
    history = [{"role": "user", "content": "The sky is blue. " * 8}, {"role": "assistant", "content": "Noted."}]
    messages = [*history, {"role": "user", "content": "What colour is the sky?"}]
    with run_server(create_app(engine, api_key="k"), "k") as server:
        c = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=60)
        open_ended = c.post("/v1/chat/completions", json={"messages": messages, "user": "u"}).json()
        used = open_ended["usage"]["prompt_tokens"]
        # usage counts the tokens decoded: the default 256, not the answer's text re-tokenised (268 here)
        assert (open_ended["usage"]["completion_tokens"], open_ended["choices"][0]["finish_reason"]) == (256, "length")
        engine.context_length = used + 5  # room for five answer tokens
        r = c.post("/v1/chat/completions", json={"messages": messages, "user": "u", "temperature": 0}).json()
        assert r["usage"]["completion_tokens"] == 5
        assert r["choices"][0]["finish_reason"] == "length"  # ended by the context, and says so

        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
        assert r.status_code == 422
        error = r.json()["error"]
        assert error["type"] == "ContextLengthError"
        assert f"{used} tokens + 6 to generate exceed the model's context length of {used + 5}" in error["message"]
        assert "lower max_tokens" in error["message"]  # the chat request's own field

        longer = [*history, {"role": "user", "content": "More. " * 40}, {"role": "user", "content": "Q?"}]
        r = c.post("/v1/chat/completions", json={"messages": longer, "user": "u"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "ContextLengthError"
        chat_sid = c.post("/v1/sessions").json()["id"]
        c.post("/v1/chat/completions", json={"messages": messages, "session": chat_sid, "max_tokens": 1})
        state = c.get(f"/v1/sessions/{chat_sid}").json()
        r = c.post("/v1/chat/completions", json={"messages": longer, "session": chat_sid})
        assert r.status_code == 422 and r.json()["error"]["type"] == "ContextLengthError"
        assert c.get(f"/v1/sessions/{chat_sid}").json() == state  # refused before the sync: nothing changed
        r = c.post("/v1/chat/completions", json={"messages": messages, "user": "u", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        sid = c.post("/v1/sessions").json()["id"]
        c.post(f"/v1/sessions/{sid}/chunks", json={"text": "The sky is blue. " * 8})
        state = c.get(f"/v1/sessions/{sid}").json()
        r = c.post(f"/v1/sessions/{sid}/generate", json={"prompt": "Q", "max_new_tokens": used})
        assert r.status_code == 422 and r.json()["error"]["type"] == "ContextLengthError"
        assert c.get(f"/v1/sessions/{sid}").json() == state  # the session is intact
        r = c.post(f"/v1/sessions/{sid}/generate", json={"prompt": "Q", "max_new_tokens": 2})
        assert (r.status_code, r.json()["tokens"], r.json()["finish_reason"]) == (200, 2, "length")

        # a session with a token budget: the sync slides the history out, so what the window will hold is
        # known only then, and a request that fits once the budget has acted is served
        fmt = turn_format(engine)
        assert fmt is not None  # the default model's chat template
        long_tokens = len(engine.tokenize(fmt.turn("user", "More. " * 40)))
        budget_sid = c.post("/v1/sessions", json={"budget_tokens": long_tokens}).json()["id"]
        served = len(engine.anchor_ids) + long_tokens + len(engine.prompt_ids(fmt.turn("user", "Q?")))
        engine.context_length = served + 2
        r = c.post("/v1/chat/completions", json={"messages": longer, "session": budget_sid, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == served
        assert c.get(f"/v1/sessions/{budget_sid}").json()["tokens"] == long_tokens


def test_cached_tokens_count_a_new_message_as_computed_once() -> None:
    engine = tiny_chat_engine()
    first = [{"role": "user", "content": "The sky is blue. " * 8}, {"role": "user", "content": "Colour?"}]
    grown = [first[0], {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And the sea?"}]
    with run_server(create_app(engine, api_key="k"), "k") as server:
        c = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=60)
        sid = c.post("/v1/sessions").json()["id"]
        body = {"session": sid, "max_tokens": 1}
        usage = c.post("/v1/chat/completions", json={"messages": first, **body}).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(engine.anchor_ids)  # all of it computed
        usage = c.post("/v1/chat/completions", json={"messages": grown, **body}).json()["usage"]
        # the kept message and the anchor are served; the new message was compiled and prefilled in
        # context (two passes over the same tokens), and counts as computed once
        kept = len(engine.tokenize(turn_format(engine).turn("user", first[0]["content"])))  # type: ignore[union-attr]
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(engine.anchor_ids) + kept
