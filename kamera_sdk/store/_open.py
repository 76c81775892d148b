"""``open_store``: one argument (None, a path, a redis URL, or a store) to a ``ChunkStore``."""

from __future__ import annotations

import os
from pathlib import Path

from kamera_engine.errors import InvalidInputError

from ._backend import Backend
from ._chunk_store import DEFAULT_MEMORY_BYTES, ChunkStore
from ._disk import DiskBackend
from ._eviction import EvictionPolicy
from ._redis import URL_SCHEMES, RedisBackend

StoreSpec = ChunkStore | Backend | str | os.PathLike[str] | None


def default_store_path() -> Path:
    """``$KAMERA_HOME/store``; ``KAMERA_HOME`` defaults to ``~/.cache/kamera``."""
    home = os.environ.get("KAMERA_HOME") or "~/.cache/kamera"
    return Path(home).expanduser() / "store"


def open_store(
    spec: StoreSpec = None,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    eviction: str | EvictionPolicy = "lru",
    write_behind: bool = True,
    max_bytes: int | None = None,
    ttl_s: float | None = None,
) -> ChunkStore:
    """A ChunkStore for ``spec``.

    ``None``: memory only (this process). A path (str or Path): a DiskBackend there (``max_bytes`` bounds
    it). ``"redis://host:port/db"`` (or ``rediss://``, ``unix://``): a RedisBackend (``ttl_s``,
    ``max_bytes`` per model). A backend object: wrapped. A ChunkStore: returned unchanged.
    """
    if isinstance(spec, ChunkStore):
        return spec
    backend: Backend | None
    if spec is None:
        backend = None
    elif isinstance(spec, str) and spec.startswith(URL_SCHEMES):
        backend = RedisBackend(spec, ttl_s=ttl_s, max_bytes=max_bytes)
    elif isinstance(spec, str) and "://" in spec:
        raise InvalidInputError(f"store URL scheme not supported: {spec!r} (use a path or {', '.join(URL_SCHEMES)})")
    elif isinstance(spec, (str, os.PathLike)):
        if ttl_s is not None:
            raise InvalidInputError("ttl_s applies to a redis store only")
        backend = DiskBackend(spec, max_bytes=max_bytes)
    elif isinstance(spec, Backend):
        backend = spec
    else:
        raise InvalidInputError(
            f"store must be None, a path, a redis:// URL or a ChunkStore, got {type(spec).__name__}"
        )
    return ChunkStore(memory_bytes=memory_bytes, backend=backend, eviction=eviction, write_behind=write_behind)
