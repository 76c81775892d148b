"""``kamera_sdk.store.__all__`` is complete and every public name imports; implementation stays private."""

from __future__ import annotations

import inspect
from pathlib import Path

import kamera_sdk.store as store


def test_store_all_is_complete() -> None:
    public = {n for n, o in vars(store).items() if not n.startswith("_") and not inspect.ismodule(o)}
    assert public == set(store.__all__)
    for name in store.__all__:
        assert getattr(store, name) is not None, name


def test_implementation_modules_are_private() -> None:
    modules = {p.stem for p in Path(store.__file__).parent.glob("*.py")} - {"__init__"}
    assert modules and all(m.startswith("_") for m in modules), modules


def test_signatures_of_the_entry_points() -> None:
    assert list(inspect.signature(store.ChunkStore).parameters)[:4] == [
        "memory_bytes",
        "backend",
        "eviction",
        "write_behind",
    ]
    assert list(inspect.signature(store.RedisBackend).parameters)[:3] == ["url", "ttl_s", "max_bytes"]
    assert next(iter(inspect.signature(store.open_store).parameters)) == "spec"
    assert {k.value for k in store.EntryKind} == {"canonical", "patch", "vision"}
