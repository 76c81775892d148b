"""Benchmarks behind ``kamera bench <name>``: each module has ``run(engine, quick=...) -> dict``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: bench name -> module (imported lazily so ``kamera --help`` stays fast)
BENCHES: dict[str, str] = {
    "operator": "kamera_sdk.bench.operator",
    "window": "kamera_sdk.bench.window",
    "compare": "kamera_sdk.bench.compare",
    "store": "kamera_sdk.bench.store",
    "gpu": "kamera_sdk.bench.gpu",
    "serve": "kamera_sdk.bench.serve",
    "threads": "kamera_sdk.bench.threads",
}


def get_bench(name: str) -> Callable[..., dict[str, Any]]:
    from kamera_engine import InvalidInputError

    if name not in BENCHES:
        raise InvalidInputError(f"unknown benchmark {name!r}; choose one of {sorted(BENCHES)}")
    return importlib.import_module(BENCHES[name]).run


def preflight(name: str) -> None:
    """The bench's own check before a model is loaded (``preflight()`` in its module, when it has one)."""
    module = importlib.import_module(BENCHES[name]) if name in BENCHES else None
    check = getattr(module, "preflight", None)
    if check is not None:
        check()
