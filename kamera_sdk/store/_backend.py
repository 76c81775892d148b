"""What a persistent backend provides. ``ChunkStore`` uses backends only through this protocol."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from ._entry import EntryKey, EntryKind, StoreEntry


@runtime_checkable
class Backend(Protocol):
    """A persistent tier keyed by ``EntryKey``.

    Reads verify: ``get`` raises ChecksumError (bytes differ from the recorded checksum),
    FingerprintMismatchError (written by another model) or StoreError (unreadable), after quarantining or
    deleting the bad entry, and returns None only for a plain miss. Writes are atomic and idempotent.
    """

    #: short name used in stats and logs ("disk", "redis")
    name: ClassVar[str]
    #: entries this backend evicted to respect its byte budget
    evictions: int
    #: times this backend rebuilt its index from the entries themselves (a lost or corrupt index)
    index_rebuilds: int

    def get(self, key: EntryKey) -> StoreEntry | None: ...

    def put(self, entry: StoreEntry) -> int:
        """Store ``entry``; returns bytes written (0 when the entry was already present)."""
        ...

    def put_blob(self, key: EntryKey, blob: bytes) -> int:
        """Store already-serialized bytes under ``key`` (copying between stores); reads verify them."""
        ...

    def contains(self, key: EntryKey) -> bool: ...

    def delete(self, key: EntryKey) -> bool: ...

    def keys(self, fingerprint: str | None = None) -> list[EntryKey]: ...

    def variants(self, fingerprint: str, kind: EntryKind, content_hash: str) -> list[EntryKey]:
        """Every stored key of one model, kind and content (all its variants), from the backend's own
        records: a new entry is listed once its write has returned, whichever process wrote it."""
        ...

    def total_bytes(self) -> int:
        """Serialized bytes held now."""
        ...

    def close(self) -> None: ...
