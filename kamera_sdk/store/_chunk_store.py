"""``ChunkStore``: the host-RAM tier in front of an optional persistent backend.

Reads go memory -> (entries still being written) -> backend, and promote backend hits into memory.
Writes land in memory at once and reach the backend through a small thread pool (write-behind;
``flush`` waits, ``close`` flushes). Loads of several misses run in parallel (``get_many``,
``submit_get``) so a caller overlaps them with computing what is not stored (MPIC, section 3).
A load that fails verification is counted in ``stats()`` and reported as a miss, never used.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Iterable
from types import TracebackType

import torch
from pydantic import BaseModel, Field

from kamera_engine.errors import ChecksumError, FingerprintMismatchError, InvalidInputError, StoreError, positive_int

from ._auth import UnauthenticatedEntryError
from ._backend import Backend
from ._entry import EntryKey, EntryKind, StoreEntry
from ._entry import storage_dtype as _storage_dtype
from ._eviction import EvictionPolicy
from ._memory import MemoryTier

log = logging.getLogger("kamera.store")

#: Default host-RAM budget of a ChunkStore (bytes).
DEFAULT_MEMORY_BYTES = 1 << 30


class StoreStats(BaseModel):
    """Counters of one ChunkStore since it was opened."""

    backend: str = Field(description="backend name ('memory' when there is none)")
    memory_hits: int = 0
    backend_hits: int = 0
    misses: int = Field(0, description="lookups that found nothing usable (refused loads included)")
    writes: int = Field(0, description="entries written to the backend")
    write_errors: int = 0
    bytes_written: int = Field(0, description="serialized bytes written to the backend")
    bytes_read: int = Field(0, description="serialized bytes read from the backend")
    refused_checksum: int = Field(0, description="loads refused: bytes differ from their checksum")
    refused_fingerprint: int = Field(0, description="loads refused: written by another model")
    refused_auth: int = Field(0, description="loads refused: no valid MAC under the store's secret (forged)")
    load_errors: int = Field(0, description="loads that failed otherwise (I/O, connection, malformed)")
    evictions: int = Field(0, description="entries evicted from the memory tier")
    backend_evictions: int = Field(0, description="entries the backend evicted for its byte budget")
    index_rebuilds: int = Field(0, description="times the backend rebuilt a lost or corrupt index from its entries")
    memory_entries: int = 0
    memory_bytes: int = Field(0, description="tensor bytes resident in the memory tier")
    pinned_bytes: int = 0
    backend_bytes: int | None = Field(None, description="serialized bytes in the backend, when known")


class ChunkStore:
    """Tiered store: a byte-budgeted RAM tier (``eviction`` "lru" or "lfu", pins) over a backend.

    ``backend``: None (this process only), a DiskBackend or a RedisBackend (see ``open_store``).
    ``write_behind``: backend writes happen on a thread pool (``flush`` waits); False writes inline.
    ``storage_dtype``: None keeps every tensor's dtype (bit-exact); ``"bfloat16"`` or ``"float16"`` writes
    wider floating tensors to the backend in that dtype (half the bytes of float32; loads cast them back
    to their own dtype, so the engine sees its dtype, rounded). The RAM tier keeps tensors as given, and
    an entry put with its own ``storage_dtype`` keeps it. See docs/storage.md for its measured KL.
    Thread-safe; use as a context manager or call ``close``.
    """

    def __init__(
        self,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        backend: Backend | None = None,
        eviction: str | EvictionPolicy = "lru",
        write_behind: bool = True,
        *,
        load_workers: int = 4,
        write_workers: int = 2,
        storage_dtype: str | torch.dtype | None = None,
    ) -> None:
        if backend is not None and not isinstance(backend, Backend):
            raise InvalidInputError(
                f"backend must be None, a DiskBackend or a RedisBackend, got {type(backend).__name__}"
            )
        for label, n in (("load_workers", load_workers), ("write_workers", write_workers)):
            positive_int(label, n)
        self.storage_dtype = _storage_dtype(storage_dtype)
        self.memory = MemoryTier(memory_bytes, eviction)
        self.backend = backend
        self.write_behind = bool(write_behind)
        self._stats = StoreStats(backend=backend.name if backend is not None else "memory")
        self._lock = threading.RLock()  # reentrant: a write's done-callback may run inline
        self._pending: dict[EntryKey, StoreEntry] = {}
        self._writes: set[cf.Future[None]] = set()
        self._loader = cf.ThreadPoolExecutor(load_workers, thread_name_prefix="kamera-store-load")
        self._writer = cf.ThreadPoolExecutor(write_workers, thread_name_prefix="kamera-store-write")
        self._closed = False

    def __repr__(self) -> str:
        dtype = "" if self.storage_dtype is None else f", storage_dtype={str(self.storage_dtype)[6:]!r}"
        return f"ChunkStore(memory_bytes={self.memory.max_bytes}, backend={self.backend!r}{dtype})"

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> StoreEntry | None:
        """The entry from memory or the backend (promoted into memory), or None.

        A backend entry that fails verification (checksum, fingerprint) or cannot be read is counted,
        logged and reported as None, so the caller recomputes it.
        """
        self._check_open()
        self._check_key(key)
        hit = self._get_local(key)
        if hit is not None:
            return hit
        return self._load(key)

    def submit_get(self, key: EntryKey) -> cf.Future[StoreEntry | None]:
        """``get`` on the load pool; a memory hit returns an already-completed future."""
        self._check_open()
        self._check_key(key)
        hit = self._get_local(key)
        if hit is not None or self.backend is None:
            done: cf.Future[StoreEntry | None] = cf.Future()
            if hit is None:
                self._count(misses=1)
            done.set_result(hit)
            return done
        return self._loader.submit(self._load, key)

    def get_many(self, keys: Iterable[EntryKey]) -> dict[EntryKey, StoreEntry]:
        """The entries found among ``keys`` (absent keys are misses); backend loads run in parallel."""
        futures = {key: self.submit_get(key) for key in dict.fromkeys(keys)}
        found: dict[EntryKey, StoreEntry] = {}
        for key, fut in futures.items():
            entry = fut.result()
            if entry is not None:
                found[key] = entry
        return found

    def contains(self, key: EntryKey) -> bool:
        """Whether ``key`` is stored in any tier (not verified; ``get`` may still refuse it)."""
        self._check_key(key)
        with self._lock:
            if key in self.memory or key in self._pending:
                return True
        if self.backend is None:
            return False
        try:
            return self.backend.contains(key)
        except StoreError as exc:
            log.warning("store: contains(%s) failed: %s", key.digest[:12], exc)
            return False

    def variants(self, fingerprint: str, kind: EntryKind | str, content_hash: str) -> list[EntryKey]:
        """Every stored key of one model, kind and content (all its variants) in any tier: this process's
        memory and pending writes, and the backend's own records, so entries other processes wrote are
        listed too. A backend that cannot be read is logged and counted; its variants are then missed."""
        self._check_open()
        kind = EntryKey(fingerprint, kind, content_hash).kind  # validates the three fields
        with self._lock:  # memory by its per-content index; pending writes are the few in flight
            pending = [k for k in self._pending if k.content_hash == content_hash]
            local = [*self.memory.variants(fingerprint, kind.value, content_hash), *pending]
        found = {k: None for k in local if k.fingerprint == fingerprint and k.kind == kind}
        if self.backend is not None:
            try:
                found.update(dict.fromkeys(self.backend.variants(fingerprint, kind, content_hash)))
            except InvalidInputError:
                raise
            except Exception as exc:  # as a failed load: counted, and the caller recomputes
                log.warning("store: listing the variants of %s failed: %s", content_hash[:12], exc)
                self._count(load_errors=1)
        return list(found)

    def _get_local(self, key: EntryKey) -> StoreEntry | None:
        with self._lock:
            entry = self.memory.get(key) or self._pending.get(key)
            if entry is not None:
                self._stats.memory_hits += 1
                entry.uses += 1
                entry.last_used = time.time()
            return entry

    def _load(self, key: EntryKey) -> StoreEntry | None:
        if self.backend is None:
            self._count(misses=1)
            return None
        try:
            entry = self.backend.get(key)
        except UnauthenticatedEntryError as exc:
            log.warning("store: refused %s (MAC): %s; recomputing", key.digest[:12], exc)
            self._count(refused_auth=1, misses=1)
            return None
        except ChecksumError as exc:
            log.warning("store: refused %s (checksum): %s; recomputing", key.digest[:12], exc)
            self._count(refused_checksum=1, misses=1)
            return None
        except FingerprintMismatchError as exc:
            log.warning("store: refused %s (fingerprint): %s; recomputing", key.digest[:12], exc)
            self._count(refused_fingerprint=1, misses=1)
            return None
        except Exception as exc:  # any failed load is a counted recompute, never a crash of the caller
            log.warning("store: load of %s failed: %s; recomputing", key.digest[:12], exc)
            self._count(load_errors=1, misses=1)
            return None
        if entry is None:
            self._count(misses=1)
            return None
        with self._lock:
            self._stats.backend_hits += 1
            self._stats.bytes_read += entry.stored_nbytes
            before = self.memory.evictions
            self.memory.put(entry)
            self._stats.evictions += self.memory.evictions - before
        return entry

    # -- writes --------------------------------------------------------------------------------------
    def put(self, entry: StoreEntry) -> None:
        """Keep ``entry`` in memory now and write it to the backend (write-behind unless disabled).

        Raises StoreError only for an inline (``write_behind=False``) backend write that fails;
        write-behind failures are logged and counted in ``write_errors``.
        """
        self._check_open()
        if not isinstance(entry, StoreEntry):
            raise InvalidInputError(f"put expects a StoreEntry, got {type(entry).__name__}")
        key = entry.key
        if entry.storage_dtype is None and self.storage_dtype is not None:
            entry.storage_dtype = self.storage_dtype  # only the serialized form changes
        with self._lock:
            known = key in self.memory or key in self._pending
            before = self.memory.evictions
            self.memory.put(entry)
            self._stats.evictions += self.memory.evictions - before
            if known or self.backend is None:
                return
            if self.write_behind:
                self._pending[key] = entry
                fut = self._writer.submit(self._write, entry)
                self._writes.add(fut)
                fut.add_done_callback(self._write_done)
                return
        self._write(entry, raise_errors=True)

    def _write(self, entry: StoreEntry, raise_errors: bool = False) -> None:
        assert self.backend is not None
        try:
            written = self.backend.put(entry)
        except Exception as exc:
            self._count(write_errors=1)
            log.warning("store: write of %s failed: %s", entry.key.digest[:12], exc)
            if raise_errors:
                if isinstance(exc, StoreError):
                    raise
                raise StoreError(f"write of {entry.key.digest[:12]} failed: {exc}") from exc
        else:
            if written:
                self._count(writes=1, bytes_written=written)
        finally:
            with self._lock:
                self._pending.pop(entry.key, None)

    def _write_done(self, fut: cf.Future[None]) -> None:
        with self._lock:
            self._writes.discard(fut)

    def flush(self) -> None:
        """Wait until every write-behind write issued so far has finished."""
        with self._lock:
            pending = list(self._writes)
        cf.wait(pending)

    def delete(self, key: EntryKey) -> bool:
        """Remove ``key`` from every tier (pins are kept). True if something was removed."""
        self._check_key(key)
        self.flush()
        with self._lock:
            removed = self.memory.discard(key)
        if self.backend is not None:
            removed = self.backend.delete(key) or removed
        return removed

    # -- pins ----------------------------------------------------------------------------------------
    def pin(self, key: EntryKey) -> int:
        """Pin ``key`` in memory (refcounted; it need not be resident yet). Returns the pin count."""
        self._check_key(key)
        return self.memory.pin(key)

    def unpin(self, key: EntryKey) -> int:
        """Drop one pin of ``key``; raises InvalidInputError when it is not pinned."""
        self._check_key(key)
        with self._lock:
            before = self.memory.evictions
            count = self.memory.unpin(key)
            self._stats.evictions += self.memory.evictions - before
        return count

    # -- stats / lifecycle ---------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """A snapshot of the counters (``backend_bytes`` asks the backend; None if that fails)."""
        backend_bytes: int | None = None
        if self.backend is not None and not self._closed:
            try:
                backend_bytes = self.backend.total_bytes()
            except StoreError as exc:
                log.debug("store: backend size unknown: %s", exc)
        with self._lock:
            snap = self._stats.model_copy()
        snap.memory_entries = len(self.memory)
        snap.memory_bytes = self.memory.nbytes
        snap.pinned_bytes = self.memory.pinned_bytes
        snap.backend_evictions = self.backend.evictions if self.backend is not None else 0
        snap.index_rebuilds = self.backend.index_rebuilds if self.backend is not None else 0
        snap.backend_bytes = backend_bytes
        return snap

    def close(self) -> None:
        """Flush pending writes, stop the thread pools and close the backend. Idempotent."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._writer.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self.backend is not None:
            self.backend.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _check_key(self, key: object) -> None:
        if not isinstance(key, EntryKey):
            raise InvalidInputError(f"expected an EntryKey, got {type(key).__name__}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")
