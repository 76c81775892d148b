"""Canonicals from the keys a forward hands RoPE (``Engine.canonical``, ``adapters/capture.py``).

A bf16 canonical relocated to ``p`` by ``Engine.apply`` / ``relocate`` is within 1 bf16 ulp (layer 0, rotary
band) of the keys a bf16 prefill of the same anchored chunk writes at ``p``, for every rope style: full and
partial rotary, linear / llama3 scaling, q/k-norm, MLA's band (DeepSeek's interleaved layout), M-RoPE (contiguous
sections and interleaved axes, a vision chunk shifted on three axes). Layer 0 is where the two forwards hand
RoPE the same bits (its pre-RoPE keys depend on the token alone); deeper layers differ already before RoPE
(docs/gpu.md). The recording is scoped to the forward that opened it: threads and other engines never see
each other's rows, and the family's function is the original again after an error.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kamera_engine import KV, Engine, SamplingParams
from kamera_engine.adapters import ADAPTERS
from kamera_engine.adapters.capture import PreRopeKeys, is_recording, recording
from kamera_engine.errors import UnsupportedModelError
from kamera_engine.scheduler import Scheduler
from tests.conftest import ANCHOR, TINY_CONFIGS, random_ids, tiny_model
from tests.engine.test_rope_in_values import TextMLAAdapter
from tests.engine.test_rope_in_values import _model as mla_model

TARGETS = (37, 1000)
#: yarn scales cos and sin inside the model: the stored key carries the scaling once, so no rotation of it is
#: the model's bits (2 ulps measured, docs/gpu.md); its capture is checked in float32 below
ROPE_STYLES = sorted(set(TINY_CONFIGS) - {"llama-yarn"})


def ordinal(x: torch.Tensor) -> torch.Tensor:
    """Integers counting representable 16-bit values: neighbours differ by 1, +0 and -0 are equal."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Most representable bf16 values between ``a`` and ``b``, elementwise (0: the same bits)."""
    return int((ordinal(a.cpu()) - ordinal(b.cpu())).abs().max().item())


def bf16_engine(name: str) -> Engine:
    return Engine(tiny_model(name).to(torch.bfloat16), None, name=f"tiny-{name}-bf16", anchor_ids=ANCHOR)


def rotated(kv: KV, engine: Engine) -> torch.Tensor:
    """The slot RoPE rotates: keys, or the value slot of a ``rope_in_values`` (MLA) cache."""
    return kv.values if engine.rope_in_values else kv.keys


def assert_layer0_within_one_ulp(engine: Engine, ids: list[int]) -> None:
    """The canonical served at each target by ``apply`` (the engine's default rotation), against the layer-0
    band a prefill of the anchored chunk at the target writes. (``relocate`` is the float64 reference
    rotation: within 1 ulp of the exact rotation, ``test_bf16.py``, which is itself up to 2 ulps from the
    model's bf16 RoPE.)"""
    assert engine.canonical_source == "pre_rope", engine.canonical_source_reason
    assert engine.rotation == "model"  # the 16-bit default with pre-RoPE canonicals
    can = engine.canonical(ids)
    assert can.is_free and rotated(can, engine).dtype == torch.bfloat16
    r = engine.operator_rope.rotary_dim
    for p in TARGETS:
        want = rotated(engine.forward(ids, engine.anchor_kv, p, logits="none").kv, engine)[0][..., :r]
        served = rotated(engine.apply(can, None, p), engine)[0][..., :r]
        assert ulps(served, want) <= 1, f"apply @ {p}: {ulps(served, want)} ulps"


@pytest.mark.parametrize("name", ROPE_STYLES)
def test_bf16_canonical_relocated_within_one_ulp_of_a_bf16_prefill(name: str) -> None:
    assert_layer0_within_one_ulp(bf16_engine(name), random_ids(24, seed=2))


