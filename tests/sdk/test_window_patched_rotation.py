"""A window serves a patched slot with one ``apply`` of its canonical and patch, so the engine's rule for
patched chunks reaches windows: under the 16-bit default ``rotation="model"`` a patched slot is computed as
``"exact"`` (``canonical + U V^T`` and the rotation in float32, rounded once), never as the model's rotation
of a reconstruction rounded to bf16 first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kamera_engine import KV, Engine, Patch
from kamera_sdk import ContextWindow, WindowConfig
from kamera_sdk.plan import Source
from tests.conftest import ANCHOR, random_ids, tiny_model

PROMPT = [9, 10, 11]


def test_a_patched_slot_is_placed_as_exact_under_model_rotation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    engine = Engine(tiny_model("llama", 3).to(torch.bfloat16), None, name="tiny-llama-bf16", anchor_ids=ANCHOR)
    assert engine.rotation == "model"
    patched: list[tuple[KV, Patch, int, KV]] = []
    apply = Engine.apply

    def spy(self: Engine, canonical: KV, patch: Patch | None, target, **kw) -> KV:
        out = apply(self, canonical, patch, target, **kw)
        if patch is not None and isinstance(target, int):
            patched.append((canonical, patch, target, KV(out.keys.clone(), out.values.clone(), out.positions)))
        return out

    monkeypatch.setattr(Engine, "apply", spy)

    chunks = [random_ids(10 + i, seed=400 + i) for i in range(4)]
    with ContextWindow(engine, policy="kamera", store=tmp_path / "s") as first:  # forms and stores the patches
        for ids in chunks:
            first.add(ids)
        first.next_token_logprobs(PROMPT)

    def trace(reuse: bool) -> list[torch.Tensor]:
        store = shutil.copytree(tmp_path / "s", tmp_path / f"s-{reuse}")  # each run starts from the same store
        win = ContextWindow(engine, policy="kamera", store=store, config=WindowConfig(reuse_buffer=reuse))
        for ids in chunks:  # the same chunks in the same order: served from the stored patches
            win.add(ids)
        out = [win.next_token_logprobs(PROMPT)]
        assert win.stats().served.get(Source.PATCH, 0) > 0, win.stats().served
        win.add(random_ids(9, seed=410))  # the patched slots are kept: placed as they were served
        out.append(win.next_token_logprobs(PROMPT))
        out.append(win.next_token_logprobs(PROMPT))
        win.close()
        return out

    patched.clear()
    reused, fresh = trace(True), trace(False)
    assert all(torch.equal(a, b) for a, b in zip(reused, fresh, strict=True))
    assert patched, "no slot was served with its patch"
    differs = []
    for canonical, patch, target, got in patched:
        exact = apply(engine, canonical, patch, target, rotation="exact")
        assert torch.equal(got.keys, exact.keys) and torch.equal(got.values, exact.values)
        twice = apply(engine, engine.reconstruct(canonical, patch), None, target)  # the model's rotation of it
        differs.append(not torch.equal(got.keys, twice.keys))
    assert any(differs)  # the two ways do round differently: the test tells them apart
