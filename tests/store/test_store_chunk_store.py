"""ChunkStore: tier order, write-behind, parallel loads, pins, stats, open_store."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from kamera_engine.errors import InvalidInputError, StoreError
from kamera_sdk.store import (
    ChunkStore,
    DiskBackend,
    EntryKey,
    EntryKind,
    RedisBackend,
    StoreEntry,
    default_store_path,
    open_store,
)


class SlowDisk(DiskBackend):
    """A DiskBackend whose reads take ``delay`` seconds and whose writes wait for ``gate``."""

    def __init__(self, path: Path, delay: float = 0.0) -> None:
        super().__init__(path)
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0
        self.in_flight = 0
        self.most_in_flight = 0  # reads running at once, at most
        self._count = threading.Lock()

    def get(self, key: EntryKey) -> StoreEntry | None:
        with self._count:
            self.reads += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            return super().get(key)
        finally:
            with self._count:
                self.in_flight -= 1

    def put(self, entry: StoreEntry) -> int:
        assert self.gate.wait(10)
        return super().put(entry)


def test_write_behind_serves_pending_then_persists(tmp_path: Path, proc: ModuleType) -> None:
    backend = SlowDisk(tmp_path)
    backend.gate.clear()
    store = ChunkStore(memory_bytes=0, backend=backend)  # RAM tier holds nothing unpinned
    e = proc.make_entry(1)
    store.put(e)
    assert store.get(e.key) is e  # still being written: served from the pending set
    assert store.contains(e.key) and not backend.contains(e.key)
    assert store.stats().writes == 0
    backend.gate.set()
    store.flush()
    assert backend.contains(e.key)
    s = store.stats()
    assert (s.writes, s.bytes_written, s.memory_hits, s.memory_bytes) == (1, len(e.encode()), 1, 0)
    got = store.get(e.key)  # now from disk
    assert got is not None and got is not e and proc.same(got, e)
    assert store.stats().backend_hits == 1
    store.close()


def test_variants_lists_every_tier_and_other_writers(tmp_path: Path, proc: ModuleType) -> None:
    """A content's variants: this store's pending writes and memory, and what another store (another
    process) wrote to the same directory; other contents, kinds and models are not listed."""
    backend = SlowDisk(tmp_path)
    backend.gate.clear()
    store = ChunkStore(memory_bytes=0, backend=backend)  # RAM holds nothing: pending or on disk only
    other = ChunkStore(backend=DiskBackend(tmp_path), write_behind=False)
    patch = [proc.make_entry(7, kind="patch", variant=f"v{i}") for i in range(3)]
    store.put(patch[0])  # pending (the write waits for the gate)
    other.put(patch[1])  # another writer, on disk now
    for noise in (
        proc.make_entry(8, kind="patch"),
        proc.make_entry(7),
        proc.make_entry(7, kind="patch", fingerprint=proc.OTHER_FP),
    ):
        other.put(noise)
    fp, content = proc.FP, patch[0].key.content_hash
    assert {k.variant for k in store.variants(fp, "patch", content)} == {"v0", "v1"}
    backend.gate.set()
    store.flush()
    other.put(patch[2])
    assert sorted(k.variant for k in store.variants(fp, EntryKind.PATCH, content)) == ["v0", "v1", "v2"]
    assert sorted(k.variant for k in other.variants(fp, "patch", content)) == ["v0", "v1", "v2"]
    with ChunkStore() as memory_only:  # no backend: the memory tier alone
        memory_only.put(patch[1])
        assert memory_only.variants(fp, "patch", content) == [patch[1].key]
        with pytest.raises(InvalidInputError):
            memory_only.variants(fp, "patch", "not hex")
    store.close()
    other.close()


def test_close_flushes_pending_writes(tmp_path: Path, proc: ModuleType) -> None:
    backend = SlowDisk(tmp_path)
    backend.gate.clear()
    store = ChunkStore(backend=backend)
    for i in range(5):
        store.put(proc.make_entry(i))
    threading.Timer(0.1, backend.gate.set).start()
    store.close()
    store.close()  # idempotent
    assert len(DiskBackend(tmp_path)) == 5
    with pytest.raises(StoreError, match="closed"):
        store.put(proc.make_entry(9))


def test_get_many_loads_in_parallel(tmp_path: Path, proc: ModuleType) -> None:
    delay = 0.25
    with ChunkStore(backend=DiskBackend(tmp_path)) as w:
        for i in range(4):
            w.put(proc.make_entry(i))
    backend = SlowDisk(tmp_path, delay=delay)
    store = ChunkStore(backend=backend, load_workers=5)
    keys = [proc.make_entry(i).key for i in range(5)]  # entry 4 was never stored
    found = store.get_many([*keys, keys[0]])  # duplicates are loaded once
    assert set(found) == set(keys[:4])
    assert all(proc.same(found[k], proc.make_entry(i)) for i, k in enumerate(keys[:4]))
    # parallel: the reads overlapped (counted, not timed: a busy machine only delays threads' starts)
    assert backend.reads == 5 and backend.most_in_flight >= 2, f"at most {backend.most_in_flight} read at once"
    s = store.stats()
    assert (s.backend_hits, s.misses, s.memory_hits) == (4, 1, 0)
    # now resident: a second call is all memory hits and reads nothing
    reads = store.backend.reads  # type: ignore[union-attr]
    assert set(store.get_many(keys[:4])) == set(keys[:4])
    assert store.backend.reads == reads and store.stats().memory_hits == 4  # type: ignore[union-attr]
    store.close()


def test_submit_get_overlaps_with_compute(tmp_path: Path, proc: ModuleType) -> None:
    delay = 0.4
    with ChunkStore(backend=DiskBackend(tmp_path)) as w:
        w.put(proc.make_entry(1))
    with ChunkStore(backend=SlowDisk(tmp_path, delay=delay)) as store:
        t0 = time.perf_counter()
        fut = store.submit_get(proc.make_entry(1).key)
        time.sleep(delay)  # "compute the missing chunks" while the load runs
        entry = fut.result()
        elapsed = time.perf_counter() - t0
        assert entry is not None and proc.same(entry, proc.make_entry(1))
        assert elapsed < 1.6 * delay  # sequential would take 2 * delay
        done = store.submit_get(proc.make_entry(1).key)
        assert done.done() and done.result() is entry  # memory hit: completed at once


def test_pins_survive_through_chunk_store(tmp_path: Path, proc: ModuleType) -> None:
    size = proc.make_entry(0).nbytes
    with ChunkStore(memory_bytes=2 * size, backend=DiskBackend(tmp_path), eviction="lru") as store:
        a = proc.make_entry(0)
        assert store.pin(a.key) == 1
        store.put(a)
        for i in range(1, 6):
            store.put(proc.make_entry(i))
        store.flush()
        s = store.stats()
        assert a.key in store.memory and s.evictions == 4 and s.memory_bytes == 2 * size
        assert s.pinned_bytes == size and s.memory_entries == 2
        assert store.get(a.key) is a and store.stats().backend_hits == 0
        assert store.unpin(a.key) == 0
        with pytest.raises(InvalidInputError, match="not pinned"):
            store.unpin(a.key)
        for i in range(6, 8):
            store.put(proc.make_entry(i))
        assert a.key not in store.memory
        assert store.get(a.key) is not None and store.stats().backend_hits == 1  # back from disk


def test_write_behind_failure_is_counted_not_raised(tmp_path: Path, proc: ModuleType) -> None:
    with ChunkStore(backend=DiskBackend(tmp_path, max_entry_bytes=1024)) as store:
        e = proc.make_entry(1)
        store.put(e)
        store.flush()
        s = store.stats()
        assert (s.write_errors, s.writes, s.bytes_written) == (1, 0, 0)
        assert store.get(e.key) is e  # still usable in this process
    with ChunkStore(backend=DiskBackend(tmp_path, max_entry_bytes=1024), write_behind=False) as store:
        with pytest.raises(StoreError, match="max_entry_bytes"):
            store.put(proc.make_entry(2))
        assert store.stats().write_errors == 1


def test_concurrent_threads_keep_counts_consistent(tmp_path: Path, proc: ModuleType) -> None:
    entries = [proc.make_entry(i, elems=64) for i in range(30)]
    size = entries[0].nbytes
    store = ChunkStore(memory_bytes=8 * size, backend=DiskBackend(tmp_path))
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            e = rng.choice(entries)
            if rng.random() < 0.4:
                store.put(e)
            else:
                got = store.get(e.key)
                if got is not None and not proc.same(got, e):
                    errors.append(f"wrong content for {e.key.content_hash}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    s = store.stats()
    assert errors == []
    assert s.memory_bytes <= 8 * size
    assert s.memory_hits + s.backend_hits + s.misses == 4 * 150 - _puts(4)
    assert s.writes == len(store.backend.keys())  # type: ignore[union-attr]
    store.close()


def _puts(n_workers: int) -> int:
    """How many puts the seeded workers above issue (recomputed from the same seeds)."""
    total = 0
    for seed in range(n_workers):
        rng = random.Random(seed)
        for _ in range(150):
            rng.choice(range(30))
            total += rng.random() < 0.4
    return total


def test_open_store_dispatch(tmp_path: Path, redis_url: str, redis_client: object) -> None:
    mem = open_store(None)
    assert mem.backend is None and mem.stats().backend == "memory"
    assert open_store(mem) is mem
    disk = open_store(str(tmp_path / "a"), memory_bytes=123, eviction="lfu", max_bytes=10_000)
    assert isinstance(disk.backend, DiskBackend) and disk.backend.root == tmp_path / "a"
    assert disk.memory.max_bytes == 123 and disk.memory.policy.name == "lfu" and disk.backend.max_bytes == 10_000
    assert isinstance(open_store(tmp_path / "b").backend, DiskBackend)
    red = open_store(redis_url, ttl_s=60, max_bytes=1 << 20)
    assert isinstance(red.backend, RedisBackend) and red.backend.ttl_s == 60
    wrapped = open_store(DiskBackend(tmp_path / "c"), write_behind=False)
    assert wrapped.write_behind is False and wrapped.stats().backend == "disk"
    for bad, msg in [("s3://bucket/x", "scheme not supported"), (42, "store must be None, a path")]:
        with pytest.raises(InvalidInputError, match=msg):
            open_store(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="ttl_s applies to a redis store"):
        open_store(tmp_path / "d", ttl_s=5)
    with pytest.raises(InvalidInputError, match="backend must be"):
        ChunkStore(backend="disk")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="EntryKey"):
        mem.get("abc")  # type: ignore[arg-type]
    for s in (mem, disk, red, wrapped):
        s.close()


def test_default_store_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KAMERA_HOME", str(tmp_path / "kh"))
    assert default_store_path() == tmp_path / "kh" / "store"
    monkeypatch.delenv("KAMERA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_path() == tmp_path / "home" / ".cache" / "kamera" / "store"
