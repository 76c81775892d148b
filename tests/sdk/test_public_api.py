"""The public surface: ``__all__`` is complete and every public name imports."""

from __future__ import annotations

import inspect

import kamera_engine
import kamera_sdk


def _public(module) -> set[str]:
    return {
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(obj) and name not in {"annotations"}
    }


def test_sdk_all_is_complete() -> None:
    assert _public(kamera_sdk) <= set(kamera_sdk.__all__) | {"__version__"}
    for name in kamera_sdk.__all__:
        assert hasattr(kamera_sdk, name), name


def test_engine_all_is_complete() -> None:
    assert _public(kamera_engine) <= set(kamera_engine.__all__)
    for name in kamera_engine.__all__:
        assert hasattr(kamera_engine, name), name


def test_every_error_is_a_kamera_error() -> None:
    for name in kamera_sdk.__all__:
        obj = getattr(kamera_sdk, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, kamera_sdk.KameraError), name
