"""``/v1/completions`` through the official ``openai`` client, against a real server on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kamera_engine import Engine, SamplingParams
from kamera_sdk import ContextWindow
from tests.server.conftest import LiveServer

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")

pytestmark = pytest.mark.slow

PROMPT = "The three primary colours are red,"
PAGE = "Ada Lovelace lived in London. She wrote the first published program, for the Analytical Engine.\n\n"


@pytest.fixture
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.api_key, max_retries=0, timeout=120) as c:
        yield c


def reference(engine: Engine, ids: list[int], max_new_tokens: int, stop: tuple[str, ...] = ()) -> str:
    """The same continuation in-process: the raw prompt with nothing before it, greedy."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
    return "".join(engine.generate(None, ids, 0, params))


def test_text_and_token_prompts_match_the_engine(client: openai.OpenAI, default_engine: Engine) -> None:
    ids = default_engine.tokenize(PROMPT)
    r = client.completions.create(model="anything", prompt=PROMPT, max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == default_engine.name
    choice = r.choices[0]
    assert choice.text == reference(default_engine, ids, 8)
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=8)
    assert by_ids.choices[0].text == choice.text
    assert client.completions.create(model="m", prompt=[PROMPT], max_tokens=8).choices[0].text == choice.text


def test_stop_and_length(client: openai.OpenAI, default_engine: Engine) -> None:
    ids = default_engine.tokenize(PROMPT)
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=12).choices[0]
    assert full.finish_reason == "length" or full.text == reference(default_engine, ids, 12)
    cut_at = full.text.strip()[:3]
    assert cut_at, "the model answered nothing to cut"
    stopped = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, stop=[cut_at]).choices[0]
    assert stopped.finish_reason == "stop" and cut_at not in stopped.text
    assert full.text.startswith(stopped.text)
    assert stopped.text == reference(default_engine, ids, 12, stop=(cut_at,))


def test_stream_gives_the_same_text_then_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt=PROMPT, max_tokens=8)
    stream = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_are_the_models_for_the_returned_tokens(client: openai.OpenAI, default_engine: Engine) -> None:
    ids = default_engine.tokenize(PROMPT)
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    first = default_engine.next_token_logprobs(None, ids, 0)
    assert lp.token_logprobs[0] == pytest.approx(float(first.max()), abs=1e-4)  # greedy: the best token
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top is not None and len(top) == 3
        assert token_lp == pytest.approx(max(top.values()), abs=1e-4)
    # echo with no answer scores the prompt itself: the first token has nothing before it
    echo = client.completions.create(model="m", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert echo.choices[0].text == PROMPT
    elp = echo.choices[0].logprobs
    assert elp is not None and len(elp.tokens) == len(ids) and "".join(elp.tokens) == PROMPT
    assert elp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    second = default_engine.next_token_logprobs(None, ids[:1], 0)
    assert elp.token_logprobs[1] == pytest.approx(float(second[ids[1]]), abs=1e-4)


def test_a_session_completion_continues_after_its_window(
    client: openai.OpenAI, live: LiveServer, default_engine: Engine
) -> None:
    with httpx.Client(base_url=live.url, headers=live.headers, timeout=120) as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        assert http.post(f"/v1/sessions/{sid}/chunks", json={"text": PAGE}).status_code == 201
        before = http.get(f"/v1/sessions/{sid}").json()
        prompt = "Ada Lovelace lived in"
        r = client.completions.create(model="m", prompt=prompt, max_tokens=6, extra_body={"session": sid})
        local = ContextWindow(default_engine)
        local.add_text(PAGE)
        assert r.choices[0].text == local.generate(default_engine.tokenize(prompt), max_new_tokens=6)
        window_tokens = len(default_engine.anchor_ids) + local.tokens
        assert r.usage.prompt_tokens == window_tokens + len(default_engine.tokenize(prompt))
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # the page was not prefilled again
        assert http.get(f"/v1/sessions/{sid}").json() == before  # a completion leaves the window as it was
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="m", prompt=prompt, extra_body={"session": "ks_nope"})


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": ["one", "two"]}, "one prompt"),
        ({"prompt": [1, 10**9]}, "out of range"),
        ({"prompt": PROMPT, "max_tokens": 1000}, "limit"),
        ({"prompt": PROMPT, "stop": [""]}, "stop"),
        ({"prompt": PROMPT, "logprobs": 2, "stream": True}, "stream"),
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": PROMPT, "logprobs": 9}, "logprobs"),
    ],
)
def test_bad_requests_are_422(client: openai.OpenAI, kwargs: dict, says: str) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.completions.create(model="m", **kwargs)
    assert info.value.body is not None and says in str(info.value.body)


def test_sampling_with_a_seed_repeats(client: openai.OpenAI) -> None:
    runs = [
        client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
