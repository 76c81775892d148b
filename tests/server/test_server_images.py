"""Images on a vision-language engine's server are counted before they are added: an image chunk or a chat
message's picture that would take the sessions past ``max_held_tokens`` is refused with 429 and changes
nothing, and a user's chat window lets go of pictures its client no longer sends."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kamera_engine.vision import VisionEngine
from kamera_engine.vision.mechanics import noise_image
from kamera_sdk import ContextWindow
from tests.server.conftest import make_app
from tests.server.test_server_http import error
from tests.vision.conftest import vlm


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> VisionEngine:
    return vlm("qwen2_vl", tmp_path_factory.getbasetemp() / "vlm")


def _png(seed: int) -> str:
    buf = io.BytesIO()
    noise_image(seed).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _image_tokens(engine: VisionEngine, seed: int) -> int:
    return len(ContextWindow(engine).image_chunk(noise_image(seed)))


def _held(c: TestClient) -> int:
    return int(c.get("/v1/server/stats").json()["held_tokens"])


def test_an_image_chunk_past_the_bound_is_refused_before_it_is_added(engine: VisionEngine) -> None:
    n = _image_tokens(engine, 1)
    assert n > 1 and _image_tokens(engine, 2) == n
    with TestClient(make_app(engine, api_key=None, max_held_tokens=3 * n)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        first = c.post(f"/v1/sessions/{sid}/chunks", json={"image_base64": _png(1)})
        assert first.status_code == 201, first.text
        assert _held(c) == 2 * n  # placed, and its content
        message = error(c.post(f"/v1/sessions/{sid}/chunks", json={"image_base64": _png(2)}), 429, "LimitExceededError")
        assert f"would hold {4 * n} tokens" in message
        state = c.get(f"/v1/sessions/{sid}").json()
        assert state["chunks"] == [first.json()["chunk"]] and state["tokens"] == n and _held(c) == 2 * n
        again = c.post(f"/v1/sessions/{sid}/chunks", json={"image_base64": _png(1)})  # held already: free
        assert again.json()["chunk"] == first.json()["chunk"] and _held(c) == 2 * n
        vision = c.get("/v1/server/stats").json()["vision_cache"]
        assert vision["tower_runs"] == engine.tower_runs >= 2 and vision["max_memory_bytes"] == 1 << 30


def test_chat_pictures_are_counted_before_the_sync_and_a_user_window_lets_them_go(engine: VisionEngine) -> None:
    def ask(c: TestClient, seed: int, **key: Any) -> Any:
        picture = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png(seed)}"}}
        messages = [{"role": "user", "content": [picture]}, {"role": "user", "content": "What is it?"}]
        return c.post("/v1/chat/completions", json={**key, "max_tokens": 1, "messages": messages})

    with TestClient(make_app(engine, api_key=None)) as c:  # what one picture's request holds
        sid = c.post("/v1/sessions").json()["id"]
        assert ask(c, 1, session=sid).status_code == 200
        one = _held(c)
    n = _image_tokens(engine, 1)
    assert one > 2 * n  # the turn's opening is a chunk too
    with TestClient(make_app(engine, api_key=None, max_held_tokens=one + n - 1)) as c:  # a second picture: one + n
        sid = c.post("/v1/sessions").json()["id"]
        assert ask(c, 1, session=sid).status_code == 200
        state = c.get(f"/v1/sessions/{sid}").json()
        error(ask(c, 2, session=sid), 429, "LimitExceededError")  # a new picture: placed and seen
        assert c.get(f"/v1/sessions/{sid}").json() == state and _held(c) == one  # nothing changed
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204

        assert ask(c, 1, user="u").status_code == 200
        r = ask(c, 2, user="u")  # the first picture is no longer sent: it is let go
        assert r.status_code == 200, r.text
        assert _held(c) == one


def test_a_picture_sent_twice_or_again_after_its_eviction_costs_its_place_only(engine: VisionEngine) -> None:
    """The same picture twice in one request is one chunk; a picture the window evicted and is sent again is
    recalled, its content held already: at a bound of exactly what that needs, every request is answered."""

    def ask(c: TestClient, seeds: list[int], **key: Any) -> Any:
        def picture(seed: int) -> dict[str, Any]:
            url = f"data:image/png;base64,{_png(seed)}"
            return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}

        messages = [*map(picture, seeds), {"role": "user", "content": "What is it?"}]
        return c.post("/v1/chat/completions", json={**key, "max_tokens": 1, "messages": messages})

    n = _image_tokens(engine, 1)
    with TestClient(make_app(engine, api_key=None)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        assert ask(c, [1], session=sid).status_code == 200
        one = _held(c)  # a turn's opening and the picture, placed and seen
        other = c.post("/v1/sessions").json()["id"]
        assert ask(c, [1, 1], session=other).status_code == 200
        opening = (one - 2 * n) // 2
        assert _held(c) == one + 2 * (2 * opening + n)  # two openings (a repeated message), one picture
    with TestClient(make_app(engine, api_key=None, max_held_tokens=one + n)) as c:
        sid = c.post("/v1/sessions").json()["id"]
        for seeds in ([1], [2], [1]):  # the third recalls the first picture: nothing new is seen
            r = ask(c, seeds, session=sid)
            assert r.status_code == 200, r.text
        assert _held(c) == one + n