def test_mla_band_within_one_ulp(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA (DeepSeek-V3, interleaved ``k_pe``): the band lands in the cache's layout; the latent is the written one."""
    monkeypatch.setitem(ADAPTERS, "deepseek_v3", TextMLAAdapter)
    engine = Engine(mla_model().to(torch.bfloat16), anchor_ids=[1, 2, 3])
    ids = list(range(10, 34))
    assert_layer0_within_one_ulp(engine, ids)
    can = engine.canonical(ids)
    written = engine.forward(ids, engine.anchor_kv, len(engine.anchor_ids), logits="none").kv
    assert torch.equal(can.keys, written.keys)  # the latent carries no position: byte for byte


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_mrope_image_chunk_within_one_ulp(family: str, tmp_path) -> None:
    """M-RoPE: an image chunk (3-axis deltas) and text after it, shifted on all three axes."""
    import numpy as np
    from PIL import Image

    from kamera_engine.vision import VisionEngine
    from kamera_engine.vision.tiny import build_tiny_vlm

    engine = VisionEngine.load(build_tiny_vlm(family, tmp_path / family), device="cpu", dtype="bfloat16", attn="sdpa")
    image = Image.fromarray((np.random.default_rng(2).random((64, 64, 3)) * 255).astype("uint8"))
    ids = engine.register_image(image, "noise-2").token_ids + engine.tokenize(" and then some text")
    can = engine.canonical(ids)
    assert can.deltas is not None and can.deltas.abs().sum() > 0 and can.positions is None
    assert_layer0_within_one_ulp(engine, ids)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_float32_canonical_is_the_unrotated_one_to_rounding(name: str) -> None:
    """In float32 the capture and the un-rotation agree to rounding (yarn's scaling included, carried once);
    values and the features past the band are the same bits."""
    engine = Engine(tiny_model(name), None, name=f"tiny-{name}", anchor_ids=ANCHOR)
    ids = random_ids(24, seed=2)
    captured = engine.canonical(ids)
    engine.canonical_source = "unrotation"
    unrotated = engine.canonical(ids)
    r = engine.rope.rotary_dim
    assert (captured.keys - unrotated.keys).abs().max().item() <= 1e-5
    assert torch.equal(captured.keys[..., r:], unrotated.keys[..., r:])
    assert torch.equal(captured.values, unrotated.values)
    assert engine.rotation == "exact"  # float32: the exact rotation


def test_a_family_whose_rope_call_cannot_be_recorded_unrotates(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """No recordable RoPE function: un-rotation, for every canonical of that model, with the reason logged and
    reported; "pre_rope" cannot be asked for; 16-bit placements keep the exact rotation."""
    blind = type("BlindLlamaAdapter", (ADAPTERS["llama"],), {"rope_functions": ("no_such_function",)})
    monkeypatch.setitem(ADAPTERS, "llama", blind)
    with caplog.at_level("INFO", logger="kamera_engine.engine"):
        engine = bf16_engine("llama")
    assert engine.canonical_source == "unrotation" and "no call of no_such_function" in engine.canonical_source_reason
    assert "canonicals by un-rotation" in caplog.text
    assert engine.rotation == "exact"
    ids = random_ids(16, seed=4)
    unrotated = engine.make_free(engine.forward(ids, engine.anchor_kv, 4).kv.to("cpu"))
    assert torch.equal(engine.canonical(ids).keys, unrotated.keys)
    with pytest.raises(UnsupportedModelError, match="no pre-RoPE capture"):
        engine.canonical_source = "pre_rope"


def test_a_chunk_whose_recording_fails_is_an_error_not_one_unrotated_canonical(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe passed, so a failed recording is unexpected: a typed error naming the chunk and the reason,
    never one un-rotated canonical keyed and placed as a pre-RoPE one."""
    engine = bf16_engine("llama")
    assert engine.canonical_source == "pre_rope"

    def fail(kv: KV, keys: PreRopeKeys) -> torch.Tensor:
        raise ValueError("3 RoPE calls recorded for 2 layers")

    monkeypatch.setattr(engine, "_pre_rope_band", fail)
    with pytest.raises(UnsupportedModelError, match=r"chunk of 11 tokens \(3 RoPE calls recorded for 2 layers\)"):
        engine.canonical(random_ids(11, seed=8))
    assert not is_recording()


# --- scoping ---------------------------------------------------------------------------------------------------
def _family_module() -> object:
    return sys.modules[type(tiny_model("llama").model.layers[0]).__module__]


def test_a_recording_sees_only_its_own_context() -> None:
    """A forward on another thread runs while this thread's recording is open: the recording sees none of its
    calls, and that forward's KV is the same bits as without any recording."""
    a, b = (
        Engine(tiny_model("llama", seed=0), anchor_ids=ANCHOR),
        Engine(tiny_model("llama", seed=1), anchor_ids=ANCHOR),
    )
    ids = random_ids(12, seed=5)
    alone = b.forward(ids, None, 0, logits="none").kv
    opened, done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def other() -> None:
        opened.wait(10)
        seen["recording"] = is_recording()
        seen["kv"] = b.forward(ids, None, 0, logits="none").kv
        done.set()

    keys = PreRopeKeys()
    thread = threading.Thread(target=other)
    thread.start()
    with recording(a.adapter.rope_modules(a.model), a.adapter.rope_functions, keys):
        opened.set()
        assert done.wait(30)
        assert not keys.calls  # b's forward, on the other thread, was not recorded here
        a.forward(ids, None, 0, logits="none")
    thread.join()
    assert len(keys.calls) == a.num_layers and seen["recording"] is False
    assert torch.equal(seen["kv"].keys, alone.keys) and torch.equal(seen["kv"].values, alone.values)


def test_canonicals_on_two_threads_are_their_serial_bits() -> None:
    engines = [bf16_engine("qwen2"), Engine(tiny_model("qwen2", seed=3).to(torch.bfloat16), anchor_ids=ANCHOR)]
    chunks = [random_ids(20, seed=s) for s in range(4)]
    serial = [[e.canonical(c).keys for c in chunks] for e in engines]
    got: list[list[torch.Tensor]] = [[], []]
    start = threading.Barrier(2)

    def work(i: int) -> None:
        start.wait(10)
        for _ in range(3):
            got[i] = [engines[i].canonical(c).keys for c in chunks]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(g, s) for g, s in zip(got[i], serial[i], strict=True))


def test_the_family_function_is_restored_after_an_error_inside_the_forward() -> None:
    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    module = _family_module()
    original = module.apply_rotary_pos_emb
    ids = random_ids(10, seed=6)
    expected = engine.canonical(ids)
    assert module.apply_rotary_pos_emb is original  # no recording open: the original

    def fail(*_: object) -> None:
        assert module.apply_rotary_pos_emb is not original  # wrapped while the canonical records
        raise RuntimeError("boom inside the forward")

    handle = engine.model.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.canonical(ids)
    finally:
        handle.remove()
    assert module.apply_rotary_pos_emb is original and not is_recording()
    assert torch.equal(engine.canonical(ids).keys, expected.keys)


def _carry_canonicals(engine: Engine, sched: Scheduler, chunks: list[list[int]]) -> list[KV | None]:
    """Each chunk's canonical on its own thread under ``sched.serving`` (no thread drives: they step it)."""
    out: list[KV | None] = [None] * len(chunks)
    start = threading.Barrier(len(chunks))

    def run(i: int) -> None:
        start.wait(10)
        with sched.serving(key=i):
            out[i] = engine.canonical(chunks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chunks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_canonicals_packed_into_scheduler_steps_equal_their_lone_forwards(name: str) -> None:
    """Canonicals compiled under a scheduler run as rows of its steps, beside a running decode and each
    other (never alone between steps): each equals its lone compile within the batching tolerance, and the
    pre-RoPE band (not an un-rotated key) is what they hold."""
    engine = Engine(tiny_model(name), anchor_ids=ANCHOR)
    chunks = [random_ids(5 + 4 * i, seed=30 + i) for i in range(4)]
    lone = [engine.canonical(c) for c in chunks]
    sched = Scheduler(engine)
    req = sched.submit(None, random_ids(6, seed=3), 0, SamplingParams(max_new_tokens=40))
    sched.step()  # the prompt's prefill: it decodes in every later step
    got = _carry_canonicals(engine, sched, chunks)
    stats = sched.stats()
    assert stats.alone == 0 and stats.carried >= 1  # rows of steps, at least one beside another row
    assert stats.carried + stats.carried_alone == len(chunks)
    for g, want in zip(got, lone, strict=True):
        assert g is not None and g.keys.shape == want.keys.shape
        assert (g.keys - want.keys).abs().max().item() < 1e-4
        assert (g.values - want.values).abs().max().item() < 1e-4
    req.cancel()


def _wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _on_threads(*fns: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    return threads


def _rope(engine: Engine) -> tuple[tuple, tuple[str, ...]]:
    return engine.adapter.rope_modules(engine.model), engine.adapter.rope_functions


def test_a_recorder_sees_only_its_own_row_of_a_packed_step() -> None:
    """A recording open around a forward that a scheduler packs with other rows (a running decode, two other
    window forwards) gets one call per layer with exactly its own tokens, the keys its lone forward hands
    RoPE (within rounding); over the step's token budget, it runs whole in one step (never split)."""
    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    modules, names = _rope(engine)
    ids = random_ids(12, seed=41)
    lone = PreRopeKeys()
    with recording(modules, names, lone):
        engine.forward(ids, None, 0, logits="none")
    sched = Scheduler(engine, step_tokens=4)
    req = sched.submit(None, random_ids(3, seed=2), 0, SamplingParams(max_new_tokens=60))
    seen = PreRopeKeys()

    def recorded() -> None:
        with sched.serving(key="rec"), recording(modules, names, seen):
            engine.forward(ids, None, 0, logits="none")

    def plain(i: int) -> Callable[[], None]:
        def run() -> None:
            with sched.serving(key=i):
                engine.forward(random_ids(9, seed=50 + i), None, 0, logits="none")

        return run

    with sched.driving():
        sched.step()  # the decode's prompt: it decodes in every later step
        threads = _on_threads(recorded, plain(0), plain(1))
        _wait_until(lambda: sched.stats().carried_waiting == 3)
        while any(t.is_alive() for t in threads):
            sched.step()
    for t in threads:
        t.join()
    stats = sched.stats()
    assert stats.carried == 3 and stats.carried_alone == 0 and stats.alone == 0  # every one in a step
    assert len(seen.calls) == engine.num_layers
    for a, b in zip(seen.calls, lone.calls, strict=True):
        assert a.k.shape == b.k.shape == (1, a.k.shape[1], len(ids), a.k.shape[3])
        assert (a.k - b.k).abs().max().item() < 1e-4
    assert not is_recording()
    req.cancel()


def test_a_recorder_that_reads_more_than_keys_runs_alone_between_steps() -> None:
    """A recorder that is not ``packable`` (it reads what RoPE returned, as the compression policies' query
    capture does) makes its forward run alone between steps, in its caller's context, and sees every call
    whole; a decode running meanwhile is undisturbed."""
    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    modules, names = _rope(engine)
    want = list(engine.generate_ids(None, random_ids(4, seed=8), 0, SamplingParams(max_new_tokens=12)))
    outs: list[object] = []
    ids = random_ids(7, seed=9)
    sched = Scheduler(engine)
    req = sched.submit(None, random_ids(4, seed=8), 0, SamplingParams(max_new_tokens=12))

    def run() -> None:
        with sched.serving(key="q"), recording(modules, names, lambda call: outs.append(call.out)):
            engine.forward(ids, None, 0, logits="none")

    with sched.driving():
        sched.step()
        (thread,) = _on_threads(run)
        while thread.is_alive() or req.state not in ("done", "failed"):
            sched.step()
    thread.join()
    assert sched.stats().alone == 1 and sched.stats().carried == 0
    assert len(outs) == engine.num_layers and all(isinstance(o, tuple) and o[1].shape[2] == len(ids) for o in outs)
    assert list(req.generated) == want


def test_a_failed_packed_step_reruns_a_canonical_alone_seen_once() -> None:
    """A step that fails inside its forward (another request's bad past) runs its rows again one by one: a
    canonical carried in it is still its lone compile, from one call per layer (the failed attempt unseen)."""
    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    chunk = random_ids(9, seed=12)
    want = engine.canonical(chunk)
    sched = Scheduler(engine)
    bad_past = KV(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16), torch.arange(3))
    bad = sched.submit(bad_past, [5, 6], 3, SamplingParams(max_new_tokens=4))
    got: list[KV] = []

    def run() -> None:
        with sched.serving(key="c"):
            got.append(engine.canonical(chunk))

    with sched.driving():
        (thread,) = _on_threads(run)
        _wait_until(lambda: sched.stats().carried_waiting == 1)
        while thread.is_alive():
            sched.step()
    thread.join()
    assert bad.state == "failed" and len(got) == 1
    assert torch.equal(got[0].keys, want.keys) and torch.equal(got[0].values, want.values)  # run alone: its bits


def test_a_recorder_error_after_a_packed_step_fails_its_own_forward_only() -> None:
    """A packable recorder that raises when its calls are handed over fails only its own forward: the step's
    other rows (a running decode) keep their tokens and KV as if nothing had happened (no row runs twice)."""
    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    modules, names = _rope(engine)
    want = list(engine.generate_ids(None, random_ids(5, seed=4), 0, SamplingParams(max_new_tokens=10)))

    class Broken:
        packable = True

        def __call__(self, call: object) -> None:
            raise RuntimeError("recorder broke")

    sched = Scheduler(engine)
    req = sched.submit(None, random_ids(5, seed=4), 0, SamplingParams(max_new_tokens=10))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with sched.serving(key="r"), recording(modules, names, Broken()):
                engine.forward(random_ids(6, seed=5), None, 0, logits="none")
        except BaseException as exc:  # asserted below
            errors.append(exc)

    with sched.driving():
        sched.step()
        (thread,) = _on_threads(run)
        _wait_until(lambda: sched.stats().carried_waiting == 1)
        while thread.is_alive() or req.state not in ("done", "failed"):
            sched.step()
    thread.join()
    assert len(errors) == 1 and "recorder broke" in str(errors[0])
    assert sched.stats().carried_failed == 1 and list(req.generated) == want


@pytest.mark.slow
def test_default_model_bf16_canonical_within_one_ulp() -> None:
    engine = Engine.load(dtype="bfloat16", device="cpu")
    text = "The position-free cache stores each chunk's keys at angle zero and rotates them into place."
    assert_layer0_within_one_ulp(engine, engine.tokenize(text))


def test_a_recording_closed_from_another_context_still_restores_the_function() -> None:
    """A generator-based context manager can be closed from another ``contextvars`` context, where resetting
    the recorder's token raises: the family function is the original again all the same."""
    import contextvars

    engine = Engine(tiny_model("llama"), anchor_ids=ANCHOR)
    module = _family_module()
    original = module.apply_rotary_pos_emb
    cm = recording(engine.adapter.rope_modules(engine.model), engine.adapter.rope_functions, PreRopeKeys())
    contextvars.copy_context().run(cm.__enter__)
    assert module.apply_rotary_pos_emb is not original
    with pytest.raises(ValueError, match="different Context"):
        cm.__exit__(None, None, None)
    assert module.apply_rotary_pos_emb is original
    ids = random_ids(10, seed=9)
    assert torch.equal(engine.canonical(ids).keys, engine.canonical(ids).keys)
    assert module.apply_rotary_pos_emb is original
