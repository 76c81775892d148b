"""The vision embedding cache: each image / video segment goes through the vision tower once.

Entries are keyed by (model fingerprint, media digest, layout): the same picture on the same model
never re-runs the tower, whether its chunk is evicted and recalled, re-materialised after a cascade,
or added to another window on the same engine. ``tower_runs`` counts every tower call.

Two tiers. Memory holds the most recently used entries up to ``max_memory_bytes`` (1 GiB by default;
None: no bound); an entry pushed out goes to disk, never away: to ``directory`` when one is given, else to a
directory of the cache's own that goes with it. A later read loads it back (``disk_hits``), byte for byte, so a
server that sees a new screenshot every step holds a bounded amount of memory and never re-runs the tower.
With ``directory`` every entry is also written there when it is made, so a later process on the same model
skips the tower too.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from ..errors import positive_int
from .base import Features

#: The memory tier's default bound: about 170 screenshots of 1000 feature rows at hidden size 1536 in fp32.
DEFAULT_MEMORY_BYTES = 1 << 30


class VisionCacheStats(BaseModel):
    """Vision tower work and cache traffic."""

    tower_runs: int = 0
    hits: int = Field(0, description="reads served from memory")
    disk_hits: int = Field(0, description="reads loaded from disk (the directory, or entries the bound moved there)")
    entries: int = Field(0, description="entries in memory")
    bytes: int = Field(0, description="bytes of the entries in memory")
    spilled: int = Field(0, description="entries moved out of memory to disk (the bound, clear_memory)")
    max_memory_bytes: int | None = Field(DEFAULT_MEMORY_BYTES, description="the memory tier's bound (null: none)")


class VisionCache:
    """Features by key: the most recent in memory (up to ``max_memory_bytes``), the rest on disk."""

    def __init__(
        self,
        fingerprint: str,
        directory: str | Path | None = None,
        *,
        max_memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    ) -> None:
        max_memory_bytes = positive_int("max_memory_bytes", max_memory_bytes, optional=True)
        self.fingerprint = fingerprint
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._own: tempfile.TemporaryDirectory[str] | None = None  # where entries go without a directory
        self._mem: OrderedDict[str, Features] = OrderedDict()  # least recently used first
        self.stats = VisionCacheStats(max_memory_bytes=max_memory_bytes)
        self._lock = threading.Lock()  # windows of one engine use it concurrently: counts and entries stay whole

    def key(self, digest: str, layout: str) -> str:
        return hashlib.blake2b(f"{self.fingerprint}|{digest}|{layout}".encode(), digest_size=16).hexdigest()

    def path_of(self, key: str) -> Path | None:
        """Where the entry of ``key`` is or would be on disk (None: no directory yet)."""
        if self.directory is not None:
            return self.directory / f"{key}.safetensors"
        if self._own is not None:
            return Path(self._own.name) / f"{key}.safetensors"
        return None

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held in either tier (a file removed behind the cache's back is not)."""
        if not isinstance(key, str):
            return False
        with self._lock:
            if key in self._mem:
                return True
        path = self.path_of(key)
        return path is not None and path.is_file()

    def get(self, key: str) -> Features | None:
        with self._lock:
            feats = self._mem.get(key)
            if feats is not None:
                self._mem.move_to_end(key)
                self.stats.hits += 1
                return feats
            path = self.path_of(key)
            if path is None or not path.is_file():
                return None
            from safetensors.torch import load_file

            t = load_file(str(path))
            feats = Features(t["embeds"], t.get("deepstack"))
            self.stats.disk_hits += 1
            self._hold(key, feats)
            return feats

    def put(self, key: str, feats: Features) -> None:
        with self._lock:
            if self.directory is not None:
                self._write(self.directory / f"{key}.safetensors", feats)
            self._hold(key, feats)

    def counted_run(self) -> None:
        with self._lock:
            self.stats.tower_runs += 1

    def clear_memory(self) -> None:
        """Empty the memory tier; its entries go to disk first (a later read loads them back)."""
        with self._lock:
            while self._mem:
                self._spill_oldest()
            self.stats.entries = 0

    # --- under the lock ---------------------------------------------------------------------------
    def _hold(self, key: str, feats: Features) -> None:
        """Put ``feats`` in memory as the most recent entry, then move the oldest to disk while the tier is past
        its bound (the newest stays even if it alone is bigger)."""
        old = self._mem.pop(key, None)
        if old is not None:
            self.stats.bytes -= old.nbytes
        self._mem[key] = feats
        self.stats.bytes += feats.nbytes
        limit = self.stats.max_memory_bytes
        while limit is not None and self.stats.bytes > limit and len(self._mem) > 1:
            self._spill_oldest()
        self.stats.entries = len(self._mem)

    def _spill_oldest(self) -> None:
        key, feats = next(iter(self._mem.items()))
        path = self._spill_path(key)
        if not path.is_file():  # not written at ``put`` (no directory), or removed since: written now
            self._write(path, feats)
        self.stats.spilled += 1
        del self._mem[key]
        self.stats.bytes -= feats.nbytes

    def _spill_path(self, key: str) -> Path:
        if self.directory is None and self._own is None:
            self._own = tempfile.TemporaryDirectory(prefix="kamera-vision-")
        path = self.path_of(key)
        assert path is not None
        return path

    @staticmethod
    def _write(path: Path, feats: Features) -> None:
        from safetensors.torch import save_file

        tensors = {"embeds": feats.embeds.contiguous()}
        if feats.deepstack is not None:
            tensors["deepstack"] = feats.deepstack.contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)


def tensors_device(feats: Features, device: torch.device, dtype: torch.dtype) -> Features:
    deep = None if feats.deepstack is None else feats.deepstack.to(device=device, dtype=dtype)
    return Features(feats.embeds.to(device=device, dtype=dtype), deep)
