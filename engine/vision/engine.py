"""``VisionEngine``: the engine for vision-language models, with image and video chunks.

Everything the window does with text chunks (canonical, relocate, patch, forward at explicit positions,
decode) works unchanged on image chunks, because an image chunk is, to the rest of Kamera, a run of
token ids like any other:

* **Virtual token ids.** Registering an image gives its placeholder tokens ids beyond the text
  vocabulary, one per feature row (``base + k``). Chunk ids stay content hashes, concatenating chunks
  for a forward needs no side channel, and the forward swaps each virtual id for its feature row
  (text ids go through the embedding table as usual).
* **Vision embedding cache.** The rows come from :class:`~.cache.VisionCache`, keyed by model
  fingerprint and image digest: the vision tower runs once per distinct image, at registration.
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
  cache's key and value slots; such families set ``rope_in_values`` and relocation rotates only the
  band (the latent is carried byte for byte), while the patch covers both channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import operator as op
from ..engine import Engine
from ..errors import InvalidInputError, ModelLoadError, UnsupportedModelError
from ..kv import KV, Past
from ..operator import Patch
from ..rope import RopeSpec
from ..runner import ForwardResult, call_with_cache, past_cache
from .base import Features, MediaInput, VisionFamily, family_for
from .cache import VisionCache, tensors_device
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
    media: MediaInput  # kept so an entry dropped from every cache tier can be re-encoded


class VisionEngine(Engine):
    """An :class:`Engine` over a transformers VLM (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        *,
        name: str | None = None,
        anchor_ids: Sequence[int] | None = None,
        attention: str | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.family: VisionFamily = family_for(model, processor)
        self.processor = processor
        self._entries: list[MediaEntry] = []
        self._bases = torch.empty(0, dtype=torch.long)
        self._by_digest: dict[tuple[str, str], MediaEntry] = {}
        super().__init__(model, self.family.tokenizer(), name=name, anchor_ids=anchor_ids, attention=attention)
        self.rope_in_values = bool(getattr(self.family, "rope_in_values", False))
        self._vspec: RopeSpec | None = None
        if self.rope_in_values:
            r = self.rope.rotary_dim
            if r != self.value_dim:
                raise UnsupportedModelError(f"{self.name}: RoPE band of {r} features != cached {self.value_dim}")
            self._vspec = RopeSpec(self.rope.inv_freq, r, r, self.rope.rope_type, self.rope.style)
        base = self._vspec or self.rope
        axes = self.family.rope_axes(base.rotary_dim // 2)
        self._mrope: MRopeSpec | None = None if axes is None else MRopeSpec.of(base, axes)
        self.vision_cache = VisionCache(self.fingerprint, cache_dir)

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
    ) -> VisionEngine:
        """Load a VLM and its processor by Hugging Face id or local path (the real ``from_pretrained``)."""
        from transformers import AutoModelForImageTextToText

        from ..attention import resolve_attention
        from ..engine import _resolve_dtype, resolve_device
        from .processors import load_processor

        dev = resolve_device(device)
        torch_dtype = _resolve_dtype(dtype, dev)
        attention = resolve_attention(attn, dev)
        processor = load_processor(str(model))
        try:
            hf = AutoModelForImageTextToText.from_pretrained(
                str(model), dtype=torch_dtype, attn_implementation=attention
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model {model}: {exc}") from exc
        return cls(hf.to(dev), processor, name=str(model), attention=attention, cache_dir=cache_dir)

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
        if known is not None:
            return known
        media: MediaInput = make()
        key = self.vision_cache.key(digest, f"{self.family.name}:{kind}")
        feats = self._features(key, media)
        rows = media.num_features
        if int(feats.embeds.shape[0]) != rows:
            raise InvalidInputError(
                f"{self.name}: the vision tower gave {feats.embeds.shape[0]} rows for {rows} placeholder tokens"
            )
        idx = torch.nonzero(media.placeholder).flatten()
        base = self.vocab_size + sum(e.rows for e in self._entries)
        ids = list(media.token_ids)
        for k, i in enumerate(idx.tolist()):
            ids[i] = base + k
        deltas = None
        offsets = self.family.chunk_offsets(media)
        if offsets is not None:
            deltas = (offsets[idx] - idx[:, None]).to(torch.long)  # (rows, 3)
            if int(offsets.max()) >= len(ids) + 1 and kind == "image":
                pass  # positions may overlap later chunks' positions; exactness is unaffected
        entry = MediaEntry(digest, kind, base, rows, ids, key, deltas, media)
        self._entries.append(entry)
        self._bases = torch.cat([self._bases, torch.tensor([base])])
        self._by_digest[(kind, digest)] = entry
        return entry

    def _features(self, key: str, media: MediaInput) -> Features:
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
            feats = tensors_device(self._features(entry.cache_key, entry.media), torch.device("cpu"), self.dtype)
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
    def _run(self, input_ids: torch.Tensor, past: Past, start: int, logits: str) -> ForwardResult:
        """Text and virtual vision ids at linear positions ``start...``; vision rows come from the cache of
        tower outputs, M-RoPE positions from their deltas."""
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

    def canonical(self, ids: Sequence[int], *, anchored: bool = True) -> KV:
        """KV(B | ∅), position-free; the un-rotation goes through this engine's operator (MLA-aware)."""
        if len(ids) == 0:
            raise InvalidInputError("a chunk needs at least one token")
        past = self.anchor_kv if anchored and self.anchor_ids else None
        start = len(self.anchor_ids) if past is not None else 0
        res = self.forward(ids, past, start, logits="none")
        return self.make_free(res.kv.to("cpu"))

    # --- the operator: M-RoPE angles per token, and MLA's RoPE band in the value slot -------------------
    # Every call runs with the spec bound to the KV's deltas (``_spec``), so vision tokens get their
    # per-axis float32 angles (the operator's functions keep the deltas on their results).
    # MLA caches (latent, k_pe) in the (key, value) slots: every operator call runs on the swapped KV
    # (``_view``), so the rotation lands on k_pe and the latent is carried byte for byte; patches are
    # swapped back.
    def _spec(self, deltas: torch.Tensor | None) -> RopeSpec:
        if self._mrope is not None and deltas is not None:
            return self._mrope.bind(deltas)
        return self._vspec or self.rope

    def _view(self, kv: KV) -> KV:
        return _swap(kv) if self._vspec is not None else kv

    def _view_patch(self, patch: Patch | None) -> Patch | None:
        return _swap_patch(patch) if patch is not None and self._vspec is not None else patch

    def relocate(self, kv: KV, target: torch.Tensor | int, *, exact: bool = True) -> KV:
        return self._view(op.relocate(self._view(kv), self._spec(kv.deltas), target, exact=exact))

    def make_free(self, kv: KV) -> KV:
        return self._view(op.make_free(self._view(kv), self._spec(kv.deltas)))

    def form_patch(
        self,
        conditioned: KV | Sequence[KV],
        canonical: KV,
        rank: int,
        *,
        layers: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> Patch:
        items = [conditioned] if isinstance(conditioned, KV) else list(conditioned)
        views = [self._view(c) for c in items]  # the same chunk's tokens: the canonical's deltas are theirs
        spec = self._spec(canonical.deltas)
        return self._view_patch(op.form_patch(views, self._view(canonical), spec, rank, layers=layers, dtype=dtype))

    def apply(self, canonical: KV, patch: Patch | None, target: torch.Tensor | int, *, exact: bool = False) -> KV:
        spec = self._spec(canonical.deltas)
        return self._view(op.apply_patch(self._view(canonical), self._view_patch(patch), spec, target, exact=exact))

    # --- reporting ------------------------------------------------------------------------------
    @property
    def tower_runs(self) -> int:
        return self.vision_cache.stats.tower_runs


def _swap(kv: KV) -> KV:
    return KV(kv.values, kv.keys, kv.positions, kv.deltas)


def _swap_patch(p: Patch) -> Patch:
    return Patch(p.v_u, p.v_vt, p.k_u, p.k_vt, p.layers)
