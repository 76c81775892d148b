"""Bridge between the content table and the chunk store: canonicals and patches persist across
processes, keyed by content and model fingerprint.

Canonicals are written when a chunk arrives (write-behind) and looked up before any canonical forward;
patches are written when formed, with a per-chunk index so a new process finds them. A load that fails
(checksum, fingerprint, I/O) is counted by the store and recomputed, never used.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

from kamera_engine import KV, Engine, Patch

from .chunks import VISION_KINDS, Chunk, StoredPatch, antecedent_signature
from .stats import WindowStats
from .store import ChunkStore, EntryKey, EntryKind, StoreEntry

_INDEX = "index"


class Persistence:
    """Reads and writes one window's canonicals and patches through a ``ChunkStore``."""

    def __init__(self, store: ChunkStore, engine: Engine, stats: WindowStats) -> None:
        self.store = store
        self.fingerprint = engine.fingerprint
        # canonicals depend on the anchor they were compiled after, and on the KV dtype
        anchor = antecedent_signature(tuple(str(t) for t in engine.anchor_ids))
        self.canonical_variant = f"anchor={anchor};dtype={str(engine.dtype).replace('torch.', '')}"
        self.anchor = anchor
        self.stats = stats
        self._prefetched: dict[str, Future[StoreEntry | None]] = {}

    def canonical_key(self, chunk: Chunk) -> EntryKey:
        return EntryKey(self.fingerprint, EntryKind.CANONICAL, chunk.id, self.canonical_variant + _frame(chunk))

    def prefetch(self, chunks: list[Chunk]) -> None:
        """Start loading canonicals in the background so they overlap with forwards of other chunks."""
        for chunk in chunks:
            if chunk.canonical is None and chunk.id not in self._prefetched:
                self._prefetched[chunk.id] = self.store.submit_get(self.canonical_key(chunk))

    def load_canonical(self, chunk: Chunk) -> KV | None:
        fut = self._prefetched.pop(chunk.id, None)
        entry = fut.result() if fut is not None else self.store.get(self.canonical_key(chunk))
        if entry is None:
            return None
        self.stats.store_loads += 1
        return KV(entry.tensors["keys"], entry.tensors["values"], None, entry.tensors.get("deltas"))

    def save_canonical(self, chunk: Chunk, kv: KV) -> None:
        tensors = {"keys": kv.keys.contiguous(), "values": kv.values.contiguous()}
        if kv.deltas is not None:  # M-RoPE vision tokens: placing them needs their axis offsets
            tensors["deltas"] = kv.deltas.cpu().contiguous()
        self.store.put(StoreEntry(self.canonical_key(chunk), tensors, {"tokens": str(len(chunk))}))

    def _patch_key(self, chunk: Chunk, variant: str) -> EntryKey:
        return EntryKey(self.fingerprint, EntryKind.PATCH, chunk.id, variant + _frame(chunk))

    def _variant(self, stored: StoredPatch) -> str:
        return f"{stored.kind}:{antecedent_signature(stored.antecedent)}:r{stored.patch.rank}:a{self.anchor}"

    def save_patch(self, chunk: Chunk, stored: StoredPatch) -> None:
        variant = self._variant(stored)
        meta = {
            "antecedent": json.dumps(list(stored.antecedent)),
            "kind": stored.kind,
            "orderings": str(stored.orderings),
        }
        self.store.put(StoreEntry(self._patch_key(chunk, variant), stored.patch.tensors(), meta))
        index = self.store.get(self._patch_key(chunk, self._index_variant))
        variants = json.loads(index.meta["variants"]) if index is not None else []
        if variant not in variants:
            variants.append(variant)
            # the index carries no tensor data of its own; safetensors needs one tensor
            marker = {"n": stored.patch.k_u.new_tensor([len(variants)])}
            self.store.put(
                StoreEntry(self._patch_key(chunk, self._index_variant), marker, {"variants": json.dumps(variants)})
            )

    @property
    def _index_variant(self) -> str:
        return f"{_INDEX}:a{self.anchor}"

    def load_patches(self, chunk: Chunk) -> list[StoredPatch]:
        index = self.store.get(self._patch_key(chunk, self._index_variant))
        if index is None:
            return []
        out = []
        keys = [self._patch_key(chunk, v) for v in json.loads(index.meta["variants"])]
        for key, entry in self.store.get_many(keys).items():
            del key
            antecedent = tuple(json.loads(entry.meta["antecedent"]))
            patch = Patch.from_tensors(entry.tensors)
            out.append(StoredPatch(patch, antecedent, entry.meta["kind"], int(entry.meta.get("orderings", "1"))))
            self.stats.store_loads += 1
        return out


def _frame(chunk: Chunk) -> str:
    """Key suffix naming the version of a chunk's position-free frame. Vision chunks (every family, M-RoPE
    or not): the frame where every rotary axis is at angle 0, with the per-token deltas stored alongside
    (None outside M-RoPE); entries written before that frame (no suffix) are never read."""
    return ";frame=axes" if chunk.kind in VISION_KINDS else ""
