"""Every entry kind through every tier, bit-exact, read back by a fresh store (so from storage, not RAM)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kamera_sdk.store import ChunkStore, DiskBackend, EntryKey, EntryKind, RedisBackend, StoreEntry

FP = "5e" * 16


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 17, 8, generator=g)  # (layers, kv_heads, tokens, head_dim)
    return {
        "k.bf16": x.to(torch.bfloat16),
        "v.f16": (x * 3).to(torch.float16),
        "u.f32": x[:, :, :5].transpose(-1, -2),  # non-contiguous
        "s.f64": x.double().sum((0, 1)),
        "pos.i64": torch.arange(-5, 12, dtype=torch.int64),
        "grid.i32": torch.tensor([[1, 28, 28]], dtype=torch.int32),
        "pix.u8": torch.randint(0, 256, (4, 4), generator=g, dtype=torch.uint8),
        "mask.bool": x[0, 0, :, 0] > 0,
        "extreme.f32": torch.tensor([float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38]),
    }


def _entry(kind: EntryKind, seed: int) -> StoreEntry:
    variant = {"canonical": "", "patch": "ante=9a0c|rank=8", "vision": "../../escape attempt"}[kind.value]
    key = EntryKey(FP, kind, f"{seed:032x}", variant)
    return StoreEntry(key, _tensors(seed), {"antecedent": "9a0c" if kind is EntryKind.PATCH else "", "k": "v"})


def _assert_bit_exact(got: StoreEntry, want: StoreEntry) -> None:
    assert got.key == want.key and got.meta == want.meta
    assert set(got.tensors) == set(want.tensors)
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert g.dtype == t.dtype, name
        assert g.shape == t.shape, name
        assert torch.equal(g, t), name
        # bit-exact, including -0.0 and denormals (torch.equal treats -0.0 == 0.0)
        assert g.contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), name
    assert got.nbytes == want.nbytes


def _backend_factory(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    if name == "disk":
        return lambda: DiskBackend(tmp_path / "store")
    url = request.getfixturevalue("redis_url")
    request.getfixturevalue("redis_client")  # empties the database
    return lambda: RedisBackend(url)


@pytest.mark.parametrize("kind", list(EntryKind), ids=lambda k: k.value)
def test_memory_round_trip(kind: EntryKind) -> None:
    with ChunkStore(memory_bytes=1 << 20) as store:
        entry = _entry(kind, 3)
        store.put(entry)
        got = store.get(entry.key)
        assert got is not None
        _assert_bit_exact(got, _entry(kind, 3))
        assert store.stats().memory_hits == 1 and store.stats().misses == 0


@pytest.mark.parametrize("backend", ["disk", "redis"])
@pytest.mark.parametrize("kind", list(EntryKind), ids=lambda k: k.value)
def test_backend_round_trip(backend: str, kind: EntryKind, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    make = _backend_factory(backend, tmp_path, request)
    entries = [_entry(kind, seed) for seed in range(3)]
    with ChunkStore(memory_bytes=1 << 20, backend=make()) as writer:
        for e in entries:
            writer.put(e)
        writer.flush()
        ws = writer.stats()
        assert ws.writes == 3
        assert ws.bytes_written == sum(len(e.encode()) for e in entries)
    with ChunkStore(memory_bytes=1 << 20, backend=make()) as reader:
        for seed, e in enumerate(entries):
            got = reader.get(e.key)
            assert got is not None, f"{backend}/{kind.value}/{seed} missing"
            _assert_bit_exact(got, _entry(kind, seed))
            assert got.checksum == e.checksum
            assert got.uses == 1
        rs = reader.stats()
        assert (rs.backend_hits, rs.memory_hits, rs.misses) == (3, 0, 0)
        assert rs.bytes_read == ws.bytes_written
        assert rs.backend_bytes == ws.bytes_written
        assert reader.get(e.key) is not None
        assert reader.stats().memory_hits == 1  # promoted on the first read
        assert sorted(k.digest for k in reader.backend.keys(FP)) == sorted(e.key.digest for e in entries)
