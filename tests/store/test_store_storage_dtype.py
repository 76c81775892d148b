"""Compact storage dtypes (bfloat16 / float16 entries for a float32 model) and backends by URL scheme."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from kamera_engine.errors import InvalidInputError
from kamera_sdk.store import BACKENDS, ChunkStore, DiskBackend, EntryKey, StoreEntry, open_store, register_backend

FP = "ab" * 16


def _entry(scale: float = 1.0) -> StoreEntry:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "keys": torch.randn(4, 3, 64, 16, generator=g) * scale,
        "half": torch.randn(8, generator=g).to(torch.bfloat16),
        "pos": torch.arange(6),
    }
    return StoreEntry(EntryKey(FP, "canonical", "01" * 16, "dtype=float32"), tensors, {"tokens": "64"})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compact_entries_load_back_in_the_models_dtype(tmp_path: Path, dtype: str) -> None:
    e = _entry()
    with open_store(tmp_path / "full", write_behind=False) as full:
        full.put(_entry())
    with open_store(tmp_path / "small", write_behind=False, storage_dtype=dtype) as small:
        small.put(e)
        assert small.get(e.key) is e  # this process's RAM tier keeps what it was given
    full_bytes = DiskBackend(tmp_path / "full").total_bytes()
    small_bytes = DiskBackend(tmp_path / "small").total_bytes()
    assert small_bytes < 0.55 * full_bytes
    with open_store(tmp_path / "small") as reader:  # a later process, with or without the option
        got = reader.get(e.key)
    assert got is not None
    assert {n: t.dtype for n, t in got.tensors.items()} == {n: t.dtype for n, t in e.tensors.items()}
    assert torch.equal(got.tensors["keys"], e.tensors["keys"].to(getattr(torch, dtype)).float())
    assert not torch.equal(got.tensors["keys"], e.tensors["keys"])  # rounded: the option is lossy
    assert torch.equal(got.tensors["half"], e.tensors["half"]) and torch.equal(got.tensors["pos"], e.tensors["pos"])
    summary = DiskBackend(tmp_path / "small").info()["by_stored_dtype"]
    assert list(summary) == ["+".join(sorted({"bfloat16", "int64", dtype}))]


def test_float16_overflow_keeps_the_tensor_wide(tmp_path: Path) -> None:
    e = _entry(scale=1e6)  # beyond float16's range: casting would turn values into inf
    with open_store(tmp_path, write_behind=False, storage_dtype="float16") as store:
        store.put(e)
    with open_store(tmp_path) as reader:
        got = reader.get(e.key)
    assert got is not None and torch.equal(got.tensors["keys"], e.tensors["keys"])


def test_storage_dtype_is_checked() -> None:
    with pytest.raises(InvalidInputError, match="storage_dtype"):
        ChunkStore(storage_dtype="int8")
    with pytest.raises(InvalidInputError, match="storage_dtype"):
        StoreEntry(_entry().key, {"a": torch.zeros(1)}, storage_dtype="float64")
    assert ChunkStore(storage_dtype=torch.bfloat16).storage_dtype == torch.bfloat16


def test_backends_resolve_by_url_scheme(tmp_path: Path, proc: ModuleType) -> None:
    assert {"file", "redis", "rediss", "unix"} <= set(BACKENDS)
    assert isinstance(open_store(f"file://{tmp_path / 'a'}").backend, DiskBackend)
    made: list[tuple[str, int | None]] = []

    @register_backend("scratch")
    def _scratch(spec: str, *, max_bytes: int | None, ttl_s: float | None) -> DiskBackend:
        made.append((spec, max_bytes))
        return DiskBackend(tmp_path / spec.removeprefix("scratch://"), max_bytes=max_bytes)

    try:
        store = open_store("scratch://here", max_bytes=10**6)
        assert made == [("scratch://here", 10**6)] and isinstance(store.backend, DiskBackend)
        store.put(proc.make_entry(1))
        store.close()
        assert len(DiskBackend(tmp_path / "here")) == 1
    finally:
        del BACKENDS["scratch"]
    with pytest.raises(InvalidInputError, match=r"not supported.*redis://"):
        open_store("scratch://here")
    with pytest.raises(ValueError, match="scheme"):
        register_backend("Bad://")
