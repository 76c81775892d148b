"""RedisBackend against a real redis-server: namespacing, byte budget (LRU), TTL, refusals, errors."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from kamera_engine.errors import ChecksumError, FingerprintMismatchError, InvalidInputError, StoreError
from kamera_sdk.store import ChunkStore, EntryKey, RedisBackend


def test_keys_are_namespaced_by_fingerprint(redis_url: str, redis_client: Any, proc: ModuleType) -> None:
    backend = RedisBackend(redis_url)
    e = proc.make_entry(1)
    written = backend.put(e)
    assert written == len(e.encode())
    assert backend.put(proc.make_entry(1)) == 0
    ns = f"kamera:{{{proc.FP}}}:"
    assert sorted(k.decode() for k in redis_client.keys("*")) == sorted(
        [f"{ns}e:{e.key.digest}", f"{ns}lru", f"{ns}sizes", f"{ns}bytes", f"{ns}clock"]  # no set: not a patch
    )
    fields = redis_client.hgetall(f"{ns}e:{e.key.digest}")
    assert fields[b"checksum"].decode() == e.checksum
    assert fields[b"data"] == e.encode()
    assert int(fields[b"size"]) == written and int(fields[b"nbytes"]) == e.nbytes
    assert backend.total_bytes(proc.FP) == backend.total_bytes() == written
    other = proc.make_entry(1, fingerprint=proc.OTHER_FP)
    backend.put(other)
    assert backend.total_bytes(proc.OTHER_FP) == written and backend.total_bytes() == 2 * written
    assert [k.fingerprint for k in backend.keys(proc.FP)] == [proc.FP]
    assert len(backend.keys()) == 2


def test_byte_budget_evicts_lru_within_namespace(redis_url: str, redis_client: Any, proc: ModuleType) -> None:
    size = len(proc.make_entry(0).encode())
    budget = 3 * size + size // 2
    backend = RedisBackend(redis_url, max_bytes=budget)
    foreign = RedisBackend(redis_url)  # another model's namespace is not charged to ours
    foreign.put(proc.make_entry(100, fingerprint=proc.OTHER_FP))
    for i in range(3):
        backend.put(proc.make_entry(i))
    assert backend.get(proc.make_entry(0).key) is not None  # 0 becomes the most recent
    backend.put(proc.make_entry(3))  # evicts 1
    backend.put(proc.make_entry(4))  # evicts 2
    assert backend.evictions == 2
    assert backend.total_bytes(proc.FP) == 3 * size <= budget
    assert sorted(k.content_hash for k in backend.keys(proc.FP)) == sorted(proc.content_hash(i) for i in (0, 3, 4))
    assert foreign.contains(proc.make_entry(100, fingerprint=proc.OTHER_FP).key)
    assert redis_client.zcard(f"kamera:{{{proc.FP}}}:lru") == 3
    with pytest.raises(StoreError, match="budget"):
        backend.put(proc.make_entry(9, elems=8 * 1024))
    with ChunkStore(memory_bytes=0, backend=RedisBackend(redis_url, max_bytes=budget)) as store:
        for i in range(5, 10):
            store.put(proc.make_entry(i))
        store.flush()
        assert store.stats().backend_bytes == 3 * size + len(proc.make_entry(100).encode())
        assert store.stats().backend_evictions == 5


def test_ttl_expires_and_accounting_follows(redis_url: str, redis_client: Any, proc: ModuleType) -> None:
    backend = RedisBackend(redis_url, ttl_s=1.0)
    e = proc.make_entry(1)
    backend.put(e)
    assert 0 < redis_client.pttl(f"kamera:{{{proc.FP}}}:e:{e.key.digest}") <= 1000
    time.sleep(0.6)
    assert backend.get(e.key) is not None  # a read refreshes the TTL
    time.sleep(0.6)
    assert backend.get(e.key) is not None  # 1.2 s after the put: alive only because of the refresh
    time.sleep(1.3)
    assert backend.get(e.key) is None
    assert backend.total_bytes(proc.FP) == 0 and redis_client.zcard(f"kamera:{{{proc.FP}}}:lru") == 0


def test_corrupt_and_foreign_entries_refused(redis_url: str, redis_client: Any, proc: ModuleType) -> None:
    backend = RedisBackend(redis_url)
    e = proc.make_entry(2)
    backend.put(e)
    name = f"kamera:{{{proc.FP}}}:e:{e.key.digest}"
    data = bytearray(redis_client.hget(name, "data"))
    data[-3] ^= 0xFF
    redis_client.hset(name, "data", bytes(data))
    with pytest.raises(ChecksumError):
        backend.get(e.key)
    assert not backend.contains(e.key) and backend.total_bytes(proc.FP) == 0

    theirs = proc.make_entry(3, fingerprint=proc.OTHER_FP)
    ours = EntryKey(proc.FP, theirs.key.kind, theirs.key.content_hash)
    backend.put_blob(ours, theirs.encode())
    with pytest.raises(FingerprintMismatchError):
        backend.get(ours)
    assert not backend.contains(ours)

    backend.put(e)
    redis_client.hset(name, "data", bytes(data))
    backend.put_blob(ours, theirs.encode())
    with ChunkStore(memory_bytes=1 << 20, backend=RedisBackend(redis_url)) as store:
        assert store.get(e.key) is None and store.get(ours) is None
        s = store.stats()
        assert (s.refused_checksum, s.refused_fingerprint, s.misses, s.backend_hits) == (1, 1, 2, 0)


def test_errors_are_store_errors(
    redis_url: str, doomed_redis: tuple[str, Callable[[], None]], proc: ModuleType
) -> None:
    with pytest.raises(InvalidInputError, match="redis url"):
        RedisBackend("http://localhost:6379")
    with pytest.raises(InvalidInputError, match="ttl_s"):
        RedisBackend(redis_url, ttl_s=0)
    dead = "redis://127.0.0.1:1/0"
    with pytest.raises(StoreError, match=r"cannot connect to redis at redis://127\.0\.0\.1:1/0"):
        RedisBackend(dead, socket_timeout_s=0.5)
    url, stop = doomed_redis
    backend = RedisBackend(url, socket_timeout_s=1.0)
    stop()  # the server goes away
    with pytest.raises(StoreError, match="redis get failed") as info:
        backend.get(proc.make_entry(1).key)
    assert info.value.__cause__ is not None
    with ChunkStore(memory_bytes=1 << 20, backend=backend, write_behind=False) as store:
        assert store.get(proc.make_entry(1).key) is None
        assert store.stats().load_errors == 1
        with pytest.raises(StoreError):
            store.put(proc.make_entry(1))
        assert store.stats().write_errors == 1
        assert store.get(proc.make_entry(1).key) is not None  # still served from memory


def test_password_not_in_messages() -> None:
    with pytest.raises(StoreError) as info:
        RedisBackend("redis://user:s3cret@127.0.0.1:1/0", socket_timeout_s=0.5)
    assert "s3cret" not in str(info.value)


def test_variants_lists_every_entry_of_a_content_and_drops_gone_ones(
    redis_url: str, redis_client: Any, proc: ModuleType
) -> None:
    """Two backends (two processes' connections) write variants of one content; either lists them all. An
    entry deleted behind the set's back (expiry, eviction) is dropped from the set when it is listed."""
    a, b = RedisBackend(redis_url), RedisBackend(redis_url)
    ours = [proc.make_entry(1, kind="patch", variant=f"v{i}") for i in range(3)]
    a.put(ours[0])
    b.put(ours[1])
    a.put(ours[2])
    a.put(proc.make_entry(2, kind="patch"))  # another content
    a.put(proc.make_entry(1, kind="canonical"))  # another kind
    a.put(proc.make_entry(1, kind="patch", fingerprint=proc.OTHER_FP))  # another model
    listed = b.variants(proc.FP, "patch", ours[0].key.content_hash)
    assert sorted(k.variant for k in listed) == ["v0", "v1", "v2"] and all(k in {e.key for e in ours} for k in listed)
    redis_client.delete(f"kamera:{{{proc.FP}}}:e:{ours[1].key.digest}")  # gone as an expired entry goes
    assert sorted(k.variant for k in a.variants(proc.FP, "patch", ours[0].key.content_hash)) == ["v0", "v2"]
    content_set = f"kamera:{{{proc.FP}}}:c:patch:{ours[0].key.content_hash}"
    assert redis_client.scard(content_set) == 2  # pruned
    assert a.variants(proc.FP, "patch", "ab" * 16) == []
    redis_client.delete(content_set)  # a set that lost its members (or an entry stored before sets)
    assert b.variants(proc.FP, "patch", ours[0].key.content_hash) == []
    assert b.put(ours[0]) == 0  # already stored: nothing written, but listed again
    assert b.variants(proc.FP, "patch", ours[0].key.content_hash) == [ours[0].key]
    assert a.delete(ours[0].key) and not redis_client.exists(content_set)  # delete unlists; empty set goes
    with pytest.raises(InvalidInputError, match="patch entries only"):
        a.variants(proc.FP, "canonical", ours[0].key.content_hash)


def test_evicted_patches_leave_their_content_set_and_sets_expire(
    redis_url: str, redis_client: Any, proc: ModuleType
) -> None:
    size = len(proc.make_entry(1, kind="patch").encode())
    backend = RedisBackend(redis_url, max_bytes=2 * size + size // 2, ttl_s=60)
    first, second, third = (proc.make_entry(i, kind="patch") for i in (1, 2, 3))
    for e in (first, second, third):  # the third evicts the first (LRU)
        backend.put(e)
    ns = f"kamera:{{{proc.FP}}}:"
    assert not redis_client.exists(f"{ns}c:patch:{first.key.content_hash}")
    assert backend.variants(proc.FP, "patch", third.key.content_hash) == [third.key]
    content_set = f"{ns}c:patch:{third.key.content_hash}"
    assert 0 < redis_client.pttl(content_set) <= 60_000  # no set outlives ttl_s
    redis_client.pexpire(content_set, 1_000)
    assert backend.get(third.key) is not None
    assert redis_client.pttl(content_set) > 1_000  # a read renews the set with the entry
