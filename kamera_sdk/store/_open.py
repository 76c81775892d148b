"""``open_store``: one argument (None, a path, a backend URL, or a store) to a ``ChunkStore``.

Spec strings resolve through the backend registry (``_registry``), keyed by URL scheme.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kamera_engine.errors import InvalidInputError

from . import _disk, _redis  # noqa: F401  (their backends register their schemes)
from ._auth import EntryAuth
from ._backend import Backend
from ._chunk_store import DEFAULT_MEMORY_BYTES, ChunkStore
from ._eviction import EvictionPolicy
from ._registry import backend_for

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
    storage_dtype: str | torch.dtype | None = None,
    secret: str | bytes | None = None,
) -> ChunkStore:
    """A ChunkStore for ``spec``.

    ``None``: memory only (this process). A path (str or Path): a DiskBackend there (``max_bytes`` bounds
    it). ``"redis://host:port/db"`` (or ``rediss://``, ``unix://``): a RedisBackend (``ttl_s``,
    ``max_bytes`` per model); any other scheme registered with ``register_backend``. A backend object:
    wrapped. A ChunkStore: returned unchanged. ``storage_dtype`` ("bfloat16", "float16" or None): the
    dtype floating tensors are written to the backend in (see ``ChunkStore``). ``secret`` (a fleet's shared
    secret, 16 bytes or more): the backend tags every entry it writes with an HMAC-SHA256 and refuses, counts
    and deletes any entry read without a valid one (see ``EntryAuth``); it needs a backend with an ``auth``
    attribute (disk, redis).
    """
    auth = EntryAuth(secret) if secret is not None else None
    if isinstance(spec, ChunkStore):
        if auth is not None:
            raise InvalidInputError("pass the secret when the store is opened, not with an open ChunkStore")
        return spec
    backend: Backend | None
    if spec is None:
        backend = None
    elif isinstance(spec, os.PathLike):
        backend = backend_for(os.fspath(spec), max_bytes=max_bytes, ttl_s=ttl_s)
    elif isinstance(spec, str):
        backend = backend_for(spec, max_bytes=max_bytes, ttl_s=ttl_s)
    elif isinstance(spec, Backend):
        backend = spec
    else:
        raise InvalidInputError(
            f"store must be None, a path, a backend URL (redis://...) or a ChunkStore, got {type(spec).__name__}"
        )
    if auth is not None:
        if backend is None or not hasattr(backend, "auth"):
            raise InvalidInputError(f"a store secret needs a backend that tags entries (disk, redis), not {spec!r}")
        backend.auth = auth
    return ChunkStore(
        memory_bytes=memory_bytes,
        backend=backend,
        eviction=eviction,
        write_behind=write_behind,
        storage_dtype=storage_dtype,
    )
