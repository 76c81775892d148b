"""The embedded persistent backend: a directory of safetensors files and an SQLite index (WAL mode).

Layout::

    <root>/index.sqlite                          the index (plus -wal / -shm while open)
    <root>/objects/<d[:2]>/<d>.safetensors       one file per entry; d = EntryKey.digest (sha256 hex)
    <root>/quarantine/<d>.<ns>.safetensors       refused files, kept for inspection (newest 32)

A write is: temp file in the target's directory, fsync, then, holding SQLite's write lock, ``os.replace``
to the final name, fsync of the directory and the index row. A row therefore exists only for a complete,
durable file: a process killed at any point leaves at most a missing entry (an orphan file or a temp file,
both swept), never a row pointing at torn bytes. Reads check the size and sha256 against the row and the
fingerprint inside the file; a bad file is quarantined and its row deleted. File names are digests only,
so no key can name a path outside ``objects/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from kamera_engine.errors import ChecksumError, InvalidInputError, StoreError

from ._entry import META_KEY, EntryKey, EntryKind, StoreEntry, decode, header_summary, read_header

log = logging.getLogger("kamera.store")

#: Largest entry a disk store accepts by default (serialized bytes).
DEFAULT_MAX_ENTRY_BYTES = 2 << 30
#: Refused files kept in ``quarantine/``.
QUARANTINE_KEEP = 32
#: Temp files of another host (or of a live-looking pid) older than this are swept at open.
STALE_TEMP_S = 3600.0

_SCHEMA = """
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
_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


