"""Qwen3: keys pass through a per-head RMSNorm (k_norm) before RoPE.

The cache holds normalised-then-rotated keys, so un-rotating gives the normalised key and relocation
stays a pure rotation; the patch lives in that normalised, position-free frame.
"""

from .base import ModelAdapter, register


@register
class Qwen3Adapter(ModelAdapter):
    name = "qwen3"
    model_types = ("qwen3",)
    keys_normalised = True

    def max_context(self) -> int | None:
        if not getattr(self.config, "use_sliding_window", False):
            return None
        return super().max_context()
