"""Tiny random VLMs per family (saved with ``save_pretrained``, loaded back through ``from_pretrained``), and
the references the vision tests compare against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from kamera_engine import KV
from kamera_engine.vision import VisionEngine
from kamera_engine.vision.mechanics import tiny_engine
from kamera_engine.vision.tiny import BUILDERS

FAMILIES = sorted(BUILDERS)
_ENGINES: dict[str, VisionEngine] = {}


def vlm(family: str, tmp_root) -> VisionEngine:
    """One engine per family for the whole session (built under pytest's tmp dir)."""
    if family not in _ENGINES:
        _ENGINES[family] = tiny_engine(family, str(tmp_root / family))
    return _ENGINES[family]


@pytest.fixture(params=FAMILIES)
def family_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VisionEngine:
    return vlm(request.param, tmp_path_factory.getbasetemp() / "vlm")


def reprefill(win, prompt: list[int]) -> torch.Tensor:
    """The reference: the window's tokens re-prefilled after the anchor, then the prompt's next-token log-probs."""
    e = win.engine
    ids = [t for c in win.chunks for t in win.chunk(c).token_ids]
    kv = e.forward(ids, e.anchor_kv, len(e.anchor_ids), logits="none").kv
    past = KV.cat([e.anchor_kv, kv])
    return e.next_token_logprobs(past, prompt, len(past))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Recompute vs re-prefill: the same forward, up to float noise of the attention kernels."""
    return (a - b).abs().max().item() <= 1e-5


def write_video(path: Path, n_frames: int = 12, fps: int = 4) -> None:
    """A small mpeg4 clip whose frames change colour, for the decoding tests."""
    import av

    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(n_frames):
            img = Image.new("RGB", (32, 32), (20 * i % 256, 100, 255 - 20 * i % 256))
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
