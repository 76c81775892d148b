"""Rebuilding a disk store's index from its entry files, so a lost or corrupt index is never a dead end.

Every entry file carries its whole index row in its safetensors header (key, meta, tensor table and the
sha256 of its data; see ``_entry.inspect``), so the index is a cache of the files. A rebuild:

1. takes ``<root>/.lock`` (``flock``: one rebuild at a time; released by the kernel if the process dies);
2. writes a new index into ``<root>/.index-rebuild-<pid>.sqlite`` from every file under
   ``objects/`` (a file that does not verify, or that sits under another key's name, goes to
   ``quarantine/``), commits, fsyncs;
3. moves the old index (and its ``-wal`` / ``-shm``) into ``index-aside/<reason>-<ns>/``;
4. renames the new index to ``index.sqlite`` (atomic) and fsyncs the directory.

A process killed at any step leaves either the old index (a broken one is found broken again at the next
open) or no index (a directory holding only the store's own names is rebuilt at the next open), plus at
most a stale temp index, removed by the next rebuild: the store always opens.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kamera_engine.errors import KameraError, StoreError

from ._entry import Inspected, inspect

log = logging.getLogger("kamera.store")

INDEX_NAME = "index.sqlite"
ASIDE_DIR = "index-aside"
LOCK_NAME = ".lock"
TEMP_PREFIX = ".index-rebuild-"
#: Old indexes kept under ``index-aside/`` (the newest; older ones are deleted).
ASIDE_KEEP = 8
#: Names a store directory may hold; a directory holding only these (and ``objects/``) is a store.
OWN_NAMES = frozenset(
    {INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", "objects", "quarantine", ASIDE_DIR, LOCK_NAME}
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest       TEXT PRIMARY KEY,
    fingerprint  TEXT NOT NULL,
    kind         TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    variant      TEXT NOT NULL,
    tensors      TEXT NOT NULL,
    nbytes       INTEGER NOT NULL,
    file_bytes   INTEGER NOT NULL,
    checksum     TEXT NOT NULL,
    created_at   REAL NOT NULL,
    last_used    REAL NOT NULL,
    uses         INTEGER NOT NULL DEFAULT 0,
    meta         TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_content ON entries (fingerprint, kind, content_hash);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries (last_used);
"""
COLUMNS = (
    "digest", "fingerprint", "kind", "content_hash", "variant", "tensors", "nbytes", "file_bytes", "checksum",
    "created_at", "last_used", "uses", "meta",
)  # fmt: skip


def schema_statements() -> list[str]:
    return [s for s in (part.strip() for part in SCHEMA.split(";")) if s]


def row_values(item: Inspected, file_bytes: int, created_at: float, last_used: float, uses: int) -> tuple[Any, ...]:
    """One ``entries`` row (in ``COLUMNS`` order) for a verified entry file."""
    key = item.key
    return (
        key.digest, key.fingerprint, key.kind.value, key.content_hash, key.variant,
        json.dumps(item.summary, sort_keys=True), item.nbytes, file_bytes, item.checksum,
        created_at, last_used, uses, json.dumps(item.meta, sort_keys=True),
    )  # fmt: skip


def is_store_layout(root: Path) -> bool:
    """Whether ``root`` holds an ``objects/`` directory and nothing but the store's own names (so a store
    whose index was deleted is recognised, and a foreign directory never is)."""
    names = [p.name for p in root.iterdir()]
    return "objects" in names and all(n in OWN_NAMES or n.startswith(TEMP_PREFIX) for n in names)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install_index(tmp: Path, final: Path) -> None:
    """The rebuild's commit point: the complete new index takes the index's name atomically."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def rebuild_lock(root: Path) -> Iterator[None]:
    """Exclusive lock of one store's rebuild (processes on this machine; the kernel drops it on death)."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


@dataclass
class RebuildReport:
    """What a rebuild found: entries indexed, files quarantined, and where the old index went."""

    reason: str
    entries: int = 0
    bytes: int = 0
    unverified: int = 0  # entries written before files carried their own data sha256 (parsed, not hashed)
    quarantined: int = 0
    skipped: int = 0  # files too large for this reader or unreadable now, left in place unindexed
    aside: str | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason, "entries": self.entries, "bytes": self.bytes, "unverified": self.unverified,
            "quarantined": self.quarantined, "skipped": self.skipped, "aside": self.aside,
            "seconds": round(self.seconds, 3),
        }  # fmt: skip


