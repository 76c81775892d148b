"""The vision-family contract: how one VLM architecture turns an image into chunk tokens and features.

A family (one file each, registered by ``config.model_type``) says:

* how an image / video segment becomes the chunk's token layout (the processor's placeholder
  expansion: e.g. ``<|vision_start|><|image_pad|>*N<|vision_end|>`` for Qwen2-VL, ``<image>*N`` for LLaVA);
* how the vision tower turns it into features: the ``(N, hidden)`` rows that replace the placeholders,
  plus per-layer rows re-injected deeper in the decoder where the family does that (Qwen3-VL deepstack);
* the chunk-relative 3-axis positions of its vision tokens where the family uses M-RoPE;
* how the language model is driven with ``inputs_embeds`` and explicit positions.

The family also registers a :class:`~kamera_engine.adapters.ModelAdapter` for its ``model_type`` (where
RoPE lives), so the text-side operator (relocate, patch) needs nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..adapters.base import ModelAdapter
from ..errors import UnsupportedModelError


@dataclass(slots=True)
class MediaInput:
    """One image or video segment, processed for a family: the chunk's tokens and the tower's inputs.

    ``token_ids``: the chunk's token ids with the placeholders expanded (real vocabulary ids).
    ``placeholder``: bool (T,), True where a vision feature row goes (in row order).
    ``tower``: keyword tensors for the family's vision tower. ``kind``: ``"image"`` or ``"video"``.
    ``grid``: the (t, h, w) feature grid when the family has one (M-RoPE families).
    """

    token_ids: list[int]
    placeholder: torch.Tensor
    tower: dict[str, Any]
    kind: str = "image"
    grid: tuple[int, int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_features(self) -> int:
        return int(self.placeholder.sum())


@dataclass(slots=True)
class Features:
    """Vision-tower output of one media input: rows for the placeholders (and deepstack rows)."""

    embeds: torch.Tensor  # (N, hidden)
    deepstack: torch.Tensor | None = None  # (n_deep_layers, N, hidden) or None

    @property
    def nbytes(self) -> int:
        n = self.embeds.numel() * self.embeds.element_size()
        if self.deepstack is not None:
            n += self.deepstack.numel() * self.deepstack.element_size()
        return n


class VisionFamily:
    """Base of the per-architecture plug-ins (see the module docstring)."""

    name: ClassVar[str] = "base"
    model_types: ClassVar[tuple[str, ...]] = ()
    #: True when the decoder uses 3-axis M-RoPE positions (temporal, height, width).
    mrope: ClassVar[bool] = False
    #: True when the family re-injects visual features in deeper decoder layers (deepstack).
    deepstack: ClassVar[bool] = False

    def __init__(self, model: nn.Module, processor: Any) -> None:
        self.model = model
        self.config = model.config
        self.processor = processor

    # --- model access ---------------------------------------------------------------------------
    def language_model(self) -> nn.Module:
        """The text decoder (takes ``inputs_embeds``, ``position_ids``, ``past_key_values``)."""
        return self.model.model.language_model

    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    # --- media ----------------------------------------------------------------------------------
    def prepare_image(self, image: Any) -> MediaInput:
        raise NotImplementedError

    def prepare_video(self, frames: list[Any], fps: float) -> MediaInput:
        """Default: a video segment is its frames as consecutive images (families without a video path)."""
        parts = [self.prepare_image(f) for f in frames]
        ids = [t for p in parts for t in p.token_ids]
        mask = torch.cat([p.placeholder for p in parts])
        return MediaInput(ids, mask, {"frames": parts}, kind="video")

    def encode(self, media: MediaInput) -> Features:
        """Run the vision tower (and projector) on one media input."""
        if media.kind == "video" and "frames" in media.tower:
            feats = [self.encode(p) for p in media.tower["frames"]]
            deep = None
            if feats[0].deepstack is not None:
                deep = torch.cat([f.deepstack for f in feats], dim=1)  # type: ignore[misc]
            return Features(torch.cat([f.embeds for f in feats]), deep)
        return self._encode(media)

    def _encode(self, media: MediaInput) -> Features:
        raise NotImplementedError

    def chunk_offsets(self, media: MediaInput) -> torch.Tensor | None:
        """(T, 3) native chunk-relative positions per axis (M-RoPE families), or None."""
        return None

    def rope_axes(self, n_freq: int) -> torch.Tensor | None:
        """(n_freq,) long: the M-RoPE axis (0 t, 1 h, 2 w) each rotary frequency follows, or None (1-D RoPE)."""
        return None

    def position_ids(self, linear: torch.Tensor, deltas: torch.Tensor | None) -> torch.Tensor:
        """Positions the language model takes for tokens at ``linear`` (T,) with 3-axis ``deltas`` (T, 3)."""
        if not self.mrope:
            return linear[None]
        pos = linear[None, :].expand(3, -1).clone()
        if deltas is not None:
            pos += deltas.T.to(pos.dtype)
        return pos[:, None, :]  # (3, 1, T)

    def forward_kwargs(self, visual_mask: torch.Tensor | None, deepstack: list[torch.Tensor] | None) -> dict[str, Any]:
        """Extra language-model keywords (deepstack injection)."""
        return {}

    def validate(self) -> None:
        """Refuse configurations the operator cannot serve exactly."""


class VisionAdapter(ModelAdapter):
    """Adapter for a VLM: the decoder is the language model inside the multimodal wrapper."""

    sliding_by_default = False

    def decoder(self, model: nn.Module) -> nn.Module:
        return model.model.language_model


FAMILIES: dict[str, type[VisionFamily]] = {}


def register_family(cls: type[VisionFamily]) -> type[VisionFamily]:
    for model_type in cls.model_types:
        FAMILIES[model_type] = cls
    return cls


def family_for(model: nn.Module, processor: Any) -> VisionFamily:
    model_type = getattr(model.config, "model_type", None)
    cls = FAMILIES.get(model_type or "")
    if cls is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} has no Kamera vision family; supported: {sorted(FAMILIES)}"
        )
    fam = cls(model, processor)
    fam.validate()
    return fam
