"""The host-RAM tier: LRU vs LFU order, pins, byte budget."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from kamera_engine.errors import InvalidInputError
from kamera_sdk.store import EVICTION_POLICIES, EntryKey, MemoryTier, StoreEntry


def _entries(proc: ModuleType, n: int) -> list[StoreEntry]:
    return [proc.make_entry(i, elems=64) for i in range(n)]


def _size(proc: ModuleType) -> int:
    return int(proc.make_entry(0, elems=64).nbytes)  # 2*64*2 + 2*64*4 + 8*8 = 832


def test_entry_size_is_known(proc: ModuleType) -> None:
    assert _size(proc) == 2 * 64 * 2 + 2 * 64 * 4 + 8 * 8


def _fill_and_touch(proc: ModuleType, eviction: str) -> tuple[MemoryTier, list[StoreEntry]]:
    size = _size(proc)
    tier = MemoryTier(3 * size, eviction)
    a, b, c, d = _entries(proc, 4)
    for e in (a, b, c):
        assert tier.put(e)
    for _ in range(3):  # a: frequent but least recent among the three after the touches below
        assert tier.get(a.key) is a
    assert tier.get(b.key) is b
    assert tier.get(c.key) is c
    assert tier.put(d)
    return tier, [a, b, c, d]


def test_lru_evicts_least_recently_used(proc: ModuleType) -> None:
    tier, (_a, b, c, d) = _fill_and_touch(proc, "lru")
    assert set(tier.keys()) == {b.key, c.key, d.key}  # a was touched longest ago
    assert tier.evictions == 1


def test_lfu_evicts_least_frequently_used(proc: ModuleType) -> None:
    tier, (a, _b, c, d) = _fill_and_touch(proc, "lfu")
    # uses: a=4, b=2, c=2; b and c tie on frequency and b is older
    assert set(tier.keys()) == {a.key, c.key, d.key}
    assert tier.evictions == 1


def test_peek_does_not_count_a_use(proc: ModuleType) -> None:
    size = _size(proc)
    tier = MemoryTier(2 * size, "lru")
    a, b, c = _entries(proc, 3)
    tier.put(a)
    tier.put(b)
    assert tier.peek(a.key) is a  # would save a under LRU if it counted
    tier.put(c)
    assert a.key not in tier and b.key in tier and c.key in tier


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_pinned_entries_survive_eviction(proc: ModuleType, eviction: str) -> None:
    size = _size(proc)
    tier = MemoryTier(2 * size, eviction)
    entries = _entries(proc, 6)
    tier.pin(entries[0].key)
    tier.pin(entries[0].key)  # refcount: a window and its fork
    for e in entries:
        tier.put(e)
        assert entries[0].key in tier
    assert tier.nbytes == 2 * size
    assert tier.pins(entries[0].key) == 2
    assert tier.unpin(entries[0].key) == 1
    tier.put(proc.make_entry(10, elems=64))
    assert entries[0].key in tier  # still pinned once
    assert tier.unpin(entries[0].key) == 0
    tier.put(proc.make_entry(11, elems=64))
    tier.put(proc.make_entry(12, elems=64))
    assert entries[0].key not in tier
    with pytest.raises(InvalidInputError, match="not pinned"):
        tier.unpin(entries[0].key)


def test_pinned_entries_admitted_over_budget_then_trimmed_on_unpin(proc: ModuleType) -> None:
    size = _size(proc)
    tier = MemoryTier(2 * size, "lru")
    entries = _entries(proc, 4)
    for e in entries[:3]:
        tier.pin(e.key)
        assert tier.put(e)
    assert tier.nbytes == 3 * size > tier.max_bytes  # only pinned bytes exceed the budget
    assert tier.pinned_bytes == 3 * size
    assert not tier.put(entries[3])  # unpinned and no room: not admitted
    assert entries[3].key not in tier
    tier.unpin(entries[0].key)  # now evictable: trimmed back to budget at once
    assert tier.nbytes == 2 * size and entries[0].key not in tier


def test_oversized_entry_not_admitted_and_nothing_evicted(proc: ModuleType) -> None:
    size = _size(proc)
    tier = MemoryTier(2 * size, "lru")
    small = proc.make_entry(1, elems=64)
    tier.put(small)
    assert not tier.put(proc.make_entry(2, elems=4096))
    assert small.key in tier and tier.evictions == 0


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_budget_respected_under_random_traffic(proc: ModuleType, eviction: str) -> None:
    rng = random.Random(0)
    pool = [proc.make_entry(i, elems=rng.choice([16, 64, 256])) for i in range(40)]
    budget = 5000
    tier = MemoryTier(budget, eviction)
    for _ in range(400):
        e = rng.choice(pool)
        if rng.random() < 0.5:
            tier.put(e)
        else:
            tier.get(e.key)
        assert tier.nbytes <= budget
        assert tier.nbytes == sum(x.nbytes for x in pool if x.key in tier)
    assert tier.evictions > 0


def test_bad_arguments(proc: ModuleType) -> None:
    with pytest.raises(InvalidInputError, match="eviction must be one of"):
        MemoryTier(10, "fifo")
    with pytest.raises(InvalidInputError, match=r"memory_bytes \(the memory tier.s max_bytes\) must be an int >= 0"):
        MemoryTier(-1)
    with pytest.raises(InvalidInputError, match="EntryKey"):
        MemoryTier(10).pin("x")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="StoreEntry"):
        MemoryTier(10).put(EntryKey(proc.FP, "canonical", "aa"))  # type: ignore[arg-type]


def test_variants_follow_admission_eviction_and_discard(proc: ModuleType) -> None:
    """The tier's per-content index (what ChunkStore.variants reads instead of scanning the tier)."""
    a, b = (proc.make_entry(1, kind="patch", variant=v) for v in ("x", "y"))
    other = proc.make_entry(2, kind="patch")
    tier = MemoryTier(a.nbytes + b.nbytes)  # room for two
    for e in (a, b):
        assert tier.put(e)
    content = a.key.content_hash
    assert sorted(k.variant for k in tier.variants(proc.FP, "patch", content)) == ["x", "y"]
    assert tier.variants(proc.FP, "canonical", content) == [] and tier.variants(proc.OTHER_FP, "patch", content) == []
    tier.get(b.key)  # a is now the least recently used
    assert tier.put(other)  # evicts a
    assert tier.variants(proc.FP, "patch", content) == [b.key]
    tier.discard(b.key)
    assert tier.variants(proc.FP, "patch", content) == [] and tier._by_content == {
        (proc.FP, "patch", other.key.content_hash): {other.key}
    }
