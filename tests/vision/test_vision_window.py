"""Mixed windows (text, images, video segments) on tiny random VLMs: every window operation keeps the
invariants of the window's stateful test; the vision tower runs once per distinct image over a sliding
trace with recalls; inputs from paths, bytes and frames; clear refusals."""

from __future__ import annotations

import io
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kamera_engine import KV, ContextLengthError, UnsupportedModelError
from kamera_engine.vision.mechanics import noise_image
from kamera_sdk import ContextWindow, InvalidInputError, Source
from tests.conftest import tiny_engine as tiny_text_engine
from tests.vision.conftest import close, reprefill, vlm
from tests.window_machine import WindowModelMachine

PROMPT_TEXT = "Question: w3 w4 w5"


def _survivor_is_a_rotation(e, got: KV, expect: KV) -> None:
    """A survivor's KV is the rotation of its previous conditioned KV: the rotated channel (keys; the k_pe
    band in the value slot for MLA) within float rounding, the other channel byte-identical."""
    rotated, carried = (got.values, got.keys) if e.rope_in_values else (got.keys, got.values)
    rot_ref, car_ref = (expect.values, expect.keys) if e.rope_in_values else (expect.keys, expect.values)
    assert (rotated - rot_ref).abs().max() <= 1e-5
    assert torch.equal(carried, car_ref)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "idefics3", "kimi_k25"])
