"""Authenticated entries: with a secret, only entries tagged by that secret are used; a forged one is
refused, counted, deleted and recomputed."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kamera_engine.errors import ChecksumError, InvalidInputError
from kamera_sdk.store import (
    DiskBackend,
    EntryAuth,
    RedisBackend,
    StoreEntry,
    UnauthenticatedEntryError,
    open_store,
)

SECRET = "fleet-secret-0123456789abcdef"


def _header(blob: bytes) -> dict[str, Any]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["kamera"])


def _forged(entry: StoreEntry, secret: str | None) -> bytes:
    """A well-formed entry for ``entry``'s key whose tensors an attacker chose (every value 7), with a
    self-consistent data sha256, tagged with ``secret`` (None: untagged)."""
    poisoned = StoreEntry(entry.key, {n: torch.full_like(t, 7) for n, t in entry.tensors.items()}, dict(entry.meta))
    return poisoned.encode(EntryAuth(secret) if secret is not None else None)


def test_tag_covers_every_field_and_secrets_are_checked() -> None:
    auth = EntryAuth(SECRET)
    header = {"format": "1", "fingerprint": "ab", "kind": "canonical", "content_hash": "cd", "variant": "",
              "meta": {}, "data_sha256": "00" * 32}  # fmt: skip
    signed = auth.sign(header)
    auth.verify(signed, "x")
    for field, value in (("kind", "patch"), ("content_hash", "ce"), ("fingerprint", "ac"), ("variant", "r8"),
                         ("data_sha256", "11" * 32), ("meta", {"a": "b"})):  # fmt: skip
        with pytest.raises(UnauthenticatedEntryError, match="not made with this store's secret"):
            auth.verify({**signed, field: value}, "x")
    with pytest.raises(UnauthenticatedEntryError, match="carries no MAC"):
        auth.verify(header, "x")
    with pytest.raises(UnauthenticatedEntryError):
        EntryAuth("another-secret-0123456789").verify(signed, "x")
    with pytest.raises(InvalidInputError, match="at least 16 bytes"):
        EntryAuth("short")
    assert "fleet" not in repr(auth)


def test_forged_redis_entry_is_refused_counted_and_recomputed(
    redis_url: str, redis_client: Any, proc: ModuleType
) -> None:
    e = proc.make_entry(5)
    name = f"kamera:{{{proc.FP}}}:e:{e.key.digest}"
    with open_store(redis_url, secret=SECRET, write_behind=False) as writer:
        writer.put(e)
    blob = redis_client.hget(name, "data")
    assert "mac" in _header(blob)
    with open_store(redis_url, secret=SECRET) as reader:  # the honest entry is used
        got = reader.get(e.key)
        assert got is not None and proc.same(got, e)

    # an attacker with write access to Redis but not the secret: an untagged entry, then one tagged with
    # a guessed secret, each with a checksum that matches its bytes, written straight into the hash
    for secret in (None, "a-guessed-secret-0123456789"):
        forged = _forged(e, secret)
        redis_client.hset(name, mapping={"data": forged, "checksum": hashlib.sha256(forged).hexdigest()})
        with open_store(redis_url, secret=SECRET, write_behind=False) as reader:
            assert reader.get(e.key) is None  # refused: never returned, never used
            s = reader.stats()
            assert (s.refused_auth, s.refused_checksum, s.misses, s.backend_hits) == (1, 0, 1, 0)
            assert not redis_client.exists(name)  # deleted, so the recomputed entry can be written
            reader.put(e)  # the caller recomputed it
        with open_store(redis_url, secret=SECRET) as again:
            got = again.get(e.key)
            assert got is not None and proc.same(got, e) and again.stats().refused_auth == 0

    # without a secret the same forgery passes the checksum: the MAC is what refuses it
    forged = _forged(e, None)
    redis_client.hset(name, mapping={"data": forged, "checksum": hashlib.sha256(forged).hexdigest()})
    plain = RedisBackend(redis_url).get(e.key)
    assert plain is not None and bool((next(iter(plain.tensors.values())) == 7).all())


def test_backend_with_secret_refuses_untagged_and_tampered_data(
    redis_url: str, redis_client: Any, proc: ModuleType
) -> None:
    auth = EntryAuth(SECRET)
    backend = RedisBackend(redis_url, auth=auth)
    e = proc.make_entry(6)
    backend.put(e)
    name = f"kamera:{{{proc.FP}}}:e:{e.key.digest}"
    data = bytearray(redis_client.hget(name, "data"))
    data[-3] ^= 0xFF  # tampered tensor data, checksum recomputed by the attacker
    redis_client.hset(name, mapping={"data": bytes(data), "checksum": hashlib.sha256(data).hexdigest()})
    with pytest.raises(ChecksumError):
        backend.get(e.key)
    assert not backend.contains(e.key)
    RedisBackend(redis_url).put(e)  # written by a process without the secret
    with pytest.raises(UnauthenticatedEntryError, match="carries no MAC"):
        backend.get(e.key)


def test_disk_backend_with_secret(tmp_path: Path, proc: ModuleType) -> None:
    e = proc.make_entry(7)
    with open_store(tmp_path / "s", secret=SECRET, write_behind=False) as store:
        store.put(e)
    with open_store(tmp_path / "s", secret=SECRET) as store:
        got = store.get(e.key)
        assert got is not None and proc.same(got, e)
    other = DiskBackend(tmp_path / "t")
    other.put_blob(e.key, _forged(e, None))
    with open_store(tmp_path / "t", secret=SECRET) as store:
        assert store.get(e.key) is None and store.stats().refused_auth == 1
    with pytest.raises(InvalidInputError, match="needs a backend"):
        open_store(None, secret=SECRET)
