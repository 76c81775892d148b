"""The host-RAM tier: a byte budget, a selectable eviction policy, and pins that are never evicted."""

from __future__ import annotations

import threading
from collections import Counter

from kamera_engine.errors import InvalidInputError

from ._entry import EntryKey, StoreEntry
from ._eviction import EvictionPolicy, Residency, make_eviction


class MemoryTier:
    """Entries in host RAM under a byte budget.

    Unpinned entries are evicted by ``eviction`` ("lru" or "lfu", or any registered policy) when a new
    entry needs room. Pinned entries (``pin`` is a refcount, so a window and its forks can pin the same
    chunk) are never evicted and are always admitted, so the tier may exceed its budget only by pinned
    bytes. An unpinned entry that cannot fit is not admitted (``put`` returns False). Thread-safe.
    """

    def __init__(self, max_bytes: int, eviction: str | EvictionPolicy = "lru") -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise InvalidInputError(
                f"memory_bytes (the memory tier's max_bytes) must be an int >= 0, got {max_bytes!r}"
            )
        self.max_bytes = max_bytes
        self.policy = make_eviction(eviction)
        self.evictions = 0
        self._entries: dict[EntryKey, StoreEntry] = {}
        self._res: dict[EntryKey, Residency] = {}
        self._pins: Counter[EntryKey] = Counter()
        self._by_content: dict[tuple[str, str, str], set[EntryKey]] = {}  # for ``variants``
        self._bytes = 0
        self._clock = 0
        self._lock = threading.RLock()

    # -- reads ---------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> StoreEntry | None:
        """The entry, counted as a use (recency and frequency), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._touch(key)
            return entry

    def peek(self, key: EntryKey) -> StoreEntry | None:
        """The entry without counting a use."""
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[EntryKey]:
        with self._lock:
            return list(self._entries)

    def variants(self, fingerprint: str, kind: str, content_hash: str) -> list[EntryKey]:
        """The resident keys of one model, kind and content (no scan of the tier)."""
        with self._lock:
            return list(self._by_content.get((fingerprint, kind, content_hash), ()))

    @property
    def nbytes(self) -> int:
        """Bytes of tensors resident now."""
        return self._bytes

    # -- writes --------------------------------------------------------------------------------------
    def put(self, entry: StoreEntry) -> bool:
        """Admit ``entry`` (evicting unpinned entries by policy as needed). False if it cannot fit."""
        if not isinstance(entry, StoreEntry):
            raise InvalidInputError(f"expected a StoreEntry, got {type(entry).__name__}")
        key = entry.key
        with self._lock:
            if key in self._entries:
                self._touch(key)
                return True
            if not self._pins[key] and not self._make_room(entry.nbytes):
                return False
            self._entries[key] = entry
            self._by_content.setdefault(_content(key), set()).add(key)
            self._clock += 1
            self._res[key] = Residency(tick=self._clock, uses=1, nbytes=entry.nbytes)
            self._bytes += entry.nbytes
            return True

    def discard(self, key: EntryKey) -> bool:
        """Drop ``key`` if resident (pins are kept). True if something was dropped."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            del self._res[key]
            self._bytes -= entry.nbytes
            same = self._by_content[_content(key)]
            same.discard(key)
            if not same:
                del self._by_content[_content(key)]
            return True

    def clear(self) -> None:
        """Drop every unpinned entry."""
        with self._lock:
            for key in [k for k in self._entries if not self._pins[k]]:
                self.discard(key)

    # -- pins ----------------------------------------------------------------------------------------
    def pin(self, key: EntryKey) -> int:
        """Add one pin on ``key`` (it need not be resident yet). Returns the new pin count."""
        if not isinstance(key, EntryKey):
            raise InvalidInputError(f"expected an EntryKey, got {type(key).__name__}")
        with self._lock:
            self._pins[key] += 1
            return self._pins[key]

    def unpin(self, key: EntryKey) -> int:
        """Remove one pin; at zero the entry becomes evictable (and is evicted now if over budget)."""
        with self._lock:
            if self._pins[key] <= 0:
                del self._pins[key]
                raise InvalidInputError(f"entry {getattr(key, 'digest', key)!s:.12} is not pinned")
            self._pins[key] -= 1
            count = self._pins[key]
            if not count:
                del self._pins[key]
                self._make_room(0)
            return count

    def pins(self, key: EntryKey) -> int:
        """Current pin count of ``key``."""
        with self._lock:
            return self._pins.get(key, 0)

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for k, e in self._entries.items() if self._pins.get(k))

    # -- internals -----------------------------------------------------------------------------------
    def _touch(self, key: EntryKey) -> None:
        self._clock += 1
        res = self._res[key]
        res.tick = self._clock
        res.uses += 1

    def _make_room(self, need: int) -> bool:
        """Evict unpinned entries, lowest rank first, until ``need`` more bytes fit. False if impossible."""
        if self._bytes + need <= self.max_bytes:
            return True
        candidates = sorted(
            (k for k in self._entries if not self._pins.get(k)), key=lambda k: self.policy.rank(self._res[k])
        )
        evictable = sum(self._res[k].nbytes for k in candidates)
        if self._bytes - evictable + need > self.max_bytes and need:
            return False  # would not fit even after evicting everything evictable: evict nothing
        for key in candidates:
            if self._bytes + need <= self.max_bytes:
                break
            self.discard(key)
            self.evictions += 1
        return self._bytes + need <= self.max_bytes


def _content(key: EntryKey) -> tuple[str, str, str]:
    return key.fingerprint, key.kind.value, key.content_hash
