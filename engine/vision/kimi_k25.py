"""Kimi-K2.5: a MoonViT-style tower in front of a DeepSeek-V3 decoder with Multi-head Latent Attention.

MLA caches the compressed latent ``c_KV`` (no RoPE: the content channel) and the decoupled, shared
``k_pe`` (the RoPE band) per token; transformers stores them in the cache's key and value slots
respectively. Relocation therefore rotates only the ``k_pe`` band (the cache's *value* slot) and leaves the
latent byte-identical; the conditioning patch covers both channels (the adapter declares ``rope_in_values``).
DeepSeek lays the band out in interleaved pairs and the model de-interleaves it before rotating, so the
cached band is in rotate-half layout.

The image chunk is ``<|media_begin|> image <|media_content|> <|media_pad|> * N <|media_end|>`` with
``N = h * w / merge^2``, the processor's rule. The image processor needs torchvision; without it the
same resize (NaViT budget, never upscale), padding to the merge grid, normalisation and patch layout
are done here with PIL.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ..adapters.base import register
from .base import Features, MediaInput, VisionAdapter, VisionFamily, register_family


@register
class KimiK25Adapter(VisionAdapter):
    name = "kimi_k25"
    model_types = ("kimi_k25",)
    #: MLA: the cache's value slot holds the rotated ``k_pe``, its key slot the RoPE-free latent
    rope_in_values = True


@register_family
class KimiK25Family(VisionFamily):
    name = "kimi_k25"
    model_types = ("kimi_k25",)

    def language_model(self) -> nn.Module:
        return self.model.model.language_model

    def _tok(self, token: str) -> int:
        return int(self.tokenizer().convert_tokens_to_ids(token))

    def _merge(self) -> tuple[int, int]:
        m = self.config.vision_config.merge_kernel_size
        return int(m[0]), int(m[1])

    def _pixels(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ip = getattr(self.processor, "image_processor", None)
        if ip is not None:
            out = ip(images=[image], return_tensors="pt")
            return out["pixel_values"], out["image_grid_thw"]
        # PIL path, same rule as Kimi_K25ImageProcessor (navit_resize + pad + normalise + patchify)
        p = int(self.config.vision_config.patch_size)
        mh, _ = self._merge()
        max_side = int(getattr(self.config.vision_config, "pos_emb_height", 64))
        max_patches = max_side * max_side
        w, h = image.size
        n_h, n_w = max(1.0, h // p), max(1.0, w // p)
        scale = min(1.0, math.sqrt(max_patches / (n_h * n_w)), max_side * p / h, max_side * p / w)
        nh, nw = min(max(1, int(h * scale)), max_side * p), min(max(1, int(w * scale)), max_side * p)
        f = mh * p
        ph, pw = nh + (f - nh % f) % f, nw + (f - nw % f) % f
        arr = np.asarray(image.convert("RGB").resize((nw, nh), resample=3), dtype=np.float32) / 255.0
        arr = (arr - 0.5) / 0.5  # IMAGENET_STANDARD mean / std
        canvas = np.zeros((ph, pw, 3), dtype=np.float32)
        canvas[:nh, :nw] = arr
        x = torch.from_numpy(canvas).permute(2, 0, 1)  # (C, H, W)
        gh, gw = ph // p, pw // p
        patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches, torch.tensor([[1, gh, gw]])

    def prepare_image(self, image: Any) -> MediaInput:
        pixels, grid = self._pixels(image)
        mh, mw = self._merge()
        n = int(grid.prod()) // (mh * mw)
        head = [self._tok("<|media_begin|>"), self._tok("image"), self._tok("<|media_content|>")]
        ids = [*head, *([int(self.config.image_token_id)] * n), self._tok("<|media_end|>")]
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(head) : len(head) + n] = True
        return MediaInput(ids, mask, {"pixel_values": pixels, "image_grid_thw": grid}, "image", tuple(grid[0].tolist()))

    def _encode(self, media: MediaInput) -> Features:
        inner = self.model.model
        dev = self.model.device
        pv = media.tower["pixel_values"].to(dev, inner.vision_tower.dtype)
        out = inner.get_image_features(pv, media.tower["image_grid_thw"].to(dev))
        pooled = out.pooler_output
        embeds = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
        return Features(embeds.reshape(-1, embeds.shape[-1]))
