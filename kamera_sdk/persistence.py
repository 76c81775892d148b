"""Bridge between the content table and the chunk store: canonicals and patches persist across
processes, keyed by content and model fingerprint.

Canonicals are written when a chunk arrives (write-behind) and looked up before any canonical forward;
patches are written when formed. A new window finds a chunk's patches by asking the store for every
variant of that chunk's patch entries (``ChunkStore.variants``): the backend's own records, so patches
that other processes wrote at the same time are all found, with no shared index to update (an index
entry rewritten by two processes at once lost one of them). A load that fails (checksum, fingerprint,
I/O, or an entry that does not cover the chunk's tokens) is counted and recomputed, never used.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future

from kamera_engine import KV, Engine, Patch
from kamera_engine.window_buffer import upload, upload_tensors

from .chunks import VISION_KINDS, Chunk, ChunkId, PatchKind, StoredPatch, antecedent_signature, sequence_digest
from .stats import WindowStats
from .store import ChunkStore, EntryKey, EntryKind, StoreEntry

#: variant prefix of the per-chunk index entries earlier versions wrote next to the patches
_LEGACY_INDEX = "index"
log = logging.getLogger("kamera.store")


class Persistence:
    """Reads and writes one window's canonicals and patches through a ``ChunkStore``."""

    def __init__(self, store: ChunkStore, engine: Engine, stats: WindowStats) -> None:
        self.store = store
        self.fingerprint = engine.fingerprint
        # canonicals depend on the anchor they were compiled after, on the KV dtype, and on how their keys were
        # made (``Engine.canonical_source``): a placement rotates a pre-RoPE canonical the model's way, so an
        # un-rotated one must never be read as one (entries of older versions, keyed without it, miss)
        anchor = sequence_digest([str(t) for t in engine.anchor_ids])
        self._engine = engine
        self._canonical_prefix = f"anchor={anchor};dtype={str(engine.dtype).replace('torch.', '')}"
        self.anchor = anchor
        self.stats = stats
        self.device = engine.device  # loaded entries are uploaded there (pinned memory, a side stream on CUDA)
        self._prefetched: dict[str, Future[StoreEntry | None]] = {}

    @property
    def canonical_variant(self) -> str:
        """The variant of this engine's canonical entries (the engine's key source read each time: it is
        assignable)."""
        return f"{self._canonical_prefix};keys={self._engine.canonical_source}"

    def canonical_key(self, chunk: Chunk) -> EntryKey:
        return EntryKey(self.fingerprint, EntryKind.CANONICAL, chunk.id, self.canonical_variant + _frame(chunk))

    def prefetch(self, chunks: list[Chunk]) -> None:
        """Start loading canonicals in the background so they overlap with forwards of other chunks."""
        for chunk in chunks:
            if chunk.canonical is None and chunk.id not in self._prefetched:
                self._prefetched[chunk.id] = self.store.submit_get(self.canonical_key(chunk))

    def forget(self, chunk_id: ChunkId) -> None:
        """Stop prefetching a forgotten chunk's canonical (the store keeps its entry)."""
        fut = self._prefetched.pop(chunk_id, None)
        if fut is not None:
            fut.cancel()

    def load_canonical(self, chunk: Chunk) -> KV | None:
        fut = self._prefetched.pop(chunk.id, None)
        entry = fut.result() if fut is not None else self.store.get(self.canonical_key(chunk))
        if entry is None:
            return None
        kv = KV(entry.tensors["keys"], entry.tensors["values"], None, entry.tensors.get("deltas"))
        if len(kv) != len(chunk):
            self._refuse(f"canonical of {len(kv)} tokens for a chunk of {len(chunk)}", chunk, entry.key)
            return None
        self.stats.store_loads += 1
        return upload(kv, self.device)

    def _refuse(self, why: str, chunk: Chunk, key: EntryKey) -> None:
        """An entry that does not fit the chunk is never used; it is deleted so a good copy can be written."""
        log.warning("store: entry for chunk %s refused: %s", chunk.id[:12], why)
        self.stats.store_load_failures += 1
        self.store.delete(key)

    def save_canonical(self, chunk: Chunk, kv: KV) -> None:
        # the store keeps host tensors (a no-op on a CPU)
        tensors = {"keys": kv.keys.cpu().contiguous(), "values": kv.values.cpu().contiguous()}
        if kv.deltas is not None:  # M-RoPE vision tokens: placing them needs their axis offsets
            tensors["deltas"] = kv.deltas.cpu().contiguous()
        self.store.put(StoreEntry(self.canonical_key(chunk), tensors, {"tokens": str(len(chunk))}))

    def _patch_key(self, chunk: Chunk, variant: str) -> EntryKey:
        return EntryKey(self.fingerprint, EntryKind.PATCH, chunk.id, variant + _frame(chunk))

    def _variant(self, stored: StoredPatch) -> str:
        p = stored.patch
        layers = sequence_digest([str(i) for i in p.layers])
        dtype = str(p.k_u.dtype).replace("torch.", "")
        antecedent = antecedent_signature(stored.antecedent)
        return f"{stored.kind.value}:{antecedent}:r{p.rank}:l{layers}:{dtype}:a{self.anchor}"

    def save_patch(self, chunk: Chunk, stored: StoredPatch) -> None:
        variant = self._variant(stored)
        meta = {
            "antecedent": json.dumps(list(stored.antecedent)),
            "kind": stored.kind.value,
            "orderings": str(stored.orderings),
            "absorbed": json.dumps(sorted(stored.carried)),
        }
        tensors = {n: t.cpu() for n, t in stored.patch.tensors().items()}
        self.store.put(StoreEntry(self._patch_key(chunk, variant), tensors, meta))

    def _patch_keys(self, chunk: Chunk) -> list[EntryKey]:
        """The stored patch entries of ``chunk`` formed after this engine's anchor, in this chunk's frame
        (older stores' per-chunk index entries are not patches: skipped)."""
        suffix = f":a{self.anchor}{_frame(chunk)}"
        keys = self.store.variants(self.fingerprint, EntryKind.PATCH, chunk.id)
        return [k for k in keys if k.variant.endswith(suffix) and not k.variant.startswith(f"{_LEGACY_INDEX}:")]

    def load_patches(self, chunk: Chunk) -> list[StoredPatch]:
        out = []
        found = self.store.get_many(self._patch_keys(chunk)).items()
        # in the order they were formed, whichever backend listed them: equally good patches are then
        # chosen the same way everywhere
        for key, entry in sorted(found, key=lambda item: (item[1].created_at, item[0].variant)):
            antecedent = tuple(json.loads(entry.meta["antecedent"]))
            if entry.meta["kind"] not in {k.value for k in PatchKind}:
                self._refuse(f"unknown patch kind {entry.meta['kind']!r}", chunk, key)
                continue
            patch = Patch.from_tensors(upload_tensors(entry.tensors, self.device))
            if patch.num_tokens != len(chunk):
                self._refuse(f"patch of {patch.num_tokens} tokens for a chunk of {len(chunk)}", chunk, key)
                continue
            absorbed = frozenset(json.loads(entry.meta["absorbed"])) if "absorbed" in entry.meta else None
            orderings = int(entry.meta.get("orderings", "1"))
            out.append(StoredPatch(patch, antecedent, PatchKind(entry.meta["kind"]), orderings, absorbed))
            self.stats.store_loads += 1
        return out


def _frame(chunk: Chunk) -> str:
    """Key suffix naming the version of a chunk's position-free frame. Vision chunks (every family, M-RoPE
    or not): the frame where every rotary axis is at angle 0, with the per-token deltas stored alongside
    (None outside M-RoPE); entries written before that frame (no suffix) are never read."""
    return ";frame=axes" if chunk.kind in VISION_KINDS else ""
