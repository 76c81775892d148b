"""Qwen2-VL and Qwen2.5-VL: GQA decoder with M-RoPE (3-axis positions: temporal, height, width).

An image chunk is ``<|vision_start|> <|image_pad|> * N <|vision_end|>`` with ``N = t * h * w / merge^2``
(the processor's own expansion rule); a video segment uses ``<|video_pad|>``. Vision tokens take the
chunk-relative 3-axis positions the model's ``get_rope_index`` gives them (Qwen2.5-VL scales the
temporal axis by ``tokens_per_second * seconds per temporal grid``); relocation shifts all three axes by
the same offset, with each rotary frequency's float32 angle taken on its own axis (contiguous
``mrope_section`` sections; see ``mrope.py``).

Video frames are patchified here in the video processor's layout (pairs of frames per temporal patch,
the last frame repeated to fill a pair), so no torchvision is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..adapters.base import register
from ..errors import UnsupportedModelError
from .base import Features, MediaInput, VisionAdapter, VisionFamily, register_family
from .mrope import section_axes


@register
class Qwen2VLAdapter(VisionAdapter):
    name = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")


@register_family
class Qwen2VLFamily(VisionFamily):
    name = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    mrope = True

    def validate(self) -> None:
        text = self.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.rope_axes(head_dim // 2)  # a missing or mis-sized mrope_section is refused at load

    def mrope_section(self) -> list[int]:
        """Rotary frequencies per axis (t, h, w), as the model's rotary embedding uses them."""
        rotary = getattr(self.language_model(), "rotary_emb", None)
        section = getattr(rotary, "mrope_section", None)
        if section is None:
            section = (self.config.get_text_config().rope_parameters or {}).get("mrope_section")
        if not section:
            raise UnsupportedModelError(f"{self.config.model_type}: no mrope_section in the text config")
        return [int(x) for x in section]

    def rope_axes(self, n_freq: int) -> torch.Tensor:
        return section_axes(self.mrope_section(), n_freq)

    # --- processing -------------------------------------------------------------------------------
    def _image_processor(self) -> Any:
        return self.processor.image_processor

    def _merge(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def _tok(self, token: str) -> int:
        return int(self.tokenizer().convert_tokens_to_ids(token))

    def _wrap(self, pad: str, n: int) -> tuple[list[int], torch.Tensor]:
        ids = [self._tok("<|vision_start|>"), *([self._tok(pad)] * n), self._tok("<|vision_end|>")]
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[1:-1] = True
        return ids, mask

    def prepare_image(self, image: Any) -> MediaInput:
        out = self._image_processor()(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"][0]
        n = int(grid.prod()) // self._merge() ** 2  # the processor's replace_image_token rule
        ids, mask = self._wrap("<|image_pad|>", n)
        tower = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        return MediaInput(ids, mask, tower, "image", tuple(int(x) for x in grid))

    def prepare_video(self, frames: list[Any], fps: float) -> MediaInput:
        ip = self._image_processor()
        tp = int(getattr(ip, "temporal_patch_size", 2))
        frames = list(frames)
        while len(frames) % tp:
            frames.append(frames[-1])
        per_frame = [ip(images=[f], return_tensors="pt") for f in frames]
        grids = {tuple(int(x) for x in o["image_grid_thw"][0]) for o in per_frame}
        if len(grids) != 1:
            raise UnsupportedModelError(f"video frames resize to different grids: {sorted(grids)}")
        _, gh, gw = grids.pop()
        c = 3
        p = int(ip.patch_size)
        # each frame's patches: (gh*gw, C, tp, p, p) with the frame broadcast over tp; keep slice 0
        single = [np.asarray(o["pixel_values"]).reshape(gh * gw, c, tp, p, p)[:, :, 0] for o in per_frame]
        groups = []
        for i in range(0, len(single), tp):
            groups.append(np.stack(single[i : i + tp], axis=2).reshape(gh * gw, c * tp * p * p))
        pixel_values = torch.from_numpy(np.concatenate(groups, axis=0))
        grid_t = len(frames) // tp
        grid = torch.tensor([[grid_t, gh, gw]])
        n = grid_t * gh * gw // self._merge() ** 2
        ids, mask = self._wrap("<|video_pad|>", n)
        tower = {"pixel_values_videos": pixel_values, "video_grid_thw": grid}
        extra = {"second_per_grid": tp / float(fps)}
        return MediaInput(ids, mask, tower, "video", (grid_t, gh, gw), extra)

    # --- tower ------------------------------------------------------------------------------------
    def _encode(self, media: MediaInput) -> Features:
        inner = self.model.model
        dev, dt = self.model.device, inner.visual.dtype
        if media.kind == "video":
            out = inner.get_video_features(
                media.tower["pixel_values_videos"].to(dev, dt), media.tower["video_grid_thw"].to(dev)
            )
        else:
            out = inner.get_image_features(
                media.tower["pixel_values"].to(dev, dt), media.tower["image_grid_thw"].to(dev)
            )
        return self._features(out)

    def _features(self, out: Any) -> Features:
        pooled = out.pooler_output
        embeds = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
        return Features(embeds)

    # --- positions --------------------------------------------------------------------------------
    def chunk_offsets(self, media: MediaInput) -> torch.Tensor:
        ids = torch.tensor([media.token_ids])
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[0, media.placeholder] = 1 if (media.kind == "image" or "frames" in media.tower) else 2
        kwargs: dict[str, Any] = {"mm_token_type_ids": types}
        if "frames" in media.tower:  # a segment served as consecutive images
            kwargs["image_grid_thw"] = torch.cat([p.tower["image_grid_thw"] for p in media.tower["frames"]])
        elif media.kind == "image":
            kwargs["image_grid_thw"] = media.tower["image_grid_thw"]
        else:
            kwargs["video_grid_thw"] = media.tower["video_grid_thw"]
            if self.config.model_type == "qwen2_5_vl":
                kwargs["second_per_grid_ts"] = torch.tensor([media.extra["second_per_grid"]])
        pos, _ = self.model.model.get_rope_index(ids, **kwargs)
        return pos[:, 0, :].T.contiguous()  # (T, 3)
