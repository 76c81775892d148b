"""``VisionEngine``: the engine for vision-language models, with image and video chunks.

Everything the window does with text chunks (canonical, relocate, patch, forward at explicit positions,
decode) works unchanged on image chunks, because an image chunk is, to the rest of Kamera, a run of
token ids like any other:

* **Virtual token ids.** Registering an image gives its placeholder tokens ids beyond the text
  vocabulary, one per feature row (``base + k``). Chunk ids stay content hashes, concatenating chunks
  for a forward needs no side channel, and the forward swaps each virtual id for its feature row
  (text ids go through the embedding table as usual).
* **Vision embedding cache.** The rows come from :class:`~.cache.VisionCache`, keyed by model
  fingerprint and image digest: the vision tower runs once per distinct image, at registration. Its memory
  tier is bounded (``vision_memory_bytes``) and what it pushes out goes to disk, so the processed pixels are
  dropped once the tower has run: an engine holds a bounded amount per image it has seen (the chunk's
  token ids and deltas), however many screenshots an agent sends.
* **Positions.** Every token advances the window's linear position by one. A vision token at linear
  position ``p`` gets, on M-RoPE families, the 3-axis position ``p + delta``, where ``delta`` is its
  native chunk-relative (t, h, w) offset minus its index in the chunk (the model's own ``get_rope_index``
  on the chunk alone). Moving a chunk by ``d`` therefore shifts all three axes by ``d``. The deltas
  travel with the chunk's KV (``KV.deltas``), and the operator runs with a spec bound to them
  (``mrope.MRopeSpec``), which takes each rotary frequency's float32 angle on its own axis, exactly as
  transformers does: relocation is as exact as for text, and position-free keys of vision tokens are
  at angle 0 like every other key. (The native layout packs the text after an image at
  ``max(t, h, w) + 1``; here it continues at the chunk's token count, the same for every policy and for
  re-prefill.)
* **MLA.** DeepSeek-V2/V3 attention caches the RoPE-free latent and the decoupled ``k_pe`` band in the
  cache's key and value slots; such adapters declare ``rope_in_values`` and the base engine's operator
  rotates only the band (the latent is carried byte for byte), while the patch covers both channels.

The operator itself is the base :class:`~kamera_engine.engine.Engine`'s; this class only binds each KV's
deltas into the spec it rotates with (:meth:`VisionEngine.rope_for`). Loading goes through the one loader
(``loading.py``), with which this module registers the vision families' model types.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..decode import SamplingParams
from ..engine import Engine
from ..errors import InvalidInputError, ModelLoadError, UnsupportedModelError
from ..kv import KV, Past
from ..loading import LoadSettings, ModelSource, load_engine, register_engine_kind
from ..rope import RopeSpec
from ..runner import ForwardResult, call_with_cache, past_cache
from .base import FAMILIES, Features, MediaInput, VisionFamily, family_for
from .cache import DEFAULT_MEMORY_BYTES, VisionCache, tensors_device
from .mrope import MRopeSpec


@dataclass(slots=True)
class MediaEntry:
    """A registered image / video segment: its chunk tokens (virtual ids) and where its rows live."""

    digest: str
    kind: str
    base: int  # first virtual id
    rows: int  # feature rows (virtual ids base .. base + rows - 1)
    token_ids: list[int]  # the chunk's tokens, placeholders replaced by virtual ids
    cache_key: str
    deltas: torch.Tensor | None  # (rows, 3) long: 3-axis position minus linear position, per row
    grid: tuple[int, int, int] | None  # the (t, h, w) feature grid on families with one


class VisionEngine(Engine):
    """An :class:`Engine` over a transformers VLM (see the module docstring)."""

    batchable = False  # vision rows and M-RoPE positions go through ``_run``, not a packed text forward

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        *,
        name: str | None = None,
        anchor_ids: Sequence[int] | None = None,
        attention: str | None = None,
        cache_dir: str | Path | None = None,
        vision_memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
        linear_backend: str | None = None,
    ) -> None:
        """``cache_dir``: where tower outputs are also written (a later process reads them); ``vision_memory_bytes``:
        the bound of those kept in memory (the rest on disk; None: no bound)."""
        self.family: VisionFamily = family_for(model, processor)
        self.processor = processor
        self._entries: list[MediaEntry] = []
        self._bases = torch.empty(0, dtype=torch.long)
        self._by_digest: dict[tuple[str, str], MediaEntry] = {}
        # windows register media concurrently (each window's gate is its own): one registration at a time, so
        # each gets its own range of virtual ids and a digest's tower runs once
        self._media_lock = threading.Lock()
        super().__init__(
            model,
            self.family.tokenizer(),
            name=name,
            anchor_ids=anchor_ids,
            attention=attention,
            linear_backend=linear_backend,
        )
        axes = self.family.rope_axes(self.operator_rope.rotary_dim // 2)
        self._mrope: MRopeSpec | None = None if axes is None else MRopeSpec.of(self.operator_rope, axes)
        self.vision_cache = VisionCache(self.fingerprint, cache_dir, max_memory_bytes=vision_memory_bytes)

    # --- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(  # type: ignore[override]
        cls,
        model: str | Path,
        *,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        attn: str | None = None,
        cache_dir: str | Path | None = None,
        vision_memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
        linear: str | None = None,
    ) -> VisionEngine:
        """Load a VLM and its processor by Hugging Face id or local path (the real ``from_pretrained``), as
        ``Engine.load`` does; ``cache_dir`` and ``vision_memory_bytes``: where and how much of the vision-tower
        outputs are kept (``__init__``)."""
        return load_engine(
            cls,
            model,
            device=device,
            dtype=dtype,
            attn=attn,
            linear=linear,
            cache_dir=cache_dir,
            vision_memory_bytes=vision_memory_bytes,
        )

    @classmethod
    def from_source(
        cls,
        source: ModelSource,
        settings: LoadSettings,
        *,
        cache_dir: str | Path | None = None,
        vision_memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
    ) -> VisionEngine:
        """Build from a located VLM (the loader's last step): its processor and image-text-to-text weights."""
        from transformers import AutoModelForImageTextToText

        from .processors import load_processor

        model_type = getattr(source.config, "model_type", None)
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"{source.name}: model type {model_type!r} has no Kamera vision family; supported: {sorted(FAMILIES)}"
            )
        offline = source.pretrained_kwargs()
        processor = load_processor(source.path, **offline)
        try:
            hf = AutoModelForImageTextToText.from_pretrained(
                source.path, dtype=settings.dtype, attn_implementation=settings.attention, **offline
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model {source.name}: {exc}") from exc
        return cls(
            hf.to(settings.device),
            processor,
            name=source.name,
            attention=settings.attention,
            cache_dir=cache_dir,
            vision_memory_bytes=vision_memory_bytes,
            linear_backend=settings.linear,
        )

    # --- media ----------------------------------------------------------------------------------
    def register_image(self, image: Any, digest: str) -> MediaEntry:
        """Register a decoded RGB image (its tower runs here, once per digest); returns its entry."""
        return self._register("image", digest, lambda: self.family.prepare_image(image))

    def register_video(self, frames: list[Any], fps: float, digest: str) -> MediaEntry:
        """Register a video segment (sampled frames at ``fps``); the tower runs once per digest."""
        return self._register("video", digest, lambda: self.family.prepare_video(frames, fps))

    def media_entry(self, digest: str, kind: str = "image") -> MediaEntry | None:
        return self._by_digest.get((kind, digest))

    def _register(self, kind: str, digest: str, make: Any) -> MediaEntry:
        known = self._by_digest.get((kind, digest))
        if known is not None and known.cache_key in self.vision_cache:
            return known
        with self._media_lock:
            return self._register_locked(kind, digest, make)

    def _register_locked(self, kind: str, digest: str, make: Any) -> MediaEntry:
        """``_register`` under the media lock: the range after every registered entry's becomes this one's,
        and the entry is published (``_entries`` before ``_bases``, which ``_lookup`` reads first) at once. A
        known entry whose rows left the cache (a file removed from its directory) has them made again, under
        its own ids."""
        known = self._by_digest.get((kind, digest))
        if known is not None and known.cache_key in self.vision_cache:  # registered while this thread waited
            return known
        media: MediaInput = make()
        key = self.vision_cache.key(digest, f"{self.family.name}:{kind}")
        feats = self._features(key, media)
        rows = media.num_features
        if int(feats.embeds.shape[0]) != rows:
            raise InvalidInputError(
                f"{self.name}: the vision tower gave {feats.embeds.shape[0]} rows for {rows} placeholder tokens"
            )
        if known is not None:
            return known
        idx = torch.nonzero(media.placeholder).flatten()
        base = self.vocab_size + sum(e.rows for e in self._entries)
        ids = list(media.token_ids)
        for k, i in enumerate(idx.tolist()):
            ids[i] = base + k
        deltas = None
        offsets = self.family.chunk_offsets(media)
        if offsets is not None:
            deltas = (offsets[idx] - idx[:, None]).to(torch.long)  # (rows, 3)
        entry = MediaEntry(digest, kind, base, rows, ids, key, deltas, media.grid)
        self._entries.append(entry)
        self._bases = torch.cat([self._bases, torch.tensor([base])])
        self._by_digest[(kind, digest)] = entry
        return entry

    def _features(self, key: str, media: MediaInput) -> Features:
        """The tower's rows for ``media`` (from the cache, or a counted tower run put there)."""
        feats = self.vision_cache.get(key)
        if feats is None:
            with torch.inference_mode():
                feats = self.family.encode(media)
            feats = Features(
                feats.embeds.detach().to("cpu"), None if feats.deepstack is None else feats.deepstack.detach().cpu()
            )
            self.vision_cache.counted_run()
            self.vision_cache.put(key, feats)
        return feats

    def _lookup(self, virt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Feature rows, 3-axis deltas and deepstack rows for virtual ids (in order)."""
        owner = torch.searchsorted(self._bases, virt, right=True) - 1
        if (owner < 0).any() or not len(self._entries):
            raise InvalidInputError(f"unknown virtual token ids {virt[owner < 0][:5].tolist()}")
        hidden = self.family.embed_tokens().embedding_dim
        rows = torch.empty(len(virt), hidden, dtype=self.dtype)
        deltas = torch.zeros(len(virt), 3, dtype=torch.long) if self.family.mrope else None
        deep: torch.Tensor | None = None
        for o in owner.unique().tolist():
            entry = self._entries[o]
            sel = owner == o
            k = virt[sel] - entry.base
            if (k >= entry.rows).any():
                raise InvalidInputError(f"virtual token ids beyond the rows of {entry.kind} {entry.digest[:8]}")
            held = self.vision_cache.get(entry.cache_key)
            if held is None:
                where = self.vision_cache.directory or "its own directory"
                raise InvalidInputError(
                    f"the vision rows of {entry.kind} {entry.digest[:8]} are gone from the cache (a file removed "
                    f"from {where}?): add the {entry.kind} again"
                )
            feats = tensors_device(held, torch.device("cpu"), self.dtype)
            rows[sel] = feats.embeds[k]
            if deltas is not None and entry.deltas is not None:
                deltas[sel] = entry.deltas[k]
            if feats.deepstack is not None:
                if deep is None:
                    deep = torch.zeros(feats.deepstack.shape[0], len(virt), hidden, dtype=self.dtype)
                deep[:, sel] = feats.deepstack[:, k]
        return rows, deltas, deep

    # --- forward ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(
        self, input_ids: torch.Tensor, past: Past, start: int, logits: str, *, answer: SamplingParams | None = None
    ) -> ForwardResult:
        """Text and virtual vision ids at linear positions ``start...``; vision rows come from the cache of
        tower outputs, M-RoPE positions from their deltas. Never in a scheduler's step (``batchable``), so no
        ``answer`` is started here: the caller decodes from the result."""
        dev = self.device
        cache, n_past = past_cache(input_ids, past, self._text_config(), dev)
        n_new = int(input_ids.shape[0])
        virt = input_ids >= self.vocab_size
        embeds = self.family.embed_tokens()(input_ids.masked_fill(virt, 0)[None].to(dev))  # (1, T, hidden)
        linear = torch.arange(start, start + n_new, dtype=torch.long)
        deltas = None
        deep_list = None
        mask = None
        if virt.any():
            rows, vd, deep = self._lookup(input_ids[virt])
            embeds[0, virt.to(dev)] = rows.to(dev, embeds.dtype)
            if vd is not None:
                deltas = torch.zeros(n_new, 3, dtype=torch.long)
                deltas[virt] = vd
            if deep is not None:
                deep_list = [d.to(dev, embeds.dtype) for d in deep]
                mask = virt[None].to(dev)
        pos = self.family.position_ids(linear, deltas).to(dev)
        lm = self.family.language_model()
        kwargs = self.family.forward_kwargs(mask, deep_list)
        out = call_with_cache(lm, cache, inputs_embeds=embeds, position_ids=pos, use_cache=True, **kwargs)
        hidden = out.last_hidden_state
        head = self.family.lm_head()
        lg = head(hidden[0] if logits == "all" else hidden[0, -1:]).float()
        new_kv = KV.from_cache(cache, n_past, n_past + n_new, linear, deltas)
        return ForwardResult(new_kv, lg, cache)

    def _text_config(self) -> Any:
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    # --- the operator: M-RoPE angles per token -----------------------------------------------------
    def rope_for(self, deltas: torch.Tensor | None) -> RopeSpec:
        """The spec bound to a KV's deltas, so vision tokens get their per-axis float32 angles (the operator's
        functions keep the deltas on their results)."""
        if self._mrope is not None and deltas is not None:
            return self._mrope.bind(deltas)
        return super().rope_for(deltas)

    # --- reporting ------------------------------------------------------------------------------
    @property
    def tower_runs(self) -> int:
        return self.vision_cache.stats.tower_runs


register_engine_kind(VisionEngine, FAMILIES)
