"""A disk store's index is rebuilt from its entry files: garbage, deleted, emptied, or a rebuild killed."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from safetensors.torch import save as st_save

from kamera_engine.errors import InvalidInputError
from kamera_sdk.store import ChunkStore, DiskBackend, EntryKind, StoreEntry, open_store

# a held-out mix: three kinds, two models, variants, tensors of several dtypes
KINDS = [EntryKind.CANONICAL, EntryKind.PATCH, EntryKind.VISION]


def _held_out(proc: ModuleType) -> list[StoreEntry]:
    entries = []
    for i in range(36):
        fp = proc.FP if i % 3 else proc.OTHER_FP
        entries.append(proc.make_entry(i, 256 + 8 * i, KINDS[i % 3], fp, f"v{i % 4}:r{i % 5}"))
    return entries


def _fill(root: Path, entries: list[StoreEntry]) -> None:
    backend = DiskBackend(root)
    for e in entries:
        assert backend.put(e) > 0
    assert len(backend) == len(entries)
    backend.close()


def _all_read_back(root: Path, entries: list[StoreEntry], proc: ModuleType) -> ChunkStore:
    store = ChunkStore(backend=DiskBackend(root))
    for e in entries:
        got = store.get(e.key)
        assert got is not None and proc.same(got, e), e.key
    return store


@pytest.mark.parametrize("damage", ["garbage", "deleted", "emptied", "foreign-sqlite"])
def test_a_broken_index_recovers_every_entry(
    tmp_path: Path, proc: ModuleType, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "store"
    entries = _held_out(proc)
    _fill(root, entries)
    index = root / "index.sqlite"
    if damage == "garbage":
        index.write_bytes(os.urandom(64 << 10))
    elif damage == "deleted":
        for f in root.glob("index.sqlite*"):
            f.unlink()
    elif damage == "emptied":  # truncated to nothing: SQLite would read it as a new, empty database
        index.write_bytes(b"")
    else:  # a valid SQLite file that is not a Kamera index
        import sqlite3

        index.unlink()
        conn = sqlite3.connect(index)
        conn.execute("CREATE TABLE entries (x)")
        conn.commit()
        conn.close()
    with caplog.at_level(logging.WARNING, logger="kamera.store"):
        store = _all_read_back(root, entries, proc)
    backend = store.backend
    assert isinstance(backend, DiskBackend)
    assert len(backend) == len(entries) == 36  # entries before == entries after
    assert store.stats().index_rebuilds == 1
    report = backend.last_rebuild
    assert report is not None and (report.entries, report.quarantined, report.unverified) == (36, 0, 0)
    assert any("rebuilt the index" in r.getMessage() for r in caplog.records)
    aside = list((root / "index-aside").glob("*/index.sqlite"))
    assert len(aside) == (0 if damage == "deleted" else 1)  # the broken index is kept for inspection
    store.close()
    again = DiskBackend(root)  # the next open finds a healthy index: no second rebuild
    assert again.index_rebuilds == 0 and len(again) == 36


def test_rebuild_quarantines_bad_files_and_keeps_usage(tmp_path: Path, proc: ModuleType) -> None:
    root = tmp_path / "store"
    entries = _held_out(proc)[:6]
    _fill(root, entries)
    backend = DiskBackend(root)
    for _ in range(3):
        backend.get(entries[0].key)
    flipped = backend.path_for(entries[1].key)
    blob = bytearray(flipped.read_bytes())
    blob[-3] ^= 0x10  # a flipped bit in the tensor data: the file's own sha256 catches it
    flipped.write_bytes(bytes(blob))
    misplaced = backend.path_for(entries[2].key)  # a good file under another key's name
    os.replace(misplaced, misplaced.with_name("ab" * 32 + ".safetensors"))
    report = backend.rebuild_index()
    assert (report.entries, report.quarantined, report.reason) == (4, 2, "requested")
    assert len(list((root / "quarantine").iterdir())) == 2
    assert backend.get(entries[1].key) is None and backend.get(entries[2].key) is None
    uses = backend._conn().execute("SELECT uses FROM entries WHERE digest=?", (entries[0].key.digest,))
    assert uses.fetchone()[0] == 3  # a healthy old index's usage counts are carried over
    for e in entries[3:]:
        got = backend.get(e.key)
        assert got is not None and proc.same(got, e)


def test_entries_written_before_files_carried_a_data_checksum(tmp_path: Path, proc: ModuleType) -> None:
    """The previous format (no data_sha256 in the header) is still read and indexed: parsed, not hashed."""
    root = tmp_path / "store"
    backend = DiskBackend(root)
    old = proc.make_entry(5)
    header = {"format": "1", **old.key.to_meta(), "meta": old.meta}
    blob = st_save(old.tensors, {"kamera": json.dumps(header, sort_keys=True)})
    assert backend.put_blob(old.key, blob) == len(blob)
    got = backend.get(old.key)
    assert got is not None and proc.same(got, old)
    backend.close()
    (root / "index.sqlite").write_bytes(b"not a database" * 100)
    backend = DiskBackend(root)
    assert backend.last_rebuild is not None and backend.last_rebuild.unverified == 1
    got = backend.get(old.key)
    assert got is not None and proc.same(got, old)
    assert backend.check()["ok_without_data_sha256"] == 1


def test_a_foreign_directory_with_objects_is_still_refused(tmp_path: Path) -> None:
    (tmp_path / "objects").mkdir()
    (tmp_path / "HEAD").write_text("ref: refs/heads/main")  # a .git directory, say
    with pytest.raises(InvalidInputError, match="without a Kamera index"):
        DiskBackend(tmp_path)
    assert not (tmp_path / "index.sqlite").exists()


def test_check_prune_clear(tmp_path: Path, proc: ModuleType) -> None:
    root = tmp_path / "store"
    entries = _held_out(proc)[:8]
    _fill(root, entries)
    backend = DiskBackend(root)
    report = backend.check()
    assert (report["ok"], report["bad"], report["missing_files"]) == (8, [], 0)
    path = backend.path_for(entries[0].key)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    backend.path_for(entries[1].key).unlink()
    report = backend.check()
    assert report["ok"] == 6 and len(report["bad"]) == 1 and report["missing_files"] == 1
    assert path.exists()  # check alone changes nothing
    fixed = backend.check(fix=True)
    assert fixed["repair"]["rows_dropped"] == 1 and len(backend) == 6 and not path.exists()
    info = backend.info()
    assert info["entries"] == 6 and info["bytes"] == backend.total_bytes()
    assert sum(v["entries"] for v in info["by_kind"].values()) == 6
    assert sum(v["bytes"] for v in info["by_fingerprint"].values()) == info["bytes"]
    keep = backend.total_bytes() // 2
    pruned = backend.prune(keep)
    assert pruned["bytes"] <= keep and pruned["evicted"] >= 1 and len(backend) == pruned["entries"]
    with pytest.raises(InvalidInputError):
        backend.prune(-1)
    assert backend.clear() == pruned["entries"] and len(backend) == 0
    assert list(root.glob("objects/*/*.safetensors")) == []
    assert open_store(root).stats().backend_bytes == 0  # still a store


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    script = Path(__file__).with_name("_store_proc.py")
    return subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.parametrize(("damage", "point"), [("garbage", "scan"), ("deleted", "scan"), ("garbage", "install")])
def test_kill_9_during_the_rebuild_leaves_a_store_that_opens(
    tmp_path: Path, proc: ModuleType, proc_env: dict[str, str], damage: str, point: str
) -> None:
    root = tmp_path / "store"
    entries = _held_out(proc)[:12]
    _fill(root, entries)
    if damage == "garbage":
        (root / "index.sqlite").write_bytes(b"\x00garbage" * 4096)
    else:
        for f in root.glob("index.sqlite*"):
            f.unlink()
    worker = _spawn(["rebuild", str(root), point], proc_env)
    assert worker.stdout is not None
    if point == "scan":
        for _ in range(4):  # killed with the new index a third written
            assert worker.stdout.readline(), worker.stderr.read() if worker.stderr else ""
        os.kill(worker.pid, signal.SIGKILL)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGKILL, err
    assert list(root.glob(".index-rebuild-*.sqlite"))  # the killed rebuild's temp index is left behind
    if point == "install":
        assert not (root / "index.sqlite").exists()  # the broken one went aside, the new one not yet in
    store = _all_read_back(root, entries, proc)  # the store opens and every entry is back
    assert isinstance(store.backend, DiskBackend) and len(store.backend) == 12
    assert store.stats().index_rebuilds == 1
    assert list(root.glob(".index-rebuild-*")) == []  # the stale temp index was removed
    store.close()