def test_mixed_window_matches_reprefill(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    e = vlm(family, tmp_path_factory.getbasetemp() / "vlm")
    prompt = e.prompt_ids(PROMPT_TEXT)
    kam, rec = ContextWindow(e, rank=32), ContextWindow(e, policy="recompute")
    for w in (kam, rec):
        w.add_text("w1 w2 w3 w4")
        w.add_image(noise_image(101))
        w.add_text("w7 w8 w9")
        w.add_image(noise_image(102))
    assert kam.chunks == rec.chunks and len(kam.chunks) == 4
    assert [kam.chunk(c).kind for c in kam.chunks] == ["text", "image", "text", "image"]
    ref = reprefill(rec, prompt)
    assert close(rec.next_token_logprobs(prompt), ref)
    kam.next_token_logprobs(prompt)  # first use: forwards in context, patches pending
    order = [kam.chunks[i] for i in (3, 0, 2, 1)]
    for w in (kam, rec):
        w.reorder(order)
    ref = reprefill(rec, prompt)
    assert close(rec.next_token_logprobs(prompt), ref)
    assert _kl(ref, kam.next_token_logprobs(prompt)) < 0.05
    # slide: survivors are rotations of their conditioned KV
    kam.next_token_logprobs(prompt)
    before = {s.chunk_id: s.kv for s in kam.slots}
    gone = kam.slide(1)
    rec.slide(1)
    plan, assembled = kam.plan(), kam.assemble()
    survivors = [sp for sp in plan.slots if sp.source is Source.SURVIVOR]
    assert survivors
    for sp in survivors:
        expect = e.relocate(before[sp.chunk.id], sp.start)
        _survivor_is_a_rotation(e, assembled.slice(sp.start, sp.start + len(sp.chunk)), expect)
    # recall the slid-out chunk at the front: a fresh patch, no vision re-encode
    runs = e.tower_runs
    for w in (kam, rec):
        w.recall(gone[0], at=0)
    ref = reprefill(rec, prompt)
    assert close(rec.next_token_logprobs(prompt), ref)
    assert _kl(ref, kam.next_token_logprobs(prompt)) < 0.05
    # fork: copy-on-write, isolated
    lp = kam.next_token_logprobs(prompt)
    child = kam.fork()
    child.evict(child.chunks[1])
    child.add_image(noise_image(103))
    assert torch.allclose(kam.next_token_logprobs(prompt), lp, atol=1e-6)
    assert len(child.chunks) == 4 and child.chunks[-1] not in kam.chunks
    assert e.tower_runs == runs + 1  # only the new image ran the tower


def test_sliding_trace_runs_the_tower_once_per_distinct_image(tmp_path_factory: pytest.TempPathFactory) -> None:
    """20 steps: images and text arrive, the budget slides the oldest out, evicted images are recalled."""
    e = vlm("qwen2_vl", tmp_path_factory.getbasetemp() / "vlm")
    runs0 = e.tower_runs
    win = ContextWindow(e, rank=8, budget_tokens=60)
    rng = random.Random(0)
    images = [noise_image(500 + i, (100, 80)) for i in range(6)]
    prompt = e.prompt_ids(PROMPT_TEXT)
    seen: set[int] = set()
    recalls = slides_seen = 0
    for step in range(20):
        if step % 3 == 2 and win.evicted:
            win.recall(rng.choice(win.evicted))
            recalls += 1
        elif step % 4 == 3:
            win.add_text(f"w{step} w{step + 1} w{step + 2}")
        else:
            i = rng.randrange(len(images))
            seen.add(i)
            win.add_image(images[i])
        slides_seen = max(slides_seen, len(win.evicted))
        lp = win.next_token_logprobs(prompt)
        assert torch.isfinite(lp).all()
    assert recalls >= 4 and slides_seen >= 2
    st_ = win.stats()
    assert e.tower_runs - runs0 == len(seen) == st_.vision_tower_runs
    assert st_.canonicals_computed >= len(seen)


def test_deepstack_survivor_removal_patch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3-VL (deepstack): survivors='patch' re-conditions image survivors once, matching re-prefill,
    and stores a removal patch that serves the same placement later."""
    from kamera_sdk import WindowConfig

    e = vlm("qwen3_vl", tmp_path_factory.getbasetemp() / "vlm")
    prompt = e.prompt_ids(PROMPT_TEXT)
    win = ContextWindow(e, config=WindowConfig(survivors="patch", survivor_rank=64, rank=4))
    rec = ContextWindow(e, policy="recompute")
    imgs = [noise_image(900 + i, (60 + 20 * i, 60)) for i in range(3)]
    ids = [win.add_image(img) for img in imgs]
    for img in imgs:
        rec.add_image(img)
    win.next_token_logprobs(prompt)
    win.slide(1)
    rec.slide(1)
    assert [sp.source for sp in win.plan().slots] == [Source.LEAD, Source.FORWARD]
    assert close(win.next_token_logprobs(prompt), rec.next_token_logprobs(prompt))
    win.flush()
    removal = [p for p in win.chunk(ids[2]).patches if p.kind == "removal"]
    assert len(removal) == 1 and removal[0].antecedent == (ids[1],)
    win.evict(ids[2])
    win.recall(ids[2], at=1)
    assert win.plan().slots[1].source is Source.PATCH


def test_image_canonicals_persist_with_their_deltas(tmp_path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A stored image canonical comes back with its M-RoPE deltas: a later window on the same store serves
    it with no forward, exactly as the window that computed it."""
    e = vlm("qwen2_vl", tmp_path_factory.getbasetemp() / "vlm")
    prompt = e.prompt_ids(PROMPT_TEXT)
    served = []
    for computed in (2, 0):
        with ContextWindow(e, policy="blind", store=tmp_path / "s") as win:
            win.add_text("w1 w2 w3 w4")
            cid = win.add_image(noise_image(131))
            served.append(win.next_token_logprobs(prompt))
            assert win.stats().canonicals_computed == computed
            deltas = win.chunk(cid).canonical.deltas
            assert deltas is not None and deltas.abs().sum() > 0
    assert torch.equal(served[0], served[1])


def test_inputs_from_paths_bytes_and_frames(tmp_path_factory: pytest.TempPathFactory, tmp_path) -> None:
    e = vlm("llava", tmp_path_factory.getbasetemp() / "vlm")
    win = ContextWindow(e)
    img = noise_image(900)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buf.getvalue())
    a = win.add_image(img)
    assert win.add_image(buf.getvalue()) == a and win.add_image(path) == a  # same pixels: same chunk
    assert len(win.chunks) == 1
    segs = win.add_video([noise_image(910 + i, (84, 56)) for i in range(5)], frames_per_segment=2)
    assert len(segs) == 3 and [win.chunk(c).kind for c in segs] == ["video"] * 3
    assert win.chunks == [a, *segs]
    assert torch.isfinite(win.next_token_logprobs(e.prompt_ids(PROMPT_TEXT))).all()


def test_refusals(tmp_path_factory: pytest.TempPathFactory) -> None:
    text_win = ContextWindow(tiny_text_engine("llama"))
    with pytest.raises(UnsupportedModelError, match="vision-language engine"):
        text_win.add_image(noise_image(1))
    e = vlm("llava", tmp_path_factory.getbasetemp() / "vlm")
    with pytest.raises(UnsupportedModelError, match="does not serve image chunks"):
        ContextWindow(e, policy="mpic").add_image(noise_image(1))
    with pytest.raises(InvalidInputError):
        ContextWindow(e).add_image(b"not an image")