def _old_usage(index: Path) -> dict[str, tuple[str, float, float, int]]:
    """digest -> (checksum, created_at, last_used, uses) from an old index, if it can still be read."""
    if not index.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{index}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = conn.execute("SELECT digest, checksum, created_at, last_used, uses FROM entries").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return {}
    return {d: (c, float(t0), float(t1), int(u)) for d, c, t0, t1, u in rows}


def entry_files(objects: Path) -> Iterator[Path]:
    """Every ``objects/<xx>/<digest>.safetensors`` file (temp files excluded)."""
    if not objects.is_dir():
        return
    for sub in sorted(objects.iterdir()):
        if sub.is_dir():
            yield from sorted(sub.glob("*.safetensors"))


def verify_file(path: Path) -> tuple[Inspected, int, float]:
    """(inspected entry, file size, mtime) of one entry file, checked on its own; raises KameraError when
    it is not a usable entry or sits under another key's name, OSError when it cannot be read."""
    st = path.stat()
    item = inspect(path.read_bytes(), path.name[:12])
    if f"{item.key.digest}.safetensors" != path.name:
        raise StoreError(f"entry file {path.name[:12]} holds the entry {item.key.digest[:12]}")
    return item, st.st_size, st.st_mtime


def quarantine(path: Path, quarantine_dir: Path) -> None:
    quarantine_dir.mkdir(exist_ok=True)
    os.replace(path, quarantine_dir / f"{path.stem}.{time.time_ns()}.safetensors")


def build_index(root: Path, reason: str, max_entry_bytes: int) -> RebuildReport:
    """Rebuild ``root``'s index from its entry files (see the module docstring). Call under ``rebuild_lock``
    with no connection of this process open on the old index."""
    t0 = time.perf_counter()
    report = RebuildReport(reason)
    index = root / INDEX_NAME
    for stale in root.glob(f"{TEMP_PREFIX}*"):  # a rebuild killed earlier (we hold the lock: none runs)
        stale.unlink(missing_ok=True)
    tmp = root / f"{TEMP_PREFIX}{os.getpid()}.sqlite"
    usage = _old_usage(index)
    try:
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
            conn.execute("BEGIN")
            for stmt in schema_statements():
                conn.execute(stmt)
            for path in entry_files(root / "objects"):
                try:
                    if path.stat().st_size > max_entry_bytes:  # too big for this reader: left alone
                        report.skipped += 1
                        continue
                    item, size, mtime = verify_file(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # unreadable now (permissions, I/O): the file may be fine
                    log.warning("store: index rebuild could not read %s: %s", path.name[:12], exc)
                    report.skipped += 1
                    continue
                except KameraError as exc:
                    report.problems.append(str(exc))
                    quarantine(path, root / "quarantine")
                    report.quarantined += 1
                    continue
                old = usage.get(item.key.digest)
                created, used, uses = (old[1], old[2], old[3]) if old and old[0] == item.checksum else (mtime, mtime, 0)
                conn.execute(
                    f"INSERT OR REPLACE INTO entries VALUES ({','.join('?' * len(COLUMNS))})",
                    row_values(item, size, created, used, uses),
                )
                report.entries += 1
                report.bytes += size
                report.unverified += not item.self_checked
            conn.execute("COMMIT")
        finally:
            conn.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if index.exists():
            aside = root / ASIDE_DIR / f"{reason.replace(' ', '-')}-{time.time_ns()}"
            aside.mkdir(parents=True)
            for suffix in ("", "-wal", "-shm"):  # a stale WAL must never meet the new index
                with contextlib.suppress(FileNotFoundError):
                    os.replace(root / f"{INDEX_NAME}{suffix}", aside / f"{INDEX_NAME}{suffix}")
            report.aside = str(aside)
            _trim_aside(root / ASIDE_DIR)
        else:
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(root / f"{INDEX_NAME}{suffix}")
        install_index(tmp, index)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot rebuild the store index of {root}: {exc}") from exc
    except OSError as exc:
        raise StoreError(f"cannot rebuild the store index of {root}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    report.seconds = time.perf_counter() - t0
    for problem in report.problems[:8]:
        log.warning("store: index rebuild quarantined a file: %s", problem)
    log.warning(
        "store: rebuilt the index of %s (%s): %d entries, %d quarantined%s",
        root, reason, report.entries, report.quarantined,
        f", old index kept at {report.aside}" if report.aside else "",
    )  # fmt: skip
    return report


def _trim_aside(aside_root: Path) -> None:
    kept = sorted((p for p in aside_root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in kept[:-ASIDE_KEEP]:
        for f in old.iterdir():
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            old.rmdir()
