"""``Engine.load`` on a vision-language checkpoint hands it to ``VisionEngine`` (the real from_pretrained path)."""

from __future__ import annotations

from kamera_engine import Engine
from kamera_engine.vision import VisionEngine
from kamera_engine.vision.tiny import build_tiny_vlm


def test_engine_load_dispatches_vision_checkpoints(tmp_path) -> None:
    path = build_tiny_vlm("llava", str(tmp_path / "llava"))
    engine = Engine.load(path, device="cpu", dtype="float32", attn="sdpa")
    assert isinstance(engine, VisionEngine)
    assert engine.family.__class__.__name__.lower().startswith("llava")
