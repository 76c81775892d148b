"""The embedded persistent backend: a directory of safetensors files and an SQLite index (WAL mode).

Layout::

    <root>/index.sqlite                          the index (plus -wal / -shm while open)
    <root>/objects/<d[:2]>/<d>.safetensors       one file per entry; d = EntryKey.digest (sha256 hex)
    <root>/quarantine/<d>.<ns>.safetensors       refused files, kept for inspection (newest 32)
    <root>/index-aside/<reason>-<ns>/            indexes replaced by a rebuild (newest 8)
    <root>/.lock                                 taken by an index rebuild

A write is: temp file in the target's directory, fsync, then, holding SQLite's write lock, ``os.replace``
to the final name, fsync of the directory and the index row. A row therefore exists only for a complete,
durable file: a process killed at any point leaves at most a missing entry (an orphan file or a temp file,
both swept), never a row pointing at torn bytes. Reads check the size and sha256 against the row and the
fingerprint inside the file; a bad file is quarantined and its row deleted. File names are digests only,
so no key can name a path outside ``objects/``.

Every file carries its own index row (``_entry.inspect``), so a corrupt, foreign or deleted index is
rebuilt from the files at open (``_rebuild``), logged and counted in ``index_rebuilds``; ``repair`` also
indexes complete files that have no row.
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

from kamera_engine.errors import ChecksumError, InvalidInputError, KameraError, StoreError, positive_int

from . import _rebuild
from ._auth import EntryAuth
from ._entry import META_KEY, EntryKey, EntryKind, StoreEntry, decode, header_summary, inspect, read_header
from ._rebuild import COLUMNS, RebuildReport, fsync_dir, row_values
from ._registry import register_backend

log = logging.getLogger("kamera.store")

#: Largest entry a disk store accepts by default (serialized bytes).
DEFAULT_MAX_ENTRY_BYTES = 2 << 30
#: Refused files kept in ``quarantine/``.
QUARANTINE_KEEP = 32
#: Temp files of another host (or of a live-looking pid) older than this are swept at open.
STALE_TEMP_S = 3600.0

_HOST = socket.gethostname().replace("-", "_")[:32] or "host"


def _fsync_dir(path: Path) -> None:
    fsync_dir(path)


def _header_meta(header: dict[str, Any]) -> str:
    """The entry meta (sorted JSON) a safetensors header carries; "{}" when it carries none."""
    try:
        meta = json.loads(header["__metadata__"][META_KEY]).get("meta", {})
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError):
        meta = {}
    return json.dumps(meta if isinstance(meta, dict) else {}, sort_keys=True)


class _BrokenIndex(StoreError):
    """The index file exists but is not a usable Kamera index (garbage, corrupt, another schema)."""


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
    or an existing Kamera store (a directory holding only a store's own names is one, even with its index
    deleted). A missing or broken index is rebuilt from the entry files (``index_rebuilds`` counts it,
    ``last_rebuild`` says what was found).
    """

    name: ClassVar[str] = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        busy_timeout_s: float = 30.0,
        auth: EntryAuth | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise InvalidInputError(f"store path must be a non-empty str or path, got {path!r}")
        for label, value in (("max_bytes", max_bytes), ("max_entry_bytes", max_entry_bytes)):
            positive_int(label, value, optional=True)
        self.root = Path(path).expanduser().absolute()
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.busy_timeout_s = float(busy_timeout_s)
        self.auth = auth  # with a secret: entries are written tagged, and read only with a valid tag
        self.evictions = 0
        self.index_rebuilds = 0
        self.last_rebuild: RebuildReport | None = None
        self._db = self.root / _rebuild.INDEX_NAME
        self._objects = self.root / "objects"
        self._quarantine = self.root / "quarantine"
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        if self.root.exists() and not self.root.is_dir():
            raise InvalidInputError(f"store path {self.root} exists and is not a directory")
        lost_index = False
        if self.root.is_dir() and not self._db.exists() and any(self.root.iterdir()):
            if not _rebuild.is_store_layout(self.root):
                raise InvalidInputError(
                    f"store path {self.root} is a non-empty directory without a Kamera index; "
                    "use a new or empty directory"
                )
            lost_index = True  # a store whose index was deleted (or a rebuild killed before its rename)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc
        self._open_index(lost_index)  # the index first: a directory holding it is recognised as a store
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
                try:
                    conn.execute("PRAGMA synchronous=NORMAL")
                except sqlite3.Error:
                    conn.close()
                    raise
            except sqlite3.OperationalError as exc:
                raise StoreError(f"cannot open store index {self._db}: {exc}") from exc
            except sqlite3.DatabaseError as exc:  # "file is not a database": rebuilt at the next open
                raise _BrokenIndex(f"store index {self._db} is unusable: {exc}") from exc
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
        """Open the index in WAL mode and create its table. Raises _BrokenIndex when the file is not a
        healthy Kamera index (not a database, corrupt pages, another table layout)."""
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                conn = self._conn()
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"store index {self._db} cannot use WAL mode (got {mode})")
                with self._tx() as tx:
                    for stmt in _rebuild.schema_statements():
                        tx.execute(stmt)
                self._check_index(conn)
                return
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                if "locked" in str(exc) or "unable to open" in str(exc):  # busy or inaccessible, not broken
                    raise StoreError(f"cannot initialise store index {self._db}: {exc}") from exc
                self._close_conns()
                raise _BrokenIndex(str(exc)) from exc
            except sqlite3.DatabaseError as exc:  # "file is not a database", "disk image is malformed"
                self._close_conns()
                raise _BrokenIndex(str(exc)) from exc

    def _open_index(self, lost: bool) -> None:
        """Open the index, rebuilding it from the entry files when it is missing (``lost``), broken, or
        empty while entry files exist (an index truncated to nothing reads as a new, empty one)."""
        reason = "missing" if lost else None
        if reason is None:
            try:
                self._init_schema()
                if self._empty_over_files():
                    reason = "empty index over entry files"
            except _BrokenIndex as exc:
                reason = f"corrupt: {exc}"
        if reason is None:
            return
        self._rebuild(reason, only_if_broken=True)
        try:
            self._init_schema()
        except _BrokenIndex as exc:
            raise StoreError(f"store index {self._db} is still unusable after a rebuild: {exc}") from exc

    def _empty_over_files(self) -> bool:
        return len(self) == 0 and next(_rebuild.entry_files(self._objects), None) is not None

    def _check_index(self, conn: sqlite3.Connection) -> None:
        columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(entries)").fetchall())
        if columns != COLUMNS:
            raise sqlite3.DatabaseError(f"the entries table has columns {columns}, not a Kamera index")
        problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError(f"quick_check: {'; '.join(map(str, problems[:3]))}")

    def _close_conns(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            self._conns.clear()
        self._local = threading.local()

    def _index_problem(self) -> str | None:
        """Why the index is unusable now (None when it is healthy)."""
        if not self._db.exists():
            return "missing"
        try:
            self._check_index(self._conn())
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc):
                return None
            return f"corrupt: {exc}"
        except (sqlite3.DatabaseError, _BrokenIndex) as exc:
            return f"corrupt: {exc}"
        return None

    def _rebuild(self, reason: str, *, only_if_broken: bool) -> RebuildReport | None:
        """Rebuild the index from the entry files under the rebuild lock. With ``only_if_broken``, a
        process that waited for another one's rebuild finds the index healthy and does nothing."""
        with _rebuild.rebuild_lock(self.root):
            self._close_conns()
            if only_if_broken and self._db.exists():
                try:
                    self._init_schema()
                    if not self._empty_over_files():
                        return None
                except _BrokenIndex:
                    pass
                self._close_conns()
            report = _rebuild.build_index(self.root, reason.split(":")[0], self.max_entry_bytes)
            report.reason = reason
        self.index_rebuilds += 1
        self.last_rebuild = report
        return report

    def rebuild_index(self) -> RebuildReport:
        """Rebuild the index from the entry files now (the old one goes to ``index-aside/``; usage times of
        entries it still lists are kept). Run it while no other process uses the store: another process's
        open index connection would keep writing to the old file."""
        report = self._rebuild(self._index_problem() or "requested", only_if_broken=False)
        assert report is not None
        try:
            self._init_schema()
        except _BrokenIndex as exc:
            raise StoreError(f"store index {self._db} is still unusable after a rebuild: {exc}") from exc
        return report

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
                entry = decode(blob, key, checksum, self.auth)
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
        blob = entry.encode(self.auth)
        self._check_size(len(blob))  # the file's size, as reads check it
        summary, nbytes = header_summary(read_header(blob)[0])  # what the file holds (compact dtypes too)
        row = (summary, nbytes, json.dumps(entry.meta, sort_keys=True), entry.created_at)
        return self._write(entry.key, blob, entry.checksum, *row)

    def put_blob(self, key: EntryKey, blob: bytes) -> int:
        """Write serialized bytes under ``key`` unchanged (reads verify them). 0 if already stored."""
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError("blob must be bytes")
        self._check_size(len(blob))
        if self._row(key.digest) is not None:
            return 0
        header, _ = read_header(blob)  # reads verify the rest (another key inside is refused there)
        summary, nbytes = header_summary(header)
        meta = _header_meta(header)
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
                    f"INSERT INTO entries VALUES ({','.join('?' * len(COLUMNS))})",
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
            self.evictions += self._evict(self.max_bytes, keep=digest)
        return len(blob)

    def _evict(self, budget: int, keep: str = "") -> int:
        """Delete least recently used entries (never ``keep``) until the store fits ``budget``; the count."""
        doomed: list[str] = []
        try:
            with self._tx() as conn:
                total = int(conn.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM entries").fetchone()[0])
                if total <= budget:
                    return 0
                rows = conn.execute(
                    "SELECT digest, file_bytes FROM entries WHERE digest != ? ORDER BY last_used ASC", (keep,)
                )
                for digest, size in rows.fetchall():
                    if total <= budget:
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
        return len(doomed)

    def prune(self, max_bytes: int) -> dict[str, int]:
        """Evict least recently used entries until the store holds at most ``max_bytes`` serialized bytes."""
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise InvalidInputError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        before, entries = self.total_bytes(), len(self)
        evicted = self._evict(max_bytes)
        return {"evicted": evicted, "entries": entries - evicted, "bytes_before": before, "bytes": self.total_bytes()}

    def clear(self) -> int:
        """Delete every entry (rows and files); the directory stays an empty store. Returns the count."""
        return self._evict(0)

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
        """Bring index and files back in line: rebuild a broken index, sweep temps, drop rows whose file
        is gone, and index files that have no row (older than the grace period) when they verify on
        their own, quarantining those that do not.

        Files with no row come from a writer killed between rename and index insert, or from rows an
        index lost; they are complete (renamed only after fsync) and carry their own row, so they are
        served again rather than deleted.
        """
        problem = self._index_problem()
        if problem is not None:
            self.rebuild_index()
        temps = self.sweep_temps()
        try:
            digests = {d for (d,) in self._conn().execute("SELECT digest FROM entries").fetchall()}
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        rows_dropped = bad_orphans = indexed = 0
        now = time.time()
        for f in _rebuild.entry_files(self._objects):
            d = f.name.removesuffix(".safetensors")
            if d in digests or now - f.stat().st_mtime <= orphan_grace_s:
                continue
            adopted = self._adopt(f)
            indexed += adopted
            bad_orphans += not adopted
        for d in digests:
            if not (self._objects / d[:2] / f"{d}.safetensors").exists():
                try:
                    self._conn().execute("DELETE FROM entries WHERE digest=?", (d,))
                except sqlite3.Error as exc:
                    raise StoreError(f"store index write failed: {exc}") from exc
                rows_dropped += 1
        return {
            "temps": temps,
            "rows_dropped": rows_dropped,
            "orphan_files": bad_orphans,
            "orphans_indexed": indexed,
            "index_rebuilt": int(problem is not None),
        }

    def _adopt(self, path: Path) -> bool:
        """Index a file with no row if it verifies (True); quarantine it otherwise (False)."""
        try:
            item, size, mtime = _rebuild.verify_file(path)
        except FileNotFoundError:
            return False
        except KameraError as exc:
            log.warning("store: file with no index row refused: %s", exc)
            with contextlib.suppress(OSError):
                _rebuild.quarantine(path, self._quarantine)
            return False
        try:
            with self._tx() as conn:  # a writer renames under this lock: its row is in by now
                if conn.execute("SELECT 1 FROM entries WHERE digest=?", (item.key.digest,)).fetchone() is None:
                    if path.exists():
                        placeholders = ",".join("?" * len(COLUMNS))
                        conn.execute(
                            f"INSERT INTO entries VALUES ({placeholders})", row_values(item, size, mtime, mtime, 0)
                        )
        except sqlite3.Error as exc:
            raise StoreError(f"store index write failed: {exc}") from exc
        return True

    def info(self) -> dict[str, Any]:
        """Entries and serialized bytes in all, by kind, by model fingerprint and by stored tensor dtype,
        and canonical bytes per token (from each canonical's ``tokens`` meta)."""
        try:
            rows = self._conn().execute("SELECT fingerprint, kind, tensors, file_bytes, meta FROM entries").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        by: dict[str, dict[str, dict[str, int]]] = {"kind": {}, "fingerprint": {}, "dtype": {}}
        tokens = canonical_bytes = 0
        for fingerprint, kind, tensors, size, meta in rows:
            dtypes = sorted({str(v[0]) for v in json.loads(tensors).values()})
            for axis, name in (("kind", kind), ("fingerprint", fingerprint), ("dtype", "+".join(dtypes))):
                slot = by[axis].setdefault(name, {"entries": 0, "bytes": 0})
                slot["entries"] += 1
                slot["bytes"] += int(size)
            if kind == EntryKind.CANONICAL.value:
                n = json.loads(meta).get("tokens", "")
                if str(n).isdigit() and int(n) > 0:
                    tokens += int(n)
                    canonical_bytes += int(size)
        quarantined = sum(1 for _ in self._quarantine.iterdir()) if self._quarantine.is_dir() else 0
        aside = self.root / _rebuild.ASIDE_DIR
        return {
            "path": str(self.root),
            "entries": len(rows),
            "bytes": sum(int(r[3]) for r in rows),
            "by_kind": by["kind"],
            "by_fingerprint": by["fingerprint"],
            "by_stored_dtype": by["dtype"],
            "canonical_tokens": tokens,
            "canonical_bytes_per_token": canonical_bytes / tokens if tokens else None,
            "quarantined_files": quarantined,
            "indexes_kept_aside": sum(1 for _ in aside.iterdir()) if aside.is_dir() else 0,
            "index_rebuilds": self.index_rebuilds,
        }

    def check(self, *, fix: bool = False) -> dict[str, Any]:
        """Verify every indexed entry: its file's size and sha256 against the index, and its data against
        the sha256 in its own header; count files with no row. ``fix`` quarantines bad files, drops rows
        whose file is gone and indexes verified files with no row (``repair``)."""
        try:
            rows = self._conn().execute("SELECT digest, checksum, file_bytes FROM entries").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"store index read failed: {exc}") from exc
        ok = unverified = 0
        bad: list[dict[str, str]] = []
        missing: list[str] = []
        for digest, checksum, size in rows:
            path = self._objects / digest[:2] / f"{digest}.safetensors"
            try:
                blob = path.read_bytes()
                if len(blob) != size or hashlib.sha256(blob).hexdigest() != checksum:
                    raise ChecksumError(f"{digest[:12]}: bytes differ from the index's size or checksum")
                item = inspect(blob, digest[:12])
                if item.key.digest != digest:
                    raise StoreError(f"{digest[:12]}: file holds the entry {item.key.digest[:12]}")
            except FileNotFoundError:
                missing.append(digest)
                continue
            except (KameraError, OSError) as exc:
                bad.append({"digest": digest, "error": str(exc)})
                if fix:
                    with contextlib.suppress(OSError, sqlite3.Error), self._tx() as conn:
                        conn.execute("DELETE FROM entries WHERE digest=? AND checksum=?", (digest, checksum))
                        _rebuild.quarantine(path, self._quarantine)
                continue
            ok += 1
            unverified += not item.self_checked
        indexed = {r[0] for r in rows}
        orphans = sum(1 for f in _rebuild.entry_files(self._objects) if f.stem not in indexed)
        report: dict[str, Any] = {
            "entries": len(rows),
            "ok": ok,
            "ok_without_data_sha256": unverified,
            "bad": bad,
            "missing_files": len(missing),
            "files_without_row": orphans,
        }
        if fix:
            report["repair"] = self.repair(orphan_grace_s=0.0)
        return report

    def close(self) -> None:
        """Close every index connection this object opened (any thread)."""
        self._close_conns()
        self._closed = True


@register_backend("file")
def _open_disk(spec: str, *, max_bytes: int | None, ttl_s: float | None) -> DiskBackend:
    """A path, or a ``file://`` URL: a DiskBackend there."""
    if ttl_s is not None:
        raise InvalidInputError("ttl_s applies to a redis store only")
    return DiskBackend(spec.removeprefix("file://"), max_bytes=max_bytes)