def test_a_video_with_a_segment_over_budget_adds_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every segment is checked against the budget before any is added: the refusal leaves the window as it
    was (the first, fitting segment is not left behind without its id ever reaching the caller)."""
    e = vlm("qwen2_vl", tmp_path_factory.getbasetemp() / "vlm")
    small, big = noise_image(920, (40, 40)), noise_image(921, (400, 400))
    probe = ContextWindow(e)
    fits = len(probe.chunk(probe.add_video([small, small], frames_per_segment=2)[0]))
    over = len(probe.chunk(probe.add_video([big, big], frames_per_segment=2)[0]))
    assert over > fits
    win = ContextWindow(e, budget_tokens=fits + 1)
    first = win.add_text("a page of notes")
    with pytest.raises(InvalidInputError, match="does not fit"):
        win.add_video([small, small, big, big], frames_per_segment=2)
    assert win.chunks == [first] and win.evicted == []
    limit = e.context_length  # the engine is shared: restored below
    e.context_length = len(e.anchor_ids) + fits  # the big segment's canonical would not fit the context
    try:
        unbounded = ContextWindow(e)
        with pytest.raises(ContextLengthError):
            unbounded.add_video([small, small, big, big], frames_per_segment=2)
        assert unbounded.chunks == []
    finally:
        e.context_length = limit


# --- stateful: the window machine of tests/sdk/test_window_stateful.py over a mixed pool -------------
_ROOT: list = []


def _engine():
    import tempfile
    from pathlib import Path

    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="kamera-vision-stateful-")))
    return vlm("qwen2_vl", _ROOT[0])


class MixedWindowMachine(WindowModelMachine):
    def __init__(self) -> None:
        e = _engine()
        super().__init__(e, e.prompt_ids(PROMPT_TEXT))
        self.e = e

    def check_survivor(self, got: KV, expect: KV) -> None:
        _survivor_is_a_rotation(self.e, got, expect)

    @rule(i=st.integers(0, 7))
    def add(self, i: int) -> None:
        if i < 4:
            self.add_to_both(lambda w: w.add_image(noise_image(700 + i, (60 + 20 * i, 60))))
        else:
            text = " ".join(f"w{j}" for j in range(i, i + 3 + i % 3))
            self.add_to_both(lambda w: w.add_text(text))

    @rule(which=st.integers(0, 3))
    def invalid(self, which: int) -> None:
        ops = [
            lambda w: w.evict("not-a-chunk"),
            lambda w: w.slide(len(self.order) + 1),
            lambda w: w.reorder([*self.order, "extra"]),
            lambda w: w.add_image(b"\x89PNG broken"),
        ]
        self.assert_refused(ops[which])

    @invariant()
    def recompute_equals_reprefill(self) -> None:
        if self.order:
            assert close(self.rec.next_token_logprobs(self.prompt), reprefill(self.rec, self.prompt))
            assert torch.isfinite(self.kam.next_token_logprobs(self.prompt)).all()

    @invariant()
    def tower_runs_once_per_image(self) -> None:
        assert self.e.tower_runs <= len(self.e._entries)


MixedWindowMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck)
)
TestMixedWindowStateful = MixedWindowMachine.TestCase


@pytest.mark.parametrize("family", ["qwen3_vl", "kimi_k25", "idefics3"])
def test_scripted_trace_one_tower_run_per_distinct_image(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from kamera_sdk.vision_trace import run_trace

    r = run_trace(vlm(family, tmp_path_factory.getbasetemp() / "vlm"), 20, seed=1)
    assert r["tower_runs_per_distinct_image"] == 1.0 and r["vision_tower_runs"] == r["distinct_images"]
    assert r["recalls"] >= 4 and r["slides"] >= 4 and r["survivors_rotated"] > 0
    assert r["kamera_tokens_prefilled"] < r["recompute_tokens_prefilled"]
    assert r["kl_mean"] < 0.05


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_mrope_section_must_cover_the_rotary_frequencies(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    e = vlm(family, tmp_path_factory.getbasetemp() / "vlm")
    fam = type(e.family)(e.family.model, e.family.processor)
    fam.validate()  # the real section passes
    fam.mrope_section = lambda: [1, 2, 3]
    with pytest.raises(UnsupportedModelError, match=r"mrope_section \[1, 2, 3\] does not cover"):
        fam.validate()
