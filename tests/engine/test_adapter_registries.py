"""Every registered model family has a tiny random model in the fast suite, so the table-driven tests
(relocation exact against re-prefilled keys in ``test_rope.py``, the operator in ``test_operator.py``, the
window's invariants in ``tests/sdk/test_registries.py``) run on it: text adapters through
``tests/conftest.py``'s ``TINY_CONFIGS`` (the ``tiny`` fixture), vision families and their adapters through
``kamera_engine.vision.tiny.BUILDERS`` (the ``family_engine`` fixture). A family registered without one
fails here."""

from __future__ import annotations

from kamera_engine import ADAPTERS
from kamera_engine.vision import FAMILIES
from kamera_engine.vision.tiny import BUILDERS
from tests.conftest import TINY_CONFIGS


def _text_tiny_types() -> dict[str, str]:
    """model_type of each text tiny config -> the first config name that builds it."""
    out: dict[str, str] = {}
    for name in sorted(TINY_CONFIGS):
        out.setdefault(TINY_CONFIGS[name]().model_type, name)
    return out


def test_every_adapter_class_has_a_tiny_model() -> None:
    covered = {ADAPTERS[t] for t in _text_tiny_types()} | {ADAPTERS[t] for t in BUILDERS if t in ADAPTERS}
    missing = sorted({t for t, cls in ADAPTERS.items() if cls not in covered})
    assert not missing, f"adapters with no tiny model (add one to tests/conftest.py TINY_CONFIGS): {missing}"


def test_every_vision_family_class_has_a_tiny_model() -> None:
    covered = {FAMILIES[t] for t in BUILDERS}
    missing = sorted({t for t, cls in FAMILIES.items() if cls not in covered})
    assert not missing, f"vision families with no tiny model (add one to kamera_engine/vision/tiny.py): {missing}"
    assert set(BUILDERS) <= set(FAMILIES)
