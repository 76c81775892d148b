"""LLaVA: a CLIP-style vision tower and projector in front of a Llama / Mistral decoder (MHA or GQA,
1-D RoPE). An image chunk is the processor's ``<image> * N`` expansion; relocation is the text operator.
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters.base import register
from .base import Features, MediaInput, VisionAdapter, VisionFamily, register_family


@register
class LlavaAdapter(VisionAdapter):
    name = "llava"
    model_types = ("llava",)


@register_family
class LlavaFamily(VisionFamily):
    name = "llava"
    model_types = ("llava",)

    def _image_token(self) -> str:
        return str(getattr(self.processor, "image_token", "<image>"))

    def prepare_image(self, image: Any) -> MediaInput:
        token = self._image_token()
        if callable(self.processor) and hasattr(self.processor, "image_processor"):
            out = self.processor(text=token, images=[image], return_tensors="pt")
            ids = [int(t) for t in out["input_ids"][0]]
            pixel_values = out["pixel_values"]
        else:  # tokenizer + image processor loaded separately: LlavaProcessor's expansion rule
            out = self.processor.image_processor(images=[image], return_tensors="pt")
            pixel_values = out["pixel_values"]
            h, w = pixel_values.shape[-2:]
            patch = int(self.config.vision_config.patch_size)
            n = (h // patch) * (w // patch) + 1  # + CLIP's class token
            n -= 1 if self.config.vision_feature_select_strategy == "default" else 0
            ids = [int(self.tokenizer().convert_tokens_to_ids(token))] * n
        image_id = int(self.config.image_token_id)
        mask = torch.tensor([t == image_id for t in ids])
        return MediaInput(ids, mask, {"pixel_values": pixel_values}, "image")

    def _encode(self, media: MediaInput) -> Features:
        inner = self.model.model
        pv = media.tower["pixel_values"].to(self.model.device, inner.vision_tower.dtype)
        out = inner.get_image_features(
            pixel_values=pv,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        pooled = out.pooler_output
        if isinstance(pooled, (list, tuple)):
            embeds = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
        else:
            embeds = pooled.reshape(-1, pooled.shape[-1])
        return Features(embeds)
