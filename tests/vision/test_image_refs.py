"""MPIC-style image references: ``add_image(..., ref=...)`` puts ``IMAGE#<ref>:`` in front of the picture,
prompts name images that way, unknown or evicted names are refused, and the tower runs once per picture."""

from __future__ import annotations

import pytest

from kamera_engine.vision.mechanics import noise_image
from kamera_sdk import ChunkNotFoundError, ContextWindow, InvalidInputError, WindowOperationError
from tests.vision.conftest import close, reprefill, vlm

PROMPT = "Compare IMAGE#EIFFEL2025 and IMAGE#LOUVRE2025."


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory):
    return vlm("qwen2_vl", tmp_path_factory.getbasetemp() / "vlm")


def test_named_images_carry_their_name_and_serve_like_reprefill(engine) -> None:
    kam, rec = ContextWindow(engine, rank=32), ContextWindow(engine, policy="recompute")
    for w in (kam, rec):
        w.add_text("w1 w2 w3")
        a = w.add_image(noise_image(7), ref="EIFFEL2025")
        w.add_image(noise_image(8), ref="LOUVRE2025")
        w.add_text("w4 w5")
    name = engine.tokenize("IMAGE#EIFFEL2025: ")
    assert kam.chunk(a).token_ids[: len(name)] == name
    assert kam.refs == rec.refs and set(kam.refs) == {"EIFFEL2025", "LOUVRE2025"}
    ids = engine.prompt_ids(PROMPT)
    ref = reprefill(rec, ids)
    assert close(rec.next_token_logprobs(PROMPT), ref)
    # reorder makes every image chunk move: relocation + patches, still close to re-prefill
    for w in (kam, rec):
        w.reorder(list(reversed(w.chunks)))
    lp = kam.next_token_logprobs(PROMPT)
    assert float((lp.exp() * (lp - reprefill(rec, ids))).sum()) < 1e-3
    assert kam.generate(PROMPT, max_new_tokens=3) == rec.generate(PROMPT, max_new_tokens=3)


def test_names_are_content_and_the_tower_runs_once_per_picture(engine) -> None:
    win = ContextWindow(engine)
    runs = engine.tower_runs
    a = win.add_image(noise_image(21), ref="A")
    assert win.add_image(noise_image(21), ref="A") == a  # same picture, same name: the same chunk
    b = win.add_image(noise_image(21), ref="B")  # same picture, another name: another chunk
    plain = win.add_image(noise_image(21))
    assert len({a, b, plain}) == 3
    assert engine.tower_runs - runs == 1
    assert win.stats().vision_tower_runs == 1


def test_bad_names_and_prompts_are_refused_and_leave_the_window_alone(engine) -> None:
    win = ContextWindow(engine)
    a = win.add_image(noise_image(31), ref="A")
    win.add_text("w1 w2")
    before = (win.chunks, win.refs)
    with pytest.raises(InvalidInputError, match="IMAGE#A already names another image"):
        win.add_image(noise_image(32), ref="A")
    for bad in ("", "two words", "x" * 65, "IMAGE#A"):
        with pytest.raises(InvalidInputError, match="image ref"):
            win.add_image(noise_image(33), ref=bad)
    assert (win.chunks, win.refs) == before
    with pytest.raises(ChunkNotFoundError, match=r"IMAGE#B.*known: IMAGE#A"):
        win.next_token_logprobs("What is in IMAGE#B?")
    win.evict(a)
    with pytest.raises(WindowOperationError, match=r"IMAGE#A, which was evicted"):
        win.generate("Describe IMAGE#A.", max_new_tokens=2)
    win.recall(win.refs["A"])
    assert win.next_token_logprobs("Describe IMAGE#A.").shape[0] > 0
    win.evict(a)
    win.forget(a)  # for good: its name goes with it
    assert win.refs == {}
    with pytest.raises(ChunkNotFoundError, match=r"IMAGE#A, but no image was added with that ref"):
        win.generate("Describe IMAGE#A.", max_new_tokens=2)


def test_forks_keep_the_names(engine) -> None:
    win = ContextWindow(engine)
    win.add_image(noise_image(41), ref="A")
    child = win.fork()
    child.add_image(noise_image(42), ref="B")
    assert set(child.refs) == {"A", "B"} and set(win.refs) == {"A"}
    with pytest.raises(ChunkNotFoundError):
        win.next_token_logprobs("IMAGE#B?")


def test_generate_streams_the_same_text_and_stops_on_a_string(engine) -> None:
    win = ContextWindow(engine)
    win.add_text("w1 w2 w3 w4")
    win.add_image(noise_image(41))
    whole = win.generate("Question: w5 w6", max_new_tokens=8)
    pieces = list(win.generate("Question: w5 w6", max_new_tokens=8, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == whole
    cut = whole[len(whole) // 2 :][:3]  # a stop string taken from the answer itself
    stopped = win.generate("Question: w5 w6", max_new_tokens=8, stop=cut)
    assert stopped == whole[: whole.index(cut)]  # one string is one stop string, not its characters


def test_an_image_chunk_is_known_before_it_is_added(engine) -> None:
    """``image_chunk`` gives the chunk ``add_image`` would append (its length: the tokens it takes) and leaves
    the window as it was; ``admit`` appends it, and neither adding it nor adding the picture again re-runs
    the tower."""
    win = ContextWindow(engine)
    win.add_text("w1 w2")
    runs, before = engine.tower_runs, (win.chunks, win.tokens, win.content_tokens)
    chunk = win.image_chunk(noise_image(7319))
    assert (win.chunks, win.tokens, win.content_tokens) == before and chunk.id not in win
    assert win.admit(chunk) == [chunk.id] and win.tokens == before[1] + len(chunk)
    assert win.add_image(noise_image(7319)) == chunk.id and engine.tower_runs - runs == 1
    assert ContextWindow(engine, policy="recompute").add_image(noise_image(7319)) == chunk.id
    with pytest.raises(InvalidInputError):
        win.image_chunk(b"not an image")
