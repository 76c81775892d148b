"""DiskBackend: refusal of corrupt / foreign entries, quarantine, bounds, path safety, sweeping, eviction."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from types import ModuleType

import pytest

from kamera_engine.errors import ChecksumError, FingerprintMismatchError, InvalidInputError, StoreError
from kamera_sdk.store import ChunkStore, DiskBackend, EntryKey, EntryKind


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_layout_index_and_idempotent_put(tmp_path: Path, proc: ModuleType) -> None:
    backend = DiskBackend(tmp_path)
    e = proc.make_entry(1)
    written = backend.put(e)
    assert written == len(e.encode()) == backend.path_for(e.key).stat().st_size
    assert backend.put(proc.make_entry(1)) == 0  # already stored
    assert backend.path_for(e.key) == tmp_path / "objects" / e.key.digest[:2] / f"{e.key.digest}.safetensors"
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        row = db.execute(
            "SELECT fingerprint, kind, content_hash, variant, nbytes, file_bytes, checksum, meta, tensors FROM entries"
        ).fetchall()
    assert row == [
        (
            proc.FP,
            "canonical",
            proc.content_hash(1),
            "",
            e.nbytes,
            written,
            e.checksum,
            '{"index": "1"}',
            '{"k": ["bfloat16", [2, 1024]], "pos": ["int64", [8]], "v": ["float32", [2, 1024]]}',
        )
    ]
    assert len(backend) == 1 and backend.total_bytes() == written
    assert backend.contains(e.key) and not backend.contains(proc.make_entry(2).key)


@pytest.mark.parametrize("where", ["header", "data", "truncate"])
def test_corrupt_file_refused_counted_quarantined(tmp_path: Path, proc: ModuleType, where: str) -> None:
    backend = DiskBackend(tmp_path)
    e = proc.make_entry(4)
    backend.put(e)
    path = backend.path_for(e.key)
    if where == "truncate":
        path.write_bytes(path.read_bytes()[:-100])  # a torn write, as if the rename had raced the data
    else:
        _flip(path, 20 if where == "header" else path.stat().st_size - 7)
    with pytest.raises(ChecksumError):
        DiskBackend(tmp_path).get(e.key)
    assert not path.exists() and not backend.contains(e.key)
    assert len(list((tmp_path / "quarantine").iterdir())) == 1

    # Through ChunkStore: a counted miss, then a recompute (put) is served again.
    backend.put(e)
    _flip(path, path.stat().st_size - 7)
    with ChunkStore(memory_bytes=1 << 20, backend=DiskBackend(tmp_path)) as store:
        assert store.get(e.key) is None
        s = store.stats()
        assert (s.refused_checksum, s.misses, s.backend_hits, s.refused_fingerprint) == (1, 1, 0, 0)
        store.put(proc.make_entry(4))
        store.flush()
        assert store.stats().writes == 1
    with ChunkStore(memory_bytes=1 << 20, backend=DiskBackend(tmp_path)) as store:
        got = store.get(e.key)
        assert got is not None and proc.same(got, e)


def test_wrong_fingerprint_refused_counted(tmp_path: Path, proc: ModuleType) -> None:
    backend = DiskBackend(tmp_path)
    theirs = proc.make_entry(5, fingerprint=proc.OTHER_FP)
    ours = EntryKey(proc.FP, theirs.key.kind, theirs.key.content_hash)
    # another model's bytes under our key (a digest collision or tampering); the checksum is valid
    assert backend.put_blob(ours, theirs.encode()) > 0
    with pytest.raises(FingerprintMismatchError, match="written by model"):
        DiskBackend(tmp_path).get(ours)
    assert not backend.contains(ours)
    backend.put_blob(ours, theirs.encode())
    with ChunkStore(memory_bytes=1 << 20, backend=DiskBackend(tmp_path)) as store:
        assert store.get(ours) is None
        s = store.stats()
        assert (s.refused_fingerprint, s.refused_checksum, s.misses) == (1, 0, 1)
        # the other model's own key is a different file: it never sees ours either
        assert store.get(theirs.key) is None and store.stats().misses == 2


def test_entry_under_another_key_is_a_load_error(tmp_path: Path, proc: ModuleType) -> None:
    backend = DiskBackend(tmp_path)
    other = proc.make_entry(6)
    key = proc.make_entry(7).key
    backend.put_blob(key, other.encode())
    with ChunkStore(memory_bytes=1 << 20, backend=DiskBackend(tmp_path)) as store:
        assert store.get(key) is None
        assert store.stats().load_errors == 1


def test_size_bounds(tmp_path: Path, proc: ModuleType) -> None:
    small = DiskBackend(tmp_path, max_entry_bytes=4096)
    with pytest.raises(StoreError, match="max_entry_bytes"):
        small.put(proc.make_entry(1, elems=4096))
    with pytest.raises(StoreError, match="max_entry_bytes"):
        small.put_blob(proc.make_entry(1).key, b"\0" * 5000)
    assert len(small) == 0
    big = DiskBackend(tmp_path)
    e = proc.make_entry(2, elems=4096)
    big.put(e)
    with pytest.raises(StoreError, match="over max_entry_bytes"):
        small.get(e.key)  # an oversized file is refused before it is read into memory
    assert big.get(e.key) is not None  # and left alone: it is too large for that reader, not bad
    exact = DiskBackend(tmp_path / "exact", max_entry_bytes=len(proc.make_entry(3).encode()))
    exact.put(proc.make_entry(3))  # the limit is on the file, on write as on read
    assert exact.get(proc.make_entry(3).key) is not None
    for bad in (0, -5, 1.5, True):
        with pytest.raises(InvalidInputError, match="max_entry_bytes"):
            DiskBackend(tmp_path, max_entry_bytes=bad)  # type: ignore[arg-type]


def test_keys_never_escape_the_store(tmp_path: Path, proc: ModuleType) -> None:
    root = tmp_path / "store"
    backend = DiskBackend(root)
    for i, variant in enumerate(["../../../../tmp/x", "/etc/passwd", "a\0b", "..\\..\\x", "ß" * 300]):
        e = proc.make_entry(i, elems=8, kind=EntryKind.PATCH, variant=variant)
        backend.put(e)
        path = backend.path_for(e.key).resolve()
        assert path.is_relative_to(root.resolve() / "objects")
        assert path.name == f"{e.key.digest}.safetensors"
        got = backend.get(e.key)
        assert got is not None and got.key.variant == variant
    files = {p.relative_to(root).parts[0] for p in root.rglob("*") if p.is_file()}
    assert files <= {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "objects"}


def test_refuses_foreign_directory_and_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="without a Kamera index"):
        DiskBackend(tmp_path)
    with pytest.raises(InvalidInputError, match="not a directory"):
        DiskBackend(tmp_path / "notes.txt")
    with pytest.raises(InvalidInputError, match="store path"):
        DiskBackend("")
    assert not (tmp_path / "objects").exists()


def test_temps_of_dead_writers_and_orphans_are_swept(tmp_path: Path, proc: ModuleType) -> None:
    from kamera_sdk.store._disk import _HOST

    backend = DiskBackend(tmp_path)
    e = proc.make_entry(1)
    backend.put(e)
    sub = backend.path_for(e.key).parent
    dead = sub / f".tmp-{_HOST}-999999999-0000-{e.key.digest[:16]}"  # no such pid
    live = sub / f".tmp-{_HOST}-{os.getpid()}-0000-{e.key.digest[:16]}"
    dead.write_bytes(b"partial")
    live.write_bytes(b"in progress")
    DiskBackend(tmp_path)  # reopening sweeps
    assert not dead.exists() and live.exists()
    # an orphan (killed between rename and index insert) is never served, and repair indexes it again:
    # the file is complete (renamed only after fsync) and carries its own index row
    orphan = proc.make_entry(2)
    orphan_path = backend.path_for(orphan.key)
    orphan_path.parent.mkdir(exist_ok=True)
    orphan_path.write_bytes(orphan.encode())
    assert backend.get(orphan.key) is None
    backend.path_for(e.key).unlink()  # a row whose file vanished
    report = backend.repair(orphan_grace_s=0.0)
    assert report == {"temps": 0, "rows_dropped": 1, "orphan_files": 0, "orphans_indexed": 1, "index_rebuilt": 0}
    assert len(backend) == 1 and orphan_path.exists() and live.exists()
    got = backend.get(orphan.key)
    assert got is not None and proc.same(got, orphan)
    # a file with no row that does not verify is quarantined, not indexed
    bad = proc.make_entry(3)
    bad_path = backend.path_for(bad.key)
    bad_path.parent.mkdir(exist_ok=True)
    blob = bytearray(bad.encode())
    blob[-1] ^= 0xFF
    bad_path.write_bytes(bytes(blob))
    report = backend.repair(orphan_grace_s=0.0)
    assert (report["orphan_files"], report["orphans_indexed"]) == (1, 0)
    assert not bad_path.exists() and len(list((tmp_path / "quarantine").iterdir())) == 1


def test_disk_budget_evicts_least_recently_used(tmp_path: Path, proc: ModuleType) -> None:
    size = len(proc.make_entry(0).encode())
    backend = DiskBackend(tmp_path, max_bytes=3 * size + 10)
    for i in range(3):
        backend.put(proc.make_entry(i))
    assert backend.get(proc.make_entry(0).key) is not None  # 0 is now the most recent
    backend.put(proc.make_entry(3))
    assert backend.total_bytes() == 3 * size <= backend.max_bytes
    assert {k.content_hash for k in backend.keys()} == {proc.content_hash(i) for i in (0, 2, 3)}
    assert backend.evictions == 1
    assert not backend.path_for(proc.make_entry(1).key).exists()


def test_delete_and_close(tmp_path: Path, proc: ModuleType) -> None:
    backend = DiskBackend(tmp_path)
    e = proc.make_entry(1)
    backend.put(e)
    assert backend.delete(e.key) and not backend.delete(e.key)
    assert not backend.path_for(e.key).exists() and backend.get(e.key) is None
    backend.close()
    with pytest.raises(StoreError, match="closed"):
        backend.get(e.key)


def test_an_entry_larger_than_the_store_is_refused(tmp_path: Path, proc: ModuleType) -> None:
    size = len(proc.make_entry(0).encode())
    backend = DiskBackend(tmp_path, max_bytes=size - 1)
    with pytest.raises(StoreError, match="larger than the whole store"):
        backend.put(proc.make_entry(0))
    assert len(backend) == 0 and backend.total_bytes() == 0


def test_a_row_whose_file_is_gone_can_be_written_again(tmp_path: Path, proc: ModuleType) -> None:
    backend = DiskBackend(tmp_path)
    e = proc.make_entry(5)
    backend.put(e)
    backend.path_for(e.key).unlink()  # lost between the index and the file (another process, a crash)
    assert backend.get(e.key) is None
    assert not backend.contains(e.key)
    assert backend.put(e) > 0 and backend.get(e.key) is not None


def test_a_read_error_leaves_the_entry_in_place(tmp_path: Path, proc: ModuleType, monkeypatch) -> None:
    backend = DiskBackend(tmp_path)
    e = proc.make_entry(6)
    backend.put(e)
    real_open = open

    def flaky(path, *a, **k):
        if str(path).endswith(".safetensors"):
            raise OSError(24, "Too many open files")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", flaky)
    with pytest.raises(StoreError, match="cannot read"):
        backend.get(e.key)
    monkeypatch.undo()
    assert backend.get(e.key) is not None  # not quarantined: the next read succeeds
