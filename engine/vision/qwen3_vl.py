"""Qwen3-VL: GQA decoder with q/k-norm, interleaved M-RoPE, and *deepstack*: visual features from several
vision-tower depths are added to the hidden states of the vision tokens after the first decoder layers.

The deepstack rows are part of each image's cached features and are re-injected in every forward that
contains the image, so the canonical ``KV(B | ∅)`` of an image chunk carries them, as does any conditioned
forward. Relocation is the 3-axis shift of Qwen2-VL, with the interleaved frequency-to-axis map (t, h, w,
t, h, w, ...; see ``mrope.py``). Video segments are served as consecutive images (Qwen3-VL's own video
layout interleaves timestamp text between frames).
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters.base import register
from .base import Features, MediaInput, VisionAdapter, VisionFamily, register_family
from .mrope import interleaved_axes
from .qwen2_vl import Qwen2VLFamily


@register
class Qwen3VLAdapter(VisionAdapter):
    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    keys_normalised = True


@register_family
class Qwen3VLFamily(Qwen2VLFamily):
    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    deepstack = True

    def prepare_video(self, frames: list[Any], fps: float) -> MediaInput:
        return VisionFamily.prepare_video(self, frames, fps)

    def rope_axes(self, n_freq: int) -> torch.Tensor:
        return interleaved_axes(self.mrope_section(), n_freq)

    def _features(self, out: Any) -> Features:
        pooled = out.pooler_output
        embeds = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
        levels = []
        for level in out.deepstack_features or []:
            levels.append(torch.cat(list(level)) if isinstance(level, (list, tuple)) else level)
        return Features(embeds, torch.stack(levels) if levels else None)

    def forward_kwargs(self, visual_mask: torch.Tensor | None, deepstack: list[torch.Tensor] | None) -> dict[str, Any]:
        if visual_mask is None or deepstack is None:
            return {}
        return {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": deepstack}
