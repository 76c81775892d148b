"""Kamera's chunk store: canonicals, patches and vision embeddings, position-free, keyed by content and model.

Tiers: a byte-budgeted host-RAM tier (LRU or LFU, pins) in front of an optional persistent backend, a
directory of safetensors files with an SQLite index (``DiskBackend``) or a shared Redis
(``RedisBackend``). Writes are atomic and checksummed; reads verify checksum and model fingerprint, and a
refused entry is a counted miss. A disk store rebuilds a lost or corrupt index from its entry files;
``storage_dtype="bfloat16"`` halves the bytes of a float32 model's entries;
``secret=`` makes a shared backend accept only entries tagged with that secret's HMAC. See docs/storage.md.

    from kamera_sdk.store import open_store, EntryKey, StoreEntry
    store = open_store("/var/lib/kamera")          # or None, or "redis://host:6379/0"
    store.put(StoreEntry(EntryKey(fp, "canonical", chunk_hash), {"k": k, "v": v}))
    entry = store.get(EntryKey(fp, "canonical", chunk_hash))
"""

from ._auth import EntryAuth, UnauthenticatedEntryError
from ._backend import Backend
from ._chunk_store import DEFAULT_MEMORY_BYTES, ChunkStore, StoreStats
from ._disk import DiskBackend
from ._entry import STORAGE_DTYPES, EntryKey, EntryKind, StoreEntry
from ._eviction import EVICTION_POLICIES, LFU, LRU, EvictionPolicy, register_eviction
from ._memory import MemoryTier
from ._open import StoreSpec, default_store_path, open_store
from ._rebuild import RebuildReport
from ._redis import RedisBackend
from ._registry import BACKENDS, BackendFactory, register_backend

__all__ = [
    "BACKENDS",
    "DEFAULT_MEMORY_BYTES",
    "EVICTION_POLICIES",
    "LFU",
    "LRU",
    "STORAGE_DTYPES",
    "Backend",
    "BackendFactory",
    "ChunkStore",
    "DiskBackend",
    "EntryAuth",
    "EntryKey",
    "EntryKind",
    "EvictionPolicy",
    "MemoryTier",
    "RebuildReport",
    "RedisBackend",
    "StoreEntry",
    "StoreSpec",
    "StoreStats",
    "UnauthenticatedEntryError",
    "default_store_path",
    "open_store",
    "register_backend",
    "register_eviction",
]
