"""The decode loop: greedy equals argmax, sampling is seeded, stop strings and EOS end the stream."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kamera_engine import Engine, InvalidInputError, SamplingParams
from kamera_engine.decode import AsyncTextStream, TextStream, pick_token
from kamera_engine.kv import KV, drop_tokens, to_cache
from tests.conftest import ANCHOR, CharTokenizer, random_ids, tiny_engine


def test_stream_stops_at_stop_string_and_never_emits_it() -> None:
    params = SamplingParams(stop=("cd",))
    pieces = list(TextStream(iter([0, 1, 2, 3, 4]), CharTokenizer(), params))
    assert "".join(pieces) == "ab"
    assert all("c" not in p for p in pieces)


def test_stream_holds_back_a_possible_stop_prefix_then_releases_it() -> None:
    params = SamplingParams(stop=("cx",))
    assert "".join(TextStream(iter([0, 1, 2, 3]), CharTokenizer(), params)) == "abcd"


def test_stream_ends_at_eos() -> None:
    params = SamplingParams(eos_token_ids=(3,))
    assert "".join(TextStream(iter([0, 1, 3, 4]), CharTokenizer(), params)) == "ab"


def test_a_stream_counts_decoded_tokens_and_says_why_it_ended() -> None:
    def run(tokens: list[int], **kw) -> tuple[str, int, str | None]:
        stream = TextStream(iter(tokens), CharTokenizer(), SamplingParams(**kw))
        assert (stream.tokens, stream.finish_reason) == (0, None)  # nothing decoded before it is read
        return "".join(stream), stream.tokens, stream.finish_reason

    # tokens decoded, not the text's length: 26 decodes to "a" again; the EOS and a stop's tokens count
    assert run([0, 26, 1]) == ("aab", 3, "length")
    assert run([0, 1, 3, 4], eos_token_ids=(3,)) == ("ab", 3, "stop")
    assert run([0, 1, 2, 3, 4], stop=("cd",)) == ("ab", 4, "stop")
    assert run([]) == ("", 0, "length")


def _counting_to_ten(closed: list[bool]):
    """Tokens 0..9; ``closed`` gets True when the generator is closed."""
    try:
        yield from range(10)
    finally:
        closed.append(True)


def test_closing_a_stream_closes_its_token_source() -> None:
    closed: list[bool] = []
    stream = TextStream(_counting_to_ten(closed), CharTokenizer(), SamplingParams())
    assert next(stream) == "a"
    stream.close()
    assert closed == [True] and stream.finish_reason is None


CASES = [
    ([0, 26, 1], {}),
    ([0, 1, 3, 4], {"eos_token_ids": (3,)}),
    ([0, 1, 2, 3, 4], {"stop": ("cd",)}),
    ([0, 1, 2, 3], {"stop": ("cx",)}),
    ([], {}),
]


@pytest.mark.parametrize(("tokens", "kw"), CASES)
def test_the_async_stream_is_the_stream(tokens: list[int], kw: dict) -> None:
    """The same pieces, token count and finish reason, from an async token source and from ``aiter()`` of a
    plain stream (its tokens read on a worker thread)."""
    sync = TextStream(iter(tokens), CharTokenizer(), SamplingParams(**kw))
    expected = (list(sync), sync.tokens, sync.finish_reason)

    async def source():
        for t in tokens:
            yield t

    async def read(stream: AsyncTextStream) -> tuple[list[str], int, str | None]:
        assert stream.finish_reason is None
        return [p async for p in stream], stream.tokens, stream.finish_reason

    direct = AsyncTextStream(source(), CharTokenizer(), SamplingParams(**kw))
    assert asyncio.run(read(direct)) == expected
    threaded = TextStream(iter(tokens), CharTokenizer(), SamplingParams(**kw)).aiter()
    assert asyncio.run(read(threaded)) == expected


def test_aclose_closes_the_token_source_and_a_read_stream_has_no_aiter() -> None:
    closed: list[bool] = []

    async def two_pieces_then_close(stream: AsyncTextStream) -> list[str]:
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    stream = TextStream(_counting_to_ten(closed), CharTokenizer(), SamplingParams())
    assert asyncio.run(two_pieces_then_close(stream.aiter())) == ["a", "b"]
    assert closed == [True]
    read = TextStream(iter([0, 1]), CharTokenizer(), SamplingParams())
    next(read)
    with pytest.raises(InvalidInputError, match="already read"):
        read.aiter()
    taken = TextStream(iter([0, 1]), CharTokenizer(), SamplingParams())
    taken.aiter()
    with pytest.raises(InvalidInputError, match="through its aiter"):
        next(taken)  # one reader only


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.5)
    gen = torch.Generator().manual_seed(0)
    assert {pick_token(logits, params, gen) for _ in range(50)} == {0}
    params = SamplingParams(temperature=1.0, top_p=0.85)
    assert {pick_token(logits, params, gen) for _ in range(200)} == {0, 1}
    # the smallest set whose mass reaches top_p: [0.5, 0.3, 0.2] at 0.5 is the first token alone
    exact = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert {pick_token(exact, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(200)} == {0}


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    assert {pick_token(logits, SamplingParams(temperature=1e-40), gen) for _ in range(20)} == {1}
    # below float32's range (1e-300 rounds to 0 there): still a temperature, still greedy, not a nan error
    assert {pick_token(logits, SamplingParams(temperature=1e-300), gen) for _ in range(20)} == {1}
    assert {pick_token(logits, SamplingParams(temperature=1.0, top_p=1e-300), gen) for _ in range(20)} == {1}


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=0.0),
        dict(top_p=float("nan")),
        dict(max_new_tokens=-2),
        dict(max_new_tokens=2.5),
        dict(stop="abc"),
        dict(stop=("",)),
    ],
)
def test_bad_sampling_params_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidInputError):
        SamplingParams(**bad).validate()


def test_greedy_and_seeded_sampling_on_a_tiny_model() -> None:
    from tests.conftest import ANCHOR, tiny_engine

    engine: Engine = tiny_engine("llama")
    past = engine.anchor_kv
    greedy = list(engine.generate_ids(past, [5, 6, 7], len(ANCHOR), SamplingParams(max_new_tokens=6)))
    # greedy reference: step-by-step argmax with full re-prefill each time
    ids = [*ANCHOR, 5, 6, 7]
    ref = []
    for _ in range(6):
        lp = engine.next_token_logprobs(None, ids, 0)
        ref.append(int(lp.argmax()))
        ids.append(ref[-1])
    assert greedy == ref
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=123)
    run1 = list(engine.generate_ids(past, [5, 6, 7], len(ANCHOR), p))
    run2 = list(
        engine.generate_ids(past, [5, 6, 7], len(ANCHOR), SamplingParams(max_new_tokens=8, temperature=1.0, seed=123))
    )
    assert run1 == run2


def test_generate_checks_sampling_before_anything_else() -> None:
    from tests.conftest import ANCHOR, tiny_engine

    e = tiny_engine("llama")
    for bad in (None, "4", 2.5):
        with pytest.raises(InvalidInputError, match="max_new_tokens must be an int"):
            e.generate_ids(e.anchor_kv, [5, 6], len(ANCHOR), SamplingParams(max_new_tokens=bad))  # type: ignore[arg-type]
    assert e.counters.forwards == 1  # the anchor's own forward only: nothing ran for the refused calls


def test_the_step_hook_sees_counts_and_its_rows_are_dropped() -> None:
    """After each step the hook gets (tokens cached, tokens generated); the rows it names leave every
    layer before the next step, which then decodes as over the cache without them."""
    engine = tiny_engine("llama", seed=1)
    res = engine.forward(random_ids(10, seed=5), engine.anchor_kv, len(ANCHOR), logits="last")
    kv = KV.cat([engine.anchor_kv, res.kv.to("cpu")])
    start = len(kv)
    params = SamplingParams(max_new_tokens=5)
    seen: list[tuple[int, int]] = []

    def keep_all(cached: int, generated: int) -> list[int]:
        seen.append((cached, generated))
        return []

    plain = list(engine.decode_on(kv, res.logits[-1], start, params))
    assert list(engine.decode_on(kv, res.logits[-1], start, params, keep_all)) == plain
    assert seen == [(start + i, i) for i in range(1, 5)]  # no forward after the last token

    seen.clear()

    def drop_third(cached: int, generated: int) -> list[int]:
        seen.append((cached, generated))
        return [3]

    list(engine.decode_on(kv, res.logits[-1], start, params, drop_third))
    assert seen == [(start + 1, i) for i in range(1, 5)]  # one row in, one row out, every step
    # t0 fed, then row 3 dropped: t1's logits are those over the cache (window + t0) without row 3
    t0, t1 = plain[0], plain[1]
    got = engine.score_on(kv, res.logits[-1], start, [t0, t1, 0], drop_third)[2]
    with_t0 = KV.cat([kv, engine.forward([t0], kv, start, logits="none").kv.to("cpu")])
    kept = KV.cat([with_t0.slice(0, 3), with_t0.slice(4, len(with_t0))])
    ref = torch.log_softmax(engine.forward([t1], kept, start + 1, logits="last").logits[-1], -1).to(got.device)
    assert torch.allclose(got, ref, atol=1e-5)
    kept_all = torch.log_softmax(engine.forward([t1], with_t0, start + 1, logits="last").logits[-1], -1).to(got.device)
    assert not torch.allclose(got, kept_all, atol=1e-5)  # the drop made a difference


def test_drop_tokens_refuses_rows_outside_the_cache_and_leaves_it_as_it_was() -> None:
    engine = tiny_engine("llama")
    kv = engine.anchor_kv
    cache = to_cache(kv, engine.model.config)
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(InvalidInputError, match="cannot drop cache rows"):
        drop_tokens(cache, [0, len(kv)])
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers, strict=True))
    drop_tokens(cache, [1])
    got = KV.from_cache(cache, 0, len(kv) - 1, None)
    ref = KV.cat([kv.slice(0, 1), kv.slice(2, len(kv))])
    assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)
