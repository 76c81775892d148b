"""The vision embedding cache: each image / video segment goes through the vision tower once.

Entries are keyed by (model fingerprint, media digest, layout): the same picture on the same model
never re-runs the tower, whether its chunk is evicted and recalled, re-materialised after a cascade,
or added to another window on the same engine. ``tower_runs`` counts every tower call.

An optional directory persists entries as safetensors files (one per key), so a later process on
the same model also skips the tower.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch
from pydantic import BaseModel

from .base import Features


class VisionCacheStats(BaseModel):
    """Vision tower work and cache traffic."""

    tower_runs: int = 0
    hits: int = 0
    disk_hits: int = 0
    entries: int = 0
    bytes: int = 0


class VisionCache:
    """Features by key, in memory (and optionally on disk)."""

    def __init__(self, fingerprint: str, directory: str | Path | None = None) -> None:
        self.fingerprint = fingerprint
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, Features] = {}
        self.stats = VisionCacheStats()
        self._lock = threading.Lock()  # windows of one engine use it concurrently: counts and entries stay whole

    def key(self, digest: str, layout: str) -> str:
        return hashlib.blake2b(f"{self.fingerprint}|{digest}|{layout}".encode(), digest_size=16).hexdigest()

    def __contains__(self, key: object) -> bool:
        return key in self._mem

    def get(self, key: str) -> Features | None:
        with self._lock:
            feats = self._mem.get(key)
            if feats is not None:
                self.stats.hits += 1
                return feats
        if self.directory is not None:
            path = self.directory / f"{key}.safetensors"
            if path.is_file():
                from safetensors.torch import load_file

                t = load_file(str(path))
                feats = Features(t["embeds"], t.get("deepstack"))
                self._put(key, feats)
                with self._lock:
                    self.stats.disk_hits += 1
                return feats
        return None

    def put(self, key: str, feats: Features) -> None:
        self._put(key, feats)
        if self.directory is not None:
            from safetensors.torch import save_file

            tensors = {"embeds": feats.embeds.contiguous()}
            if feats.deepstack is not None:
                tensors["deepstack"] = feats.deepstack.contiguous()
            tmp = self.directory / f"{key}.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(self.directory / f"{key}.safetensors")

    def _put(self, key: str, feats: Features) -> None:
        with self._lock:
            if key not in self._mem:
                self.stats.entries += 1
                self.stats.bytes += feats.nbytes
            self._mem[key] = feats

    def counted_run(self) -> None:
        with self._lock:
            self.stats.tower_runs += 1

    def clear_memory(self) -> None:
        """Drop the in-memory tier (entries on disk stay)."""
        with self._lock:
            self._mem.clear()
            self.stats.entries = 0
            self.stats.bytes = 0


def tensors_device(feats: Features, device: torch.device, dtype: torch.dtype) -> Features:
    deep = None if feats.deepstack is None else feats.deepstack.to(device=device, dtype=dtype)
    return Features(feats.embeds.to(device=device, dtype=dtype), deep)
