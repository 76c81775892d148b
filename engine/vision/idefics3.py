"""Idefics3 / SmolVLM: a SigLIP tower with pixel-shuffle connector in front of a Llama decoder (1-D RoPE).

The processor splits a large image into tiles plus a global view; the chunk is its expansion
(``<fake_token_around_image> <row_i_col_j> <image> * seq_len ... <global-img> <image> * seq_len
<fake_token_around_image>``), so one image chunk carries every tile. Relocation is the text operator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters.base import register
from .base import Features, MediaInput, VisionAdapter, VisionFamily, register_family


@register
class Idefics3Adapter(VisionAdapter):
    name = "idefics3"
    model_types = ("idefics3", "smolvlm")

    def decoder(self, model: nn.Module) -> nn.Module:
        return model.model.text_model


@register_family
class Idefics3Family(VisionFamily):
    name = "idefics3"
    model_types = ("idefics3", "smolvlm")

    def language_model(self) -> nn.Module:
        return self.model.model.text_model

    def prepare_image(self, image: Any) -> MediaInput:
        image_token = str(getattr(self.processor, "image_token", "<image>"))
        out = self.processor(text=image_token, images=[[image]], return_tensors="pt")
        ids = [int(t) for t in out["input_ids"][0]]
        image_id = int(self.config.image_token_id)
        mask = torch.tensor([t == image_id for t in ids])
        tower = {"pixel_values": out["pixel_values"], "pixel_attention_mask": out.get("pixel_attention_mask")}
        return MediaInput(ids, mask, tower, "image")

    def _encode(self, media: MediaInput) -> Features:
        inner = self.model.model
        pv = media.tower["pixel_values"].to(self.model.device, self.model.dtype)
        pam = media.tower["pixel_attention_mask"]
        out = inner.get_image_features(pv, None if pam is None else pam.to(self.model.device))
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(pooled, (list, tuple)):
            pooled = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
        return Features(pooled.reshape(-1, pooled.shape[-1]))
