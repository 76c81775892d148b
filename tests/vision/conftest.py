"""Tiny random VLMs per family, saved with ``save_pretrained`` and loaded back through ``from_pretrained``."""

from __future__ import annotations

import pytest

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
