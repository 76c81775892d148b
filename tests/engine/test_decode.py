"""The decode loop: greedy equals argmax, sampling is seeded, stop strings and EOS end the stream."""

from __future__ import annotations

import pytest
import torch

from kamera_engine import Engine, InvalidInputError, SamplingParams
from kamera_engine.decode import TextStream, pick_token


class _CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26); enough to test text streaming."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stream_stops_at_stop_string_and_never_emits_it() -> None:
    params = SamplingParams(stop=("cd",))
    pieces = list(TextStream(iter([0, 1, 2, 3, 4]), _CharTokenizer(), params))
    assert "".join(pieces) == "ab"
    assert all("c" not in p for p in pieces)


def test_stream_holds_back_a_possible_stop_prefix_then_releases_it() -> None:
    params = SamplingParams(stop=("cx",))
    assert "".join(TextStream(iter([0, 1, 2, 3]), _CharTokenizer(), params)) == "abcd"


def test_stream_ends_at_eos() -> None:
    params = SamplingParams(eos_token_ids=(3,))
    assert "".join(TextStream(iter([0, 1, 3, 4]), _CharTokenizer(), params)) == "ab"


def test_a_stream_counts_decoded_tokens_and_says_why_it_ended() -> None:
    def run(tokens: list[int], **kw) -> tuple[str, int, str | None]:
        stream = TextStream(iter(tokens), _CharTokenizer(), SamplingParams(**kw))
        assert (stream.tokens, stream.finish_reason) == (0, None)  # nothing decoded before it is read
        return "".join(stream), stream.tokens, stream.finish_reason

    # tokens decoded, not the text's length: 26 decodes to "a" again; the EOS and a stop's tokens count
    assert run([0, 26, 1]) == ("aab", 3, "length")
    assert run([0, 1, 3, 4], eos_token_ids=(3,)) == ("ab", 3, "stop")
    assert run([0, 1, 2, 3, 4], stop=("cd",)) == ("ab", 4, "stop")
    assert run([]) == ("", 0, "length")


def test_closing_a_stream_closes_its_token_source() -> None:
    closed = []

    def source():
        try:
            yield from range(10)
        finally:
            closed.append(True)

    stream = TextStream(source(), _CharTokenizer(), SamplingParams())
    assert next(stream) == "a"
    stream.close()
    assert closed == [True] and stream.finish_reason is None


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