class DiskBackend:
    """Entries as safetensors files under ``path`` with an SQLite index; safe for several processes.

    ``max_bytes`` bounds the serialized bytes held (least recently used entries are evicted past it);
    ``max_entry_bytes`` refuses bigger entries with StoreError. ``path`` must be a new or empty directory
    or an existing Kamera store.
    """

    name: ClassVar[str] = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        busy_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidInputError(f"store path must be a non-empty str or path, got {path!r}")
        for label, value in (("max_bytes", max_bytes), ("max_entry_bytes", max_entry_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidInputError(f"{label} must be a positive int, got {value!r}")
        self.root = Path(path).expanduser().absolute()
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.busy_timeout_s = float(busy_timeout_s)
        self.evictions = 0
        self._db = self.root / "index.sqlite"
        self._objects = self.root / "objects"
        self._quarantine = self.root / "quarantine"
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        if self.root.exists() and not self.root.is_dir():
            raise InvalidInputError(f"store path {self.root} exists and is not a directory")
        if self.root.is_dir() and not self._db.exists() and any(self.root.iterdir()):
            raise InvalidInputError(
                f"store path {self.root} is a non-empty directory without a Kamera index; use a new or empty directory"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc
        self._init_schema()  # the index first: a directory holding it is recognised as a store
        try:
            self._objects.mkdir(exist_ok=True)
            self._quarantine.mkdir(exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc
        self.sweep_temps()

    def __repr__(self) -> str:
        return f"DiskBackend({str(self.root)!r})"

    # -- sqlite plumbing -----------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError(f"disk store {self.root} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(
                    self._db, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
                )
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open store index {self._db}: {exc}") from exc
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction holding SQLite's write lock (serialises writers across processes)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")

    def _init_schema(self) -> None:
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                conn = self._conn()
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"store index {self._db} cannot use WAL mode (got {mode})")
                with self._tx() as tx:
                    for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                        tx.execute(stmt)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise StoreError(f"cannot initialise store index {self._db}: {exc}") from exc
                time.sleep(0.05)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot initialise store index {self._db}: {exc}") from exc

    def _row(self, digest: str) -> tuple[Any, ...] | None:
        try:
            return (
                self._conn()
                .execute(
                    "SELECT checksum, file_bytes, created_at, last_used, uses FROM entries WHERE digest=?", (digest,)
                )
                .fetchone()
            )
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc

    def path_for(self, key: EntryKey) -> Path:
        """Where ``key``'s file lives (digest-only name under ``objects/``)."""
        d = key.digest
        return self._objects / d[:2] / f"{d}.safetensors"

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> StoreEntry | None:
        """The verified entry, or None on a miss. Raises ChecksumError / FingerprintMismatchError /
        StoreError for a bad file (after quarantining it)."""
        for _ in range(2):
            row = self._row(key.digest)
            if row is None:
                return None
            checksum, file_bytes, created_at, _last_used, uses = row
            try:
                blob = self._read(key, file_bytes)
            except FileNotFoundError:
                # deleted or evicted between the row and the file; a row left naming no file would refuse
                # every later put of this key, so drop it (unless the entry was rewritten meanwhile)
                self._drop_row(key.digest, checksum)
                return None
            except ChecksumError:  # the file is not the size the index recorded: truncated or replaced
                self._quarantine_file(key, checksum)
                raise
            try:
                entry = decode(blob, key, checksum)
            except ChecksumError:
                again = self._row(key.digest)
                if again is not None and again[0] != checksum:
                    continue  # rewritten concurrently: read the new version once
                self._quarantine_file(key, checksum)
                raise
            except StoreError:
                self._quarantine_file(key, checksum)
                raise
            now = time.time()
            entry.created_at, entry.last_used, entry.uses = created_at, now, uses + 1
            self._touch(key.digest, now)
            return entry
        return None

    def _read(self, key: EntryKey, expected: int) -> bytes:
        """The file's bytes. ChecksumError when its size is not the indexed one (the entry is bad);
        StoreError when this reader cannot read it now (too large for its limit, an I/O error): the
        entry itself may be fine and is left alone."""
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected:
                    raise ChecksumError(f"entry file {path.name} is {size} bytes, the index says {expected}")
                if size > self.max_entry_bytes:
                    raise StoreError(f"entry file {path.name} is {size} bytes, over max_entry_bytes")
                return f.read()
        except (FileNotFoundError, StoreError):
            raise
        except OSError as exc:
            raise StoreError(f"cannot read entry file {path.name}: {exc}") from exc

    def _drop_row(self, digest: str, checksum: str) -> None:
        try:
            with self._tx() as conn:
                conn.execute("DELETE FROM entries WHERE digest=? AND checksum=?", (digest, checksum))
        except sqlite3.Error as exc:
            log.warning("store: could not drop the row of missing file %s: %s", digest[:12], exc)

    def _touch(self, digest: str, now: float) -> None:
        try:
            self._conn().execute("UPDATE entries SET last_used=?, uses=uses+1 WHERE digest=?", (now, digest))
        except sqlite3.Error as exc:  # usage times are advisory; a busy index must not fail a read
            log.debug("store: could not update usage of %s: %s", digest[:12], exc)

    def contains(self, key: EntryKey) -> bool:
        return self._row(key.digest) is not None

    def keys(self, fingerprint: str | None = None) -> list[EntryKey]:
        """Every indexed key (of one model when ``fingerprint`` is given)."""
        sql = "SELECT fingerprint, kind, content_hash, variant FROM entries"
        args: tuple[str, ...] = ()
        if fingerprint is not None:
            sql, args = sql + " WHERE fingerprint=?", (fingerprint,)
        try:
            rows = self._conn().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        return [EntryKey(fingerprint=f, kind=k, content_hash=c, variant=v) for f, k, c, v in rows]

    def variants(self, fingerprint: str, kind: EntryKind, content_hash: str) -> list[EntryKey]:
        """Every indexed key of one model, kind and content (one indexed query)."""
        sql = "SELECT variant FROM entries WHERE fingerprint=? AND kind=? AND content_hash=? ORDER BY created_at"
        try:
            rows = self._conn().execute(sql, (fingerprint, EntryKind(kind).value, content_hash)).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        return [EntryKey(fingerprint, kind, content_hash, v) for (v,) in rows]

    def total_bytes(self) -> int:
        try:
            return int(self._conn().execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0])
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc

    def __len__(self) -> int:
        try:
            return int(self._conn().execute("SELECT COUNT(*) FROM entries").fetchone()[0])
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc

    # -- writes --------------------------------------------------------------------------------------
    def put(self, entry: StoreEntry) -> int:
        """Write ``entry`` atomically; 0 if it is already stored, else the bytes written."""
        if not isinstance(entry, StoreEntry):
            raise InvalidInputError(f"expected a StoreEntry, got {type(entry).__name__}")
        if self._row(entry.key.digest) is not None:
            return 0
        blob = entry.encode()
        self._check_size(len(blob))  # the file's size, as reads check it
        row = (entry.summary(), entry.nbytes, json.dumps(entry.meta, sort_keys=True), entry.created_at)
        return self._write(entry.key, blob, entry.checksum, *row)

    def put_blob(self, key: EntryKey, blob: bytes) -> int:
        """Write serialized bytes under ``key`` unchanged (reads verify them). 0 if already stored."""
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError("blob must be bytes")
        self._check_size(len(blob))
        if self._row(key.digest) is not None:
            return 0
        header, _ = read_header(blob)
        summary, nbytes = header_summary(header)
        meta = header.get("__metadata__", {}).get(META_KEY, "{}")
        return self._write(key, bytes(blob), hashlib.sha256(blob).hexdigest(), summary, nbytes, meta, time.time())

    def _check_size(self, n: int) -> None:
        if n > self.max_entry_bytes:
            raise StoreError(f"entry of {n} bytes exceeds max_entry_bytes={self.max_entry_bytes}")
        if self.max_bytes is not None and n > self.max_bytes:
            raise StoreError(f"entry of {n} bytes is larger than the whole store (max_bytes={self.max_bytes})")

    def _write(
        self,
        key: EntryKey,
        blob: bytes,
        checksum: str,
        summary: dict[str, Any],
        nbytes: int,
        meta: str,
        created_at: float,
    ) -> int:
        digest = key.digest
        final = self.path_for(key)
        tmp = final.parent / f".tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}-{digest[:16]}"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            with self._tx() as conn:
                if conn.execute("SELECT 1 FROM entries WHERE digest=?", (digest,)).fetchone() is not None:
                    return 0  # another writer won the race; the index row already names a complete file
                os.replace(tmp, final)
                _fsync_dir(final.parent)
                conn.execute(
                    "INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        digest,
                        key.fingerprint,
                        key.kind.value,
                        key.content_hash,
                        key.variant,
                        json.dumps(summary, sort_keys=True),
                        nbytes,
                        len(blob),
                        checksum,
                        created_at,
                        time.time(),
                        0,
                        meta,
                    ),
                )
        except sqlite3.Error as exc:
            raise StoreError(f"store index write failed for {digest[:12]}: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot write entry {digest[:12]} under {self.root}: {exc}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if self.max_bytes is not None:
            self._evict(keep=digest)
        return len(blob)

    def _evict(self, keep: str) -> None:
        """Delete least recently used entries (never ``keep``) until the store fits ``max_bytes``."""
        assert self.max_bytes is not None
        doomed: list[str] = []
        try:
            with self._tx() as conn:
                total = int(conn.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0])
                if total <= self.max_bytes:
                    return
                rows = conn.execute(
                    "SELECT digest, file_bytes FROM entries WHERE digest != ? ORDER BY last_used ASC", (keep,)
                )
                for digest, size in rows.fetchall():
                    if total <= self.max_bytes:
                        break
                    conn.execute("DELETE FROM entries WHERE digest=?", (digest,))
                    total -= size
                    doomed.append(digest)
                # files go inside the transaction: a writer re-adding one of these keys waits for the
                # commit, so its new file is never the one unlinked here
                for digest in doomed:
                    with contextlib.suppress(FileNotFoundError):
                        (self._objects / digest[:2] / f"{digest}.safetensors").unlink()
        except sqlite3.Error as exc:
            raise StoreError(f"store eviction failed: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"store eviction could not remove a file: {exc}") from exc
        self.evictions += len(doomed)

    def delete(self, key: EntryKey) -> bool:
        """Remove ``key``'s row and file. True if it was stored."""
        try:
            with self._tx() as conn:
                gone = conn.execute("DELETE FROM entries WHERE digest=?", (key.digest,)).rowcount > 0
                with contextlib.suppress(FileNotFoundError):
                    self.path_for(key).unlink()
        except sqlite3.Error as exc:
            raise StoreError(f"store index write failed: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"cannot delete entry {key.digest[:12]}: {exc}") from exc
        return gone

    # -- repair --------------------------------------------------------------------------------------
    def _quarantine_file(self, key: EntryKey, checksum: str) -> None:
        """Move a refused file aside and drop its row (unless another process rewrote it meanwhile)."""
        digest = key.digest
        try:
            with self._tx() as conn:
                row = conn.execute("SELECT checksum FROM entries WHERE digest=?", (digest,)).fetchone()
                if row is not None and row[0] != checksum:
                    return
                conn.execute("DELETE FROM entries WHERE digest=?", (digest,))
                with contextlib.suppress(FileNotFoundError):
                    os.replace(self.path_for(key), self._quarantine / f"{digest}.{time.time_ns()}.safetensors")
            kept = sorted(self._quarantine.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in kept[:-QUARANTINE_KEEP]:
                old.unlink(missing_ok=True)
        except (sqlite3.Error, OSError) as exc:
            log.warning("store: could not quarantine %s: %s", digest[:12], exc)
        else:
            log.warning("store: quarantined refused entry %s under %s", digest[:12], self._quarantine)

    def sweep_temps(self, stale_s: float = STALE_TEMP_S) -> int:
        """Remove temp files left by dead writers (this host) or older than ``stale_s``. Returns the count."""
        removed = 0
        now = time.time()
        for sub in self._objects.iterdir() if self._objects.is_dir() else ():
            if not sub.is_dir():
                continue
            for tmp in sub.glob(".tmp-*"):
                parts = tmp.name.split("-")
                try:
                    host, pid = parts[1], int(parts[2])
                    dead = host == _HOST and not _pid_alive(pid)
                    if dead or now - tmp.stat().st_mtime > stale_s:
                        tmp.unlink()
                        removed += 1
                except (IndexError, ValueError, OSError):
                    continue
        return removed

    def repair(self, orphan_grace_s: float = STALE_TEMP_S) -> dict[str, int]:
        """Sweep temps, drop rows whose file is gone, delete files with no row older than the grace period.

        Orphan files come from a writer killed between rename and index insert; they are never served
        (no row), so this only reclaims space.
        """
        temps = self.sweep_temps()
        try:
            digests = {d for (d,) in self._conn().execute("SELECT digest FROM entries").fetchall()}
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        rows_dropped = files_dropped = 0
        now = time.time()
        for sub in self._objects.iterdir():
            for f in sub.glob("*.safetensors") if sub.is_dir() else ():
                d = f.name.removesuffix(".safetensors")
                if d not in digests and now - f.stat().st_mtime > orphan_grace_s:
                    f.unlink(missing_ok=True)
                    files_dropped += 1
        for d in digests:
            if not (self._objects / d[:2] / f"{d}.safetensors").exists():
                try:
                    self._conn().execute("DELETE FROM entries WHERE digest=?", (d,))
                except sqlite3.Error as exc:
                    raise StoreError(f"store index write failed: {exc}") from exc
                rows_dropped += 1
        return {"temps": temps, "rows_dropped": rows_dropped, "orphan_files": files_dropped}

    def close(self) -> None:
        """Close every index connection this object opened (any thread)."""
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._conns.clear()
            self._closed = True
        self._local = threading.local()
